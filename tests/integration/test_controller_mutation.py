"""KIP-599 controller mutation quota, end to end: real Tansu broker, real admin clients, raw sockets.

Quota under test (DESIGN.md, "Reference semantics"): ``controller_mutation_rate`` Q = 5 partitions/s,
controller_quota_window_num 11 × controller_quota_window_size_seconds 1, so the token bucket's
burst B = Q × 11 × 1 = 55 and a new bucket starts full. Unauthenticated clients are user
ANONYMOUS; the quota entries name client ids under ``user: "<default>"``. Every test uses its own
client id (``storm`` exactly, or one matching the ``storm-*`` glob), so each starts with its own
full bucket: a ``<default>`` user / glob quota is a quota *each* matching entity gets.

Exact throttle values are read from raw responses (kafka-python's request classes over a plain
socket): the admin clients swallow ``throttle_time_ms``.

CreatePartitions runs against the scripted cluster (tests/support/scripted_broker.py) because
Tansu has no CreatePartitions; the scripted broker gets a CreatePartitions handler here through
``Script.handlers``.

Tansu 0.6.0 quirk seen here: it ignores CreateTopics ``validate_only`` and really creates the
topic (not a proxy matter; the ValidateOnly test only uses names nothing else needs).
"""

from __future__ import annotations

import itertools
import socket
import struct
import time
import uuid

import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic
from kafka import KafkaAdminClient
from kafka.errors import NodeNotReadyError, RetriableError, ThrottlingQuotaExceededError
from kafka.protocol.admin import (
    CreatePartitionsRequest,
    CreatePartitionsResponse,
    CreateTopicsRequest,
    DeleteTopicsRequest,
)
from kafka.protocol.metadata import ApiVersionsRequest, MetadataRequest
from prometheus_client.parser import text_string_to_metric_families

from protocol.apis import ApiKey
from protocol.headers import response_body_offset
from protocol.messages import decode_response
from tests.support.inproc import InProcessProxy
from tests.support.scripted_broker import Partition, Script, ScriptedCluster
from tests.support.wire import read_frame, request_bytes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

RATE = 5  # partitions per second
WINDOWS = {"controller_quota_window_num": 11, "controller_quota_window_size_seconds": 1}
BURST = 55  # Q × S × W
KIND = "controller_mutation_rate"
THROTTLED = 89  # THROTTLING_QUOTA_EXCEEDED
UNKNOWN_TOPIC_OR_PARTITION = 3
INVALID_PARTITIONS = 37
QUOTAS = [
    {"user": "<default>", "client_id": "storm", KIND: RATE},
    {"user": "<default>", "client_id": "storm-*", KIND: RATE},
    {"user": "<default>", "client_id": "other-tenant", KIND: RATE},
]
ZERO_UUID = uuid.UUID(int=0)
MUTE_TOLERANCE_S = 0.020  # scheduling slack allowed on a mute's end


# -- plumbing ----------------------------------------------------------------------------------


@pytest.fixture
def proxy(tansu):
    with InProcessProxy([tansu.bootstrap], quotas=QUOTAS, quota_windows=WINDOWS) as p:
        yield p


class Wire:
    """One raw client connection: Kafka requests out, decoded responses back, receipt times noted."""

    def __init__(self, address, client_id: str) -> None:
        self.sock = socket.create_connection(tuple(address), timeout=20)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.client_id = client_id
        self._correlation_id = 0
        self._sent: list[tuple[int, object]] = []

    def send(self, request) -> None:
        self._correlation_id += 1
        self.sock.sendall(request_bytes(request, self._correlation_id, self.client_id))
        self._sent.append((self._correlation_id, request))

    def recv(self):
        """The next response (in request order) and the monotonic time it was read."""
        correlation_id, request = self._sent.pop(0)
        frame = read_frame(self.sock)
        received = time.monotonic()
        assert frame is not None, "the proxy closed the connection"
        assert struct.unpack(">i", frame[:4])[0] == correlation_id
        key, version = request.API_KEY, request.API_VERSION
        return decode_response(key, version, memoryview(frame)[response_body_offset(frame, key, version):]), received

    def call(self, request):
        self.send(request)
        return self.recv()

    def nothing_to_read(self) -> bool:
        self.sock.setblocking(False)
        try:
            return not self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True
        finally:
            self.sock.setblocking(True)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Wire:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def create_topics(version: int, names, partitions: int, validate_only: bool = False):
    T = CreateTopicsRequest[version].CreatableTopic
    topics = [T(name=n, num_partitions=partitions, replication_factor=1, assignments=[], configs=[]) for n in names]
    return CreateTopicsRequest[version](topics=topics, timeout_ms=10_000, validate_only=validate_only)


