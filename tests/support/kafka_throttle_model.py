"""A reference model of what an Apache Kafka broker lets greedy producers send under a
``producer_byte_rate`` quota: the yardstick ``tests/integration/test_greedy_clients.py`` holds
the proxy to.

Written from Kafka's code, not from the proxy's (nothing here imports ``quotas`` or ``proxy``):

* ``SampledStat`` + ``WindowedSum`` + ``Rate`` (clients, ``common/metrics/stats``, as of
  Kafka 3.8, "Fix rate metric spikes" #15889): a record goes to the current sample, or opens a
  new one (recycling the oldest of ``samples + 1`` slots) once ``window`` has passed since the
  current one started; a measurement first resets every sample whose last event is
  ``samples × window`` or more old; rate = sum / windowSize, windowSize = now − start of the
  oldest sample, plus however many full windows it falls short of ``samples − 1``, at least 1 ms.
* ``Sensor.record(value, timeMs, checkQuotas=true)``: record, then check (``Quota.acceptable``:
  rate ≤ bound); ``QuotaUtils.throttleTime``: Math.round((rate − bound) / bound × windowSize).
* ``KafkaApis.handleProduceRequest``: the records are appended whatever the quota says; the
  request's size is recorded when the append is done (``time.milliseconds()`` then); a
  throttled connection is muted for ``throttle_time_ms`` from then (``ClientQuotaManager
  .throttle``, KIP-219) — with acks=0 too (``sendNoOpResponseExemptThrottle``).
* ``SocketServer.Processor``: a channel is muted when a request is received and unmuted when
  its response is sent (for acks=0, the no-op response) *and* any throttle is over, so each
  connection has one request in the broker at a time. A greedy client's next request is
  waiting in the socket, so it is read the moment the channel is unmuted.

So each connection runs: read → ``service_s`` later the request is appended, recorded and
checked → read the next one ``throttle_time_ms`` later (at once when not throttled). Every
connection of a client id shares one sensor. ``service_s`` is the broker's time for one
request (the whole round trip but the client's own share); with several connections the
broker serves them in parallel (``num.io.threads``), as Kafka does.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class _Sample:
    start_ms: int
    last_event_ms: int
    value: float = 0.0
    events: int = 0

    def reset(self, now_ms: int) -> None:
        self.start_ms = self.last_event_ms = now_ms
        self.value = 0.0
        self.events = 0


class KafkaRate:
    """Kafka's ``Rate`` over a ``WindowedSum`` with ``samples`` samples of ``window_ms``."""

    def __init__(self, samples: int = 11, window_ms: int = 1000) -> None:
        self.samples_config = samples
        self.window_ms = window_ms
        self._samples: list[_Sample] = []
        self._current = 0

    # SampledStat.record / advance / current
    def record(self, value: float, now_ms: int) -> None:
        if not self._samples:
            self._samples.append(_Sample(now_ms, now_ms))
        sample = self._samples[self._current]
        if now_ms - sample.start_ms >= self.window_ms:  # Sample.isComplete (eventWindow: unbounded)
            self._current = (self._current + 1) % (self.samples_config + 1)  # one extra: overlapping
            if self._current >= len(self._samples):
                sample = _Sample(now_ms, now_ms)
                self._samples.append(sample)
            else:
                sample = self._samples[self._current]
                sample.reset(now_ms)
        sample.value += value
        sample.events += 1
        sample.last_event_ms = now_ms

    # SampledStat.purgeObsoleteSamples
    def _purge(self, now_ms: int) -> None:
        expire_age_ms = self.samples_config * self.window_ms
        for sample in self._samples:
            if now_ms - sample.last_event_ms >= expire_age_ms:
                sample.reset(now_ms)

    # Rate.windowSize (SampledStat.oldest creates a sample if there is none)
    def window_size_ms(self, now_ms: int) -> int:
        self._purge(now_ms)
        if not self._samples:
            self._samples.append(_Sample(now_ms, now_ms))
        elapsed_ms = now_ms - min(s.start_ms for s in self._samples)
        full_windows = elapsed_ms // self.window_ms
        min_full_windows = self.samples_config - 1
        if full_windows < min_full_windows:
            elapsed_ms += (min_full_windows - full_windows) * self.window_ms
        return max(elapsed_ms, 1)

    # Rate.measure: WindowedSum.measure (purge, then sum) / windowSize in seconds
    def measure(self, now_ms: int) -> float:
        self._purge(now_ms)
        total = sum(s.value for s in self._samples)
        return total / (self.window_size_ms(now_ms) / 1000.0)

    def record_and_throttle_ms(self, value: float, bound: float, now_ms: int) -> int:
        """``ClientQuotaManager.recordAndGetThrottleTimeMs``: record, check, QuotaUtils.throttleTime."""
        self.record(value, now_ms)
        observed = self.measure(now_ms)
        if observed <= bound:  # Quota.acceptable for an upper bound
            return 0
        # Math.round: half up
        return int((observed - bound) / bound * self.window_size_ms(now_ms) + 0.5)


