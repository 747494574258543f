"""Greedy-client rate runs through the proxy process to a real Tansu broker.

What ``tests/integration/test_rate_quotas.py`` and ``test_record_rates.py`` share: a run drives
a client as fast as it can go, keeps an ``(instant, count)`` event for what the *broker*
acknowledged or delivered, and the rate is measured over a window that leaves out the warm-up
(``test_rate_quotas.py``'s module docstring explains why), then held to a tolerance of the bound.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from tests.support.proxy_process import sum_samples
from tests.support.tansu import TansuBroker

TOLERANCE = 0.10  # how far a measured rate may be from its bound, either way
# 2 × 1 s quota windows: a greedy client's slack is one window of quota, not eleven.
WINDOWS = {"quota_window_num": 2, "quota_window_size_seconds": 1}
WARMUP_S = 2.0  # left out of every measurement: the first burst


@pytest.fixture(scope="module")
def broker() -> Iterator[TansuBroker]:
    """One Tansu for all the tests of a module, each on topics of its own (:func:`fresh_topic`).

    A test module takes it in as ``broker = rate_runs.broker``."""
    with TansuBroker() as b:
        yield b


def start_proxy(proxy, broker: TansuBroker, quotas: list[dict], rate_limiters: list | None = None):
    """The proxy (the ``proxy`` fixture) in front of ``broker`` with :data:`WINDOWS` and ``quotas``."""
    extra = {"quota_windows": dict(WINDOWS), "quotas": quotas}
    if rate_limiters is not None:
        extra["rate_limiters"] = rate_limiters
    return proxy([broker.bootstrap], extra_config=extra)


def fresh_topic(broker: TansuBroker, prefix: str) -> str:
    """A new one-partition topic, ``<prefix>-<8 hex digits>``, created on the broker directly."""
    from confluent_kafka.admin import AdminClient, NewTopic

    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1)])[name].result(30)
    return name


def assert_offsets_contiguous(offsets: list[int]) -> None:
    """The broker gave the acknowledged records offsets 0..n-1: each was written exactly once.

    (Tansu 0.6.0's ListOffsets(latest) answers a few less than the end offset, 7 less in every
    run here, so the broker's own count is read from the offsets it acknowledged.)"""
    assert sorted(offsets) == list(range(len(offsets))), "acknowledged offsets are not 0..n-1"


def assert_clean(p) -> None:
    """The proxy logged no traceback and no ERROR (the end of its log is shown if it did)."""
    log = p.log_text()
    assert "Traceback" not in log and "level=ERROR" not in log, log[-5000:]


def metric_delta(before: dict, after: dict, name: str, **labels) -> float:
    """How much the samples called ``name`` with ``labels`` grew from one scrape to the next."""
    return sum_samples(after, name, **labels) - sum_samples(before, name, **labels)


def rate_in_window(events: list[tuple[float, int]], start: float, end: float, weight: float = 1) -> float:
    """Units per second of the ``(instant, count)`` events inside [start, end], each counted
    ``weight`` units (records or batches: 1; bytes: the wire bytes one record is charged)."""
    return sum(n for t, n in events if start <= t <= end) * weight / (end - start)


def assert_within(what: str, rate: float, bound: float, unit: str = "records/s", tolerance: float = TOLERANCE,
                  below: float | None = None) -> None:
    """``rate`` is at most ``tolerance`` above ``bound`` and at most ``below`` (default: the same
    ``tolerance``) under it; both and their ratio are printed either way."""
    below = tolerance if below is None else below
    ratio = rate / bound
    print(f"\n{what}: {rate:.1f} {unit} measured, bound {bound:g} {unit}, ratio {ratio:.3f}")
    assert 1 - below <= ratio <= 1 + tolerance, (
        f"{what}: measured {rate:.1f} {unit} = {ratio:.3f} × {bound:g} {unit} "
        f"(allowed {1 - below:.2f} to {1 + tolerance:.2f})"
    )


def throttle_time_max(client) -> float:
    """A kafka-python client's own record of the longest throttle_time_ms it was sent."""
    return max(
        (v for group in client.metrics().values() for name, v in group.items() if name == "throttle-time-max"),
        default=0,
    )


class Deliveries:
    """A librdkafka ``on_delivery`` callback that keeps what the delivery reports said: ``acks``,
    ``(instant, 1)`` per record the broker acknowledged, their ``offsets``, and the ``errors``
    (a record purged unsent, see :func:`greedy_librdkafka`, is not one)."""

    def __init__(self) -> None:
        from confluent_kafka import KafkaError

        self.acks: list[tuple[float, int]] = []
        self.offsets: list[int] = []
        self.errors: list = []
        self._purged = KafkaError._PURGE_QUEUE

    def __call__(self, err, msg) -> None:
        if err is None:
            self.acks.append((time.monotonic(), 1))
            self.offsets.append(msg.offset())
        elif err.code() != self._purged:
            self.errors.append(err)


def librdkafka_producer(bootstrap: str, client_id: str, delivered: Deliveries, throttles_s: list[float],
                        **settings):
    """A librdkafka producer (acks=all, not idempotent, linger 5 ms, plus ``settings``) whose
    delivery reports go to ``delivered`` and whose reported throttle times to ``throttles_s``."""
    from confluent_kafka import Producer

    return Producer({
        "bootstrap.servers": bootstrap, "client.id": client_id, "acks": "all", "enable.idempotence": False,
        "linger.ms": 5, **settings, "on_delivery": delivered,
        "throttle_cb": lambda event: throttles_s.append(event.throttle_time),
    })


def greedy_librdkafka(producer, topic: str, value: bytes, run_s: float,
                      purge_in_flight: bool = False) -> tuple[float, float]:
    """Produces ``value`` to ``topic`` as fast as the librdkafka ``producer`` takes it, for
    ``run_s`` seconds, serving its callbacks as it goes (a full queue is polled 5 ms at a time);
    then purges what was never sent, which is not part of the measurement, and flushes the rest.
    ``purge_in_flight``: what was sent but not yet answered is purged too (librdkafka pipelines
    its whole queue into a throttled connection: a total counted over the run excludes it).
    Delivery reports go to the producer's ``on_delivery`` (e.g. :class:`Deliveries`). Returns
    the run's (start, end) instants."""
    start = time.monotonic()
    end = start + run_s
    while time.monotonic() < end:
        try:
            producer.produce(topic, value)
        except BufferError:
            producer.poll(0.005)
            continue
        producer.poll(0)
    producer.purge(in_queue=True, in_flight=purge_in_flight)  # never sent: not part of the measurement
    assert producer.flush(30) == 0
    return start, end


def fill_topic(broker: TansuBroker, prefix: str, value: bytes, records: int, config: dict) -> str:
    """A fresh topic holding ``records`` copies of ``value`` at offsets 0..records-1, written
    straight to the broker (no proxy, no quota) by a librdkafka producer with ``config`` added
    to its settings (how it batches)."""
    from confluent_kafka import Producer

    topic = fresh_topic(broker, prefix)
    offsets: list[int] = []
    producer = Producer({"bootstrap.servers": broker.bootstrap, "linger.ms": 5, **config,
                         "enable.idempotence": False, "acks": 1,
                         "on_delivery": lambda err, msg: err is None and offsets.append(msg.offset())})
    for _ in range(records):
        while True:
            try:
                producer.produce(topic, value)
                break
            except BufferError:
                producer.poll(0.01)
    assert producer.flush(60) == 0
    assert_offsets_contiguous(offsets)
    assert len(offsets) == records
    return topic


class GreedyKafkaPython:
    """A kafka-python producer that always has ``value`` records to send (at most ``backlog``
    unacknowledged: kafka-python 3.0 has no buffer_memory), for ``run_s`` seconds, in its own
    thread. Keeps ``acks`` ((instant, 1) per record), ``batch_acks`` (per producer batch: its
    first record), ``offsets``, ``errors`` and, after :meth:`finish`, ``throttle_max_ms``."""

    def __init__(self, bootstrap: str, client_id: str, topic: str, value: bytes, batch_size: int, run_s: float,
                 backlog: int = 1000) -> None:
        from kafka import KafkaProducer

        self.client_id, self.topic, self.value, self.run_s = client_id, topic, value, run_s
        self.acks: list[tuple[float, int]] = []
        self.batch_acks: list[tuple[float, int]] = []
        self.offsets: list[int] = []
        self.errors: list = []
        self.throttle_max_ms = 0.0
        self._backlog = threading.BoundedSemaphore(backlog)
        self.producer = KafkaProducer(bootstrap_servers=bootstrap, client_id=client_id, acks="all",
                                      linger_ms=5, batch_size=batch_size)
        self.start = self.end = 0.0
        self._thread = threading.Thread(target=self._run, name=f"produce-{client_id}", daemon=True)

    def _on_ack(self, future):
        def on_ack(metadata):
            now = time.monotonic()
            self.acks.append((now, 1))
            # FutureRecordMetadata.args[0] is the record's index in its producer batch; one batch
            # is one Produce request to a one-partition topic.
            if future.args[0] == 0:
                self.batch_acks.append((now, 1))
            self.offsets.append(metadata.offset)
            self._backlog.release()
        return on_ack

    def _on_error(self, exc):
        self.errors.append(exc)
        self._backlog.release()

    def _run(self) -> None:
        self.start = time.monotonic()
        self.end = self.start + self.run_s
        while time.monotonic() < self.end:
            if not self._backlog.acquire(timeout=0.05):
                continue
            future = self.producer.send(self.topic, self.value)
            future.add_callback(self._on_ack(future)).add_errback(self._on_error)

    def run_in_background(self) -> GreedyKafkaPython:
        self._thread.start()
        return self

    def finish(self) -> None:
        self._thread.join(self.run_s + 30)
        try:
            self.producer.flush(30)
            self.throttle_max_ms = throttle_time_max(self.producer)
        finally:
            self.producer.close(10)

    def rate(self, weight: float = 1) -> float:
        """Records (times ``weight``) per second acknowledged after the warm-up."""
        return rate_in_window(self.acks, self.start + WARMUP_S, self.end, weight)

    def batch_rate(self) -> float:
        return rate_in_window(self.batch_acks, self.start + WARMUP_S, self.end)


def consume_for(consumer, seconds: float,
                value: bytes) -> tuple[float, float, list[tuple[float, int]], list[int], float]:
    """Polls a kafka-python consumer for ``seconds``, each record's value checked against
    ``value``: (start, end, [(instant, records)], offsets, its throttle-time-max)."""
    received: list[tuple[float, int]] = []
    offsets: list[int] = []
    start = time.monotonic()
    end = start + seconds
    while time.monotonic() < end:
        for records in consumer.poll(timeout_ms=50).values():
            assert all(r.value == value for r in records)
            received.append((time.monotonic(), len(records)))
            offsets.extend(r.offset for r in records)
    return start, end, received, offsets, throttle_time_max(consumer)