def delete_topics_v6(names):
    D = DeleteTopicsRequest[6].DeleteTopicState
    return DeleteTopicsRequest[6](topics=[D(name=n, topic_id=ZERO_UUID) for n in names], timeout_ms=10_000)


def api_versions_v3():
    return ApiVersionsRequest[3](client_software_name="wire", client_software_version="1")


def broker_topics(address) -> dict[str, int]:
    """Topic name -> partition count, asked of the broker itself (bypassing the proxy)."""
    with Wire(address, "test-inspector") as w:
        resp, _ = w.call(MetadataRequest[12](topics=None, allow_auto_topic_creation=False))
    return {t.name: len(t.partitions) for t in resp.topics if t.error_code == 0}


def tansu_address(tansu) -> tuple[str, int]:
    return tansu.host, tansu.port


def samples(proxy) -> list:
    return [s for family in text_string_to_metric_families(proxy.metrics_text()) for s in family.samples]


def tokens(proxy, client_id: str) -> float:
    """kqp_quota_tokens for (ANONYMOUS, client_id); fails if the entity has no bucket."""
    return tokens_read(proxy, client_id)[0]


def tokens_read(proxy, client_id: str) -> tuple[float, float, float]:
    """kqp_quota_tokens for (ANONYMOUS, client_id) and the monotonic clock just before and just after
    the scrape: the proxy refilled the bucket to some instant between the two (its clock is this
    process's), so a bound that involves the refill takes the side of that interval that loosens it."""
    before = time.monotonic()
    found = [s.value for s in samples(proxy)
             if s.name == "kqp_quota_tokens"
             and s.labels == {"kind": KIND, "user": "ANONYMOUS", "client_id": client_id}]
    after = time.monotonic()
    assert found, f"no token bucket for client id {client_id!r}"
    return found[0], before, after


def has_bucket(proxy, client_id: str) -> bool:
    return any(s.name == "kqp_quota_tokens" and s.labels.get("client_id") == client_id for s in samples(proxy))


def rejected_total(proxy) -> float:
    return proxy.metric("kqp_quota_rejected_total", kind=KIND)


def codes(resp) -> list[int]:
    return [t.error_code for t in resp.topics]


# -- 1. strict CreateTopics: exactly the topics the bucket allows -----------------------------------


