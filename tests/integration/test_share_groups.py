"""Share groups (KIP-932) through the proxy, against the scripted cluster: no broker here serves
share groups (Tansu 0.6 does not), so the scripted brokers advertise the share APIs as a Kafka
4.x broker with share groups enabled does, and answer ShareFetch / ShareAcknowledge with bodies
built from Kafka's definitions (protocol.share_messages).

The share APIs are one family (protocol.apis.API_FAMILIES): offered whole when the broker has
all four at versions the proxy speaks (ShareFetch / ShareAcknowledge capped at v2, as Kafka
4.2 defines them), hidden whole otherwise, so that a share consumer is never left half-working:
it fails at once (librdkafka: "ShareGroupHeartbeatRequest not supported by broker") instead of
joining a group and spinning on a ShareFetch it may not send. librdkafka 2.16 speaks v1; v2
(KIP-1206, KIP-1222) is driven on a raw connection.
"""

from __future__ import annotations

import logging
import socket
import struct
import time

import pytest
from confluent_kafka import ShareConsumer

from protocol.apis import ApiKey
from protocol.messages import decode_response
from protocol.share_messages import ShareAcknowledgeRequest, ShareFetchRequest
from tests.support.inproc import InProcessProxy
from tests.support.scripted_broker import Script, ScriptedCluster
from tests.support.scripted_handlers import default_api_versions
from tests.support.share_broker import INVALID_REQUEST, LOCK_TIMEOUT_MS, ShareGroups
from tests.support.wire import api_versions, read_frame, request_bytes
from tests.unit.test_records import batch

pytestmark = pytest.mark.integration

SHARE_FAMILY = {76: (1, 1), 77: (1, 1), 78: (1, 1), 79: (1, 1)}  # as Kafka 4.1 lists them
SHARE_STATE = {83: (0, 0), 84: (0, 0), 85: (0, 0), 86: (0, 0), 87: (0, 0)}  # broker to broker
SHARE_ADMIN = {90: (0, 0), 91: (0, 0), 92: (0, 0)}  # Describe/Alter/DeleteShareGroupOffsets


def cluster_with(api_versions: dict[int, tuple[int, int]]):
    script = Script(api_versions={**default_api_versions(), **api_versions})
    return ScriptedCluster(brokers=1, script=script).threaded()


@pytest.fixture
def stack():
    """A broker with share groups whole, and the proxy in front of it."""
    with cluster_with({**SHARE_FAMILY, **SHARE_STATE, **SHARE_ADMIN}) as cluster:
        with InProcessProxy(cluster.bootstrap_servers) as proxy:
            yield cluster, proxy


@pytest.fixture
def half_stack():
    """A broker listing ShareGroupHeartbeat and ShareGroupDescribe but not ShareFetch /
    ShareAcknowledge (the shape a client saw through older proxies), and the proxy."""
    half = {k: v for k, v in SHARE_FAMILY.items() if k in (76, 77)}
    with cluster_with({**half, **SHARE_STATE, **SHARE_ADMIN}) as cluster:
        with InProcessProxy(cluster.bootstrap_servers) as proxy:
            yield cluster, proxy


def flexible_request(api_key: int, api_version: int, correlation_id: int, body: bytes = b"\x00") -> bytes:
    """A request with a v2 header (every share API is flexible from v0)."""
    client_id = b"share-consumer"
    header = struct.pack(">hhih", api_key, api_version, correlation_id, len(client_id)) + client_id + b"\x00"
    return struct.pack(">i", len(header) + len(body)) + header + body


def listed(address) -> dict[int, tuple[int, int]]:
    return {e.api_key: (e.min_version, e.max_version) for e in api_versions(address).api_keys}


def test_the_share_family_is_offered_whole_at_the_versions_the_proxy_speaks(stack):
    cluster, proxy = stack
    direct, through = listed(cluster.broker(1).address), listed(proxy.address)
    assert {k: through[k] for k in SHARE_FAMILY} == SHARE_FAMILY
    assert through == direct  # nothing else hidden or changed (DescribeQuorum is not listed here)


