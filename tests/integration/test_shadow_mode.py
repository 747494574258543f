"""Shadow mode end to end: a real Tansu broker, real clients, two proxies in front of it on the
same sequence — one enforcing the quotas, one with the very same quotas in shadow mode.

Shadow mode must apply nothing (no throttle_time_ms a client sees, no mute, no refused topic or
produce, no emptied fetch) and count exactly what enforcing counts: the shadow counters and the
usage log's shadow_* columns of the shadow proxy equal the real counters and columns of the
enforcing one.

Why the sequences are paced: a client's next request depends on the throttles it is given, so
"the same sequence" needs requests that no throttle can move. The rate quotas here use 2 × 1 s
windows and requests 3 s apart: every sample is purged (2 s) before the next request, so each
request is measured alone over exactly one window (quotas/rate.py), its throttle is the same
number in both runs, and it ends before the next request is due. A real consumer's fetch
schedule follows its throttles, so the fetch sequence is sent by the test with kafka-python's
request classes over a client connection; a real KafkaConsumer then shows that a consumer in
shadow mode reads at full speed. controller_mutation_rate and producer_ids_rate are token
buckets with a slow refill, so one burst of requests decides the same whatever the timing.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from protocol.apis import SPECS, ApiKey
from protocol.headers import response_body_offset
from protocol.messages import decode_response
from tests.support.inproc import InProcessProxy
from tests.support.wire import read_frame, request_bytes
from usage.schema import COUNTER_COLUMNS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PRODUCE, FETCH, CREATE_TOPICS = 0, 1, 19
GAP_S = 3.0  # > 2 windows of 1 s (the purge age), with room: each paced request is measured alone
WINDOWS = {"quota_window_num": 2, "quota_window_size_seconds": 1}
COUNTERS = COUNTER_COLUMNS


class Pair:
    """Two proxies in front of one broker, the same quotas enforced in one and shadowed in the other."""

    def __init__(self, broker, tmp_path: Path, quotas: list[dict], **sections) -> None:
        self.dirs = {mode: tmp_path / f"usage-{mode}" for mode in ("enforce", "shadow")}
        self.proxies = {
            mode: InProcessProxy([broker.bootstrap], mode=mode, quotas=quotas, quota_windows=WINDOWS,
                                 usage_log={"directory": str(self.dirs[mode]), "interval_seconds": 1,
                                            "proxy_name": mode}, **sections)
            for mode in ("enforce", "shadow")
        }

    def __enter__(self) -> Pair:
        for p in self.proxies.values():
            p.start()
        return self

    def __exit__(self, *exc) -> None:
        for p in self.proxies.values():
            if p.server is not None:
                p.stop()
                p.server = None

    @property
    def enforce(self) -> InProcessProxy:
        return self.proxies["enforce"]

    @property
    def shadow(self) -> InProcessProxy:
        return self.proxies["shadow"]

    def both(self, run) -> dict:
        """Runs ``run(proxy, mode)`` against both proxies at once; {mode: its result}."""
        results: dict = {}
        errors: list = []

        def go(mode: str) -> None:
            try:
                results[mode] = run(self.proxies[mode], mode)
            except BaseException as exc:  # surfaced in the test thread
                errors.append(exc)

        threads = [threading.Thread(target=go, args=(m,)) for m in self.proxies]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        if errors:
            raise errors[0]
        return results

    def usage(self) -> dict[str, dict[tuple[str, int], dict]]:
        """Stops both proxies (the usage log is flushed) and sums each one's rows per (client id, API)."""
        self.__exit__()
        out = {}
        for mode, directory in self.dirs.items():
            totals: dict = defaultdict(lambda: dict.fromkeys(COUNTERS, 0))
            for path in sorted(directory.rglob("*.parquet")):
                for r in pq.read_table(path).to_pylist():
                    t = totals[(r["client_id"], r["api_key"])]
                    for c in COUNTERS:
                        t[c] = max(t[c], r[c]) if c.endswith("_max") else t[c] + r[c]
            out[mode] = dict(totals)
        return out