def test_strict_create_topics_admits_while_tokens_last_then_follows_the_refill_rate(tansu, proxy):
    """30 topics × 4 partitions in one CreateTopics v7: B = 55, so topics 1..14 are admitted (the
    14th is checked at K = 3 ≥ 0 and drives K to −1), topics 15..30 get error 89 with
    throttle_time_ms = −K/Q = 1/5 s = 200 ms exactly, and only the admitted ones reach the broker.
    Then one 4-partition topic per request, sent back to back by a client that never waits: the
    mute paces it, and admissions come every 4/Q = 0.8 s (~5 partitions/s)."""
    names = [f"burst-{i:02d}" for i in range(30)]
    with Wire(proxy.address, "storm") as w:
        burst_sent = time.monotonic()
        resp, burst_answered = w.call(create_topics(7, names, 4))
        assert [t.name for t in resp.topics] == names  # merged back in request order
        assert codes(resp) == [0] * 14 + [THROTTLED] * 16
        assert resp.throttle_time_ms == 200
        assert all(t.num_partitions == 4 for t in resp.topics[:14])
        for t in resp.topics[14:]:
            assert t.error_message == "The throttling quota has been exceeded."
        assert rejected_total(proxy) == 16
        on_broker = broker_topics(tansu_address(tansu))
        assert {n: on_broker.get(n) for n in names[:14]} == dict.fromkeys(names[:14], 4)
        assert not set(names[14:]) & set(on_broker), "a rejected topic reached the broker"

        # The drip: never sleeps, so only the proxy's mute holds it back.
        admitted_at, rejections, i = [], [], 0
        deadline = time.monotonic() + 15
        while len(admitted_at) < 5:
            assert time.monotonic() < deadline, f"only {len(admitted_at)} admissions"
            sent = time.monotonic()
            resp, answered = w.call(create_topics(7, [f"drip-{i:02d}"], 4))
            i += 1
            if resp.topics[0].error_code == 0:
                assert resp.throttle_time_ms == 0  # strict: an admitted topic is never throttled
                admitted_at.append(answered)
            else:
                assert resp.topics[0].error_code == THROTTLED
                assert 0 <= resp.throttle_time_ms <= 800
                rejections.append(resp.throttle_time_ms)
        k_end, _, k_end_after = tokens_read(proxy, "storm")
    # The bucket's guarantee: K = −1 after the burst (decided after burst_sent), and an admission needs
    # K ≥ 0 and takes 4, so the k-th drip topic cannot be decided before (4k − 3) / Q after it.
    for k, answered in enumerate(admitted_at, 1):
        assert answered - burst_sent >= (4 * k - 3) / RATE - MUTE_TOLERANCE_S, (k, answered - burst_sent)
    # And the mute paces the client at the refill rate: one topic per 0.8 s, give or take a few
    # round trips (the client's own pace bounds this one on a busy machine).
    gaps = [b - a for a, b in itertools.pairwise(admitted_at)]
    rate = 4 * len(gaps) / (admitted_at[-1] - admitted_at[0])
    print(f"drip: first after {admitted_at[0] - burst_answered:.3f} s, gaps {[round(g, 3) for g in gaps]}, "
          f"{rate:.2f} partitions/s")
    assert rate >= 4.0, f"{rate:.2f} partitions/s admitted"
    # A client that ignores throttles gets about one rejection per admission, not a busy loop.
    assert len(rejections) <= 2 * len(admitted_at) + 1, rejections
    # K = −4 when the last drip topic was admitted (at the earliest when it was sent), refilled since.
    assert -4.0 - 1e-9 <= k_end <= -4.0 + RATE * (k_end_after - sent) + 1e-9
    on_broker = broker_topics(tansu_address(tansu))
    drip_created = sorted(n for n in on_broker if n.startswith("drip-"))
    assert len(drip_created) == 5 and all(on_broker[n] == 4 for n in drip_created)


def test_kafka_python_admin_client_on_error_89(tansu, proxy):
    """kafka-python 3.0.12 KafkaAdminClient, create_topics(30 topics × 4 partitions) through the proxy:

    * it sends ONE CreateTopics v7 (strict) and does not retry;
    * it raises ``ThrottlingQuotaExceededError`` (error 89; a ``RetriableError`` subclass) for the
      first failed topic — yet topics 1..14 were admitted and really exist on the broker;
    * it honours the response's throttle_time_ms itself: a call made before the 200 ms throttle
      has passed fails at once with ``NodeNotReadyError('Node paused: {'throttle'}')`` without
      sending anything;
    * with ``raise_errors=False`` it returns the per-topic error codes (admitted first, then 89s,
      in request order) and drops throttle_time_ms from the result.
    """
    names = [f"kp-{i:02d}" for i in range(30)]
    admin = KafkaAdminClient(bootstrap_servers=proxy.bootstrap, client_id="storm-kafka-python")
    try:
        sent_before = proxy.metric("kqp_requests_total", api="CreateTopics", version="7")
        with pytest.raises(ThrottlingQuotaExceededError) as raised:
            admin.create_topics({n: {"num_partitions": 4, "replication_factor": 1} for n in names})
        returned = time.monotonic()
        assert isinstance(raised.value, RetriableError)
        assert proxy.metric("kqp_requests_total", api="CreateTopics", version="7") - sent_before == 1
        on_broker = broker_topics(tansu_address(tansu))
        assert sorted(n for n in names if n in on_broker) == names[:14]

        second = {n: {"num_partitions": 4, "replication_factor": 1} for n in names[14:]}
        if time.monotonic() - returned < 0.15:  # still inside the 200 ms throttle
            with pytest.raises(NodeNotReadyError, match="throttle"):
                admin.create_topics(second, raise_errors=False)
            assert proxy.metric("kqp_requests_total", api="CreateTopics", version="7") - sent_before == 1

        time.sleep(0.25)  # the throttle has passed: K ≈ −1 + 5 × 0.25 ≥ 0
        result = admin.create_topics(second, raise_errors=False)
        assert "throttle_time_ms" not in result
        assert [t["name"] for t in result["topics"]] == names[14:]
        got = [t["error_code"] for t in result["topics"]]
        n_ok = got.count(0)
        assert n_ok >= 1 and got == [0] * n_ok + [THROTTLED] * (16 - n_ok), got
    finally:
        admin.close()
    on_broker = broker_topics(tansu_address(tansu))
    assert sorted(n for n in names if n in on_broker) == names[: 14 + n_ok]