@dataclass
class ModelRun:
    """What the model broker appended: ``admitted`` = sorted (instant s, bytes), one per request."""

    admitted: list[tuple[float, int]]
    run_s: float
    throttles_ms: list[int] = field(default_factory=list)

    def bytes_between(self, start_s: float, end_s: float) -> int:
        return bytes_between(self.admitted, start_s, end_s)

    def largest_burst(self, width_s: float = 2.0) -> int:
        return largest_burst(self.admitted, width_s)


def bytes_between(admitted: list[tuple[float, int]], start_s: float, end_s: float) -> int:
    """Bytes of the ``(instant, bytes)`` events with start_s ≤ instant < end_s."""
    return sum(n for t, n in admitted if start_s <= t < end_s)


def largest_burst(admitted: list[tuple[float, int]], width_s: float = 2.0) -> int:
    """The most bytes of the ``(instant, bytes)`` events in any ``[t, t + width_s)``; a window
    with the most bytes can always be made to start at an event, so only those are tried."""
    events = sorted(admitted)
    times = [t for t, _ in events]
    prefix = [0]
    for _, n in events:
        prefix.append(prefix[-1] + n)
    best = 0
    for i, t in enumerate(times):
        j = bisect.bisect_left(times, t + width_s, lo=i)
        best = max(best, prefix[j] - prefix[i])
    return best


def greedy_producers(
    *,
    quota_bytes_per_s: float,
    request_bytes: int | Sequence[int],
    connections: int = 1,
    service_s: float = 0.005,
    run_s: float = 30.0,
    samples: int = 11,
    window_s: float = 1.0,
) -> ModelRun:
    """``connections`` greedy connections of one client id, each sending ``request_bytes``
    Produce requests back to back for ``run_s`` seconds, against a Kafka broker with the quota
    ``quota_bytes_per_s``. The same for acks=0 and acks=1 (see the module docstring).
    ``request_bytes`` may instead be the sizes of successive requests (whichever connection
    sends next takes the next size; the last one repeats), e.g. the batches a client really sent.

    A request is admitted (appended, recorded) ``service_s`` after it was read; requests read
    before ``run_s`` are all admitted. Instants are seconds from the start."""
    sizes = [request_bytes] if isinstance(request_bytes, int) else list(request_bytes)
    if connections < 1 or not sizes or min(sizes) < 1 or service_s < 0 or run_s <= 0:
        raise ValueError("connections and request sizes must be positive, service_s ≥ 0, run_s > 0")
    rate = KafkaRate(samples, round(window_s * 1000))
    # (instant the request is appended, connection); ties in connection order
    pending = [(service_s, c) for c in range(connections)]
    heapq.heapify(pending)
    admitted: list[tuple[float, int]] = []
    throttles_ms: list[int] = []
    # Bounded: every connection reads at most one request per service_s (or per ms when 0).
    max_events = connections * (int(run_s / max(service_s, 0.001)) + 2)
    for _ in range(max_events):
        if not pending:
            break
        appended_s, c = heapq.heappop(pending)
        size = sizes[min(len(admitted), len(sizes) - 1)]
        now_ms = int(appended_s * 1000 + 1e-6)  # time.milliseconds() (less a float's error)
        throttle_ms = rate.record_and_throttle_ms(size, quota_bytes_per_s, now_ms)
        admitted.append((appended_s, size))
        throttles_ms.append(throttle_ms)
        next_read_s = appended_s + throttle_ms / 1000.0
        if next_read_s < run_s:
            heapq.heappush(pending, (next_read_s + service_s, c))
    else:
        raise AssertionError("model did not finish within its event bound")
    return ModelRun(admitted=admitted, run_s=run_s, throttles_ms=throttles_ms)
