"""Share groups (KIP-932) on the scripted cluster, enough for a real share consumer (librdkafka's
ShareConsumer) to join, fetch, acknowledge and leave: no broker here serves share groups (Tansu
0.6 does not; no Kafka 4.x runs here).

- ShareGroupHeartbeat (76, v0-1; definitions in tests/support/share_schemas): a member is given
  every partition of the topics it subscribes to, epoch 1 (a heartbeat without a subscription
  changes nothing); a member leaving (epoch -1) is let go.
- ShareFetch (78) and ShareAcknowledge (79), v0-2 (protocol.share_messages): one share session
  per member (epoch 0 opens it with the partitions listed, later epochs add and forget); each
  record is delivered once, acquired with delivery count 1, in whole batches; acknowledgements
  are recorded (:attr:`ShareGroups.acknowledged`) and answered per partition. A partition whose
  leader is another broker answers NOT_LEADER_OR_FOLLOWER with its CurrentLeader and the leader
  in NodeEndpoints, as Kafka does. v2 (Kafka 4.2): a renew acknowledgement (IsRenewAck,
  KIP-1222) is recorded like any other (type 4) and delivers nothing; a ShareFetch carrying
  one with MaxWaitMs, MinBytes, MaxBytes or MaxRecords not 0 is answered INVALID_REQUEST, as
  Kafka does. librdkafka 2.16 speaks v1 and never sends one.

What it does not do, because the tests need none of it: redelivery, acquisition lock expiry,
several members sharing a partition's records, rebalancing, share-group state persistence.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from kafka.protocol.api_message import ApiMessage

from protocol.apis import ApiKey
from protocol.share_messages import ShareAcknowledgeResponse, ShareFetchResponse
from tests.support import share_schemas
from tests.support.scripted_broker import ReceivedRequest, Script, ScriptedBroker

NOT_LEADER_OR_FOLLOWER = 6
INVALID_REQUEST = 42
LOCK_TIMEOUT_MS = 30_000
SHARE_API_VERSIONS = {76: (0, 1), 77: (0, 1), 78: (0, 2), 79: (0, 2)}


class ShareGroupHeartbeatRequest(ApiMessage, load_json=share_schemas):
    pass


class ShareGroupHeartbeatResponse(ApiMessage, load_json=share_schemas):
    pass


@dataclass
class ShareGroups:
    """The share-group state of the whole scripted cluster."""

    members: dict[str, int] = field(default_factory=dict)  # member id -> epoch
    left: list[str] = field(default_factory=list)
    sessions: dict[str, set[tuple[uuid.UUID, int]]] = field(default_factory=dict)  # member -> partitions
    next_offset: dict[tuple[uuid.UUID, int], int] = field(default_factory=dict)  # next offset to deliver
    delivered: list[tuple[uuid.UUID, int, int, int]] = field(default_factory=list)  # topic, partition, first, last
    acknowledged: list[tuple[uuid.UUID, int, int, int, tuple[int, ...]]] = field(default_factory=list)

    def install(self, script: Script) -> None:
        script.api_versions.update(SHARE_API_VERSIONS)
        script.request_classes[ApiKey.SHARE_GROUP_HEARTBEAT] = ShareGroupHeartbeatRequest
        script.handlers[ApiKey.SHARE_GROUP_HEARTBEAT] = self.heartbeat
        script.handlers[ApiKey.SHARE_FETCH] = self.share_fetch
        script.handlers[ApiKey.SHARE_ACKNOWLEDGE] = self.share_acknowledge

    def acknowledged_offsets(self) -> set[tuple[uuid.UUID, int, int]]:
        return {(t, p, o) for t, p, first, last, _ in self.acknowledged for o in range(first, last + 1)}

    # -- ShareGroupHeartbeat -------------------------------------------------------------------

    def heartbeat(self, broker: ScriptedBroker, req: ReceivedRequest):
        body, R = req.body, ShareGroupHeartbeatResponse[req.api_version]
        member = body.member_id or str(uuid.uuid4())
        if body.member_epoch == -1:  # leaving the group
            self.members.pop(member, None)
            self.left.append(member)
            return R(throttle_time_ms=0, error_code=0, error_message=None, member_id=member, member_epoch=-1,
                     heartbeat_interval_ms=500, assignment=None)
        self.members[member] = 1
        if body.subscribed_topic_names is None:
            # Kafka: a null subscription is the one sent before, and a null assignment in the
            # answer leaves the member's as it is.
            return R(throttle_time_ms=0, error_code=0, error_message=None, member_id=member, member_epoch=1,
                     heartbeat_interval_ms=500, assignment=None)
        topics = [broker.cluster.topics[name] for name in body.subscribed_topic_names if name in broker.cluster.topics]
        A = R.Assignment
        assignment = A(topic_partitions=[A.TopicPartitions(topic_id=t.topic_id,
                                                           partitions=list(range(len(t.partitions))))
                                         for t in topics])
        return R(throttle_time_ms=0, error_code=0, error_message=None, member_id=member, member_epoch=1,
                 heartbeat_interval_ms=500, assignment=assignment)

    # -- ShareFetch / ShareAcknowledge ---------------------------------------------------------

    def _acknowledge(self, topics) -> set[tuple[uuid.UUID, int]]:
        acked = set()
        for t in topics:
            for p in t.partitions:
                for b in p.acknowledgement_batches or ():
                    self.acknowledged.append((t.topic_id, p.partition_index, b.first_offset, b.last_offset,
                                              tuple(b.acknowledge_types)))
                    acked.add((t.topic_id, p.partition_index))
        return acked

    async def share_fetch(self, broker: ScriptedBroker, req: ReceivedRequest):
        body, v, cluster = req.body, req.api_version, broker.cluster
        R = ShareFetchResponse[v]
        renew = v >= 2 and body.is_renew_ack
        if renew and (body.max_wait_ms or body.min_bytes or body.max_bytes or body.max_records):
            # KIP-1222: Kafka refuses a renew acknowledgement that also asks for records.
            return R(throttle_time_ms=0, error_code=INVALID_REQUEST, error_message="renew ack with fetch params",
                     acquisition_lock_timeout_ms=0, responses=[], node_endpoints=[])
        session = self.sessions.setdefault(body.member_id, set())
        if body.share_session_epoch == 0:
            session.clear()
        listed = {(t.topic_id, p.partition_index) for t in body.topics for p in t.partitions}
        session |= listed
        for t in body.forgotten_topics_data or ():
            session -= {(t.topic_id, p) for p in t.partitions}
        acked = self._acknowledge(body.topics)
        wait_s = min(body.max_wait_ms, cluster.script.fetch_wait_cap_ms) / 1000
        while True:
            parts, leaders = self._collect(broker, session, acked, max(body.max_bytes, 1), fetch=not renew)
            if any(p.records or p.error_code for _, p in parts) or wait_s <= 0:
                break
            await cluster.wait_for_data(wait_s)
            wait_s = 0
        by_topic: dict[uuid.UUID, list] = {}
        for topic_id, part in parts:
            by_topic.setdefault(topic_id, []).append(part)
        fields = {"throttle_time_ms": 0, "error_code": 0, "error_message": None,
                  "responses": [R.ShareFetchableTopicResponse(topic_id=t, partitions=ps) for t, ps in by_topic.items()],
                  "node_endpoints": cluster.leader_endpoints(R, leaders)}
        if v >= 1:
            fields["acquisition_lock_timeout_ms"] = LOCK_TIMEOUT_MS
        return R(**fields)

    def _collect(self, broker, session, acked, max_bytes: int, fetch: bool = True):
        cluster = broker.cluster
        P = ShareFetchResponse.ShareFetchableTopicResponse.PartitionData
        parts, leaders, size = [], [], 0
        for topic_id, index in sorted(session):
            topic = cluster.topic_by_id(topic_id)
            if topic is None or index >= len(topic.partitions):
                continue
            p = topic.partitions[index]
            leader = P.LeaderIdAndEpoch(leader_id=p.leader, leader_epoch=p.leader_epoch)
            if p.leader != broker.node_id:
                parts.append((topic_id, P(partition_index=index, error_code=NOT_LEADER_OR_FOLLOWER, error_message=None,
                                          acknowledge_error_code=0, acknowledge_error_message=None,
                                          current_leader=leader, records=b"", acquired_records=[])))
                leaders.append(p.leader)  # Kafka sends empty records, not null (librdkafka refuses null)
                continue
            start = self.next_offset.get((topic_id, index), 0)
            records, acquired = b"", []
            for base, last, batch in p.batches if fetch else ():
                if last < start:
                    continue
                if records and size + len(records) + len(batch) > max_bytes:
                    break  # like Kafka: at least one batch, then whole batches up to the limit
                records += batch
                acquired.append(P.AcquiredRecords(first_offset=max(base, start), last_offset=last, delivery_count=1))
            if records:
                size += len(records)
                self.next_offset[(topic_id, index)] = acquired[-1].last_offset + 1
                self.delivered.extend((topic_id, index, a.first_offset, a.last_offset) for a in acquired)
            if records or (topic_id, index) in acked:
                parts.append((topic_id, P(partition_index=index, error_code=0, error_message=None,
                                          acknowledge_error_code=0, acknowledge_error_message=None,
                                          current_leader=leader, records=records,
                                          acquired_records=acquired)))
        return parts, leaders

    def share_acknowledge(self, broker: ScriptedBroker, req: ReceivedRequest):
        body, R = req.body, ShareAcknowledgeResponse[req.api_version]
        self._acknowledge(body.topics)
        P = R.ShareAcknowledgeTopicResponse.PartitionData
        topics = []
        for t in body.topics:
            topic = broker.cluster.topic_by_id(t.topic_id)
            parts = []
            for p in t.partitions:
                part = topic.partitions[p.partition_index] if topic is not None else None
                leader = P.LeaderIdAndEpoch(leader_id=part.leader if part else -1,
                                            leader_epoch=part.leader_epoch if part else -1)
                parts.append(P(partition_index=p.partition_index, error_code=0, error_message=None,
                               current_leader=leader))
            topics.append(R.ShareAcknowledgeTopicResponse(topic_id=t.topic_id, partitions=parts))
        fields = {"throttle_time_ms": 0, "error_code": 0, "error_message": None, "responses": topics,
                  "node_endpoints": []}
        if req.api_version >= 2:
            fields["acquisition_lock_timeout_ms"] = LOCK_TIMEOUT_MS  # KIP-1222
        return R(**fields)