def test_confluent_kafka_admin_client_is_permissive_and_muted(tansu, proxy):
    """confluent-kafka 2.16.1 (librdkafka 2.16) AdminClient, create_topics(30 × 4) through the proxy:

    * librdkafka speaks CreateTopics v4 at most, which is *permissive* under KIP-599: no topic
      gets error 89, every future resolves to None, all 30 topics (120 partitions) exist;
    * K = 55 − 120 = −65, so the response carries throttle_time_ms = 65/5 s = 13 000 ms, which
      librdkafka reports through ``throttle_cb`` (13.0 s) but does not wait for by itself;
    * the proxy mutes the connection for those 13 s: a second create_topics on the same client
      (request_timeout 1.5 s) fails with ``KafkaException(_TIMED_OUT)`` (not retriable).
    """
    names = [f"ck-{i:02d}" for i in range(30)]
    events = []
    admin = AdminClient({"bootstrap.servers": proxy.bootstrap, "client.id": "storm-confluent",
                         "throttle_cb": lambda e: events.append(e.throttle_time)})
    sent = time.monotonic()
    futures = admin.create_topics([NewTopic(n, 4, 1) for n in names], request_timeout=10)
    assert {n: f.result(15) for n, f in futures.items()} == dict.fromkeys(names)
    assert proxy.metric("kqp_requests_total", api="CreateTopics", version="4") == 1
    assert rejected_total(proxy) == 0
    on_broker = broker_topics(tansu_address(tansu))
    assert {n: on_broker.get(n) for n in names} == dict.fromkeys(names, 4)
    k, _, k_after = tokens_read(proxy, "storm-confluent")
    assert -65.0 - 1e-9 <= k <= -65.0 + RATE * (k_after - sent) + 1e-9  # −65 when charged, refilled since
    deadline = time.monotonic() + 5
    while not events and time.monotonic() < deadline:
        admin.poll(0.05)
    assert events[0] == 13.0  # (librdkafka reports 0.0 again once a response carries no throttle)
    assert proxy.metric("kqp_muted_connections") >= 1
    assert proxy.metric("kqp_quota_throttled_total", kind=KIND) == 1

    futures = admin.create_topics([NewTopic("ck-late", 4, 1)], request_timeout=1.5)
    with pytest.raises(KafkaException) as raised:
        futures["ck-late"].result(10)
    assert raised.value.args[0].code() == KafkaError._TIMED_OUT
    assert "ck-late" not in broker_topics(tansu_address(tansu))


# -- 2. a muted connection is not read ---------------------------------------------------------------


