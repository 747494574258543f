"""The scripted cluster itself, checked with raw sockets and kafka-python (no proxy)."""

from __future__ import annotations

import asyncio
import functools
import socket
import struct
import time

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.protocol.admin import CreateTopicsRequest, DeleteTopicsRequest, DescribeClusterRequest
from kafka.protocol.consumer import FetchRequest
from kafka.protocol.metadata import ApiVersionsRequest, FindCoordinatorRequest, MetadataRequest
from kafka.protocol.producer import ProduceRequest
from kafka.record import MemoryRecords, MemoryRecordsBuilder

from protocol.apis import ApiKey
from protocol.headers import response_body_offset
from protocol.messages import decode_response
from tests.support.scripted_broker import Close, ReceivedRequest, Script, ScriptedCluster
from tests.support.wire import request_bytes


def run_async(fn):
    """Runs an ``async def`` test in a fresh event loop (with an overall timeout)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(asyncio.wait_for(fn(*args, **kwargs), 20))

    return wrapper


class Conn:
    """A raw client connection: send requests (pipelined if you like), read responses."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.sent: dict[int, object] = {}
        self._next_id = 1

    @classmethod
    async def open(cls, address) -> Conn:
        return cls(*await asyncio.open_connection(*address))

    def send(self, *requests, client_id: str = "raw-test") -> list[int]:
        """Writes every request in one write; returns their correlation ids."""
        ids, data = [], b""
        for req in requests:
            cid = self._next_id
            self._next_id += 1
            self.sent[cid] = req
            ids.append(cid)
            data += request_bytes(req, cid, client_id)
        self.writer.write(data)
        return ids

    async def read_frame(self, timeout_s: float = 5.0) -> bytes:
        (size,) = struct.unpack(">i", await asyncio.wait_for(self.reader.readexactly(4), timeout_s))
        return await asyncio.wait_for(self.reader.readexactly(size), timeout_s)

    async def receive(self, timeout_s: float = 5.0):
        """(correlation id, decoded response) for the next response frame."""
        data = await self.read_frame(timeout_s)
        (cid,) = struct.unpack_from(">i", data)
        req = self.sent[cid]
        offset = response_body_offset(data, req.API_KEY, req.API_VERSION)
        return cid, decode_response(req.API_KEY, req.API_VERSION, memoryview(data)[offset:])

    async def call(self, req):
        (cid,) = self.send(req)
        got, resp = await self.receive()
        assert got == cid
        return resp

    async def closed_by_peer(self, timeout_s: float = 2.0) -> bool:
        try:
            return await asyncio.wait_for(self.reader.read(1), timeout_s) == b""
        except (ConnectionError, asyncio.IncompleteReadError):
            return True

    def close(self) -> None:
        self.writer.close()


def batch(*values: bytes) -> bytes:
    b = MemoryRecordsBuilder(magic=2, compression_type=0, batch_size=1 << 16)
    for v in values:
        b.append(timestamp=None, key=None, value=v, headers=[])
    b.close()
    return bytes(b.buffer())


def produce(version: int, topic, partitions: dict[int, bytes], acks: int = 1):
    T = ProduceRequest.TopicProduceData
    parts = [T.PartitionProduceData(index=i, records=r) for i, r in partitions.items()]
    td = T(name=topic.name, topic_id=topic.topic_id, partition_data=parts)
    return ProduceRequest[version](transactional_id=None, acks=acks, timeout_ms=1000, topic_data=[td])


def fetch(version: int, topic, partition: int, offset: int = 0, max_wait_ms: int = 0):
    T = FetchRequest.FetchTopic
    fp = T.FetchPartition(partition=partition, current_leader_epoch=-1, fetch_offset=offset, last_fetched_epoch=-1,
                          log_start_offset=-1, partition_max_bytes=1 << 20)
    return FetchRequest[version](replica_id=-1, max_wait_ms=max_wait_ms, min_bytes=1, max_bytes=1 << 20,
                                 isolation_level=0, session_id=0, session_epoch=-1,
                                 topics=[T(topic=topic.name, topic_id=topic.topic_id, partitions=[fp])],
                                 forgotten_topics_data=[], rack_id="")


