"""Greedy-client rate runs through the proxy process to a real Tansu broker.

What ``tests/integration/test_rate_quotas.py`` and ``test_record_rates.py`` share: a run drives
a client as fast as it can go, keeps an ``(instant, count)`` event for what the *broker*
acknowledged or delivered, and the rate is measured over a window that leaves out the warm-up
(``test_rate_quotas.py``'s module docstring explains why), then held to a tolerance of the bound.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from tests.support.proxy_process import sum_samples
from tests.support.tansu import TansuBroker

TOLERANCE = 0.10  # how far a measured rate may be from its bound, either way


@pytest.fixture(scope="module")
def broker() -> Iterator[TansuBroker]:
    """One Tansu for all the tests of a module, each on topics of its own (:func:`fresh_topic`).

    A test module takes it in as ``broker = rate_runs.broker``."""
    with TansuBroker() as b:
        yield b


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


def assert_within(what: str, rate: float, bound: float, unit: str = "records/s", tolerance: float = TOLERANCE) -> None:
    """``rate`` is within ``tolerance`` of ``bound``; both and their ratio are printed either way."""
    ratio = rate / bound
    print(f"\n{what}: {rate:.1f} {unit} measured, bound {bound:g} {unit}, ratio {ratio:.3f}")
    assert abs(ratio - 1) <= tolerance, (
        f"{what}: measured {rate:.1f} {unit} = {ratio:.3f} × {bound:g} {unit} (allowed ±{tolerance:.0%})"
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


def greedy_librdkafka(producer, topic: str, value: bytes, run_s: float) -> tuple[float, float]:
    """Produces ``value`` to ``topic`` as fast as the librdkafka ``producer`` takes it, for
    ``run_s`` seconds, serving its callbacks as it goes (a full queue is polled 5 ms at a time);
    then purges what was never sent, which is not part of the measurement, and flushes the rest.
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
    producer.purge(in_queue=True, in_flight=False)  # never sent: not part of the measurement
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