def _applied_equals_shadowed(usage, key, throttle_tolerance_ms: int = 0) -> dict:
    """The enforcing proxy's applied counts for ``key`` equal the shadow proxy's shadow counts, and
    each applied nothing of what it shadowed (and the other way round)."""
    e, s = usage["enforce"][key], usage["shadow"][key]
    assert e["requests"] == s["requests"], (e, s)
    assert (s["shadow_throttled"], s["shadow_rejected"]) == (e["throttled"], e["rejected"]), (e, s)
    assert abs(s["shadow_throttle_time_ms_sum"] - e["throttle_time_ms_sum"]) <= throttle_tolerance_ms * max(
        e["throttled"], 1), (e, s)
    assert abs(s["shadow_throttle_time_ms_max"] - e["throttle_time_ms_max"]) <= throttle_tolerance_ms, (e, s)
    assert (s["throttled"], s["rejected"], s["throttle_time_ms_sum"]) == (0, 0, 0), s
    assert (e["shadow_throttled"], e["shadow_rejected"]) == (0, 0), e
    return e


def _kind_counts(proxy, kind: str) -> tuple[float, float, float, float]:
    return (proxy.metric("kqp_quota_throttled_total", kind=kind), proxy.metric("kqp_quota_rejected_total", kind=kind),
            proxy.metric("kqp_quota_shadow_throttled_total", kind=kind),
            proxy.metric("kqp_quota_shadow_rejected_total", kind=kind))


def _same_kind_counts(pair, kind: str) -> tuple[float, float]:
    e, s = _kind_counts(pair.enforce, kind), _kind_counts(pair.shadow, kind)
    assert e[2:] == (0, 0) and s[:2] == (0, 0), (kind, e, s)
    assert s[2:] == e[:2], (kind, e, s)
    return e[:2]


def _topic(broker, prefix: str, partitions: int = 1) -> str:
    from confluent_kafka.admin import AdminClient, NewTopic

    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])[name].result(30)
    return name


# -- producer kinds: a real kafka-python producer, paced ------------------------------------------

PRODUCER_KINDS = {
    # client id: (quota kind, bound). Each send is one Produce of one 3000-byte record, measured
    # alone over one window: ~3.1 kB/s, 1 record/s, 1 batch/s, one request/s or more: all over
    # their bounds, with throttles well under GAP_S (request_rate's capped at one window,
    # ClientRequestQuotaManager).
    "paced-bytes": ("producer_byte_rate", 2000),
    "paced-records": ("producer_record_rate", 0.75),
    "paced-batches": ("producer_batch_rate", 0.75),
    "paced-requests": ("request_rate", 0.01),
}
SENDS = 3


def test_producer_quotas_in_shadow_count_what_enforcing_applies(tansu, tmp_path):
    from kafka import KafkaProducer

    topic = _topic(tansu, "shadow-produce")
    quotas = [{"client_id": cid, kind: bound} for cid, (kind, bound) in PRODUCER_KINDS.items()]

    def run(proxy, mode):
        seen_throttles: dict[str, list[float]] = {}
        producers = {cid: KafkaProducer(bootstrap_servers=proxy.bootstrap, client_id=cid, acks=1, linger_ms=0,
                                        enable_idempotence=False, retries=0, bootstrap_timeout_ms=10000)
                     for cid in PRODUCER_KINDS}
        try:
            # Connections, metadata and one record each first, outside the paced part (a first
            # send waits for its connection, which would move it closer to the next).
            for producer in producers.values():
                producer.send(topic, value=b"v" * 3000, partition=0).get(10)
            # Each round GAP_S after the previous one was delivered (so after the proxy took it in):
            # a slow round delays the next rather than bringing it within the purge age of the last.
            delivered = time.monotonic()
            for _ in range(SENDS):
                time.sleep(max(0.0, delivered + GAP_S - time.monotonic()))
                futures = [(cid, [p.send(topic, value=b"v" * 3000, partition=0)]) for cid, p in producers.items()]
                for p in producers.values():
                    p.flush(10)
                for _cid, fs in futures:
                    for f in fs:
                        f.get(10)  # delivered: nothing refused in either mode
                delivered = time.monotonic()
            for cid, p in producers.items():
                sensor = p.metrics().get("producer-metrics", {}).get("produce-throttle-time-max")
                seen_throttles[cid] = sensor
        finally:
            for p in producers.values():
                p.close(5)
        return seen_throttles

    with Pair(tansu, tmp_path, quotas) as pair:
        pair.both(run)
        assert pair.shadow.metric("kqp_mutes_total") == 0
        assert pair.enforce.metric("kqp_mutes_total") > 0
        for kind in {k for k, _ in PRODUCER_KINDS.values()} - {"request_rate"}:
            throttled, _ = _same_kind_counts(pair, kind)
            assert throttled == SENDS + 1, kind
        # request_rate charges the client's metadata requests too, which a throttled client
        # sends on its own schedule: compared on the paced Produce requests (the usage log) only.
        assert pair.shadow.metric("kqp_quota_throttled_total", kind="request_rate") == 0
        assert pair.shadow.metric("kqp_quota_shadow_throttled_total", kind="request_rate") >= SENDS
        usage = pair.usage()
    for cid, (kind, _) in PRODUCER_KINDS.items():
        e = _applied_equals_shadowed(usage, (cid, PRODUCE))
        assert e["requests"] == SENDS + 1 and e["throttled"] == SENDS + 1, (cid, e)
        if kind == "request_rate":
            assert e["throttle_time_ms_sum"] == (SENDS + 1) * 1000  # capped at one window