def values(records: bytes) -> list[tuple[int, bytes]]:
    out, mr = [], MemoryRecords(records)
    while (b := mr.next_batch()) is not None:
        out.extend((r.offset, r.value) for r in b)
    return out


# --- cluster shape --------------------------------------------------------------------------


@run_async
async def test_brokers_have_distinct_ids_and_ports():
    async with ScriptedCluster(3) as cluster:
        assert list(cluster.brokers) == [1, 2, 3]
        ports = {b.port for b in cluster.brokers.values()}
        assert len(ports) == 3 and 0 not in ports
        assert cluster.bootstrap_servers == [f"127.0.0.1:{cluster.broker(n).port}" for n in (1, 2, 3)]
    with pytest.raises(OSError):
        socket.create_connection(cluster.broker(1).address, timeout=1).close()


@run_async
async def test_custom_node_ids():
    async with ScriptedCluster(node_ids=[7, 11]) as cluster:
        conn = await Conn.open(cluster.broker(11).address)
        meta = await conn.call(MetadataRequest[12](topics=None))
        assert sorted(b.node_id for b in meta.brokers) == [7, 11]
        assert meta.controller_id == 7
        conn.close()


# --- ApiVersions ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", range(5))
@run_async
async def test_api_versions(version):
    ranges = {ApiKey.API_VERSIONS: (0, 4), ApiKey.METADATA: (0, 8), ApiKey.PRODUCE: (3, 9)}
    async with ScriptedCluster(1, script=Script(api_versions=ranges)) as cluster:
        conn = await Conn.open(cluster.broker(1).address)
        (cid,) = conn.send(ApiVersionsRequest[version]())
        data = await conn.read_frame()
        # ApiVersions responses keep header v0, so the body starts right after the correlation id.
        resp = decode_response(ApiKey.API_VERSIONS, version, data[4:])
        assert struct.unpack_from(">i", data)[0] == cid
        assert resp.error_code == 0
        assert {k.api_key: (k.min_version, k.max_version) for k in resp.api_keys} == ranges
        conn.close()


@pytest.mark.parametrize("version", [5, 127])
@run_async
async def test_api_versions_too_new_is_answered_like_kafka(version):
    async with ScriptedCluster(1) as cluster:
        conn = await Conn.open(cluster.broker(1).address)
        header = struct.pack(">hhih", ApiKey.API_VERSIONS, version, 99, 3) + b"raw" + b"\x00"
        body = b"\x02a\x021\x00"  # client software name "a", version "1", no tags
        conn.writer.write(struct.pack(">i", len(header) + len(body)) + header + body)
        data = await conn.read_frame()
        assert data == struct.pack(">i", 99) + struct.pack(">hihhh", 35, 1, 18, 0, 4)
        conn.close()
        assert cluster.requests[0].api_version == version and cluster.requests[0].body is None


# --- Metadata, FindCoordinator, DescribeCluster -----------------------------------------------


@pytest.mark.parametrize("version", [0, 1, 4, 9, 10, 12, 13])
@run_async
async def test_metadata_lists_every_broker_and_leader(version):
    async with ScriptedCluster(3, topics={"orders": 3, "audit": 1}) as cluster:
        conn = await Conn.open(cluster.broker(2).address)
        topics = None if version >= 1 else []
        resp = await conn.call(MetadataRequest[version](topics=topics))
        assert [(b.node_id, b.host, b.port) for b in resp.brokers] == [
            (n, "127.0.0.1", b.port) for n, b in cluster.brokers.items()
        ]
        leaders = {t.name: [p.leader_id for p in t.partitions] for t in resp.topics}
        assert leaders == {"orders": [1, 2, 3], "audit": [2]}
        if version >= 10:
            assert {t.name: t.topic_id for t in resp.topics} == {n: t.topic_id for n, t in cluster.topics.items()}
        conn.close()


@run_async
async def test_metadata_for_named_and_unknown_topics():
    async with ScriptedCluster(2, topics={"orders": 2}) as cluster:
        conn = await Conn.open(cluster.broker(1).address)
        T = MetadataRequest.MetadataRequestTopic
        resp = await conn.call(MetadataRequest[12](topics=[T(name="orders"), T(name="missing")]))
        found = [(t.name, t.error_code, len(t.partitions)) for t in resp.topics]
        assert found == [("orders", 0, 2), ("missing", 3, 0)]
        resp = await conn.call(MetadataRequest[12](topics=[]))
        assert resp.topics == [] and len(resp.brokers) == 2
        conn.close()