def test_kafka_4_2s_v2_is_offered_a_later_version_capped_and_a_broker_needing_it_hides_the_family():
    kafka_4_2 = {76: (1, 1), 77: (1, 1), 78: (1, 2), 79: (1, 2)}  # KIP-1206, KIP-1222
    with cluster_with(kafka_4_2) as cluster, InProcessProxy(cluster.bootstrap_servers) as proxy:
        assert {k: v for k, v in listed(proxy.address).items() if k in SHARE_FAMILY} == kafka_4_2
    newer = {76: (1, 1), 77: (1, 1), 78: (1, 3), 79: (1, 3)}  # a version past 2 is not guessed at
    with cluster_with(newer) as cluster, InProcessProxy(cluster.bootstrap_servers) as proxy:
        through = listed(proxy.address)
        assert (through[78], through[79]) == ((1, 2), (1, 2)) and (through[76], through[77]) == ((1, 1), (1, 1))
    only_v3 = {76: (1, 1), 77: (1, 1), 78: (3, 3), 79: (1, 2)}
    with cluster_with(only_v3) as cluster, InProcessProxy(cluster.bootstrap_servers) as proxy:
        assert not set(listed(proxy.address)) & set(SHARE_FAMILY)


def test_a_family_the_broker_offers_in_part_is_hidden_whole(half_stack):
    cluster, proxy = half_stack
    direct, through = listed(cluster.broker(1).address), listed(proxy.address)
    assert {76, 77} <= set(direct) and not set(through) & set(SHARE_FAMILY)
    assert through == {k: v for k, v in direct.items() if k not in SHARE_FAMILY}  # share state and admin stay


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_librdkafkas_share_consumer_is_told_at_once_and_sends_nothing_of_the_family(half_stack):
    """confluent-kafka's ShareConsumer (librdkafka 2.16, KIP-932 in preview) through the proxy
    in front of a broker without ShareFetch: ShareGroupHeartbeat is not offered either, so it
    never sends one; librdkafka then backs off and asks again (its coordinator query) instead
    of spinning."""
    cluster, proxy = half_stack
    cluster.call(cluster.add_topic, "orders", 1, [1])
    lines = _Lines()
    logger = logging.getLogger("test.share-consumer")
    logger.addHandler(lines)
    logger.setLevel(logging.DEBUG)
    created = time.monotonic()  # every lookup below was sent after this...
    consumer = ShareConsumer({"bootstrap.servers": proxy.bootstrap, "group.id": "share-group",
                              "debug": "cgrp", "logger": logger})
    try:
        consumer.subscribe(["orders"])
        start = time.monotonic()
        while time.monotonic() - start < 3.0:
            assert len(consumer.poll(0.2)) == 0
    finally:
        consumer.close()
        closed = time.monotonic()  # ...and before this
        logger.removeHandler(lines)
    assert any("ShareGroupHeartbeatRequest not supported by broker" in line for line in lines.lines)
    assert all(cluster.requests_for(key) == [] for key in SHARE_FAMILY)
    # Its back-off is about a second: a handful of coordinator lookups (10 per 3 s at most), not
    # thousands; counted over the time the consumer lived, which a busy machine stretches past 3 s.
    lookups = len(cluster.requests_for(ApiKey.FIND_COORDINATOR))
    assert 1 <= lookups <= 10 * max(1.0, (closed - created) / 3.0), (lookups, round(closed - created, 2))


# -- a real share consumer through the proxy ---------------------------------------------------------

def share_cluster(brokers: int = 1):
    script = Script()
    groups = ShareGroups()
    groups.install(script)
    return ScriptedCluster(brokers=brokers, script=script).threaded(), groups


def consume(consumer, want: int, timeout_s: float = 20.0) -> list[tuple[int, int, bytes]]:
    got: list[tuple[int, int, bytes]] = []
    start = time.monotonic()
    while len(got) < want and time.monotonic() - start < timeout_s:
        for m in consumer.poll(0.3):
            assert m.error() is None, m.error()
            got.append((m.partition(), m.offset(), m.value()))
    consumer.poll(0.3)  # implicit acknowledgement of the last records goes with the next poll
    return got