def test_request_sent_while_muted_waits_for_the_mute_to_end(proxy):
    with Wire(proxy.address, "storm-mute") as w:
        resp, throttled_at = w.call(create_topics(7, [f"mute-{i:02d}" for i in range(30)], 4))
        assert resp.throttle_time_ms == 200 and codes(resp).count(THROTTLED) == 16
        w.send(api_versions_v3())  # at once: the proxy is not reading this socket
        resp, answered_at = w.recv()
        assert resp.error_code == 0
        waited = answered_at - throttled_at
        assert 0.200 - MUTE_TOLERANCE_S <= waited <= 0.200 + 0.5, f"answered {waited * 1000:.1f} ms later"
        # The mute is over: the next request goes straight through, never muted again.
        mutes = proxy.metric("kqp_mutes_total")
        resp, answered_at = w.call(api_versions_v3())
        assert resp.error_code == 0 and resp.throttle_time_ms == 0
        assert proxy.metric("kqp_mutes_total") == mutes
        assert proxy.metric("kqp_muted_connections") == 0


# -- 3. old versions are permissive -------------------------------------------------------------------


def test_permissive_create_topics_v5_admits_everything_throttles_and_mutes(tansu, proxy):
    names = [f"perm-{i:02d}" for i in range(15)]
    with Wire(proxy.address, "storm-v5") as w:
        resp, throttled_at = w.call(create_topics(5, names, 4))
        assert codes(resp) == [0] * 15  # no error 89 below v6
        assert resp.throttle_time_ms == 1000  # K = 55 − 60 = −5: −K/Q = 1 s
        assert proxy.metric("kqp_muted_connections") == 1
        on_broker = broker_topics(tansu_address(tansu))
        assert {n: on_broker.get(n) for n in names} == dict.fromkeys(names, 4)
        assert rejected_total(proxy) == 0
        assert proxy.metric("kqp_quota_throttled_total", kind=KIND) == 1

        w.send(api_versions_v3())
        _, answered_at = w.recv()
        assert answered_at - throttled_at >= 1.0 - MUTE_TOLERANCE_S
        assert proxy.metric("kqp_muted_connections") == 0

        # Still (just) in debt or at zero: a permissive request is charged and throttled by −K/Q.
        resp, _ = w.call(create_topics(5, ["perm-late"], 2))
        assert codes(resp) == [0]
        assert 300 <= resp.throttle_time_ms <= 400  # K ≈ 0 − 2
    assert "perm-late" in broker_topics(tansu_address(tansu))


# -- 4. ValidateOnly is never charged -----------------------------------------------------------------


def test_validate_only_is_not_charged(proxy):
    with Wire(proxy.address, "storm-validate") as w:
        resp, _ = w.call(create_topics(7, ["validate-big"], 100, validate_only=True))
        assert codes(resp) == [0] and resp.throttle_time_ms == 0
        assert not has_bucket(proxy, "storm-validate"), "a ValidateOnly request touched the bucket"

        # The bucket is still full: 15 × 4 admits exactly 14 topics (as a full bucket does), where a
        # charged ValidateOnly (K = 55 − 100) would have had every topic rejected.
        names = [f"after-validate-{i:02d}" for i in range(15)]
        resp, _ = w.call(create_topics(7, names, 4))
        assert codes(resp) == [0] * 14 + [THROTTLED]
        assert resp.throttle_time_ms == 200

    # In debt now; ValidateOnly still is neither rejected nor throttled nor charged (KIP-599).
    with Wire(proxy.address, "storm-validate") as w:
        mutes = proxy.metric("kqp_mutes_total")
        before, t0, _ = tokens_read(proxy, "storm-validate")
        assert before < 0
        resp, _ = w.call(create_topics(7, ["validate-in-debt"], 100, validate_only=True))
        assert codes(resp) == [0] and resp.throttle_time_ms == 0
        after, _, t1 = tokens_read(proxy, "storm-validate")
        assert before - 1e-9 <= after <= before + RATE * (t1 - t0) + 1e-9  # refilled only
        assert proxy.metric("kqp_mutes_total") == mutes  # and this connection was not muted


# -- 5. strict DeleteTopics, charged by partition count -------------------------------------------------