@pytest.mark.parametrize("version", range(4))
@run_async
async def test_find_coordinator_single(version):
    script = Script(coordinators={"group-a": 3})
    async with ScriptedCluster(3, script=script) as cluster:
        conn = await Conn.open(cluster.broker(1).address)
        resp = await conn.call(FindCoordinatorRequest[version](key="group-a", key_type=0))
        assert (resp.error_code, resp.node_id, resp.host, resp.port) == (0, 3, "127.0.0.1", cluster.broker(3).port)
        conn.close()


@pytest.mark.parametrize("version", range(4, 7))
@run_async
async def test_find_coordinator_batched_with_an_error(version):
    script = Script(coordinators={"group-a": 2}, coordinator_errors={"group-b": 15})
    async with ScriptedCluster(3, script=script) as cluster:
        conn = await Conn.open(cluster.broker(1).address)
        keys = ["group-a", "group-b", "c"]
        resp = await conn.call(FindCoordinatorRequest[version](key_type=0, coordinator_keys=keys))
        assert [(c.key, c.error_code, c.node_id, c.port) for c in resp.coordinators] == [
            ("group-a", 0, 2, cluster.broker(2).port),
            ("group-b", 15, -1, -1),
            ("c", 0, 1, cluster.broker(1).port),  # default: the controller
        ]
        conn.close()


@pytest.mark.parametrize("version", range(3))
@run_async
async def test_describe_cluster(version):
    async with ScriptedCluster(3) as cluster:
        conn = await Conn.open(cluster.broker(3).address)
        resp = await conn.call(DescribeClusterRequest[version]())
        assert resp.cluster_id == "scripted-cluster" and resp.controller_id == 1
        assert [(b.broker_id, b.port) for b in resp.brokers] == [(n, b.port) for n, b in cluster.brokers.items()]
        conn.close()


# --- Produce ----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [3, 9, 10, 12, 13])
@run_async
async def test_produce_to_leader_and_to_a_follower(version):
    async with ScriptedCluster(3, topics={"orders": 2}) as cluster:
        topic = cluster.topics["orders"]  # partition 0 led by node 1, partition 1 by node 2
        conn = await Conn.open(cluster.broker(1).address)
        resp = await conn.call(produce(version, topic, {0: batch(b"a", b"b"), 1: batch(b"c")}))
        ok, moved = resp.responses[0].partition_responses
        assert (ok.index, ok.error_code, ok.base_offset) == (0, 0, 0)
        assert (moved.index, moved.error_code) == (1, 6)  # NOT_LEADER_OR_FOLLOWER
        if version >= 10:  # KIP-951
            assert (moved.current_leader.leader_id, moved.current_leader.leader_epoch) == (2, 0)
            endpoints = [(e.node_id, e.host, e.port) for e in resp.node_endpoints]
            assert endpoints == [(2, "127.0.0.1", cluster.broker(2).port)]
        else:
            assert not resp.node_endpoints
        assert topic.partitions[0].next_offset == 2 and topic.partitions[1].next_offset == 0
        resp = await conn.call(produce(version, topic, {0: batch(b"d")}))
        assert resp.responses[0].partition_responses[0].base_offset == 2
        conn.close()


@run_async
async def test_leadership_move():
    async with ScriptedCluster(3, topics={"orders": 1}) as cluster:
        topic = cluster.topics["orders"]
        old = await Conn.open(cluster.broker(1).address)
        resp = await old.call(produce(10, topic, {0: batch(b"x")}))
        assert resp.responses[0].partition_responses[0].error_code == 0
        cluster.move_leader("orders", 0, 3)
        resp = await old.call(produce(10, topic, {0: batch(b"y")}))
        part = resp.responses[0].partition_responses[0]
        assert part.error_code == 6
        assert (part.current_leader.leader_id, part.current_leader.leader_epoch) == (3, 1)
        assert [(e.node_id, e.port) for e in resp.node_endpoints] == [(3, cluster.broker(3).port)]
        new = await Conn.open(cluster.broker(3).address)
        resp = await new.call(produce(10, topic, {0: batch(b"y")}))
        assert resp.responses[0].partition_responses[0].base_offset == 1
        meta = await new.call(MetadataRequest[12](topics=None))
        assert (meta.topics[0].partitions[0].leader_id, meta.topics[0].partitions[0].leader_epoch) == (3, 1)
        old.close()
        new.close()


