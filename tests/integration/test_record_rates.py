"""KIP-731 record and batch rates end to end: the proxy process, a real Tansu broker, real clients.

The quotas ``producer_record_rate``, ``consumer_record_rate`` and ``producer_batch_rate`` are
enforced by the built-in rate limiters with the windowed rate of the byte quotas, so what
``test_rate_quotas.py`` explains about measuring those holds here too: the proxy runs with
2 × 1 s quota windows (the slack a greedy client can take at once is one window's worth of
quota, not eleven), the client always has records to send or fetch, and the rate is measured on
what the *broker* acknowledged (producer delivery reports, whose offsets must be exactly 0..n-1)
or what the consumer was delivered, from 2 s after the start to the end of the run.

How long each measurement runs, and why that is enough
------------------------------------------------------
A greedy client moves at most about one window's worth of quota (1 s × quota) more, or less,
than ``quota × duration`` in any stretch, and that only where the stretch cuts a burst; the bound
to assert is ±10%.

* ``producer_record_rate``: 20 s runs, 18 s measured, for librdkafka and kafka-python.
  librdkafka reports throttle_time_ms but does not wait it out, and pipelines its whole
  backlog: the proxy reads the requests already on the wire before the first throttled answer
  mutes the connection, so librdkafka moves in bursts of up to ~2 windows' worth with ~2.5 s
  between them (per second, for a 3,000 records/s quota: 6800, 1000, 5000, 2000, 1000, 5200, ...).
  Only a long measurement averages that out: 0.975, 0.993, 0.989 × the quota over 18 s in three
  trial runs. kafka-python waits throttle_time_ms out itself and is smooth after its first burst
  (0.995 over 18 s), but the issue asks the same 20 s of it.
* ``consumer_record_rate``: 20 s, 18 s measured (kafka-python; the issue asks for 20 s). Records
  are delivered and the consumer then pauses (KIP-731), nothing is emptied and re-fetched.
* ``producer_batch_rate`` and the per-connector glob: 20 s runs, 18 s measured, with kafka-python
  producers, which honour throttle_time_ms themselves. One such producer alone sends about one
  request per throttle after its first burst (in the 2 s warm-up): 0.993 to 0.999 × the bound
  over 8 s or 18 s. The connector test runs two of them and a librdkafka loop in this one
  interpreter on a 2-core machine, and there they fall behind their own timetable: the acks
  come in bursts and pauses (per second: 1440, 148, 1476, 444), which is the one-window slack
  above cut by the ends of the measurement (up to ±12.5% of 8 s, under ±5.6% of 18 s, hence
  20 s runs), and what a task loses while it lags is given back only while it is still inside
  the quota's window (2 samples of 1 s, as ``Rate`` keeps them in Kafka), not later. Measured
  per task: 0.890 to 0.99 × over 8 s (0.890 in CI; 0.903 here with the librdkafka loop
  offering next to nothing), 0.923 to 0.98 × over 18 s. So the upper side, the quota's
  guarantee, stays at +10% for every run, and the connector tasks may end up to 20% under the
  bound: still far from the 0.5 × each that one bound shared by the glob would give them.
* The pause limiter, the broken limiter and check-config assert exact values (throttle_time_ms,
  failure counts, exit codes) and need no measurement window.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from kafka.protocol.metadata import ApiVersionsRequest, ApiVersionsResponse

from tests.support import rate_runs
from tests.support.proxy_process import REPO_ROOT, sum_samples
from tests.support.rate_runs import (
    WARMUP_S,
    Deliveries,
    GreedyKafkaPython,
    assert_clean,
    assert_offsets_contiguous,
    assert_within,
    consume_for,
    fill_topic,
    fresh_topic,
    greedy_librdkafka,
    librdkafka_producer,
    metric_delta,
    rate_in_window,
    start_proxy,
)
from tests.support.wire import read_frame, request_bytes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

RECORD_VALUE = b"r" * 100
SCHEDULING_TOLERANCE_S = 0.020

RECORD_QUOTA = 3000  # records/s: librdkafka reaches ~300,000 and kafka-python ~20,000 unthrottled here
RECORD_RUN_S = 20.0
BATCH_QUOTA = 50  # batches/s
CONNECTOR_QUOTA = 1000  # records/s for each connector-producer-orders-* task
# How far under its bound a connector task may end up: its own pace, not the quota's (module
# docstring); one bound shared by the glob would hold each task to 0.5 of it.
STALLED_TASK_BELOW = 0.20

BUILT_IN = ["quotas.limiters:RecordRateLimiter", "quotas.limiters:BatchRateLimiter"]
PAUSE_LIMITER = "tests.support.custom_limiter:PauseLimiter"
BROKEN_LIMITER = "tests.support.custom_limiter:BrokenLimiter"

broker = rate_runs.broker  # one Tansu for the module (a pytest fixture)


# -- producer_record_rate ----------------------------------------------------------------------


@pytest.mark.slow
def test_producer_record_rate_holds_back_librdkafka(broker, proxy):
    """librdkafka reports throttle_time_ms (throttle_cb) but keeps sending: the mute holds it."""
    client_id = "records-librdkafka"
    p = start_proxy(proxy, broker, [{"client_id": client_id, "producer_record_rate": RECORD_QUOTA}])
    topic = fresh_topic(broker, "records-ck")
    before = p.metrics()
    delivered = Deliveries()
    throttles_s: list[float] = []
    producer = librdkafka_producer(p.bootstrap, client_id, delivered, throttles_s, **{
        "batch.num.messages": 100,  # a request is 1/30 of a second's quota
        "queue.buffering.max.messages": 1000,  # a bounded backlog, so the run ends promptly
    })
    start, end = greedy_librdkafka(producer, topic, RECORD_VALUE, RECORD_RUN_S)
    after = p.metrics()

    assert delivered.errors == []
    assert_offsets_contiguous(delivered.offsets)
    assert_within("producer_record_rate (librdkafka)", rate_in_window(delivered.acks, start + WARMUP_S, end),
                  RECORD_QUOTA)
    assert metric_delta(before, after, "kqp_quota_throttled_total", kind="producer_record_rate") > 0
    assert throttles_s and max(throttles_s) > 0, "no response reached librdkafka with throttle_time_ms"
    assert sum_samples(after, "kqp_quota_bound", kind="producer_record_rate", client_id=client_id) == RECORD_QUOTA
    assert metric_delta(before, after, "kqp_quota_throttled_total", kind="producer_byte_rate") == 0
    assert_clean(p)


@pytest.mark.slow
def test_producer_record_rate_kafka_python(broker, proxy):
    """kafka-python waits throttle_time_ms out itself; the achieved rate is the same."""
    client_id = "records-kafka-python"
    p = start_proxy(proxy, broker, [{"client_id": client_id, "producer_record_rate": RECORD_QUOTA}])
    topic = fresh_topic(broker, "records-kp")
    before = p.metrics()
    # 12 KiB batches: ~110 records of 100 B, a request is 1/27 of a second's quota.
    producer = GreedyKafkaPython(p.bootstrap, client_id, topic, RECORD_VALUE, batch_size=12 * 1024, run_s=RECORD_RUN_S)
    producer.run_in_background().finish()
    after = p.metrics()

    assert producer.errors == []
    assert_offsets_contiguous(producer.offsets)
    assert_within("producer_record_rate (kafka-python)", producer.rate(), RECORD_QUOTA)
    assert metric_delta(before, after, "kqp_quota_throttled_total", kind="producer_record_rate") > 0
    assert producer.throttle_max_ms > 0, "kafka-python never saw throttle_time_ms in a response"
    assert_clean(p)


# -- consumer_record_rate ----------------------------------------------------------------------

FILL_BATCH = 100  # records per batch in the pre-filled topic
FILLED_RECORDS = int(RECORD_QUOTA * (RECORD_RUN_S + 5))  # 20 s at the quota, the first burst and margin


@pytest.fixture(scope="module")
def filled_topic(broker):
    """A one-partition topic of FILLED_RECORDS 100 B records in batches of 100, written straight
    to the broker (no proxy, no quota)."""
    return fill_topic(broker, "records-fetch", RECORD_VALUE, FILLED_RECORDS, {"batch.num.messages": FILL_BATCH})


@pytest.mark.slow
def test_consumer_record_rate_kafka_python(broker, filled_topic, proxy):
    from kafka import KafkaConsumer
    from kafka.structs import TopicPartition

    client_id = "records-consumer"
    p = start_proxy(proxy, broker, [{"client_id": client_id, "consumer_record_rate": RECORD_QUOTA}])
    before = p.metrics()
    # 16 KiB fetches: Tansu answers with whole batches up to max_bytes, ~200 records a fetch,
    # 1/15 of a second's quota.
    consumer = KafkaConsumer(bootstrap_servers=p.bootstrap, client_id=client_id, enable_auto_commit=False,
                             auto_offset_reset="earliest", fetch_max_bytes=16 * 1024,
                             max_partition_fetch_bytes=16 * 1024)
    try:
        consumer.assign([TopicPartition(filled_topic, 0)])
        start, end, received, offsets, throttle_max_ms = consume_for(consumer, RECORD_RUN_S, RECORD_VALUE)
    finally:
        consumer.close()
    after = p.metrics()

    assert len(offsets) < FILLED_RECORDS, "the consumer ran out of data: the measurement would not be of the quota"
    assert offsets == list(range(len(offsets))), "records were skipped or delivered twice"
    assert_within("consumer_record_rate (kafka-python)", rate_in_window(received, start + WARMUP_S, end), RECORD_QUOTA)
    assert metric_delta(before, after, "kqp_quota_throttled_total", kind="consumer_record_rate") > 0
    assert throttle_max_ms > 0, "kafka-python never saw throttle_time_ms in a fetch response"
    assert sum_samples(after, "kqp_quota_bound", kind="consumer_record_rate", client_id=client_id) == RECORD_QUOTA
    assert_clean(p)


# -- producer_batch_rate -----------------------------------------------------------------------


@pytest.mark.slow
def test_producer_batch_rate_kafka_python(broker, proxy):
    """Batches are counted on the client: the first record of each producer batch acknowledged
    (one batch is one Produce request to a one-partition topic, which the proxy's request count
    confirms). 4 KiB batches hold ~37 records, so the batch bound (~1,850 records/s) is what
    holds the producer, not its speed (~20,000 records/s unthrottled)."""
    client_id = "batches-kafka-python"
    p = start_proxy(proxy, broker, [{"client_id": client_id, "producer_batch_rate": BATCH_QUOTA}])
    topic = fresh_topic(broker, "batches-kp")
    before = p.metrics()
    producer = GreedyKafkaPython(p.bootstrap, client_id, topic, RECORD_VALUE, batch_size=4096, run_s=RECORD_RUN_S)
    producer.run_in_background().finish()
    after = p.metrics()

    assert producer.errors == []
    assert_offsets_contiguous(producer.offsets)
    batches, records = len(producer.batch_acks), len(producer.acks)
    assert metric_delta(before, after, "kqp_requests_total", api="Produce") == batches, "a batch is not one request"
    assert records / batches >= 20, f"{records} records in {batches} batches: the batches are not what is limited"
    assert_within("producer_batch_rate (kafka-python)", producer.batch_rate(), BATCH_QUOTA, unit="batches/s")
    print(f"  ({producer.rate():.0f} records/s in {records / batches:.1f}-record batches)")
    assert metric_delta(before, after, "kqp_quota_throttled_total", kind="producer_batch_rate") > 0
    assert metric_delta(before, after, "kqp_quota_throttled_total", kind="producer_record_rate") == 0
    assert producer.throttle_max_ms > 0
    assert sum_samples(after, "kqp_quota_bound", kind="producer_batch_rate", client_id=client_id) == BATCH_QUOTA
    assert_clean(p)


# -- a per-connector limit: a client-id glob ---------------------------------------------------


@pytest.mark.slow
def test_connector_glob_holds_each_task_to_its_own_record_rate(broker, proxy):
    """Kafka Connect names a source task's producer ``connector-producer-<connector>-<task>``.
    One rule for ``connector-producer-orders-*`` gives each task of that connector its own
    bound (state per client id, as Kafka keys default and glob quotas), not a share of one;
    another connector's task is not touched. The orders tasks are kafka-python producers (they
    wait out throttles, like the Java producer Connect uses); the billing task is librdkafka
    offering twice the bound at a steady pace."""
    orders = ["connector-producer-orders-0", "connector-producer-orders-1"]
    billing = "connector-producer-billing-0"
    p = start_proxy(proxy, broker,
                    [{"client_id": "connector-producer-orders-*", "producer_record_rate": CONNECTOR_QUOTA}])
    before = p.metrics()
    tasks = [GreedyKafkaPython(p.bootstrap, cid, fresh_topic(broker, cid), RECORD_VALUE, batch_size=4096,
                               run_s=RECORD_RUN_S)
             for cid in orders]
    billing_topic = fresh_topic(broker, billing)
    billing_delivered = Deliveries()
    billing_throttles: list[float] = []
    billing_producer = librdkafka_producer(p.bootstrap, billing, billing_delivered, billing_throttles)
    offered_rate = 2 * CONNECTOR_QUOTA
    for task in tasks:
        task.run_in_background()
    start = time.monotonic()
    end = start + RECORD_RUN_S
    sent = 0
    produced_at: list[tuple[float, int]] = []  # (instant, records handed to librdkafka then)
    while (now := time.monotonic()) < end:
        due = 0
        while sent < (now - start) * offered_rate:
            billing_producer.produce(billing_topic, RECORD_VALUE)
            sent += 1
            due += 1
        if due:
            produced_at.append((now, due))
        billing_producer.poll(0.005)
    assert billing_producer.flush(30) == 0
    for task in tasks:
        task.finish()
    after = p.metrics()

    for task in tasks:
        assert task.errors == []
        assert_offsets_contiguous(task.offsets)
        assert_within(f"producer_record_rate ({task.client_id})", task.rate(), CONNECTOR_QUOTA,
                      below=STALLED_TASK_BELOW)
        assert task.throttle_max_ms > 0
        assert sum_samples(after, "kqp_quota_bound", kind="producer_record_rate",
                           client_id=task.client_id) == CONNECTOR_QUOTA, "not an entity of its own"
    assert billing_delivered.errors == []
    assert_offsets_contiguous(billing_delivered.offsets)
    # The billing task gets what it offers: at least 90% of what this loop actually handed to
    # librdkafka in the measured window (its timetable asks twice the orders bound, but the loop
    # lags when the kafka-python tasks, which share its interpreter, take the CPU: what it offered
    # is measured, not assumed). Only the lower side says "not limited": a lagging loop's backlog
    # is delivered inside the window, which reads as more than it offered there, never as less.
    # What it offered must be well over the orders bound, or being held to it would not show.
    billing_rate = rate_in_window(billing_delivered.acks, start + WARMUP_S, end)
    offered = rate_in_window(produced_at, start + WARMUP_S, end)
    print(f"\noffered rate ({billing}, not limited): {billing_rate:.1f} records/s delivered, "
          f"{offered:.1f} offered (timetable {offered_rate}), ratio {billing_rate / offered:.3f}")
    assert offered >= 1.5 * CONNECTOR_QUOTA, f"the loop offered only {offered:.1f} records/s"
    assert billing_rate >= 0.9 * offered, f"{billing} held to {billing_rate:.1f} records/s of {offered:.1f} offered"
    assert not any(t > 0 for t in billing_throttles), f"{billing} was throttled: {billing_throttles}"
    assert sum_samples(after, "kqp_quota_bound", client_id=billing) == 0
    assert metric_delta(before, after, "kqp_quota_throttled_total", kind="producer_record_rate") > 0
    assert_clean(p)


# -- a custom limiter by dotted path -----------------------------------------------------------


def _produce_request(topic: str, correlation_id: int, client_id: str, records: int) -> bytes:
    """A framed Produce v8 (acks=1) of one batch of ``records`` 100 B records to partition 0."""
    from kafka.protocol.producer import ProduceRequest
    from kafka.record.memory_records import MemoryRecordsBuilder

    builder = MemoryRecordsBuilder(magic=2, compression_type=0, batch_size=records * 256)
    for _ in range(records):
        builder.append(timestamp=None, key=None, value=RECORD_VALUE, headers=[])
    builder.close()
    T = ProduceRequest[8].TopicProduceData
    request = ProduceRequest[8](
        transactional_id=None, acks=1, timeout_ms=10000,
        topic_data=[T(name=topic, partition_data=[T.PartitionProduceData(index=0, records=bytes(builder.buffer()))])],
    )
    return request_bytes(request, correlation_id, client_id)


def _produce(sock: socket.socket, topic: str, correlation_id: int, client_id: str,
             records: int) -> tuple[int, float, float]:
    """(throttle_time_ms, sent at, answered at) of one Produce; the records must have been written."""
    from kafka.protocol.producer import ProduceResponse

    request = _produce_request(topic, correlation_id, client_id, records)
    sent = time.monotonic()
    sock.sendall(request)
    frame = read_frame(sock)
    answered = time.monotonic()
    assert frame is not None, "the proxy closed the connection"
    assert struct.unpack(">i", frame[:4])[0] == correlation_id
    resp = ProduceResponse[8].decode(frame[4:], version=8)  # header v0 below Produce v9
    [[partition]] = [t.partition_responses for t in resp.responses]
    assert partition.error_code == 0, partition
    return resp.throttle_time_ms, sent, answered


def _api_versions(sock: socket.socket, correlation_id: int, client_id: str) -> tuple[int, float]:
    """(throttle_time_ms, answered at) of one ApiVersions v3."""
    sock.sendall(request_bytes(
        ApiVersionsRequest[3](client_software_name="it-wire", client_software_version="1"), correlation_id, client_id,
    ))
    frame = read_frame(sock)
    answered = time.monotonic()
    assert frame is not None, "the proxy closed the connection"
    assert struct.unpack(">i", frame[:4])[0] == correlation_id
    resp = ApiVersionsResponse.decode(frame[4:], version=3)
    assert resp.error_code == 0
    return resp.throttle_time_ms, answered


def _record_throttle_ms(records: int, quota: float) -> int:
    """The throttle a fresh entity earns for one request of ``records``: with 2 × 1 s windows it
    is measured over num − 1 = 1 window, so (records/1 s − quota) / quota × 1000 ms."""
    return max(round((records - quota) / quota * 1000), 0)


def test_custom_limiter_by_dotted_path_and_the_longest_throttle_applies_once(broker, proxy, tmp_path):
    from confluent_kafka import Producer

    pause_ms, quota = 300, 1000
    calls_file = tmp_path / "pause-calls.jsonl"
    p = start_proxy(proxy, broker, [{"client_id": "paused-*", "producer_record_rate": quota}], rate_limiters=[
        *BUILT_IN,
        {"class": PAUSE_LIMITER,
         "config": {"client_id": "paused-*", "pause_ms": pause_ms, "calls_file": str(calls_file)}},
    ])
    topic = fresh_topic(broker, "paused")
    before = p.metrics()

    # 1. Raw requests, each client id a fresh entity, so each record throttle is known exactly.
    cases = [
        # (client id, records, the throttle expected: the larger of the pause and the record
        # throttle, and the sum of the two: the mute a proxy applying both one after the other
        # would impose)
        ("paused-over-quota", 2500, _record_throttle_ms(2500, quota), 1500 + pause_ms),  # 1500 ms > the pause
        ("paused-slightly-over", 1200, pause_ms, 200 + pause_ms),  # a 200 ms record throttle < the pause
        ("paused-under-quota", 100, pause_ms, pause_ms),  # no record throttle: the pause alone
        ("not-paused", 2500, 0, 0),  # neither the pause nor the quota matches this client id
    ]
    assert _record_throttle_ms(2500, quota) == 1500 and _record_throttle_ms(1200, quota) == 200
    seen = []
    for i, (client_id, records, expected_ms, summed_ms) in enumerate(cases):
        with socket.create_connection(p.address, timeout=10) as s:
            throttle_ms, sent, produced = _produce(s, topic, 2 * i, client_id, records)
            # Straight away, on the same connection: held by the mute for the throttle, once.
            _, answered = _api_versions(s, 2 * i + 1, client_id)
        seen.append((client_id, throttle_ms, round(answered - produced, 3)))
        assert throttle_ms == expected_ms, (client_id, throttle_ms, expected_ms)
        # The mute began when the Produce was answered, at the latest when its answer was read.
        waited = answered - produced
        assert waited >= expected_ms / 1000 - SCHEDULING_TOLERANCE_S, (client_id, waited)
        if summed_ms > expected_ms:
            # Not the sum (1.8 s for the first case), nor the pause after the record throttle: such
            # a mute would begin after the Produce was sent and hold the next answer for summed_ms,
            # so the answer came before that could have ended.
            assert answered - sent < summed_ms / 1000, (client_id, round(answered - sent, 3), summed_ms)
    print(f"\n(client id, throttle_time_ms, next answer after s): {seen}")

    # 2. librdkafka sees the pause as the throttle of each Produce response; another client sees none.
    def produce_rounds(client_id: str, rounds: int = 3) -> list[float]:
        throttles: list[float] = []
        producer = Producer({"bootstrap.servers": p.bootstrap, "client.id": client_id, "linger.ms": 5,
                             "enable.idempotence": False, "throttle_cb": lambda e: throttles.append(e.throttle_time)})
        for _ in range(rounds):
            for _ in range(10):
                producer.produce(topic, RECORD_VALUE)
            assert producer.flush(10) == 0
        producer.flush(1)  # serves the last throttle_cb
        return throttles

    paused = produce_rounds("paused-librdkafka")
    other = produce_rounds("other-librdkafka")
    after = p.metrics()

    # The limiter was shown every Produce request with its records and batches counted.
    calls = [json.loads(line) for line in calls_file.read_text().splitlines()]
    by_client: dict[str, list[dict]] = {}
    for call in calls:
        by_client.setdefault(call["client_id"], []).append(call)
    for client_id, records, _, _ in cases:
        [call] = by_client[client_id]
        assert (call["records"], call["batches"], call["api_version"]) == (records, 1, 8), call
    assert sum(c["records"] for c in by_client["paused-librdkafka"]) == 30
    assert sum(c["records"] for c in by_client["other-librdkafka"]) == 30

    # librdkafka calls throttle_cb for every response with a non-zero throttle_time_ms, and once
    # for the first zero after one (here a Metadata response): one 0.3 s per Produce request.
    produce_requests = len(by_client["paused-librdkafka"])
    print(f"librdkafka throttle_cb (s): paused-librdkafka {paused} for {produce_requests} Produce requests, "
          f"other-librdkafka {other}")
    assert produce_requests >= 3  # a flush per round
    assert [t for t in paused if t > 0] == [pause_ms / 1000] * produce_requests, paused
    assert not any(t > 0 for t in other), other
    # Only the two raw requests over the record quota were throttled for it.
    assert metric_delta(before, after, "kqp_quota_throttled_total", kind="producer_record_rate") == 2
    assert sum_samples(after, "kqp_rate_limiter_failures_total") == 0
    assert_clean(p)


def test_a_failing_limiter_is_counted_and_logged_and_the_connection_kept(broker, proxy):
    from confluent_kafka import Producer

    client_id, quota = "beside-a-broken-limiter", 1000
    p = start_proxy(proxy, broker, [{"client_id": client_id, "producer_record_rate": quota}],
                     rate_limiters=[*BUILT_IN, BROKEN_LIMITER])
    topic = fresh_topic(broker, "broken")

    # One connection: every request is answered on it, and the working limiters still apply.
    with socket.create_connection(p.address, timeout=10) as s:
        assert _api_versions(s, 1, client_id)[0] == 0
        throttle_ms, _, produced = _produce(s, topic, 2, client_id, 1500)
        assert throttle_ms == _record_throttle_ms(1500, quota) == 500
        _, answered = _api_versions(s, 3, client_id)
        assert answered - produced >= 0.5 - SCHEDULING_TOLERANCE_S
        assert sum_samples(p.metrics(), "kqp_rate_limiter_failures_total", limiter="BrokenLimiter") == 3

        # A real client, meanwhile, produces through it.
        offsets: list[int] = []
        errors: list = []
        producer = Producer({"bootstrap.servers": p.bootstrap, "client.id": "broken-bystander", "linger.ms": 5,
                             "enable.idempotence": False, "acks": "all",
                             "on_delivery": lambda err, msg: offsets.append(msg.offset()) if err is None
                             else errors.append(err)})
        for _ in range(200):
            producer.produce(topic, RECORD_VALUE)
        assert producer.flush(30) == 0
        assert errors == []
        assert sorted(offsets) == list(range(1500, 1700)), "the bystander's records were not all written once"

        assert _api_versions(s, 4, client_id)[0] == 0  # the first connection still answers
    after = p.metrics()

    failures = sum_samples(after, "kqp_rate_limiter_failures_total", limiter="BrokenLimiter")
    print(f"\nBrokenLimiter failures counted: {failures:.0f}")
    assert failures > 4  # the raw connection's four requests and every request of the producer
    assert sum_samples(after, "kqp_frames_rejected_total") == 0
    log = p.log_text()
    assert log.count("rate limiter BrokenLimiter failed") == 1, "not logged, or logged every time"
    assert "RuntimeError: BrokenLimiter cannot count" in log
    assert "closing" not in log, log[-3000:]


# -- check-config ------------------------------------------------------------------------------


def _check_config(tmp_path: Path, name: str, config: dict,
                  env_extra: dict | None = None) -> subprocess.CompletedProcess:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    script = Path(sys.executable).with_name("kafka-quota-proxy")
    assert script.exists(), f"{script} is not installed (pip install -e .)"
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([str(script), "check-config", str(path)], capture_output=True, text=True,
                          timeout=60, env=env, cwd=tmp_path)


def test_check_config_refuses_a_record_quota_without_its_limiter_and_names_bad_dotted_paths(tmp_path):
    upstream = {"bootstrap_servers": ["127.0.0.1:9092"]}
    orders = {"client_id": "connector-producer-orders-*", "producer_record_rate": 1000}
    pause = {"class": PAUSE_LIMITER, "config": {"client_id": "paused-*", "pause_ms": 300}}
    # A plug-in is imported from the proxy's sys.path: the console script's does not hold the
    # repository, so it is given as an operator would give a plug-in directory.
    plugins = {"PYTHONPATH": str(REPO_ROOT)}

    ok = _check_config(tmp_path, "ok.yaml", {"upstream": upstream, "quotas": [orders],
                                             "rate_limiters": [*BUILT_IN, pause]}, plugins)
    assert ok.returncode == 0, ok.stderr
    assert "ok" in ok.stdout

    missing = _check_config(tmp_path, "missing.yaml", {"upstream": upstream, "quotas": [orders],
                                                       "rate_limiters": [BUILT_IN[1], pause]}, plugins)
    print(f"\n{missing.stderr.strip()}")
    assert missing.returncode == 2, (missing.returncode, missing.stdout, missing.stderr)
    assert "quotas[0].producer_record_rate" in missing.stderr
    assert "RecordRateLimiter" in missing.stderr

    for target, words in [
        ("tests.support.custom_limiter:NoSuchLimiter", "has no"),
        ("kqp_no_such_plugins.limiters:PauseLimiter", "cannot import"),
        ("tests.support.custom_limiter.PauseLimiter", "package.module:ClassName"),
    ]:
        bad = _check_config(tmp_path, "bad.yaml", {"upstream": upstream, "rate_limiters": [target, *BUILT_IN]}, plugins)
        print(bad.stderr.strip())
        assert bad.returncode == 2, (target, bad.returncode, bad.stdout, bad.stderr)
        assert "rate_limiters[0]" in bad.stderr and words in bad.stderr, (target, bad.stderr)
        assert "Traceback" not in bad.stderr
