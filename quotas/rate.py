"""Windowed rate with the sample arithmetic of Kafka's ``SampledStat`` + ``WindowedSum`` + ``Rate``.

Pure: every method takes ``now_ms``; nothing reads a clock. Time going backwards counts as no
time passing: an instant earlier than the latest one seen is treated as that latest instant.

How Kafka's arithmetic works, and so this one:

* Up to ``window_num + 1`` samples are kept (one extra for a sample that started before the
  monitored window but overlaps it). A sample starts at the instant of the record that opened
  it — not on a grid — and is complete once ``window_size_ms`` has passed since its start;
  the next record then opens a new sample (recycling the slot after the current one).
* When measuring, a sample whose last event is ``window_num × window_size_ms`` or more in the
  past is reset to an empty sample starting now.
* rate = sum of samples / window, window = now − start of the oldest sample, but at least
  ``window_num − 1`` full windows (plus the elapsed part) and at least 1 ms.
* throttle = (observed − bound) / bound × window, in ms, rounded half up; zero while
  observed ≤ bound.
"""

from __future__ import annotations

from quotas.common import MAX_THROTTLE_MS, round_ms

_INF = float("inf")


class WindowedRate:
    """A sum over samples of ``window_size_ms`` each, ``window_num`` of them, read as a rate."""

    __slots__ = (
        "window_num",
        "window_size_ms",
        "_expire_age_ms",
        "_min_full_windows",
        "_starts",
        "_last_events",
        "_values",
        "_current",
        "_latest_ms",
        "_next_purge_ms",
    )

    def __init__(self, window_num: int, window_size_ms: int) -> None:
        if window_num < 1 or window_size_ms < 1:
            raise ValueError("window_num and window_size_ms must be at least 1")
        self.window_num = window_num
        self.window_size_ms = window_size_ms
        self._expire_age_ms = window_num * window_size_ms
        self._min_full_windows = window_num - 1
        # Samples as parallel lists (start, last event, summed value); grown lazily like Kafka's.
        self._starts: list[int] = []
        self._last_events: list[int] = []
        self._values: list[float] = []
        self._current = 0
        self._latest_ms = -_INF  # latest instant seen: earlier instants are clamped to it
        # No sample can be purged before this instant (a lower bound, recomputed when reached).
        self._next_purge_ms = _INF

    # -- time -------------------------------------------------------------------------------

    def _clamp(self, now_ms: int) -> int:
        if now_ms < self._latest_ms:
            return self._latest_ms  # type: ignore[return-value]
        self._latest_ms = now_ms
        return now_ms

    def _new_sample(self, now_ms: int) -> None:
        if not self._starts:
            self._next_purge_ms = now_ms + self._expire_age_ms
        self._starts.append(now_ms)
        self._last_events.append(now_ms)
        self._values.append(0.0)

    # -- recording --------------------------------------------------------------------------

    def record_at(self, amount: float, now_ms: int) -> None:
        """Adds ``amount`` to the current sample, opening a new sample if it is complete."""
        now_ms = self._clamp(now_ms)
        starts = self._starts
        if not starts:
            self._new_sample(now_ms)
        i = self._current
        if now_ms - starts[i] >= self.window_size_ms:
            # SampledStat.advance: the next slot, out of window_num + 1, restarts at this record.
            i = (i + 1) % (self.window_num + 1)
            self._current = i
            if i >= len(starts):
                self._new_sample(now_ms)
            else:
                starts[i] = now_ms
                self._last_events[i] = now_ms
                self._values[i] = 0.0
        self._values[i] += amount
        self._last_events[i] = now_ms

    def unrecord_at(self, amount: float, now_ms: int) -> None:
        """Takes back ``amount`` recorded earlier by recording its negative.

        ClientQuotaManager.unrecordQuotaSensor records −value, so it lands in the current sample
        (which may be a new one), not necessarily in the sample that holds the original.
        """
        self.record_at(-amount, now_ms)

    # -- measuring --------------------------------------------------------------------------

    def _purge(self, now_ms: int) -> None:
        if now_ms < self._next_purge_ms:
            return
        # SampledStat.purgeObsoleteSamples: a sample with no event in window_num windows is
        # reset to an empty sample starting now (which moves the oldest start forward).
        expire_age_ms = self._expire_age_ms
        last_events = self._last_events
        for i, last_ms in enumerate(last_events):
            if now_ms - last_ms >= expire_age_ms:
                self._starts[i] = now_ms
                last_events[i] = now_ms
                self._values[i] = 0.0
        self._next_purge_ms = min(last_events) + expire_age_ms

    def _window_ms(self, now_ms: int) -> int:
        if not self._starts:
            # SampledStat.oldest creates a sample when there is none yet.
            self._new_sample(now_ms)
        elapsed_ms = now_ms - min(self._starts)
        # Rate.windowSize: assume at least window_num − 1 full windows have elapsed ...
        full_windows = elapsed_ms // self.window_size_ms
        if full_windows < self._min_full_windows:
            elapsed_ms += (self._min_full_windows - full_windows) * self.window_size_ms
        # ... and never less than 1 ms.
        return elapsed_ms if elapsed_ms > 1 else 1

    def window_ms_at(self, now_ms: int) -> int:
        """The window the rate is measured over at ``now_ms`` (Kafka's ``Rate.windowSize``)."""
        now_ms = self._clamp(now_ms)
        self._purge(now_ms)
        return self._window_ms(now_ms)

    def total_at(self, now_ms: int) -> float:
        """Sum of the retained samples after purging (Kafka's ``WindowedSum.measure``)."""
        now_ms = self._clamp(now_ms)
        self._purge(now_ms)
        return sum(self._values)

    def rate_at(self, now_ms: int) -> float:
        """Amount per second over the window (Kafka's ``Rate.measure``)."""
        now_ms = self._clamp(now_ms)
        self._purge(now_ms)
        return sum(self._values) / (self._window_ms(now_ms) / 1000.0)

    def throttle_ms_at(self, bound: float, now_ms: int, max_throttle_ms: int = MAX_THROTTLE_MS) -> int:
        """Time to wait for the rate to fall back to ``bound`` if nothing more is recorded."""
        now_ms = self._clamp(now_ms)
        self._purge(now_ms)
        window_ms = self._window_ms(now_ms)
        observed = sum(self._values) / (window_ms / 1000.0)
        # Quota.acceptable: an upper bound is met while value <= bound.
        if observed <= bound:
            return 0
        if bound <= 0:
            return max_throttle_ms
        # QuotaUtils.throttleTime: X = (O − T) / T × W, Math.round; boundedThrottleTime caps it.
        throttle_ms = round_ms((observed - bound) / bound * window_ms)
        return throttle_ms if throttle_ms < max_throttle_ms else max_throttle_ms

    def record_and_throttle_at(
        self, amount: float, bound: float, now_ms: int, max_throttle_ms: int = MAX_THROTTLE_MS
    ) -> int:
        """Records, then checks: Kafka's ``Sensor.record(value, timeMs, checkQuotas=true)``.

        The same steps as :meth:`record_at` then :meth:`throttle_ms_at`, inlined: this is the
        per-request path.
        """
        if now_ms < self._latest_ms:
            now_ms = self._latest_ms  # type: ignore[assignment]
        else:
            self._latest_ms = now_ms
        starts = self._starts
        if not starts:
            self._new_sample(now_ms)
        window_size_ms = self.window_size_ms
        i = self._current
        if now_ms - starts[i] >= window_size_ms:
            i = (i + 1) % (self.window_num + 1)
            self._current = i
            if i >= len(starts):
                self._new_sample(now_ms)
            else:
                starts[i] = now_ms
                self._last_events[i] = now_ms
                self._values[i] = 0.0
        values = self._values
        values[i] += amount
        self._last_events[i] = now_ms
        if now_ms >= self._next_purge_ms:
            self._purge(now_ms)
        elapsed_ms = now_ms - min(starts)
        full_windows = elapsed_ms // window_size_ms
        if full_windows < self._min_full_windows:
            elapsed_ms += (self._min_full_windows - full_windows) * window_size_ms
        window_ms = elapsed_ms if elapsed_ms > 1 else 1
        observed = sum(values) / (window_ms / 1000.0)
        if observed <= bound:
            return 0
        if bound <= 0:
            return max_throttle_ms
        throttle_ms = round_ms((observed - bound) / bound * window_ms)
        return throttle_ms if throttle_ms < max_throttle_ms else max_throttle_ms
