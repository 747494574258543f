"""Every quota kind held across the fleet (``fleet:``), not per instance.

``test_fleet.py`` holds ``producer_byte_rate`` with an even load; here the other kinds, and
``producer_byte_rate`` with an uneven one. The same setup: three proxy processes with the fleet
on in front of one Tansu, a greedy client (real client libraries) through each, against one
such client through a reference proxy alone (no fleet) in front of the same broker, driven at
the same time on another client id, so both see the same machine; what is counted is what the
broker acknowledged or delivered, seen by the clients, outside the proxies. Kafka's quota
windows (11 x 1 s, for the rates and for KIP-599's bucket). Each instance enforcing alone, the
three members together would get about three times the reference.

Each kind has client ids of its own (``fleet-<kind>`` through the members, ``solo-<kind>``
through the reference: their own quota entities), so the kinds share the four proxies and the
broker and are driven in two 30 s runs instead of five (about 65 s for the module):

* **streams**: ``consumer_byte_rate``, ``request_rate``, ``producer_record_rate``;
* **uneven**: ``producer_byte_rate`` with ~90 % of the fleet's traffic on one member, and the
  ``controller_mutation_rate`` admin storms.

This machine has two cores, so the quotas are small (512 KiB/s fetched, 100 requests/s, 2,000
100 B records/s, 1 MiB/s produced, 5 partitions/s) and every test first checks that its
reference sat at what Kafka's formulas let one greedy client through
(``tests/support/kafka_throttle_model.py``; measured 0.97-1.03 x): a reference held back by the
CPU rather than by its quota would make the ratio meaningless. Every figure is printed (``-s``).

Measured here, fleet / reference over three runs: consumer_byte_rate 1.005-1.038, request_rate
1.007-1.027, producer_record_rate 0.983-1.040, uneven producer_byte_rate 0.974-1.003 (the busy
member about what the reference got less what the others got), controller_mutation_rate
1.010-1.019 (1.02-1.03 x one bucket's allowance). The bound is the issue's, test_fleet's
FLEET_AT_MOST. (Before the burst pacing applied to shared principals at every step of headroom,
request_rate came out at 1.10-1.25 and producer_record_rate at 1.10-1.19 over eleven runs: each
member filled every small step of headroom, when the first samples leave the window, before it
read the others' usage; and a fleet member emptied a Fetch larger than its part of the burst
again and again, a consumer starved: the consumer test's small fetches kept clear of it.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from tests.integration.test_fleet import FLEET, FLEET_AT_MOST
from tests.support.kafka_throttle_model import greedy_producers
from tests.support.polling import wait_for
from tests.support.proxy_process import ProxyProcess
from tests.support.rate_runs import fill_topic, fresh_topic, greedy_librdkafka
from tests.support.tansu import TansuBroker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180), pytest.mark.slow]

RUN_S = 30.0
MEMBERS = 3
FLEET_AT_LEAST = 0.8
WINDOWS = {"quota_window_num": 11, "quota_window_size_seconds": 1}  # Kafka's defaults
MUTATION_WINDOWS = {"controller_quota_window_num": 11, "controller_quota_window_size_seconds": 1}
# A reference below this part of what Kafka admits one greedy client was held back by the
# machine, not by its quota; above the other, the reference proxy itself let too much through.
REFERENCE_AT_LEAST, REFERENCE_AT_MOST = 0.8, 1.1

CONSUME_QUOTA = 512 * 1024  # consumer_byte_rate, bytes/s
REQUEST_QUOTA = 100  # request_rate, requests/s
RECORD_QUOTA = 2000  # producer_record_rate, records/s
PRODUCE_QUOTA = 1 << 20  # producer_byte_rate, bytes/s
MUTATION_RATE = 5  # controller_mutation_rate, partitions/s
BURST = MUTATION_RATE * 11 * 1  # KIP-599: quota x window_num x window_size
TOPIC_PARTITIONS = 2  # per topic an admin storm creates
TOPICS_PER_CALL = 5
BATCH_BYTES = 64 * 1024  # librdkafka's batch.size for the producer_byte_rate producers
QUIET_SHARE = 0.05  # of PRODUCE_QUOTA, offered through each of members 1 and 2

FETCH_VALUE = b"f" * 1024
FETCH_RECORDS = 40 * CONSUME_QUOTA // len(FETCH_VALUE)  # more than 30 s at the quota plus its burst
PRODUCE_VALUE = b"p" * 1000
RECORD_VALUE = b"r" * 100
REQUEST_VALUE = b"q" * 10

KINDS = {  # quota kind -> its bound, for fleet-<kind> and solo-<kind>
    "consumer_byte_rate": CONSUME_QUOTA,
    "request_rate": REQUEST_QUOTA,
    "producer_record_rate": RECORD_QUOTA,
    "producer_byte_rate": PRODUCE_QUOTA,
    "controller_mutation_rate": MUTATION_RATE,
}


def _fleet_id(kind: str) -> str:
    return f"fleet-{kind}"


def _solo_id(kind: str) -> str:
    return f"solo-{kind}"


def _quotas() -> list[dict]:
    return [{"user": "<default>", "client_id": cid(kind), kind: quota}
            for kind, quota in KINDS.items() for cid in (_fleet_id, _solo_id)]


@dataclass
class Proxies:
    broker: TansuBroker
    solo: ProxyProcess
    fleet: list[ProxyProcess]


@pytest.fixture(scope="module")
def proxies():
    """One Tansu, a reference proxy alone and three fleet members, every quota of this module on
    each (the fleet's client ids never reach the reference, nor the reference's the fleet)."""
    extra: dict[str, Any] = {"quota_windows": {**WINDOWS, **MUTATION_WINDOWS}, "quotas": _quotas()}
    started: list[ProxyProcess] = []
    with TansuBroker() as broker:
        try:
            solo = ProxyProcess([broker.bootstrap], extra_config=extra).start()
            started.append(solo)
            for _ in range(MEMBERS):
                started.append(ProxyProcess([broker.bootstrap], extra_config={**extra, "fleet": FLEET}).start())
            fleet = started[1:]
            for p in fleet:
                wait_for(lambda p=p: p.metric_sum("kqp_fleet_members") == MEMBERS, 15, "three fleet members")
            yield Proxies(broker, solo, fleet)
            for p in fleet:
                assert p.metric_sum("kqp_fleet_fallback") == 0
                assert p.metric_sum("kqp_fleet_records_ignored_total") == 0
            for p in started:
                log = p.log_text()
                assert "Traceback" not in log and "level=ERROR" not in log, log[-5000:]
        finally:
            for p in started:
                p.stop()


# -- the clients ---------------------------------------------------------------------------------------
#
# Each is a function of the start barrier, run in a thread of its own: it connects, waits at the
# barrier, runs for RUN_S and returns what the broker acknowledged or delivered, counted here,
# outside the proxies.


def _consumer(bootstrap: str, client_id: str, topic: str) -> Callable[[threading.Barrier], int]:
    """A kafka-python consumer reading ``topic`` from its start as fast as it is let: the value
    bytes delivered to it. Small fetches (16 KiB; Tansu answers in whole batches, here one
    16 KiB batch), so one response is a small part of a window's allowance, and of a member's
    part of it (1 / members) while the fleet paces a burst."""

    def run(start: threading.Barrier) -> int:
        from kafka import KafkaConsumer
        from kafka.structs import TopicPartition

        consumer = KafkaConsumer(bootstrap_servers=bootstrap, client_id=client_id, enable_auto_commit=False,
                                 auto_offset_reset="earliest", fetch_max_bytes=16 * 1024,
                                 max_partition_fetch_bytes=16 * 1024)
        delivered = 0
        try:
            consumer.assign([TopicPartition(topic, 0)])
            start.wait(60)
            deadline = time.monotonic() + RUN_S
            while time.monotonic() < deadline:
                for records in consumer.poll(timeout_ms=50).values():
                    delivered += sum(len(r.value) for r in records)
        finally:
            consumer.close()
        return delivered

    return run


def _greedy_producer(bootstrap: str, client_id: str, topic: str, value: bytes,
                     **settings: Any) -> Callable[[threading.Barrier], int]:
    """A librdkafka producer (acks=1, not idempotent, ``settings``) producing ``value`` as fast
    as it takes it (a bounded queue): the records the broker acknowledged."""

    def run(start: threading.Barrier) -> int:
        from confluent_kafka import Producer

        acked = [0]

        def delivered(err, _msg) -> None:
            if err is None:
                acked[0] += 1

        producer = Producer({"bootstrap.servers": bootstrap, "client.id": client_id, "acks": 1,
                             "enable.idempotence": False, **settings, "on_delivery": delivered})
        producer.list_topics(topic, timeout=10)
        start.wait(60)
        greedy_librdkafka(producer, topic, value, RUN_S, purge_in_flight=True)
        return acked[0]

    return run


def _paced_producer(bootstrap: str, client_id: str, topic: str, value: bytes,
                    bytes_per_s: float) -> Callable[[threading.Barrier], int]:
    """A librdkafka producer offering ``bytes_per_s`` of ``value`` records on a timetable: the
    records the broker acknowledged."""

    def run(start: threading.Barrier) -> int:
        from confluent_kafka import Producer

        acked = [0]

        def delivered(err, _msg) -> None:
            if err is None:
                acked[0] += 1

        producer = Producer({"bootstrap.servers": bootstrap, "client.id": client_id, "acks": 1, "linger.ms": 5,
                             "enable.idempotence": False})
        producer.list_topics(topic, timeout=10)
        start.wait(60)
        began = time.monotonic()
        sent = 0
        while (now := time.monotonic()) < began + RUN_S:
            while sent < (now - began) * bytes_per_s / len(value):
                producer.produce(topic, value, on_delivery=delivered)
                sent += 1
            producer.poll(0.01)
        producer.purge(in_queue=True, in_flight=True)
        producer.flush(10)
        return acked[0]

    return run


@dataclass
class Storm:
    admitted: list[str]  # the topics admitted, in order
    refused: int  # topics answered THROTTLING_QUOTA_EXCEEDED
    elapsed_s: float  # from the start to the last answer

    @property
    def partitions(self) -> int:
        return len(self.admitted) * TOPIC_PARTITIONS


def _admin_storm(bootstrap: str, client_id: str, prefix: str) -> Callable[[threading.Barrier], Storm]:
    """A kafka-python KafkaAdminClient creating new topics of TOPIC_PARTITIONS partitions,
    TOPICS_PER_CALL a call, as fast as it is let (it waits out throttle_time_ms itself: a call
    during the wait fails at once with NodeNotReadyError)."""

    def run(start: threading.Barrier) -> Storm:
        from kafka import KafkaAdminClient
        from kafka.errors import NodeNotReadyError

        admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id=client_id)
        admitted: list[str] = []
        refused = 0
        n = 0
        try:
            start.wait(60)
            began = time.monotonic()
            last = began
            while time.monotonic() < began + RUN_S:
                names = [f"{prefix}-{n + i:05d}" for i in range(TOPICS_PER_CALL)]
                try:
                    result = admin.create_topics(
                        {name: {"num_partitions": TOPIC_PARTITIONS, "replication_factor": 1} for name in names},
                        raise_errors=False)
                except NodeNotReadyError:  # the client's own wait for the throttle
                    time.sleep(0.02)
                    continue
                last = time.monotonic()
                n += TOPICS_PER_CALL
                codes = {t["name"]: t["error_code"] for t in result["topics"]}
                assert set(codes.values()) <= {0, 89}, codes  # admitted, or THROTTLING_QUOTA_EXCEEDED
                admitted += [name for name, code in codes.items() if code == 0]
                refused += sum(code == 89 for code in codes.values())
        finally:
            admin.close()
        return Storm(admitted, refused, last - began)

    return run


def _run_all(loads: dict[str, Callable[[threading.Barrier], Any]]) -> dict[str, Any]:
    """Every load at once, from one barrier; each one's result (an exception is raised here)."""
    start = threading.Barrier(len(loads))
    results: dict[str, Any] = {}
    errors: dict[str, BaseException] = {}

    def body(name: str, load: Callable[[threading.Barrier], Any]) -> None:
        try:
            results[name] = load(start)
        except BaseException as exc:  # raised below, in the test's thread
            errors[name] = exc
            start.abort()

    threads = [threading.Thread(target=body, args=item, name=item[0], daemon=True) for item in loads.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(RUN_S + 90)
    assert not errors, errors
    assert set(results) == set(loads), f"no result from {set(loads) - set(results)}"
    return results


def _per_member(name: str, results: dict[str, Any]) -> list:
    return [results[f"{name}-{i}"] for i in range(MEMBERS)]


# -- the runs --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def streams(proxies):
    """consumer_byte_rate, request_rate and producer_record_rate at once, 30 s."""
    broker, solo, fleet = proxies.broker, proxies.solo, proxies.fleet
    fetched = fill_topic(broker, "fleet-fetch", FETCH_VALUE, FETCH_RECORDS, {"batch.size": 16 * 1024})
    loads: dict[str, Callable[[threading.Barrier], Any]] = {}
    kind = "consumer_byte_rate"
    loads["fetch-solo"] = _consumer(solo.bootstrap, _solo_id(kind), fetched)
    for i, p in enumerate(fleet):
        loads[f"fetch-{i}"] = _consumer(p.bootstrap, _fleet_id(kind), fetched)
    # One record a request: a Produce request answered is a delivery report (one partition).
    one_per_request = {"linger.ms": 0, "batch.num.messages": 1, "queue.buffering.max.messages": 50,
                       "max.in.flight": 5}
    kind = "request_rate"
    topic = fresh_topic(broker, "fleet-requests")
    loads["requests-solo"] = _greedy_producer(solo.bootstrap, _solo_id(kind), topic, REQUEST_VALUE,
                                              **one_per_request)
    for i, p in enumerate(fleet):
        loads[f"requests-{i}"] = _greedy_producer(p.bootstrap, _fleet_id(kind), topic, REQUEST_VALUE,
                                                  **one_per_request)
    # 100 records a request: a request is 1/20 of a second's quota.
    batched = {"linger.ms": 5, "batch.num.messages": 100, "queue.buffering.max.messages": 1000}
    kind = "producer_record_rate"
    topic = fresh_topic(broker, "fleet-records")
    loads["records-solo"] = _greedy_producer(solo.bootstrap, _solo_id(kind), topic, RECORD_VALUE, **batched)
    for i, p in enumerate(fleet):
        loads[f"records-{i}"] = _greedy_producer(p.bootstrap, _fleet_id(kind), topic, RECORD_VALUE, **batched)
    results = _run_all(loads)
    results["fetch-records"] = FETCH_RECORDS
    return results


@pytest.fixture(scope="module")
def uneven(proxies):
    """producer_byte_rate with one busy member, and the admin storms, at once, 30 s."""
    broker, solo, fleet = proxies.broker, proxies.solo, proxies.fleet
    kind = "producer_byte_rate"
    topic = fresh_topic(broker, "fleet-bytes")
    # 64 KiB batches: Kafka's formula lets a greedy client a little more the larger its requests
    # (~1 MB, librdkafka's default: 38 quota-seconds in 30 s; 64 KiB: 33.7), so the reference is
    # held to a known figure.
    greedy = {"linger.ms": 5, "batch.size": BATCH_BYTES, "queue.buffering.max.kbytes": 4096}
    loads: dict[str, Callable[[threading.Barrier], Any]] = {
        "bytes-solo": _greedy_producer(solo.bootstrap, _solo_id(kind), topic, PRODUCE_VALUE, **greedy),
        "bytes-0": _greedy_producer(fleet[0].bootstrap, _fleet_id(kind), topic, PRODUCE_VALUE, **greedy),
    }
    for i, p in enumerate(fleet[1:], start=1):
        loads[f"bytes-{i}"] = _paced_producer(p.bootstrap, _fleet_id(kind), topic, PRODUCE_VALUE,
                                              QUIET_SHARE * PRODUCE_QUOTA)
    kind = "controller_mutation_rate"
    loads["storm-solo"] = _admin_storm(solo.bootstrap, _solo_id(kind), "storm-solo")
    for i, p in enumerate(fleet):
        loads[f"storm-{i}"] = _admin_storm(p.bootstrap, _fleet_id(kind), f"storm-{i}")
    return _run_all(loads)


def _kafka_admits(quota: float, request: float) -> float:
    """What Kafka's windowed rate lets one greedy client through in RUN_S, in the quota's units,
    for requests of ``request`` units each."""
    run = greedy_producers(quota_bytes_per_s=quota, request_bytes=max(1, round(request)), run_s=RUN_S,
                           service_s=0.002, samples=WINDOWS["quota_window_num"],
                           window_s=WINDOWS["quota_window_size_seconds"])
    return sum(n for _, n in run.admitted)


def _check_fleet(what: str, solo: float, members: list[float], quota: float, request: float) -> None:
    """Prints the figures; asserts the reference sat at its quota and the fleet at the reference's."""
    kafka = _kafka_admits(quota, request)
    fleet = sum(members)
    ratio = fleet / solo
    print(f"\n{what}: reference {solo / quota:.1f} quota-seconds in {RUN_S:.0f} s ({solo / kafka:.3f} x Kafka's "
          f"{kafka / quota:.1f}); three members together {fleet / quota:.1f}, ratio {ratio:.3f}; per member "
          f"{[round(m / solo, 3) for m in members]}")
    assert REFERENCE_AT_LEAST <= solo / kafka <= REFERENCE_AT_MOST, f"reference off its quota: {solo / kafka:.3f}"
    assert FLEET_AT_LEAST <= ratio <= FLEET_AT_MOST, ratio


# -- the tests ---------------------------------------------------------------------------------------------


def test_consumer_byte_rate_is_held_across_the_fleet(streams):
    """A greedy kafka-python consumer through each member reads a pre-filled topic under one
    client id's consumer_byte_rate; the value bytes delivered to the three together against
    those delivered to one consumer through the reference. (A Fetch over the quota is answered
    empty and its bytes un-recorded, the same on both sides.)"""
    solo, members = streams["fetch-solo"], _per_member("fetch", streams)
    for delivered in [solo, *members]:
        assert delivered < streams["fetch-records"] * len(FETCH_VALUE), "a consumer ran out of data"
    _check_fleet("consumer_byte_rate", solo, members, CONSUME_QUOTA, 16 * 1024)


def test_request_rate_is_held_across_the_fleet(streams):
    """request_rate is the proxy's requests per second (Kafka's own request quota is a part of
    the broker's network and I/O thread time, which a proxy cannot see: docs/quotas.md). So
    what is measured is what the quota governs: requests answered. A librdkafka producer with
    one record per batch and one partition sends one record per Produce request (up to five in
    flight), and every delivery report is one request the broker answered. The few Metadata and
    ApiVersions requests (charged as well) are left out on both sides."""
    solo, members = streams["requests-solo"], _per_member("requests", streams)
    _check_fleet("request_rate", solo, members, REQUEST_QUOTA, 1)


def test_producer_record_rate_is_held_across_the_fleet(streams):
    """KIP-731's producer_record_rate (the built-in RecordRateLimiter): greedy librdkafka
    producers of 100 B records, 100 a batch; the records the broker acknowledged."""
    solo, members = streams["records-solo"], _per_member("records", streams)
    _check_fleet("producer_record_rate", solo, members, RECORD_QUOTA, 100)


def test_uneven_producer_byte_rate_is_held_and_the_busy_member_not_starved(uneven):
    """A greedy producer through member 0, and one through each of members 1 and 2 offering 5 %
    of the quota on a timetable: member 0 carries ~90 % of the fleet's traffic. The three
    together against a greedy producer through the reference, the same bound as with an even
    load; and member 0 gets at least 0.7 x what the reference got less what the other two got.

    Why 0.7: each member's throttle is Kafka's on the fleet's rate stretched by its part of the
    recent usage, so a member carrying ~90 % of it is throttled about as a proxy alone would be,
    and gets about all that is left (measured: see the printed figures). A fleet that divided
    the quota evenly among its members (as the ``share`` fallback does) would leave it a third
    of the quota, ~0.37 x that; 0.7 leaves room for the sync lag and the sawtooth."""
    solo, members = uneven["bytes-solo"], _per_member("bytes", uneven)
    solo_b, members_b = solo * len(PRODUCE_VALUE), [m * len(PRODUCE_VALUE) for m in members]
    _check_fleet("producer_byte_rate, uneven", solo_b, members_b, PRODUCE_QUOTA, BATCH_BYTES)
    others = sum(members_b[1:])
    offered = QUIET_SHARE * PRODUCE_QUOTA * RUN_S * 2
    busy = members_b[0] / (solo_b - others)
    print(f"busy member: {busy:.3f} x (reference - the others); the others got {others / offered:.3f} x what "
          f"they offered ({others / (solo_b + others):.3f} of the fleet's total with ~{2 * QUIET_SHARE:.2f} offered)")
    assert busy >= 0.7, busy


def test_controller_mutation_rate_is_held_across_the_fleet(uneven, proxies):
    """A kafka-python admin storm through each member for 30 s (new topics, strict CreateTopics
    v7): the partitions admitted fleet-wide, counted by the clients and found on the broker.

    One bucket admits at most rate x elapsed + burst (plus the last topic, which may drive it
    into debt). The members share what they admit, but each starts with a full bucket and
    admits before the others' reports are read, so the fleet may admit one burst per member
    (docs/fleet.md: a KIP-599 bucket is not paced); the others' bursts are then debts the buckets
    repay. So: at most rate x elapsed + one burst per member + one topic per member, where
    three members enforcing alone would admit three times rate x elapsed + burst. And against
    the reference storm, the same ratio as the rates (the fleet is not held below one bucket)."""
    from confluent_kafka.admin import AdminClient

    solo = uneven["storm-solo"]
    members = _per_member("storm", uneven)
    fleet = sum(s.partitions for s in members)
    elapsed_s = max(s.elapsed_s for s in members)
    one_bucket = MUTATION_RATE * elapsed_s + BURST
    bound = MUTATION_RATE * elapsed_s + MEMBERS * BURST + MEMBERS * TOPIC_PARTITIONS
    alone = MEMBERS * one_bucket
    ratio = fleet / solo.partitions
    print(f"\ncontroller_mutation_rate: reference {solo.partitions} partitions in {solo.elapsed_s:.1f} s "
          f"({solo.partitions / (MUTATION_RATE * solo.elapsed_s + BURST):.3f} x rate x elapsed + burst); three "
          f"members {fleet} ({[s.partitions for s in members]}), {fleet / one_bucket:.3f} x one bucket's "
          f"{one_bucket:.0f}, bound {bound:.0f}, enforcing alone ~{alone:.0f}; ratio {ratio:.3f}; refused "
          f"{sum(s.refused for s in members)} topics")
    # What the clients were told was admitted is what the broker holds, and only that.
    admin = AdminClient({"bootstrap.servers": proxies.broker.bootstrap})
    on_broker = {t for t in admin.list_topics(timeout=10).topics if t.startswith("storm-")}
    assert on_broker == {name for s in [solo, *members] for name in s.admitted}
    assert solo.partitions <= MUTATION_RATE * solo.elapsed_s + BURST + TOPIC_PARTITIONS
    assert solo.partitions >= REFERENCE_AT_LEAST * (MUTATION_RATE * solo.elapsed_s + BURST), "the reference lagged"
    assert fleet <= bound, (fleet, bound)
    assert ratio >= FLEET_AT_LEAST, ratio