def _delete_setup(tansu, proxy) -> None:
    """del-a and del-b (20 partitions each) and del-d (10) are created through the proxy, which
    learns their counts from the CreateTopics responses; del-c (20) is created on Tansu directly,
    so the proxy must look it up (the deferred Metadata path) when asked to delete it."""
    with Wire(proxy.address, "setup") as w:  # no quota for this client id
        resp, _ = w.call(create_topics(7, ["del-a", "del-b"], 20))
        assert codes(resp) == [0, 0]
        resp, _ = w.call(create_topics(7, ["del-d"], 10))
        assert codes(resp) == [0]
    with Wire(tansu_address(tansu), "direct") as w:
        resp, _ = w.call(create_topics(7, ["del-c"], 20))
        assert codes(resp) == [0]
    cache = proxy.server.topics
    assert proxy.run(lambda: (cache.count("del-a"), cache.count("del-b"), cache.count("del-c"),
                              cache.count("del-d"))) == (20, 20, None, 10)


def test_strict_delete_topics_charged_by_partition_count(tansu, proxy):
    """DeleteTopics v6 of del-a, del-b, del-c (20 partitions each; del-c known to the broker only)
    and a topic nobody has: 20 + 20 + 20 + 0 = 60 partitions, all admitted (K = 55 ≥ 0 at each
    check) and forwarded, no throttle (strict), K = −5. Then del-d is rejected with error 89 and
    throttle −K/Q ≈ 1000 ms, and stays on the broker."""
    _delete_setup(tansu, proxy)
    order = ["del-a", "del-b", "del-c", "del-missing"]
    with Wire(proxy.address, "storm-delete") as w:
        t0 = time.monotonic()
        resp, _ = w.call(delete_topics_v6(order))
        assert [r.name for r in resp.responses] == order
        assert [r.error_code for r in resp.responses] == [0, 0, 0, UNKNOWN_TOPIC_OR_PARTITION]
        assert resp.throttle_time_ms == 0
        # K = −5 once del-c was charged (after the request was sent), refilled until the scrape.
        k, k_from, k_to = tokens_read(proxy, "storm-delete")
        assert -5.0 - 1e-9 <= k <= -5.0 + RATE * (k_to - t0) + 1e-9, k
        on_broker = broker_topics(tansu_address(tansu))
        assert "del-d" in on_broker and not {"del-a", "del-b", "del-c"} & set(on_broker)

        sent = time.monotonic()
        resp, answered = w.call(delete_topics_v6(["del-d"]))
        assert [(r.name, r.error_code) for r in resp.responses] == [("del-d", THROTTLED)]
        # The refusal's throttle is −K/Q at its decision (a lookup comes first), some instant between
        # sending and the answer; K then is k refilled since the scrape, which was inside [k_from, k_to].
        # The throttle is in whole ms: 1 ms either way.
        longest_ms = -k / RATE * 1000 - (sent - k_to) * 1000
        shortest_ms = -k / RATE * 1000 - (answered - k_from) * 1000
        assert shortest_ms - 1 <= resp.throttle_time_ms <= min(longest_ms, 1000) + 1, (shortest_ms, longest_ms)
    assert rejected_total(proxy) == 1
    assert "del-d" in broker_topics(tansu_address(tansu))


def test_strict_delete_topics_partly_admitted(tansu, proxy):
    """The same in one request: K 55 → 35 → 15 → (del-c, 15 ≥ 0) −5 → del-d rejected with throttle
    exactly 5/5 s = 1000 ms; the broker gets a DeleteTopics for the others only."""
    _delete_setup(tansu, proxy)
    order = ["del-a", "del-b", "del-c", "del-d", "del-missing"]
    with Wire(proxy.address, "storm-delete") as w:
        resp, _ = w.call(delete_topics_v6(order))
    assert [r.name for r in resp.responses] == order
    assert [r.error_code for r in resp.responses] == [0, 0, 0, THROTTLED, UNKNOWN_TOPIC_OR_PARTITION]
    assert resp.throttle_time_ms == 1000
    on_broker = broker_topics(tansu_address(tansu))
    assert "del-d" in on_broker and not {"del-a", "del-b", "del-c"} & set(on_broker)


# -- 6. tenants do not slow each other -----------------------------------------------------------------