def test_librdkafkas_share_consumer_reads_and_acknowledges_everything_through_the_proxy():
    cluster_cm, groups = share_cluster()
    with cluster_cm as cluster:
        topic = cluster.call(cluster.add_topic, "orders", 2, [1, 1])
        for p in topic.partitions:
            cluster.call(cluster.append, p, batch(5))
        with InProcessProxy(cluster.bootstrap_servers) as proxy:
            consumer = ShareConsumer({"bootstrap.servers": proxy.bootstrap, "group.id": "orders-workers"})
            try:
                consumer.subscribe(["orders"])
                got = consume(consumer, 10)
            finally:
                consumer.close()
            assert sorted((p, o) for p, o, _ in got) == [(p, o) for p in (0, 1) for o in range(5)]
            assert {v for _, _, v in got} == {b"value-%d" % i * 3 for i in range(5)}
            # Every record acknowledged once (accepted), and the member left the group on close.
            assert groups.acknowledged_offsets() == {(topic.topic_id, p, o) for p in (0, 1) for o in range(5)}
            assert {types for *_, types in groups.acknowledged} == {(1,)}
            assert len(groups.left) == 1
            for api in ("ShareGroupHeartbeat", "ShareFetch", "ShareAcknowledge"):
                assert proxy.metric("kqp_requests_total", api=api) >= 1, api


def test_a_moved_partition_is_found_through_the_proxy_and_no_broker_address_reaches_the_client():
    """Partition 0 moves from broker 1 to broker 2 while the consumer reads: broker 1 answers its
    ShareFetch NOT_LEADER_OR_FOLLOWER with CurrentLeader and broker 2's address in NodeEndpoints;
    the client must go on at the proxy's listener for node 2, never at broker 2 itself."""
    cluster_cm, _groups = share_cluster(brokers=2)
    with cluster_cm as cluster:
        topic = cluster.call(cluster.add_topic, "orders", 1, [1])
        cluster.call(cluster.append, topic.partitions[0], batch(3))
        lines = _Lines()
        logger = logging.getLogger("test.share-consumer.moved")
        logger.addHandler(lines)
        logger.setLevel(logging.DEBUG)
        with InProcessProxy(cluster.bootstrap_servers) as proxy:
            consumer = ShareConsumer({"bootstrap.servers": proxy.bootstrap, "group.id": "movers",
                                      "debug": "broker", "logger": logger})
            try:
                consumer.subscribe(["orders"])
                first = consume(consumer, 3)
                cluster.call(cluster.move_leader, "orders", 0, 2)
                cluster.call(cluster.append, topic.partitions[0], batch(4))
                second = consume(consumer, 4)
            finally:
                consumer.close()
                logger.removeHandler(lines)
            assert [o for _, o, _ in first] == [0, 1, 2] and sorted(o for _, o, _ in second) == [3, 4, 5, 6]
            assert proxy.metric("kqp_leader_hints_total", source="broker") >= 1
            assert any(r.node_id == 2 for r in cluster.requests_for(ApiKey.SHARE_FETCH))
        broker_ports = {str(cluster.broker(n).address[1]) for n in (1, 2)}
        seen = " ".join(lines.lines)
        assert not [p for p in broker_ports if f":{p}" in seen], "the client saw a broker's own address"