@run_async
async def test_old_broker_without_leader_hints():
    async with ScriptedCluster(2, topics={"orders": 2}, script=Script(leader_hints=False)) as cluster:
        conn = await Conn.open(cluster.broker(1).address)
        resp = await conn.call(produce(11, cluster.topics["orders"], {1: batch(b"x")}))
        part = resp.responses[0].partition_responses[0]
        assert part.error_code == 6
        assert part.current_leader is None or part.current_leader.leader_id == -1
        assert not resp.node_endpoints
        conn.close()


@run_async
async def test_scripted_partition_errors_and_broker_throttle():
    script = Script(produce_errors={("orders", 0): 19}, throttle_time_ms={ApiKey.PRODUCE: 250})
    async with ScriptedCluster(1, topics={"orders": 2}, script=script) as cluster:
        conn = await Conn.open(cluster.broker(1).address)
        resp = await conn.call(produce(9, cluster.topics["orders"], {0: batch(b"a"), 1: batch(b"b")}))
        assert [(p.index, p.error_code) for p in resp.responses[0].partition_responses] == [(0, 19), (1, 0)]
        assert resp.throttle_time_ms == 250
        script.produce_errors[("orders", 1)] = 74  # FENCED_LEADER_EPOCH, with the leader hint
        resp = await conn.call(produce(12, cluster.topics["orders"], {1: batch(b"c")}))
        part = resp.responses[0].partition_responses[0]
        assert part.error_code == 74 and part.current_leader.leader_id == 1
        conn.close()


@run_async
async def test_unknown_topic_and_partition():
    async with ScriptedCluster(1, topics={"orders": 1}) as cluster:
        conn = await Conn.open(cluster.broker(1).address)
        ghost = cluster.add_topic("ghost")
        del cluster.topics["ghost"]
        resp = await conn.call(produce(9, ghost, {0: batch(b"a")}))
        assert resp.responses[0].partition_responses[0].error_code == 3
        resp = await conn.call(produce(9, cluster.topics["orders"], {5: batch(b"a")}))
        assert resp.responses[0].partition_responses[0].error_code == 3
        conn.close()


# --- pipelining and acks=0 -------------------------------------------------------------------


@run_async
async def test_pipelined_requests_answered_in_order_and_acks_0_never_answered():
    async with ScriptedCluster(2, topics={"orders": 1}) as cluster:
        topic = cluster.topics["orders"]
        conn = await Conn.open(cluster.broker(1).address)
        ids = conn.send(
            MetadataRequest[12](topics=None),
            produce(9, topic, {0: batch(b"fire", b"forget")}, acks=0),
            ApiVersionsRequest[3](client_software_name="t", client_software_version="1"),
            produce(9, topic, {0: batch(b"acked")}, acks=-1),
            DescribeClusterRequest[1](),
        )
        answered = [(await conn.receive())[0] for _ in range(4)]
        assert answered == [ids[0], ids[2], ids[3], ids[4]]
        # Nothing ever comes for the acks=0 produce.
        with pytest.raises(asyncio.TimeoutError):
            await conn.read_frame(timeout_s=0.2)
        recorded = [(r.correlation_id, r.api_key) for r in cluster.requests]
        assert recorded == list(zip(ids, [3, 0, 18, 0, 60]))
        assert topic.partitions[0].next_offset == 3  # the acks=0 records were appended
        conn.close()


@run_async
async def test_a_waiting_fetch_holds_later_responses_back():
    async with ScriptedCluster(1, topics={"orders": 1}) as cluster:
        conn = await Conn.open(cluster.broker(1).address)
        started = time.monotonic()
        ids = conn.send(fetch(12, cluster.topics["orders"], 0, max_wait_ms=10_000), MetadataRequest[9](topics=None))
        first, resp = await conn.receive()
        second, _ = await conn.receive()
        assert [first, second] == ids
        assert resp.responses[0].partitions[0].records in (b"", None)
        # The empty fetch waited for the script's cap (100 ms), not the client's 10 s (which could not
        # have ended before 10 s had passed).
        assert 0.08 < time.monotonic() - started < 10
        conn.close()