def test_other_tenants_are_not_slowed_while_one_is_muted(tansu, proxy):
    noisy = Wire(proxy.address, "storm-noisy")
    try:
        # Permissive: 30 × 4 admitted, K = −65, the connection is muted for 13 s.
        resp, muted_at = noisy.call(create_topics(5, [f"noisy-{i:02d}" for i in range(30)], 4))
        assert resp.throttle_time_ms == 13_000
        resp_mute_s = resp.throttle_time_ms / 1000
        noisy.send(create_topics(7, ["noisy-late"], 1))  # held by the mute

        round_trips = {}
        with Wire(proxy.address, "calm") as calm, Wire(proxy.address, "other-tenant") as other:
            for i in range(5):
                for name, w in (("calm", calm), ("other-tenant", other)):
                    started = time.monotonic()
                    resp, answered = w.call(create_topics(7, [f"{name}-{i}-a", f"{name}-{i}-b"], 2))
                    assert codes(resp) == [0, 0] and resp.throttle_time_ms == 0
                    round_trips.setdefault(name, []).append(answered - started)
        # All of it was answered inside the noisy tenant's 13 s mute (so none of it waited for the mute
        # to end), while the noisy tenant's own request still waits.
        assert time.monotonic() - muted_at < resp_mute_s, round_trips
        assert noisy.nothing_to_read(), "the muted tenant's request was answered during its mute"
        assert 55 - 20 - 0.01 <= tokens(proxy, "other-tenant") <= BURST
        assert not has_bucket(proxy, "calm")
        assert proxy.metric("kqp_muted_connections") == 1
        on_broker = broker_topics(tansu_address(tansu))
        assert "noisy-late" not in on_broker
        assert all(f"{n}-{i}-{s}" in on_broker for n in round_trips for i in range(5) for s in "ab")
    finally:
        noisy.close()


# -- 7. CreatePartitions (scripted cluster: Tansu has none) --------------------------------------------


def _create_partitions(broker, req):
    """CreatePartitions for the scripted cluster: grows a topic to ``count`` partitions."""
    topics = broker.cluster.topics
    R = CreatePartitionsResponse
    results = []
    for t in req.body.topics:
        topic = topics.get(t.name)
        if topic is None:
            error = UNKNOWN_TOPIC_OR_PARTITION
        elif t.count <= len(topic.partitions):
            error = INVALID_PARTITIONS
        else:
            error = 0
            if not req.body.validate_only:
                topic.partitions += [Partition(broker.node_id) for _ in range(t.count - len(topic.partitions))]
        results.append(R.CreatePartitionsTopicResult(name=t.name, error_code=error, error_message=None))
    return R[req.api_version](throttle_time_ms=0, results=results)


@pytest.fixture
def scripted():
    script = Script()
    script.api_versions[ApiKey.CREATE_PARTITIONS] = (0, CreatePartitionsRequest.max_version)
    script.handlers[ApiKey.CREATE_PARTITIONS] = _create_partitions
    topics = {"cp-a": 2, "cp-b": 10, "cp-c": 1}
    with ScriptedCluster(brokers=1, topics=topics, script=script).threaded() as cluster:
        with InProcessProxy(cluster.bootstrap_servers, quotas=QUOTAS, quota_windows=WINDOWS) as proxy:
            yield cluster, proxy


def create_partitions_v3(counts: dict[str, int]):
    T = CreatePartitionsRequest[3].CreatePartitionsTopic
    return CreatePartitionsRequest[3](topics=[T(name=n, count=c, assignments=None) for n, c in counts.items()],
                                      timeout_ms=10_000, validate_only=False)


def _partition_counts(cluster) -> dict[str, int]:
    return cluster.call(lambda: {n: len(t.partitions) for n, t in cluster.topics.items()})