# -- fetch kinds: a paced fetch sequence, then a real consumer ----------------------------------


def _fetch(topic: str, offset: int):
    R = SPECS[ApiKey.FETCH].request[12]
    T = R.FetchTopic
    part = T.FetchPartition(partition=0, current_leader_epoch=-1, fetch_offset=offset, log_start_offset=-1,
                            partition_max_bytes=1 << 20)
    return R(replica_id=-1, max_wait_ms=100, min_bytes=1, max_bytes=1 << 20, isolation_level=0, session_id=0,
             session_epoch=-1, topics=[T(topic=topic, partitions=[part])], forgotten_topics_data=[], rack_id="")


def test_consumer_quotas_in_shadow_count_what_enforcing_applies(tansu, tmp_path):
    from kafka import KafkaProducer

    empty = _topic(tansu, "shadow-empty")
    fed = {mode: _topic(tansu, "shadow-fed") for mode in ("enforce", "shadow")}  # one record per fetch
    # Tansu answers a fetch of an empty topic with 69 bytes: consumer_byte_rate 50 B/s throttles
    # each one alone by 380 ms; one record a fetch against consumer_record_rate 0.75/s by 333 ms.
    quotas = [{"client_id": "fetch-bytes", "consumer_byte_rate": 50},
              {"client_id": "fetch-records", "consumer_record_rate": 0.75}]
    feeder = KafkaProducer(bootstrap_servers=tansu.bootstrap, acks=1, linger_ms=0)

    def run(proxy, mode):
        socks = {cid: socket.create_connection(proxy.address, timeout=10) for cid in ("fetch-bytes", "fetch-records")}
        got = {"throttle": [], "records": []}
        try:
            answered = time.monotonic() - GAP_S  # no fetch yet: the first round goes at once
            for i in range(SENDS):
                # GAP_S after the previous round's last answer (each fetch measured alone, however
                # slowly the round before went).
                time.sleep(max(0.0, answered + GAP_S - time.monotonic()))
                feeder.send(fed[mode], value=b"r%d" % i, partition=0).get(10)
                for cid, topic, offset in (("fetch-bytes", empty, 0), ("fetch-records", fed[mode], i)):
                    socks[cid].sendall(request_bytes(_fetch(topic, offset), i, cid))
                    frame = read_frame(socks[cid])
                    body = decode_response(FETCH, 12, memoryview(frame)[response_body_offset(frame, FETCH, 12):])
                    got["throttle"].append((cid, body.throttle_time_ms))
                    records = sum(len(p.records or b"") for t in body.responses for p in t.partitions)
                    got["records"].append((cid, records))
                answered = time.monotonic()
        finally:
            for s in socks.values():
                s.close()
        return got

    with Pair(tansu, tmp_path, quotas) as pair:
        try:
            got = pair.both(run)
        finally:
            feeder.close()
        assert all(t == 0 for _, t in got["shadow"]["throttle"])  # no throttle_time_ms a client sees
        assert [t > 0 for _, t in got["enforce"]["throttle"]] == [True] * (2 * SENDS), got
        fed_sizes = {m: [n for cid, n in got[m]["records"] if cid == "fetch-records"] for m in got}
        assert all(n > 0 for n in fed_sizes["enforce"] + fed_sizes["shadow"])  # records delivered in both
        assert pair.shadow.metric("kqp_mutes_total") == 0
        for kind in ("consumer_byte_rate", "consumer_record_rate"):
            throttled, _ = _same_kind_counts(pair, kind)
            assert throttled == SENDS, kind
        usage = pair.usage()
    for cid in ("fetch-bytes", "fetch-records"):
        e = _applied_equals_shadowed(usage, (cid, FETCH))
        assert e["requests"] == SENDS and e["throttled"] == SENDS


