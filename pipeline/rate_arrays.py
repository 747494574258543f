"""Kafka's windowed rate over one entity's whole event sequence at once (numpy), for the what-if
replay: the throttle ``quotas.rate.WindowedRate.record_and_throttle_at`` gives each event,
computed from the arrays of event times and amounts instead of one call per event.

What it guarantees: for events in time order, each recorded and then checked (Kafka's
``Sensor.record(value, timeMs, checkQuotas=true)``), the same throttle as the engine's, exactly
while the amounts are whole numbers below 2**53 (the sums are then exact in floating point, as
the replay's amounts are). ``tests/pipeline/test_rate_arrays.py`` holds it to the engine on
random and hand-made sequences.

How the engine's state follows from the times alone (``quotas/rate.py`` says why each rule is
Kafka's):

- **Samples.** The first event opens sample 0; an event ``window_size_ms`` or more after the
  current sample's start opens the next one. So the samples are a walk over the events: from an
  opening event, the next opening is the first event at or after start + window.
- **The ring** keeps ``window_num + 1`` samples: at an event of sample k, samples k − N … k.
- **Purge.** After each record, a kept sample whose last event is ``N × window`` or more before
  now is reset: no value, and its start moved to now; reset again each time a later event comes
  ``N × window`` after its previous reset. The current sample is never reset (it was just
  recorded to), so an event's total is the sum from the first event of the oldest sample not
  reset to the event itself, and the oldest start is that sample's start. A reset sample's
  start, the time of its last reset, is never older: that reset came at an event whose sample
  is newer than the reset one and, being less than ``N × window`` old, still kept.
- **Rate** = total / window, window = now − oldest start, raised to ``N − 1`` whole windows and
  at least 1 ms; throttle = Math.round((rate − bound) / bound × window), capped.

Everything but the total depends on the times alone (:func:`sample_windows`), so the kinds that
charge the same events, and every round of the replay's un-recording fixed point, share it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from quotas.common import MAX_THROTTLE_MS

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray


class SampleWindows(NamedTuple):
    """What the windowed rate measures each event over, from the event times alone."""

    oldest: NDArray[np.int64]  # each event's first event of the oldest sample kept
    window_ms: NDArray[np.int64]  # each event's rate window (at least 1 ms)


def sample_windows(times_ms: NDArray[np.int64], window_num: int, window_size_ms: int) -> SampleWindows:
    """The samples of events at ``times_ms`` (non-decreasing, not empty): see the module docstring."""
    import numpy as np

    t = np.asarray(times_ms, dtype=np.int64)
    n = len(t)
    big_n, w = window_num, window_size_ms
    first = _sample_openings(t, w)  # first event of each sample
    opening = np.zeros(n, dtype=bool)
    opening[first] = True
    k = np.cumsum(opening) - 1  # sample of each event
    last_time = t[np.concatenate([first[1:] - 1, [n - 1]])]  # of each sample's last event (so far, the current)
    # Oldest sample not reset, among k − N … k − 1 (else k itself): the first whose last event is
    # within N windows. Samples' last events only grow later, so that is a search, not a scan.
    alive_from = np.searchsorted(last_time, t - big_n * w, side="right")
    oldest = first[np.minimum(np.maximum(alive_from, k - big_n), k)]
    elapsed = t - t[oldest]
    full = elapsed // w
    elapsed = np.where(full < big_n - 1, elapsed + (big_n - 1 - full) * w, elapsed)
    return SampleWindows(oldest, np.maximum(elapsed, 1))


def throttles_ms(times_ms: NDArray[np.int64], amounts: NDArray[np.int64], bound: float, window_num: int,
                 window_size_ms: int, max_throttle_ms: int = MAX_THROTTLE_MS,
                 kept: NDArray[np.int64] | None = None, windows: SampleWindows | None = None) -> NDArray[np.int64]:
    """The throttle of each event (``times_ms`` non-decreasing, ``amounts`` whole): see the
    module docstring. ``kept``: what each event leaves recorded after its check, when that is
    not its amount (a throttled Fetch un-records its bytes right after, ``KafkaApis``: 0).
    ``windows``: :func:`sample_windows` of these times, when already known."""
    import numpy as np

    n = len(times_ms)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if windows is None:
        windows = sample_windows(times_ms, window_num, window_size_ms)
    a = np.asarray(amounts, dtype=np.float64)
    prefix = np.concatenate([[0.0], np.cumsum(a if kept is None else np.asarray(kept, dtype=np.float64))])
    total = prefix[:-1] - prefix[windows.oldest] + a  # the earlier events' net, and this one's amount
    window = windows.window_ms
    observed = total / (window / 1000.0)
    if bound <= 0:
        return np.where(observed <= bound, 0, max_throttle_ms).astype(np.int64)
    raw = (observed - bound) / bound * window
    rounded = np.floor(np.minimum(raw, float(max_throttle_ms)) + 0.5)  # Math.round, half up
    out = np.where(observed <= bound, 0, np.clip(rounded, 0, max_throttle_ms))
    return out.astype(np.int64)


def _sample_openings(t: NDArray[np.int64], window_size_ms: int) -> NDArray[np.int64]:
    """The events that open a sample (``t`` non-decreasing): the first event, then from each
    opening the first event ``window_size_ms`` or more after it. The walk is followed by
    doubling its jumps (log2 of the samples rounds over whole arrays), not one step per sample."""
    import numpy as np

    n = len(t)
    jump = np.append(np.searchsorted(t, t + window_size_ms, side="left"), n)  # n: past the end, stays
    walk = np.zeros(1, dtype=np.int64)  # openings 0 … m − 1 of the walk, with jump = m steps
    while walk[-1] < n:
        walk = np.concatenate([walk, jump[walk]])
        jump = jump[jump]
    return walk[walk < n]