@run_async
async def test_a_waiting_fetch_wakes_when_data_arrives():
    async with ScriptedCluster(1, topics={"orders": 1}, script=Script(fetch_wait_cap_ms=5000)) as cluster:
        topic = cluster.topics["orders"]
        consumer = await Conn.open(cluster.broker(1).address)
        producer = await Conn.open(cluster.broker(1).address)
        consumer.send(fetch(13, topic, 0, max_wait_ms=5000))
        await cluster.wait_for_requests(ApiKey.FETCH)
        await producer.call(produce(9, topic, {0: batch(b"late")}))
        _, resp = await consumer.receive(timeout_s=2)
        assert values(resp.responses[0].partitions[0].records) == [(0, b"late")]
        consumer.close()
        producer.close()


# --- Fetch ------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [4, 11, 12, 13, 16, 18])
@run_async
async def test_fetch_returns_produced_records(version):
    async with ScriptedCluster(2, topics={"orders": 1}) as cluster:
        topic = cluster.topics["orders"]
        conn = await Conn.open(cluster.broker(1).address)
        await conn.call(produce(9, topic, {0: batch(b"a", b"b")}))
        await conn.call(produce(9, topic, {0: batch(b"c")}))
        resp = await conn.call(fetch(version, topic, 0))
        part = resp.responses[0].partitions[0]
        assert (part.error_code, part.high_watermark) == (0, 3)
        assert values(part.records) == [(0, b"a"), (1, b"b"), (2, b"c")]
        resp = await conn.call(fetch(version, topic, 0, offset=2))
        assert values(resp.responses[0].partitions[0].records) == [(2, b"c")]
        resp = await conn.call(fetch(version, topic, 0, offset=9))
        assert resp.responses[0].partitions[0].error_code == 1  # OFFSET_OUT_OF_RANGE
        conn.close()


@pytest.mark.parametrize("version", [11, 12, 15, 16, 18])
@run_async
async def test_fetch_from_a_follower(version):
    async with ScriptedCluster(2, topics={"orders": 2}) as cluster:
        conn = await Conn.open(cluster.broker(1).address)
        resp = await conn.call(fetch(version, cluster.topics["orders"], 1))
        part = resp.responses[0].partitions[0]
        assert part.error_code == 6
        if version >= 12:
            assert part.current_leader.leader_id == 2
        if version >= 16:
            assert [(e.node_id, e.port) for e in resp.node_endpoints] == [(2, cluster.broker(2).port)]
        else:
            assert not resp.node_endpoints
        conn.close()


# --- CreateTopics / DeleteTopics --------------------------------------------------------------


@pytest.mark.parametrize("version", range(2, 8))
@run_async
async def test_create_topics(version):
    async with ScriptedCluster(2, topics={"exists": 1}, script=Script(default_partitions=3)) as cluster:
        conn = await Conn.open(cluster.broker(1).address)
        C = CreateTopicsRequest.CreatableTopic
        topics = [C(name="new", num_partitions=-1, replication_factor=-1, assignments=[], configs=[]),
                  C(name="exists", num_partitions=1, replication_factor=1, assignments=[], configs=[])]
        resp = await conn.call(CreateTopicsRequest[version](topics=topics, timeout_ms=1000, validate_only=False))
        assert [(t.name, t.error_code) for t in resp.topics] == [("new", 0), ("exists", 36)]
        assert len(cluster.topics["new"].partitions) == 3
        if version >= 7:
            assert resp.topics[0].topic_id == cluster.topics["new"].topic_id
        conn.close()


@pytest.mark.parametrize("version", range(1, 7))
@run_async
async def test_delete_topics(version):
    async with ScriptedCluster(1, topics={"doomed": 1}) as cluster:
        conn = await Conn.open(cluster.broker(1).address)
        if version < 6:
            req = DeleteTopicsRequest[version](topic_names=["doomed", "never"], timeout_ms=1000)
        else:
            S = DeleteTopicsRequest.DeleteTopicState
            req = DeleteTopicsRequest[version](topics=[S(name="doomed"), S(name="never")], timeout_ms=1000)
        resp = await conn.call(req)
        assert [(r.name, r.error_code) for r in resp.responses] == [("doomed", 0), ("never", 3)]
        assert "doomed" not in cluster.topics
        conn.close()


