"""The fleet at scale (``fleet.report_threshold``, ``fleet.max_remote_entries_per_s``), against
Tansu with real proxy processes:

- a principal near its bound is held across three members as one proxy alone holds it, while
  5,000 client ids far below theirs are never reported (nor throttled): the members write a
  small part of what reporting every entity charged would write;
- a forged member flooding the usage topic with 100,000 entries every interval costs a member
  its budget of entries a second and no more: the excess is counted and dropped unread, and its
  clients' round trips and ``/metrics`` keep answering.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest
from confluent_kafka import Producer
from kafka.protocol.metadata import MetadataRequest

from quotas.fleet import UsageEntry, UsageReport, encode_report
from tests.support.proxy_process import ProxyProcess, start_proxies
from tests.support.rate_runs import fresh_topic, greedy_librdkafka
from tests.support.tansu import TansuBroker
from tests.support.wire import api_versions_round_trip, read_frame, request_bytes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

QUOTA = 1 << 20  # the hot principal's producer_byte_rate, bytes/s
REQUEST_RATE = 1000  # every client id's request_rate: the cold ones send far fewer
WINDOWS = {"quota_window_num": 11, "quota_window_size_seconds": 1}  # Kafka's defaults
RUN_S = 30.0
COLD_CLIENTS = 5_000
RECORD = b"x" * 1000
FLEET = {"enabled": True, "sync_interval_ms": 250, "member_timeout_ms": 2000}
TOPIC = "__kqp_quota_usage"


@pytest.fixture
def broker():
    with TansuBroker() as b:
        yield b


def started(broker: TansuBroker, n: int, extra: dict) -> list[ProxyProcess]:
    return start_proxies([broker.bootstrap], n, extra)


def wait_for(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def greedy(bootstrap: str, client_id: str, topic: str, start: threading.Barrier, out: list[int]) -> None:
    """librdkafka producing 1 KB records as fast as it is let for RUN_S (64 KiB batches, a
    sixteenth of the quota each); the bytes the broker acknowledged go to ``out``."""
    acked = [0]

    def delivered(err, msg) -> None:
        if err is None:
            acked[0] += len(msg.value())

    producer = Producer({"bootstrap.servers": bootstrap, "client.id": client_id, "linger.ms": 5,
                         "batch.size": 64 * 1024, "queue.buffering.max.kbytes": 4096, "acks": 1,
                         "on_delivery": delivered})
    producer.list_topics(topic, timeout=10)
    start.wait(60)
    greedy_librdkafka(producer, topic, RECORD, RUN_S, purge_in_flight=True)
    out.append(acked[0])


def cold_clients(members: list[ProxyProcess], stop: threading.Event, sent: list[int]) -> None:
    """COLD_CLIENTS client ids, each sending a Metadata request now and then (about a request a
    minute each) through the members in turn, until ``stop`` and at least one request each:
    every one charged, each far below its bound."""
    socks = [socket.create_connection(p.address, timeout=10) for p in members]
    try:
        correlation_id = 0
        while not stop.is_set() or sent[0] < COLD_CLIENTS:
            for i in range(COLD_CLIENTS):
                if stop.is_set() and sent[0] >= COLD_CLIENTS:
                    break
                sock = socks[i % len(socks)]
                correlation_id += 1
                sock.sendall(request_bytes(MetadataRequest[1](topics=[]), correlation_id, f"cold-{i:04d}"))
                assert read_frame(sock) is not None
                sent[0] += 1
                time.sleep(0.005)  # about 200 requests a second in all
    finally:
        for sock in socks:
            sock.close()


# Entries the three members withheld over all they charged, measured here: 0.965 (the hot
# principal's bytes are written every interval; the cold ids, a dozen or so a member and
# interval, never). Reporting every entity charged would write them all.
WITHHELD_AT_LEAST = 0.85


@pytest.mark.slow
def test_a_hot_principal_is_held_while_5000_cold_client_ids_are_withheld_and_never_throttled(broker):
    rules = [{"user": "<default>", "client_id": c, "producer_byte_rate": QUOTA} for c in ("solo", "tenant")]
    rules.append({"client_id": "<default>", "request_rate": REQUEST_RATE})
    alone = started(broker, 1, {"quota_windows": WINDOWS, "quotas": rules})
    fleet = started(broker, 3, {"quota_windows": WINDOWS, "quotas": rules, "fleet": FLEET})
    stop = threading.Event()
    try:
        for p in fleet:
            assert wait_for(lambda p=p: p.metric_sum("kqp_fleet_members") == 3)
        topics = {c: fresh_topic(broker, c) for c in ("solo", "tenant")}
        sent = [0]
        cold = threading.Thread(target=cold_clients, args=(fleet, stop, sent), daemon=True)
        cold.start()
        start = threading.Barrier(4)
        results: list[list[int]] = [[] for _ in range(4)]
        loads = [(alone[0].bootstrap, "solo", topics["solo"])] + [(p.bootstrap, "tenant", topics["tenant"])
                                                                  for p in fleet]
        threads = [threading.Thread(target=greedy, args=(*load, start, results[i]), daemon=True)
                   for i, load in enumerate(loads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(RUN_S + 60)
        stop.set()
        cold.join(120)
        solo, shared = results[0][0], sum(r[0] for r in results[1:])
        withheld = sum(p.metric_sum("kqp_fleet_entries_withheld_total") for p in fleet)
        written = sum(p.metric_sum("kqp_fleet_entries_sent_total") for p in fleet)
        print(f"three members together / one proxy alone: {shared / solo:.3f}; cold requests {sent[0]}; "
              f"entries withheld {withheld:.0f}, written {written:.0f} "
              f"({withheld / (withheld + written):.3f} withheld)")
        assert 0.8 <= shared / solo <= 1.1, shared / solo
        assert sent[0] >= COLD_CLIENTS  # every cold client id was charged, at least once
        assert withheld / (withheld + written) >= WITHHELD_AT_LEAST
        for p in fleet:
            assert p.metric_sum("kqp_quota_throttled_total", kind="request_rate") == 0
            assert p.metric_sum("kqp_fleet_fallback") == 0
            assert p.metric_sum("kqp_fleet_records_ignored_total") == 0
    finally:
        stop.set()
        for p in alone + fleet:
            p.stop()


BUDGET = 10_000  # fleet.max_remote_entries_per_s: the least it may be
FLOOD_ENTRIES = 100_000  # a forged member's every interval, in records of 10,000 (as members split theirs)
FLOOD_S = 8.0


def forged_reports() -> list[bytearray]:
    entries = tuple(UsageEntry("request_rate", None, f"flood-{i:06d}", 1.0) for i in range(FLOOD_ENTRIES))
    return [bytearray(v) for v in encode_report(UsageReport("forger", 1, 0, 0, 250, entries))]


def flood(bootstrap: str, partition: int, stop: threading.Event, written: list[int]) -> None:
    """Every 250 ms, the forged member's 100,000 entries under a new sequence number each record
    (a sequence number and send time at bytes 13-29 of the documented encoding)."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "compression.type": "gzip",
                         "message.max.bytes": 10 << 20})
    chunks = forged_reports()
    seq = 0
    while not stop.is_set():
        now_ms = int(time.time() * 1000)
        for chunk in chunks:
            struct.pack_into(">Qq", chunk, 13, seq, now_ms)
            seq += 1
            producer.produce(TOPIC, bytes(chunk), b"forger", partition=partition)
        producer.poll(0)
        written[0] += FLOOD_ENTRIES
        time.sleep(0.25)
    producer.flush(30)


