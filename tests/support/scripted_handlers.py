"""The scripted cluster's answers: one handler per API, each building the response message.

Split from :mod:`tests.support.scripted_broker` (which serves them); like it, this exists only
for what no real broker here can stage.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from kafka.protocol.admin import CreateTopicsResponse, DeleteTopicsResponse, DescribeClusterResponse
from kafka.protocol.consumer import FetchResponse, ListOffsetsResponse
from kafka.protocol.metadata import ApiVersionsResponse, FindCoordinatorResponse, MetadataResponse
from kafka.protocol.producer import InitProducerIdResponse, ProduceResponse

from protocol.apis import SPECS, ApiKey

if TYPE_CHECKING:
    from tests.support.scripted_broker import Partition, ReceivedRequest, ScriptedBroker, Topic

LIST_OFFSETS = 2
INIT_PRODUCER_ID = 22
OFFSET_OUT_OF_RANGE = 1
UNKNOWN_TOPIC_OR_PARTITION = 3
NOT_LEADER_OR_FOLLOWER = 6
UNSUPPORTED_VERSION = 35
TOPIC_ALREADY_EXISTS = 36
INVALID_REPLICATION_FACTOR = 38
FENCED_LEADER_EPOCH = 74
UNKNOWN_TOPIC_ID = 100
_ZERO_UUID = uuid.UUID(int=0)
_LEADER_MOVED = (NOT_LEADER_OR_FOLLOWER, FENCED_LEADER_EPOCH)


def next_error(broker: ScriptedBroker, api_key: int) -> int:
    """The error the script has for this request of ``api_key`` (Script.next_errors), or 0."""
    codes = broker.cluster.script.next_errors.get(api_key)
    return codes.pop(0) if codes else 0


def default_api_versions() -> dict[int, tuple[int, int]]:
    """Each API implemented here: from the lowest version Kafka 4 accepts (the schemas'
    validVersions) to the highest kafka-python can encode."""
    lowest = {ApiKey.PRODUCE: 3, ApiKey.FETCH: 4, LIST_OFFSETS: 1, ApiKey.METADATA: 0, ApiKey.FIND_COORDINATOR: 0,
              ApiKey.API_VERSIONS: 0, ApiKey.CREATE_TOPICS: 2, ApiKey.DELETE_TOPICS: 1, ApiKey.DESCRIBE_CLUSTER: 0,
              INIT_PRODUCER_ID: 0}
    return {int(k): (lo, SPECS[k].max_version) for k, lo in lowest.items()}


def _api_versions(broker: ScriptedBroker, req: ReceivedRequest):
    R = ApiVersionsResponse
    keys = [R.ApiVersion(api_key=k, min_version=lo, max_version=hi)
            for k, (lo, hi) in sorted(broker.cluster.script.api_versions.items())]
    return R[req.api_version](error_code=0, api_keys=keys, throttle_time_ms=0)


def _metadata(broker: ScriptedBroker, req: ReceivedRequest):
    cluster, v = broker.cluster, req.api_version
    R = MetadataResponse
    T = R.MetadataResponseTopic
    wanted = req.body.topics
    scripted = 0
    if wanted is None or (v == 0 and not wanted):
        selected = [(t.name, t) for t in cluster.topics.values()]
    else:
        selected = []
        for w in wanted:
            t = cluster.topics.get(w.name) if w.name is not None else cluster.topic_by_id(w.topic_id)
            selected.append((w.name, t))
        scripted = next_error(broker, ApiKey.METADATA) if wanted else 0
    topics = []
    for name, t in selected:
        if scripted:
            topics.append(T(error_code=scripted, name=name, topic_id=_ZERO_UUID, is_internal=False, partitions=[],
                            authorized_operations=None))
            continue
        if t is None:
            code = UNKNOWN_TOPIC_OR_PARTITION if name is not None else UNKNOWN_TOPIC_ID
            topics.append(T(error_code=code, name=name, topic_id=_ZERO_UUID, is_internal=False, partitions=[],
                            authorized_operations=None))
            continue
        parts = [T.MetadataResponsePartition(error_code=0, partition_index=i, leader_id=p.leader,
                                             leader_epoch=p.leader_epoch, replica_nodes=[p.leader],
                                             isr_nodes=[p.leader], offline_replicas=[])
                 for i, p in enumerate(t.partitions)]
        topics.append(T(error_code=0, name=t.name, topic_id=t.topic_id, is_internal=False, partitions=parts,
                        authorized_operations=None))
    brokers = [R.MetadataResponseBroker(node_id=b.node_id, host=b.host, port=b.port, rack=None)
               for b in cluster.brokers.values()]
    return R[v](throttle_time_ms=0, brokers=brokers, cluster_id=cluster.script.cluster_id,
                controller_id=cluster.script.controller_id, topics=topics, authorized_operations=None, error_code=0)


def _coordinator(broker: ScriptedBroker, key: str) -> dict:
    script = broker.cluster.script
    error = script.coordinator_errors.get(key, 0)
    if error:
        return {"error_code": error, "error_message": "scripted error", "node_id": -1, "host": "", "port": -1}
    b = broker.cluster.brokers[script.coordinators.get(key, script.controller_id)]
    return {"error_code": 0, "error_message": None, "node_id": b.node_id, "host": b.host, "port": b.port}


def _find_coordinator(broker: ScriptedBroker, req: ReceivedRequest):
    R = FindCoordinatorResponse
    scripted = next_error(broker, ApiKey.FIND_COORDINATOR)

    def coordinator(key: str) -> dict:
        if scripted:
            return {"error_code": scripted, "error_message": "scripted error", "node_id": -1, "host": "", "port": -1}
        return _coordinator(broker, key)

    if req.api_version < 4:
        return R[req.api_version](throttle_time_ms=0, **coordinator(req.body.key))
    coordinators = [R.Coordinator(key=k, **coordinator(k)) for k in req.body.coordinator_keys]
    return R[req.api_version](throttle_time_ms=0, coordinators=coordinators)


def _describe_cluster(broker: ScriptedBroker, req: ReceivedRequest):
    R = DescribeClusterResponse
    cluster = broker.cluster
    brokers = [R.DescribeClusterBroker(broker_id=b.node_id, host=b.host, port=b.port, rack=None, is_fenced=False)
               for b in cluster.brokers.values()]
    return R[req.api_version](throttle_time_ms=0, error_code=0, error_message=None, endpoint_type=1,
                              cluster_id=cluster.script.cluster_id, controller_id=cluster.script.controller_id,
                              brokers=brokers, authorized_operations=None)


def _partition_error(
    broker: ScriptedBroker, topic: Topic | None, index: int, scripted: dict, once: int = 0
) -> tuple[int, Partition | None]:
    if topic is None or not 0 <= index < len(topic.partitions):
        return once or UNKNOWN_TOPIC_OR_PARTITION, None
    p = topic.partitions[index]
    error = once or scripted.get((topic.name, index))
    if error is None:
        error = 0 if p.leader == broker.node_id else NOT_LEADER_OR_FOLLOWER
    return error, p


def _produce(broker: ScriptedBroker, req: ReceivedRequest):
    cluster, v = broker.cluster, req.api_version
    R = ProduceResponse
    P = R.TopicProduceResponse.PartitionProduceResponse
    hints = cluster.script.leader_hints and v >= 10
    once = next_error(broker, ApiKey.PRODUCE)
    leaders, topics = [], []
    for td in req.body.topic_data:
        topic = cluster.topics.get(td.name) if v < 13 else cluster.topic_by_id(td.topic_id)
        parts = []
        for pd in td.partition_data:
            error, p = _partition_error(broker, topic, pd.index, cluster.script.produce_errors, once)
            base = cluster.append(p, pd.records) if error == 0 else -1
            leader = None
            if hints and error in _LEADER_MOVED and p is not None:
                leader = P.LeaderIdAndEpoch(leader_id=p.leader, leader_epoch=p.leader_epoch)
                leaders.append(p.leader)
            parts.append(P(index=pd.index, error_code=error, base_offset=base, log_append_time_ms=-1,
                           log_start_offset=0, record_errors=[], error_message=None, current_leader=leader))
        topics.append(R.TopicProduceResponse(name=td.name, topic_id=td.topic_id, partition_responses=parts))
    if req.body.acks == 0:
        return None  # acks=0: the broker never answers
    return R[v](responses=topics, throttle_time_ms=0,
                node_endpoints=cluster.leader_endpoints(R, leaders) if hints else [])


def _fetch_partition(broker, topic, fp, v, leaders, once=0):
    cluster = broker.cluster
    P = FetchResponse.FetchableTopicResponse.PartitionData
    error, p = _partition_error(broker, topic, fp.partition, cluster.script.fetch_errors, once)
    if error == 0 and fp.fetch_offset > p.next_offset:
        error = OFFSET_OUT_OF_RANGE
    records, leader = b"", None
    if error == 0:
        limit = max(fp.partition_max_bytes, 1)
        for _base, last, batch in p.batches:
            if last < fp.fetch_offset:
                continue
            if records and len(records) + len(batch) > limit:
                break  # like Kafka: at least one batch, then whole batches up to the limit
            records += batch
    elif error in _LEADER_MOVED and p is not None and v >= 12 and cluster.script.leader_hints:
        leader = P.LeaderIdAndEpoch(leader_id=p.leader, leader_epoch=p.leader_epoch)
        leaders.append(p.leader)
    hw = p.next_offset if p is not None and error == 0 else -1
    return P(partition_index=fp.partition, error_code=error, high_watermark=hw, last_stable_offset=hw,
             log_start_offset=0 if hw >= 0 else -1, aborted_transactions=None, preferred_read_replica=-1,
             records=records, current_leader=leader)


async def _fetch(broker: ScriptedBroker, req: ReceivedRequest):
    cluster, v = broker.cluster, req.api_version
    R = FetchResponse
    wait_s = min(req.body.max_wait_ms, cluster.script.fetch_wait_cap_ms) / 1000
    once = next_error(broker, ApiKey.FETCH)
    while True:
        leaders, topics, anything = [], [], False
        for ft in req.body.topics:
            topic = cluster.topics.get(ft.topic) if v < 13 else cluster.topic_by_id(ft.topic_id)
            parts = [_fetch_partition(broker, topic, fp, v, leaders, once) for fp in ft.partitions]
            anything = anything or any(p.records or p.error_code for p in parts)
            topics.append(R.FetchableTopicResponse(topic=ft.topic, topic_id=ft.topic_id, partitions=parts))
        if anything or wait_s <= 0:
            break
        # Nothing to return: wait (like fetch.max.wait.ms, capped) for a produce, then look again.
        await cluster.wait_for_data(wait_s)
        wait_s = 0
    hints = cluster.script.leader_hints and v >= 16
    return R[v](throttle_time_ms=0, error_code=0, session_id=0, responses=topics,
                node_endpoints=cluster.leader_endpoints(R, leaders) if hints else [])


def _init_producer_id(broker: ScriptedBroker, req: ReceivedRequest):
    """A fresh producer id per request (KIP-936's rogue producers get one each time), unless
    the script has an error for it (no id then)."""
    scripted = next_error(broker, INIT_PRODUCER_ID)
    if scripted:
        return InitProducerIdResponse[req.api_version](throttle_time_ms=0, error_code=scripted, producer_id=-1,
                                                       producer_epoch=-1)
    return InitProducerIdResponse[req.api_version](throttle_time_ms=0, error_code=0,
                                                   producer_id=next(broker.cluster._producer_ids), producer_epoch=0)


def _list_offsets(broker: ScriptedBroker, req: ReceivedRequest):
    R = ListOffsetsResponse
    T = R.ListOffsetsTopicResponse
    once = next_error(broker, LIST_OFFSETS)
    topics = []
    for lt in req.body.topics:
        parts = []
        for lp in lt.partitions:
            error, p = _partition_error(broker, broker.cluster.topics.get(lt.name), lp.partition_index, {}, once)
            offset = -1
            if error == 0:
                offset = 0 if lp.timestamp == -2 else p.next_offset  # -2 earliest, else latest
            parts.append(T.ListOffsetsPartitionResponse(partition_index=lp.partition_index, error_code=error,
                                                        timestamp=-1, offset=offset,
                                                        leader_epoch=p.leader_epoch if p else -1))
        topics.append(T(name=lt.name, partitions=parts))
    return R[req.api_version](throttle_time_ms=0, topics=topics)


def _create_topics(broker: ScriptedBroker, req: ReceivedRequest):
    cluster = broker.cluster
    R = CreateTopicsResponse
    once = next_error(broker, ApiKey.CREATE_TOPICS)
    results = []
    for ct in req.body.topics:
        count = ct.num_partitions
        if count == -1:
            count = len(ct.assignments) or cluster.script.default_partitions
        error, topic_id = once or TOPIC_ALREADY_EXISTS, _ZERO_UUID
        placeable = bool(ct.assignments) or ct.replication_factor <= len(cluster.brokers)
        if ct.name not in cluster.topics and not once and not placeable:
            error = INVALID_REPLICATION_FACTOR  # as Kafka's replica placer answers (Tansu creates it)
        elif ct.name not in cluster.topics and not once:
            error = 0
            if not req.body.validate_only:
                leaders = [a.broker_ids[0] for a in ct.assignments] or None
                topic_id = cluster.add_topic(ct.name, count, leaders).topic_id
        results.append(R.CreatableTopicResult(name=ct.name, topic_id=topic_id, error_code=error,
                                              error_message=None if error == 0 else (
                                                  "scripted error" if once else f"scripted: error {error}"),
                                              num_partitions=count if error == 0 else -1,
                                              replication_factor=1 if error == 0 else -1, configs=[]))
    return R[req.api_version](throttle_time_ms=0, topics=results)


def _delete_topics(broker: ScriptedBroker, req: ReceivedRequest):
    cluster, v = broker.cluster, req.api_version
    R = DeleteTopicsResponse
    wanted = [(n, None) for n in req.body.topic_names] if v < 6 else [(t.name, t.topic_id) for t in req.body.topics]
    results = []
    for name, topic_id in wanted:
        topic = cluster.topics.get(name) if name is not None else cluster.topic_by_id(topic_id)
        if topic is None:
            error = UNKNOWN_TOPIC_OR_PARTITION if name is not None else UNKNOWN_TOPIC_ID
        else:
            error = 0
            del cluster.topics[topic.name]
        results.append(R.DeletableTopicResult(name=topic.name if topic else name,
                                              topic_id=topic.topic_id if topic else (topic_id or _ZERO_UUID),
                                              error_code=error, error_message=None))
    return R[v](throttle_time_ms=0, responses=results)


HANDLERS: dict = {
    ApiKey.API_VERSIONS: _api_versions,
    ApiKey.METADATA: _metadata,
    ApiKey.FIND_COORDINATOR: _find_coordinator,
    ApiKey.DESCRIBE_CLUSTER: _describe_cluster,
    ApiKey.PRODUCE: _produce,
    ApiKey.FETCH: _fetch,
    LIST_OFFSETS: _list_offsets,
    INIT_PRODUCER_ID: _init_producer_id,
    ApiKey.CREATE_TOPICS: _create_topics,
    ApiKey.DELETE_TOPICS: _delete_topics,
}