def test_share_fetches_are_held_to_the_consumer_byte_rate_and_lose_nothing():
    quota = 4096  # bytes/s; the records below are about 23 KiB
    cluster_cm, _groups = share_cluster()
    with cluster_cm as cluster:
        topic = cluster.call(cluster.add_topic, "orders", 1, [1])
        for _ in range(60):
            cluster.call(cluster.append, topic.partitions[0], batch(10))
        with InProcessProxy(cluster.bootstrap_servers, quotas=[{"user": "ANONYMOUS", "consumer_byte_rate": quota}],
                            quota_windows={"quota_window_num": 2, "quota_window_size_seconds": 1}) as proxy:
            consumer = ShareConsumer({"bootstrap.servers": proxy.bootstrap, "group.id": "slow"})
            try:
                consumer.subscribe(["orders"])
                start = time.monotonic()
                got = consume(consumer, 600, timeout_s=40)
                elapsed_s = time.monotonic() - start
            finally:
                consumer.close()
            assert sorted(o for _, o, _ in got) == list(range(600))  # every record once, none emptied away
            assert proxy.metric("kqp_quota_throttled_total", kind="consumer_byte_rate") > 0
            # Each ShareFetch asked for at most quota x window, and the mute held the rate: about
            # 23 KiB at 4 KiB/s, less the first two windows' allowance, takes more than 3.5 s.
            assert max(r.body.max_bytes for r in cluster.requests_for(ApiKey.SHARE_FETCH)) <= quota
            assert elapsed_s > 2.5, f"{len(got)} records in {elapsed_s:.1f} s at {quota} bytes/s"


# -- v2 (Kafka 4.2) on the wire: librdkafka 2.16 speaks v1 ------------------------------------------------

def share_fetch_v2(topic_id, epoch: int, acks=(), renew: bool = False, max_bytes: int = 1 << 20):
    """A ShareFetchRequest v2 for partition 0; ``acks``: (first, last, types). A renew
    acknowledgement (KIP-1222) asks for nothing: MaxWaitMs, MinBytes, MaxBytes, MaxRecords 0."""
    R = ShareFetchRequest[2]
    P = R.FetchTopic.FetchPartition
    batches = [P.AcknowledgementBatch(first_offset=f, last_offset=last, acknowledge_types=list(types))
               for f, last, types in acks]
    fetching = 0 if renew else 1
    return R(group_id="g2", member_id="m-v2", share_session_epoch=epoch, max_wait_ms=500 * fetching,
             min_bytes=fetching, max_bytes=max_bytes * fetching, max_records=500 * fetching, batch_size=500,
             share_acquire_mode=1, is_renew_ack=renew,  # KIP-1206 record-limit, KIP-1222
             topics=[R.FetchTopic(topic_id=topic_id, partitions=[P(partition_index=0,
                                                                   acknowledgement_batches=batches)])],
             forgotten_topics_data=[])


def round_trip(sock, req, api_key: int, correlation_id: int):
    sock.sendall(request_bytes(req, correlation_id, client_id="share-v2"))
    frame = read_frame(sock)
    assert frame is not None and struct.unpack(">i", frame[:4])[0] == correlation_id
    return decode_response(api_key, 2, frame[5:])  # response header v1, no tagged fields