def test_a_forged_member_flooding_the_topic_costs_a_member_its_budget_and_no_more(broker):
    (p,) = started(broker, 1, {"quotas": [{"client_id": "<default>", "request_rate": REQUEST_RATE}],
                                "fleet": {**FLEET, "max_remote_entries_per_s": BUDGET}})
    stop = threading.Event()
    try:
        assert wait_for(lambda: p.metric_sum("kqp_fleet_reports_sent_total") > 0)
        before = p.metric_sum("kqp_fleet_remote_entries_total")
        written = [0]
        writer = threading.Thread(target=flood, args=(broker.bootstrap, 0, stop, written),
                                  daemon=True)
        t0 = time.monotonic()
        writer.start()
        answered = scrapes = 0
        with socket.create_connection(p.address, timeout=10) as sock:
            while time.monotonic() - t0 < FLOOD_S:
                api_versions_round_trip(sock, answered + 1)  # raises on a timeout: the client must be answered
                answered += 1
                if answered % 50 == 0:
                    p.metric_sum("kqp_fleet_members")  # /metrics answers within its 5 s timeout
                    scrapes += 1
                time.sleep(0.01)
        stop.set()
        writer.join(60)
        assert wait_for(lambda: p.metric_sum("kqp_fleet_remote_entries_dropped_total") > 0)
        elapsed = time.monotonic() - t0
        applied = p.metric_sum("kqp_fleet_remote_entries_total") - before
        dropped = p.metric_sum("kqp_fleet_remote_entries_dropped_total")
        print(f"flood: {written[0]} entries written in {elapsed:.1f} s; applied {applied:.0f}, dropped {dropped:.0f}; "
              f"{answered} round trips and {scrapes} scrapes answered meanwhile")
        assert written[0] >= 10 * FLOOD_ENTRIES
        assert applied <= BUDGET * (elapsed + 1)  # a second's worth, and as much again each second
        assert dropped >= written[0] / 2
        assert p.metric_sum("kqp_fleet_records_ignored_total", reason="over_budget") > 0
        assert p.metric_sum("kqp_fleet_members") == 2  # its heartbeats count: it is a member
        assert answered > 100 and scrapes >= 2
        assert "Traceback" not in p.log_text()
    finally:
        stop.set()
        p.stop()