def test_a_real_consumer_in_shadow_mode_reads_at_full_speed(tansu, tmp_path):
    from kafka import KafkaConsumer, KafkaProducer
    from kafka.structs import TopicPartition

    topic = _topic(tansu, "shadow-read")
    producer = KafkaProducer(bootstrap_servers=tansu.bootstrap, acks=1, linger_ms=5)
    for _ in range(200):
        producer.send(topic, value=b"x" * 1000, partition=0)
    producer.flush(10)
    producer.close()
    # 1 KiB/s against 200 kB to read: enforced, this would take minutes.
    byte_rate = 1024
    quotas = [{"client_id": "reader", "consumer_byte_rate": byte_rate, "consumer_record_rate": 10}]
    with InProcessProxy([tansu.bootstrap], mode="shadow", quotas=quotas, quota_windows=WINDOWS) as proxy:
        consumer = KafkaConsumer(bootstrap_servers=proxy.bootstrap, client_id="reader", enable_auto_commit=False,
                                 fetch_max_bytes=64 * 1024, max_partition_fetch_bytes=64 * 1024)
        try:
            consumer.assign([TopicPartition(topic, 0)])
            consumer.seek_to_beginning()
            read, value_bytes, started = 0, 0, time.monotonic()
            while read < 200 and time.monotonic() - started < 60:  # a guard, not the measurement
                for records in consumer.poll(500).values():
                    read += len(records)
                    value_bytes += sum(len(r.value) for r in records)
            took = time.monotonic() - started
        finally:
            consumer.close()
        assert read == 200
        # More than the byte quota, enforced, could have let through in the time it took: bound x
        # elapsed, one window's burst (2 x 1 s windows: measured over num - 1 = 1 s) and the one
        # response a fetch is admitted whole before it is throttled (at most fetch_max_bytes).
        # Enforced, the 200 kB take over 130 s.
        window_s = WINDOWS["quota_window_size_seconds"] * (WINDOWS["quota_window_num"] - 1)
        assert value_bytes > byte_rate * (took + window_s) + 64 * 1024, (value_bytes, took)
        assert proxy.metric("kqp_quota_shadow_throttled_total", kind="consumer_byte_rate") >= 1
        assert proxy.metric("kqp_quota_shadow_throttled_total", kind="consumer_record_rate") >= 1
        assert proxy.metric("kqp_quota_throttled_total", kind="consumer_byte_rate") == 0
        assert proxy.metric("kqp_mutes_total") == 0


# -- token buckets: controller mutations and producer ids ----------------------------------------


def test_controller_mutation_rate_in_shadow_refuses_nothing_and_counts_the_refusals(tansu, tmp_path):
    from kafka import KafkaAdminClient

    # A burst of 0.1 × 11 = 1.1 partitions: the first topic is admitted, the second into debt,
    # the other three refused (strict CreateTopics v7, KIP-599) with a ~9 s throttle.
    quotas = [{"client_id": "storm", "controller_mutation_rate": 0.1}]

    def run(proxy, mode):
        admin = KafkaAdminClient(bootstrap_servers=proxy.bootstrap, client_id="storm", request_timeout_ms=10000)
        try:
            names = [f"storm-{mode}-{uuid.uuid4().hex[:6]}-{i}" for i in range(5)]
            result = admin.create_topics({n: {"num_partitions": 1, "replication_factor": 1} for n in names},
                                         raise_errors=False)
            return names, [t["error_code"] for t in result["topics"]]
        finally:
            admin.close()

    with Pair(tansu, tmp_path, quotas) as pair:
        out = pair.both(run)
        assert out["enforce"][1] == [0, 0, 89, 89, 89]
        assert out["shadow"][1] == [0] * 5  # all created
        _, rejected = _same_kind_counts(pair, "controller_mutation_rate")
        assert rejected == 3
        assert pair.shadow.metric("kqp_mutes_total") == 0
        usage = pair.usage()
    e = _applied_equals_shadowed(usage, ("storm", CREATE_TOPICS), throttle_tolerance_ms=1000)
    assert e["rejected"] == 1 and e["throttle_time_ms_max"] > 8000


