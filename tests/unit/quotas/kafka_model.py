"""A slow, literal model of Kafka's SampledStat + WindowedSum + Rate.

Written straight from how Kafka behaves (one object per sample, purge on every measure), to
check the optimised engines against. Time going backwards is clamped here too, because the
engines deliberately treat it as no time passing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def java_round(x: float) -> int:
    return math.floor(x + 0.5)


@dataclass
class Sample:
    start_ms: int
    last_event_ms: int
    value: float = 0.0


class ModelRate:
    def __init__(self, num: int, window_ms: int) -> None:
        self.num = num
        self.window_ms = window_ms
        self.samples: list[Sample] = []
        self.current = 0
        self.latest = None

    def _t(self, now: int) -> int:
        if self.latest is not None and now < self.latest:
            return self.latest
        self.latest = now
        return now

    def record(self, value: float, now: int) -> None:
        now = self._t(now)
        if not self.samples:
            self.samples.append(Sample(now, now))
        s = self.samples[self.current]
        if now - s.start_ms >= self.window_ms:
            self.current = (self.current + 1) % (self.num + 1)
            if self.current >= len(self.samples):
                s = Sample(now, now)
                self.samples.append(s)
            else:
                s = self.samples[self.current]
                s.start_ms, s.last_event_ms, s.value = now, now, 0.0
        s.value += value
        s.last_event_ms = now

    def _purge(self, now: int) -> None:
        for s in self.samples:
            if now - s.last_event_ms >= self.num * self.window_ms:
                s.start_ms, s.last_event_ms, s.value = now, now, 0.0

    def window(self, now: int) -> int:
        now = self._t(now)
        self._purge(now)
        if not self.samples:
            self.samples.append(Sample(now, now))
        elapsed = now - min(s.start_ms for s in self.samples)
        full = elapsed // self.window_ms
        if full < self.num - 1:
            elapsed += (self.num - 1 - full) * self.window_ms
        return max(elapsed, 1)

    def rate(self, now: int) -> float:
        now = self._t(now)
        self._purge(now)
        total = 0.0
        for s in self.samples:
            total += s.value
        return total / (self.window(now) / 1000.0)

    def throttle(self, bound: float, now: int, cap: int | None = None) -> int:
        observed = self.rate(now)
        if observed <= bound:
            return 0
        t = java_round((observed - bound) / bound * self.window(now))
        return t if cap is None else min(t, cap)