# --- recording, hanging, closing, custom handlers --------------------------------------------


@run_async
async def test_every_request_is_recorded():
    async with ScriptedCluster(2) as cluster:
        conn = await Conn.open(cluster.broker(2).address)
        T = MetadataRequest.MetadataRequestTopic
        conn.send(MetadataRequest[9](topics=[T(name="a")]), client_id="recorder")
        conn.send(DescribeClusterRequest[0](), client_id=None)
        recorded = await cluster.wait_for_requests(count=2)
        first, second = recorded
        assert isinstance(first, ReceivedRequest)
        assert (first.node_id, first.api_key, first.api_version) == (2, ApiKey.METADATA, 9)
        assert (first.correlation_id, first.client_id) == (1, "recorder")
        assert [t.name for t in first.body.topics] == ["a"]
        assert (second.api_key, second.correlation_id, second.client_id) == (60, 2, None)
        assert first.connection == second.connection
        assert cluster.requests_for(ApiKey.METADATA) == [first]
        assert cluster.requests_for(ApiKey.METADATA, node_id=1) == []
        conn.close()


@run_async
async def test_wait_for_requests_times_out():
    async with ScriptedCluster(1) as cluster:
        with pytest.raises(asyncio.TimeoutError):
            await cluster.wait_for_requests(ApiKey.PRODUCE, timeout_s=0.05)


@run_async
async def test_hanging_broker_reads_but_never_answers():
    async with ScriptedCluster(1, script=Script(hang_on={ApiKey.METADATA})) as cluster:
        conn = await Conn.open(cluster.broker(1).address)
        assert (await conn.call(ApiVersionsRequest[0]())).error_code == 0
        conn.send(MetadataRequest[1](topics=None), ApiVersionsRequest[0]())
        with pytest.raises(asyncio.TimeoutError):
            await conn.read_frame(timeout_s=0.3)
        assert [r.api_key for r in cluster.requests] == [18, 3, 18]
        other = await Conn.open(cluster.broker(1).address)  # other connections still work
        assert (await other.call(ApiVersionsRequest[0]())).error_code == 0
        conn.close()
        other.close()


@run_async
async def test_unknown_api_key_closes_the_connection():
    async with ScriptedCluster(1) as cluster:
        conn = await Conn.open(cluster.broker(1).address)
        payload = struct.pack(">hhih", 9999, 0, 1, -1) + b"junk"
        conn.writer.write(struct.pack(">i", len(payload)) + payload)
        assert await conn.closed_by_peer()
        assert cluster.requests[0].api_key == 9999 and cluster.requests[0].body is None


@run_async
async def test_version_outside_the_advertised_range_closes_the_connection():
    script = Script(api_versions={ApiKey.API_VERSIONS: (0, 3), ApiKey.PRODUCE: (3, 9)})
    async with ScriptedCluster(1, topics={"orders": 1}, script=script) as cluster:
        conn = await Conn.open(cluster.broker(1).address)
        conn.send(produce(10, cluster.topics["orders"], {0: batch(b"x")}))
        assert await conn.closed_by_peer()
        conn = await Conn.open(cluster.broker(1).address)
        conn.send(MetadataRequest[1](topics=None))  # not advertised at all
        assert await conn.closed_by_peer()


@run_async
async def test_custom_handlers():
    def slow_metadata(broker, req):
        async def answer():
            await asyncio.sleep(0.05)
            resp = broker.default_response(req)
            resp.controller_id = 2
            return resp
        return answer()

    script = Script(handlers={ApiKey.METADATA: slow_metadata, ApiKey.DESCRIBE_CLUSTER: lambda b, r: Close})
    async with ScriptedCluster(2, script=script) as cluster:
        conn = await Conn.open(cluster.broker(1).address)
        ids = conn.send(MetadataRequest[12](topics=None), ApiVersionsRequest[0]())
        cid, meta = await conn.receive()
        assert cid == ids[0] and meta.controller_id == 2
        conn.send(DescribeClusterRequest[0]())
        assert (await conn.receive())[0] == ids[1]
        assert await conn.closed_by_peer()