def _produce_once(bootstrap: str, topic: str) -> str:
    """One new idempotent librdkafka producer sends one record: "delivered" or the error's name."""
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "client.id": "restarts", "enable.idempotence": True,
                  "linger.ms": 0, "message.timeout.ms": 10000})
    reports: list = []
    p.produce(topic, value=b"x", partition=0, on_delivery=lambda err, msg: reports.append(err))
    p.flush(15)
    if not reports:
        return "no delivery report"
    return "delivered" if reports[0] is None else reports[0].name()


def test_producer_ids_rate_in_shadow_rejects_nothing_and_counts_the_rejections(tansu, tmp_path):

    topic = _topic(tansu, "shadow-pids")
    sections = {"producer_id_quota": {"producer_id_quota_window_size_seconds": 60}}
    quotas = [{"user": "<default>", "producer_ids_rate": 2}]

    def run(proxy, mode):
        outcomes = []
        for _ in range(4):  # four producers in a row: four new producer ids, two over the quota
            # librdkafka fails the message at once on THROTTLING_QUOTA_EXCEEDED (no retry), so
            # each producer sends one Produce in either mode (test_producer_ids.py).
            outcomes.append(_produce_once(proxy.bootstrap, topic))
        return outcomes

    with Pair(tansu, tmp_path, quotas, **sections) as pair:
        out = pair.both(run)
        assert out["shadow"] == ["delivered"] * 4
        assert out["enforce"][:2] == ["delivered"] * 2
        assert out["enforce"][2:] == ["THROTTLING_QUOTA_EXCEEDED"] * 2, out
        assert pair.enforce.metric("kqp_producer_ids_rejected_total") == 2
        assert pair.shadow.metric("kqp_producer_ids_shadow_rejected_total") == 2
        assert pair.shadow.metric("kqp_producer_ids_rejected_total") == 0
        assert pair.shadow.metric("kqp_mutes_total") == 0
        usage = pair.usage()
    e = _applied_equals_shadowed(usage, ("restarts", PRODUCE), throttle_tolerance_ms=1000)
    assert e["rejected"] == 2


# -- from shadow to enforce: a reload, the state kept --------------------------------------------


def test_a_reload_from_shadow_to_enforce_keeps_what_shadow_mode_measured(tansu, tmp_path, caplog):
    """A tenant measured in shadow mode is throttled by its very next request once a reload
    enforces the same quota: the rate the shadow quota measured is kept (as any reload keeps an
    entity's samples), so enforcement starts from the truth rather than from zero."""
    from kafka import KafkaProducer

    from config.loader import parse_config

    topic = _topic(tansu, "shadow-switch")
    quota = {"client_id": "switch", "producer_byte_rate": 20_000, "mode": "shadow"}
    with InProcessProxy([tansu.bootstrap], quotas=[quota], quota_windows=WINDOWS) as proxy:
        producer = KafkaProducer(bootstrap_servers=proxy.bootstrap, client_id="switch", acks=1, linger_ms=0,
                                 enable_idempotence=False, bootstrap_timeout_ms=10000)
        try:
            for _ in range(8):  # 8 × 10 kB at once: 4× the bound over the window, not applied
                producer.send(topic, value=b"b" * 10_000, partition=0)
            producer.flush(10)
            assert proxy.metric("kqp_quota_shadow_throttled_total", kind="producer_byte_rate") >= 1
            assert proxy.metric("kqp_quota_throttled_total", kind="producer_byte_rate") == 0
            raw = {"upstream": {"bootstrap_servers": [tansu.bootstrap]}, "quota_windows": WINDOWS,
                   "quotas": [{**quota, "mode": "enforce"}]}
            with caplog.at_level("WARNING", logger="proxy.app.server"):
                proxy.run(proxy.server.reload, parse_config(raw))
            assert any("reload puts the quotas of client_id=switch in enforce mode" in r.getMessage()
                       for r in caplog.records)
            producer.send(topic, value=b"s", partition=0).get(10)  # a few bytes, but the rate is kept
            assert proxy.metric("kqp_quota_throttled_total", kind="producer_byte_rate") == 1
            assert proxy.metric("kqp_mutes_total") >= 1
        finally:
            producer.close(5)
