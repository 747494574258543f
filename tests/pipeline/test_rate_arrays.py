"""The array form of Kafka's windowed rate (pipeline.rate_arrays) against the engine it stands in
for (quotas.rate.WindowedRate), event for event: dense, sparse and bursty sequences, idle gaps
that purge samples, one window or many, and bounds the traffic is under, at and over."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.rate_arrays import throttles_ms
from quotas.rate import WindowedRate


def engine(times, amounts, bound, window_num, window_size_ms, max_throttle_ms=None):
    rate = WindowedRate(window_num, window_size_ms)
    kw = {} if max_throttle_ms is None else {"max_throttle_ms": max_throttle_ms}
    return [rate.record_and_throttle_at(float(a), bound, int(t), **kw) for t, a in zip(times, amounts)]


def sequence(rng: np.random.Generator, n: int, window_size_ms: int, window_num: int):
    """Event times mixing bursts, steady traffic and idle gaps longer than the whole window."""
    kind = rng.integers(0, 4, n)
    gaps = np.select([kind == 0, kind == 1, kind == 2],
                     [np.zeros(n, dtype=np.int64),  # same instant
                      rng.integers(1, max(2, window_size_ms // 3), n),  # within a sample
                      rng.integers(window_size_ms // 2 + 1, 2 * window_size_ms + 2, n)],  # next samples
                     rng.integers(max(1, window_num * window_size_ms - 2), 3 * window_num * window_size_ms + 3,
                                  n))  # idle
    times = 1_000_000 + np.cumsum(gaps)
    assert (np.diff(times) >= 0).all()
    amounts = rng.integers(0, 5_000, n)
    return times.astype(np.int64), amounts.astype(np.int64)


@pytest.mark.parametrize("seed", range(200))
def test_random_sequences_get_the_engines_throttles(seed):
    rng = np.random.default_rng(seed)
    window_num = int(rng.integers(1, 13))
    window_size_ms = int(rng.choice([1, 7, 100, 1000, 1500]))
    times, amounts = sequence(rng, int(rng.integers(1, 600)), window_size_ms, window_num)
    rate_per_s = amounts.sum() / max((times[-1] - times[0]) / 1000, 0.001)
    for bound in (0.0, rate_per_s * 0.3, rate_per_s, rate_per_s * 3, 1e12):
        want = engine(times, amounts, bound, window_num, window_size_ms)
        got = throttles_ms(times, amounts, bound, window_num, window_size_ms).tolist()
        assert got == want, (seed, bound, next(i for i, (g, e) in enumerate(zip(got, want)) if g != e))


def test_hand_made_sequences():
    # Kafka's defaults (11 samples of 1 s), 1,000 B/s bound.
    steady = np.arange(0, 20_000, 100, dtype=np.int64)  # 10 events a second
    for amounts in (np.full(len(steady), 100), np.full(len(steady), 150)):
        assert throttles_ms(steady, amounts, 1000.0, 11, 1000).tolist() == engine(steady, amounts, 1000.0, 11, 1000)
    # A burst, an idle gap long enough to purge every sample, and the burst again.
    times = np.array([0, 0, 1, 500, 999, 1000, 30_000, 30_000, 30_001, 45_000], dtype=np.int64)
    amounts = np.array([5000, 1, 2, 3, 4, 5000, 7000, 1, 1, 9000], dtype=np.int64)
    for bound in (0.0, 100.0, 1000.0, 1e9):
        assert throttles_ms(times, amounts, bound, 11, 1000).tolist() == engine(times, amounts, bound, 11, 1000)
    assert throttles_ms(times, amounts, 100.0, 11, 1000, max_throttle_ms=2000).tolist() == \
        engine(times, amounts, 100.0, 11, 1000, max_throttle_ms=2000)
    assert throttles_ms(np.array([], dtype=np.int64), np.array([], dtype=np.int64), 1.0, 11, 1000).tolist() == []