def test_strict_create_partitions_charged_new_minus_current(scripted):
    """cp-a 2 → 30 costs 28, cp-b 10 → 40 costs 30, cp-c 1 → 5 costs 4: K 55 → 27 → −3, so cp-c is
    rejected with throttle 3/5 s = 600 ms and never reaches the broker. The current counts are
    unknown to the proxy, which asks the broker (Metadata) before deciding."""
    cluster, proxy = scripted
    with Wire(proxy.address, "storm-partitions") as w:
        sent = time.monotonic()
        resp, _ = w.call(create_partitions_v3({"cp-a": 30, "cp-b": 40, "cp-c": 5}))
    assert [(r.name, r.error_code) for r in resp.results] == [("cp-a", 0), ("cp-b", 0), ("cp-c", THROTTLED)]
    assert resp.throttle_time_ms == 600
    forwarded = cluster.requests_for(ApiKey.CREATE_PARTITIONS)
    assert len(forwarded) == 1
    assert [(t.name, t.count) for t in forwarded[0].body.topics] == [("cp-a", 30), ("cp-b", 40)]
    assert _partition_counts(cluster) == {"cp-a": 30, "cp-b": 40, "cp-c": 1}
    lookups = [r for r in cluster.requests_for(ApiKey.METADATA)
               if r.client_id == "kafka-quota-proxy" and r.body.topics]
    assert lookups and {t.name for t in lookups[0].body.topics} == {"cp-a", "cp-b", "cp-c"}
    k, _, k_after = tokens_read(proxy, "storm-partitions")
    assert -3.0 - 1e-9 <= k <= -3.0 + RATE * (k_after - sent) + 1e-9  # −3 when charged, refilled since


def test_create_partitions_after_create_partitions_is_charged_from_the_new_count(scripted):
    """cp-a grows 2 → 30 through the proxy, then 30 → 32: the second request creates 2 partitions
    and must cost 2 tokens, not 32 − 2 = 30 (the count the proxy looked up before the first)."""
    cluster, proxy = scripted
    with Wire(proxy.address, "storm-grow") as w:
        resp, _ = w.call(create_partitions_v3({"cp-a": 30}))
        assert [r.error_code for r in resp.results] == [0]
        assert _partition_counts(cluster)["cp-a"] == 30
        k1, k1_from, k1_to = tokens_read(proxy, "storm-grow")
        assert k1 >= 0  # 55 − 28: the next request is admitted whatever it costs
        resp, _ = w.call(create_partitions_v3({"cp-a": 32}))
        assert [r.error_code for r in resp.results] == [0]
        k2, k2_from, k2_to = tokens_read(proxy, "storm-grow")
    assert _partition_counts(cluster)["cp-a"] == 32
    # k2 = k1 + Q × (time between the two scrapes) − charged; that time is known to lie between
    # k2_from − k1_to and k2_to − k1_from. Charging 30 instead of 2 would leave the interval unless
    # the scrapes took seconds (checked: the interval is narrower than 28 tokens).
    least = k1 - k2 + RATE * (k2_from - k1_to)
    most = k1 - k2 + RATE * (k2_to - k1_from)
    assert most - least < 28, (least, most)
    assert least - 1e-9 <= 2 <= most + 1e-9, f"charged between {least:.2f} and {most:.2f} partitions for 2 new ones"


def test_validate_only_create_does_not_make_a_topic_chargeable(scripted):
    """The scripted broker honours ValidateOnly (Tansu does not). "ghost" is validated with 100
    partitions but never created; deleting it deletes nothing, so DeleteTopics [cp-c, ghost]
    costs cp-c's 1 partition only (K 55 → 54). With the bug ghost costs 100 (K → −46); both
    topics are still admitted (K ≥ 0 at each check), so only the bucket shows it."""
    cluster, proxy = scripted
    with Wire(proxy.address, "setup") as w:
        resp, _ = w.call(create_topics(7, ["ghost"], 100, validate_only=True))
        assert codes(resp) == [0]
    assert "ghost" not in _partition_counts(cluster)
    with Wire(proxy.address, "storm-ghost") as w:
        resp, _ = w.call(delete_topics_v6(["cp-c", "ghost"]))
    assert [(r.name, r.error_code) for r in resp.responses] == [("cp-c", 0), ("ghost", UNKNOWN_TOPIC_OR_PARTITION)]
    assert resp.throttle_time_ms == 0
    assert tokens(proxy, "storm-ghost") >= BURST - 1 - 0.01