@run_async
async def test_a_failing_handler_fails_the_test_at_exit():
    def broken(broker, req):
        raise KeyError("script bug")

    cluster = ScriptedCluster(1, script=Script(handlers={ApiKey.METADATA: broken}))
    with pytest.raises(AssertionError, match="script bug"):
        async with cluster:
            conn = await Conn.open(cluster.broker(1).address)
            conn.send(MetadataRequest[1](topics=None))
            assert await conn.closed_by_peer()
    assert isinstance(cluster.errors[0], KeyError)


@run_async
async def test_close_connections_keeps_listening():
    async with ScriptedCluster(1) as cluster:
        broker = cluster.broker(1)
        conn = await Conn.open(broker.address)
        await conn.call(ApiVersionsRequest[0]())
        assert broker.open_connections == 1
        await broker.close_connections()
        assert await conn.closed_by_peer()
        again = await Conn.open(broker.address)
        assert (await again.call(ApiVersionsRequest[0]())).error_code == 0
        assert broker.connections_accepted == 2
        again.close()


# --- threaded, with kafka-python's own clients ------------------------------------------------


def test_kafka_admin_client():
    with ScriptedCluster(3, topics={"orders": 3}).threaded() as cluster:
        admin = KafkaAdminClient(bootstrap_servers=cluster.bootstrap, request_timeout_ms=5000)
        try:
            described = admin.describe_cluster()
            assert described["controller_id"] == 1
            assert [(b["broker_id"], b["port"]) for b in described["brokers"]] == [
                (n, b.port) for n, b in cluster.brokers.items()
            ]
            assert admin.list_topics() == ["orders"]
            created = admin.create_topics({"payments": {"num_partitions": 2, "replication_factor": 1}})
            assert [(t["name"], t["error_code"]) for t in created["topics"]] == [("payments", 0)]
            (payments,) = admin.describe_topics(["payments"])
            assert [p["leader_id"] for p in payments["partitions"]] == [2, 3]
            deleted = admin.delete_topics(["orders"])
            assert [(t["name"], t["error_code"]) for t in deleted["topics"]] == [("orders", 0)]
            assert admin.list_topics() == ["payments"]
        finally:
            admin.close()
        apis = {r.api_key for r in cluster.requests}
        assert {ApiKey.API_VERSIONS, ApiKey.METADATA, ApiKey.DESCRIBE_CLUSTER, ApiKey.CREATE_TOPICS,
                ApiKey.DELETE_TOPICS} <= apis


def test_kafka_python_producer_and_consumer():
    with ScriptedCluster(3, topics={"orders": 3}).threaded() as cluster:
        producer = KafkaProducer(bootstrap_servers=cluster.bootstrap, linger_ms=0)
        try:
            futures = [producer.send("orders", value=b"v%d" % i, partition=i % 3) for i in range(9)]
            assert [f.get(10).offset for f in futures] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
        finally:
            producer.close(5)
        # Each partition's Produce went to its own leader.
        produce_nodes = {r.node_id for r in cluster.requests_for(ApiKey.PRODUCE)}
        assert produce_nodes == {1, 2, 3}
        consumer = KafkaConsumer(bootstrap_servers=cluster.bootstrap, consumer_timeout_ms=5000, fetch_max_wait_ms=50)
        try:
            consumer.assign([TopicPartition("orders", p) for p in range(3)])
            consumer.seek_to_beginning()
            got = []
            for message in consumer:
                got.append((message.partition, message.offset, message.value))
                if len(got) == 9:
                    break
        finally:
            consumer.close()
        assert sorted(got) == sorted((i % 3, i // 3, b"v%d" % i) for i in range(9))


def test_threaded_call_and_wait_for_requests():
    with ScriptedCluster(2, topics={"orders": 1}).threaded() as cluster:
        cluster.call(cluster.move_leader, "orders", 0, 2)
        with socket.create_connection(cluster.broker(1).address, timeout=5) as s:
            s.sendall(request_bytes(MetadataRequest[9](topics=None), 41))
            (got,) = cluster.wait_for_requests(ApiKey.METADATA)
        assert got.correlation_id == 41
        assert cluster.call(lambda: cluster.topics["orders"].partitions[0].leader_epoch) == 1