def test_share_fetch_and_acknowledge_v2_through_the_proxy_with_a_renew_acknowledgement():
    """Kafka 4.2's v2 of both APIs on one connection through a proxy enforcing a byte quota:
    records fetched (MaxBytes capped), their lock renewed by a ShareFetch with IsRenewAck whose
    zeros reach the broker as zeros (anything else is INVALID_REQUEST), then accepted by a
    ShareAcknowledge whose v2 answer carries AcquisitionLockTimeoutMs."""
    quota = 4096
    cluster_cm, groups = share_cluster()
    with cluster_cm as cluster:
        topic = cluster.call(cluster.add_topic, "orders", 1, [1])
        cluster.call(cluster.append, topic.partitions[0], batch(5))
        tid = topic.topic_id
        with InProcessProxy(cluster.bootstrap_servers, quotas=[{"user": "ANONYMOUS", "consumer_byte_rate": quota}],
                            quota_windows={"quota_window_num": 2, "quota_window_size_seconds": 1}) as proxy, \
                socket.create_connection(proxy.address, timeout=10) as s:
            fetched = round_trip(s, share_fetch_v2(tid, 0), ApiKey.SHARE_FETCH, 1)
            assert (fetched.error_code, fetched.acquisition_lock_timeout_ms) == (0, LOCK_TIMEOUT_MS)
            [part] = fetched.responses[0].partitions
            assert [(a.first_offset, a.last_offset) for a in part.acquired_records] == [(0, 4)]
            renewed = round_trip(s, share_fetch_v2(tid, 1, [(0, 4, (4,))], renew=True), ApiKey.SHARE_FETCH, 2)
            assert renewed.error_code == 0
            assert [p.acquired_records for t in renewed.responses for p in t.partitions] == [[]]
            ack = ShareAcknowledgeRequest[2]
            AP = ack.AcknowledgeTopic.AcknowledgePartition
            accept = ack(group_id="g2", member_id="m-v2", share_session_epoch=2, is_renew_ack=False, topics=[
                ack.AcknowledgeTopic(topic_id=tid, partitions=[AP(partition_index=0, acknowledgement_batches=[
                    AP.AcknowledgementBatch(first_offset=0, last_offset=4, acknowledge_types=[1])])])])
            acked = round_trip(s, accept, ApiKey.SHARE_ACKNOWLEDGE, 3)
            assert (acked.error_code, acked.acquisition_lock_timeout_ms) == (0, LOCK_TIMEOUT_MS)
            assert [(p.partition_index, p.error_code) for p in acked.responses[0].partitions] == [(0, 0)]
        first, renew = [(b.max_bytes, b.min_bytes, b.max_wait_ms, b.max_records, b.is_renew_ack)
                        for b in (r.body for r in cluster.requests_for(ApiKey.SHARE_FETCH))]
        assert first == (quota, 1, 500, 500, False)  # MaxBytes capped to quota x window
        assert renew == (0, 0, 0, 0, True)
        assert [(r.api_version, r.body.is_renew_ack) for r in cluster.requests_for(ApiKey.SHARE_ACKNOWLEDGE)] \
            == [(2, False)]
        assert [a[2:] for a in groups.acknowledged] == [(0, 4, (4,)), (0, 4, (1,))]  # renewed, accepted
        # The control: the scripted broker refuses, as Kafka does, a renew acknowledgement that asks for bytes.
        with socket.create_connection(cluster.broker(1).address, timeout=10) as s:
            bad = share_fetch_v2(tid, 3, [(0, 4, (4,))], renew=True)
            bad.max_bytes = 1
            assert round_trip(s, bad, ApiKey.SHARE_FETCH, 4).error_code == INVALID_REQUEST


def test_share_group_describe_passes_through_byte_for_byte(stack):
    """ShareGroupDescribe (77) carries no broker address: the broker's answer comes back as it is."""
    cluster, proxy = stack
    # ShareGroupDescribeResponse v1 body: throttle 0, one group, error 0, no message, id "g",
    # state "Stable", epochs 3 / 3, assignor "Range", no members, authorized operations -2^31.
    body = (struct.pack(">i", 0) + b"\x02" + struct.pack(">h", 0) + b"\x00" + b"\x02g" + b"\x07Stable"
            + struct.pack(">ii", 3, 3) + b"\x06" + b"RangeAssignor"[:5] + b"\x01"
            + struct.pack(">i", -(2 ** 31)) + b"\x00" + b"\x00")

    def answer(broker, req):
        payload = struct.pack(">i", req.correlation_id) + b"\x00" + body
        return struct.pack(">i", len(payload)) + payload

    cluster.script.handlers[ApiKey.SHARE_GROUP_DESCRIBE] = answer
    cluster.script.request_classes[ApiKey.SHARE_GROUP_DESCRIBE] = _AnyBody
    with socket.create_connection(proxy.address, timeout=10) as s:
        s.sendall(flexible_request(ApiKey.SHARE_GROUP_DESCRIBE, 1, 9, b"\x02\x02g\x00\x00"))
        frame = read_frame(s)
    assert frame == struct.pack(">i", 9) + b"\x00" + body
    assert proxy.metric("kqp_requests_total", api="ShareGroupDescribe") == 1


class _AnyBody:
    """A request class for the script that reads nothing of the body."""

    max_version = 1
    _flexible_versions = (0, 32767)

    @classmethod
    def decode(cls, data, version):
        return b"not read"
