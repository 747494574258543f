"""Bloom filters and KIP-936's time-layered Bloom filter, over a fake clock (integers).

The layer timing rules (module docstring of ``quotas.bloom``): a layer is opened when there is
none, when the newest is ``window / layer_count`` old, when the newest is full, or when the
policy's shape changed; a layer is dropped once its *last write* is a whole window old. So an id
tracked at ``t`` is remembered for every ``t' < t + window`` and, if nothing tracks it again,
forgotten at ``last write of its layer + window`` — before ``t + window + window / layer_count``.
"""

from __future__ import annotations

import copy
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quotas.bloom import BloomFilter, BloomShape, LayeredBloomFilter, LayerPolicy
from quotas.producer_ids import ProducerIdSettings


def layered(window_ms: int = 1000, layer_count: int = 4, expected: int = 1000, fpr: float = 0.001):
    return LayeredBloomFilter(LayerPolicy(window_ms, layer_count, BloomShape.for_items(expected, fpr)))


# --- BloomShape ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expected, fpr, bits, hashes",
    [
        (1000, 0.01, 9586, 7),  # commons' Shape.fromNP(1000, 0.01)
        (1000, 0.001, 14378, 10),
        (1_000_000, 0.001, 14_377_588, 10),
        (1, 0.5, 8, 6),  # 1.44 bits rounds up to the 8-bit floor; k = round(8 · ln 2) = 6
        (1, 0.01, 10, 7),
        (100, 0.999, 8, 1),  # a useless rate: the 8-bit floor, and at least one hash
        (1000, 0.99, 21, 1),
    ],
)
def test_shape_for_items_textbook_optimum(expected, fpr, bits, hashes):
    shape = BloomShape.for_items(expected, fpr)
    assert (shape.expected, shape.fpr, shape.bits, shape.hashes) == (expected, fpr, bits, hashes)
    assert shape.bits == max(8, math.ceil(-expected * math.log(fpr) / math.log(2) ** 2))


@pytest.mark.parametrize("expected", [0, -1, -1000])
def test_shape_rejects_fewer_than_one_item(expected):
    with pytest.raises(ValueError, match="expected items"):
        BloomShape.for_items(expected, 0.01)


@pytest.mark.parametrize("fpr", [0, 0.0, 1, 1.0, -0.1, 1.5, float("nan"), float("inf")])
def test_shape_rejects_rate_outside_open_unit_interval(fpr):
    with pytest.raises(ValueError, match="false-positive rate"):
        BloomShape.for_items(10, fpr)


def test_shape_tiny_rate_is_large_but_finite():
    shape = BloomShape.for_items(10, 1e-300)
    assert shape.bits == math.ceil(10 * 300 * math.log(10) / math.log(2) ** 2)
    assert shape.hashes == round(shape.bits / 10 * math.log(2))


@given(st.integers(min_value=-(2**63), max_value=2**64 - 1), st.integers(1, 5000), st.floats(1e-6, 0.5))
@settings(max_examples=200, deadline=None)
def test_positions_in_range_deterministic_and_wrap_to_64_bits(item, expected, fpr):
    shape = BloomShape.for_items(expected, fpr)
    positions = shape.positions(item)
    assert len(positions) == shape.hashes
    assert all(0 <= p < shape.bits for p in positions)
    assert positions == shape.positions(item)
    assert positions == shape.positions(item & (2**64 - 1))  # -1 is 2**64 − 1, and so on


def test_fpr_at_bounds():
    shape = BloomShape.for_items(100, 0.01)
    assert shape.fpr_at(0) == 0.0
    assert shape.fpr_at(shape.bits) == 1.0
    half = shape.bits // 2
    assert shape.fpr_at(half) == pytest.approx((half / shape.bits) ** shape.hashes)


# --- BloomFilter --------------------------------------------------------------------------------


def test_plain_filter_add_contains_full_and_counts():
    shape = BloomShape.for_items(3, 0.01)
    bloom = BloomFilter(shape)
    assert bloom.memory_bytes == (shape.bits + 7) // 8
    assert bloom.bits_set() == 0 and 5 not in bloom and not bloom.is_full
    for item in (5, -1, 2**63 - 1):
        bloom.add(item)
        assert item in bloom
    assert bloom.count == 3 and bloom.is_full
    assert 0 < bloom.bits_set() <= 3 * shape.hashes


# --- LayerPolicy --------------------------------------------------------------------------------


def test_extend_check_cases():
    shape = BloomShape.for_items(2, 0.01)
    policy = LayerPolicy(1000, 4, shape)
    assert policy.layer_span_ms == 250
    assert policy.extend_check([], 0)  # no layer yet
    layer = policy.build(100)
    assert (layer.opened_ms, layer.last_write_ms, layer.filter.shape) == (100, 100, shape)
    assert not policy.extend_check([layer], 349)
    assert policy.extend_check([layer], 350)  # a layer's span has passed since it opened
    layer.filter.add(1)
    layer.filter.add(2)
    assert policy.extend_check([layer], 100)  # full
    other = policy.build(100)
    assert LayerPolicy(1000, 4, BloomShape.for_items(3, 0.01)).extend_check([other], 100)  # new shape


def test_policy_cleanup_by_last_write_and_next_cleanup():
    policy = LayerPolicy(1000, 4, BloomShape.for_items(10, 0.01))
    a, b = policy.build(0), policy.build(250)
    a.last_write_ms, b.last_write_ms = 200, 400
    assert policy.next_cleanup_ms([a, b]) == 1200
    assert policy.cleanup([a, b], 1199) == [a, b]
    assert policy.cleanup([a, b], 1200) == [b]
    assert policy.cleanup([a, b], 1400) == []
    assert policy.next_cleanup_ms([]) is None


# --- LayeredBloomFilter: expiry -----------------------------------------------------------------


def test_id_remembered_for_a_window_then_forgotten_with_its_layer():
    f = layered(window_ms=1000, layer_count=4)  # span 250 ms
    assert f.track(1, 0) is False
    assert f.track(1, 0) is True
    assert f.contains(1, 999)
    assert not f.contains(1, 1000)  # its layer's last write was 0: gone at exactly t + window
    assert f.live_layers == 0 and f.layers == []
    assert (f.memory_bytes, f.bits_set(), f.estimated_fpr()) == (0, 0, 0.0)
    assert f.track(1, 1000) is False  # a new sighting starts over
    assert f.live_layers == 1


def test_id_lives_until_the_last_write_of_its_layer_plus_a_window():
    f = layered(window_ms=1000, layer_count=4)
    f.track(1, 0)
    for t in range(10, 250, 10):
        f.track(1000 + t, t)  # other ids keep writing the same layer until 240
    f.track(5000, 250)  # a new layer opens at the span
    assert f.live_layers == 2
    assert f.contains(1, 1239)  # held by a layer last written at 240
    assert not f.contains(1, 1240)
    assert f.live_layers == 1
    assert f.contains(5000, 1249) and not f.contains(5000, 1250)
    assert f.live_layers == 0


def test_layers_dropped_one_by_one_then_none_left():
    f = layered(window_ms=1000, layer_count=4)
    for i, t in enumerate(range(0, 1000, 50)):
        f.track(i, t)
    assert f.live_layers == 4
    assert [layer.opened_ms for layer in f.layers] == [0, 250, 500, 750]
    assert [layer.last_write_ms for layer in f.layers] == [200, 450, 700, 950]
    expected_live = {1199: 4, 1200: 3, 1450: 2, 1700: 1, 1949: 1, 1950: 0}
    for now, live in expected_live.items():
        f.cleanup(now)
        assert f.live_layers == live, now
    assert not any(f.contains(i, 1950) for i in range(20))


def test_refresh_changes_nothing_for_an_unseen_id():
    f = layered()
    assert f.refresh(1, 0) is False
    assert f.layers == []
    f.track(2, 0)
    before = (f.live_layers, f.bits_set(), f.layers[0].filter.count)
    assert f.refresh(1, 10) is False
    assert (f.live_layers, f.bits_set(), f.layers[0].filter.count) == before
    assert f.layers[0].last_write_ms == 0


# --- LayeredBloomFilter: when layers open -------------------------------------------------------


def test_full_layer_opens_a_new_one_before_its_span():
    f = layered(window_ms=1000, layer_count=4, expected=3)
    for i in range(3):
        f.track(i, 10)
    assert f.live_layers == 1 and f.layers[0].filter.is_full
    f.track(3, 11)  # well within the 250 ms span
    assert f.live_layers == 2
    assert f.layers[1].opened_ms == 11
    assert all(f.contains(i, 11) for i in range(4))


def test_changed_shape_opens_a_new_layer_and_old_layers_still_answer():
    f = layered(window_ms=1000, layer_count=4, expected=100)
    for i in range(10):
        f.track(i, 0)
    new_policy = LayerPolicy(1000, 4, BloomShape.for_items(400, 0.01))
    f.policy = new_policy  # what a quota change does
    assert all(f.contains(i, 1) for i in range(10))  # checked with the old layer's own shape
    assert f.track(100, 1) is False
    assert f.live_layers == 2
    assert f.layers[1].filter.shape is new_policy.shape
    assert f.layers[0].filter.shape is not new_policy.shape
    assert f.track(5, 2) is True  # seen: re-added into the new layer
    assert 5 in f.layers[1].filter


def test_span_opens_a_layer_at_the_first_write_after_it():
    f = layered(window_ms=1000, layer_count=4)
    f.track(1, 0)
    assert f.contains(1, 600)  # reading does not open layers
    assert f.live_layers == 1
    assert f.track(1, 600) is True  # the re-add does
    assert [layer.opened_ms for layer in f.layers] == [0, 600]


def test_stable_layer_count_at_the_configured_load():
    """KIP-936: at the configured load a layered filter settles at layer_count layers (one more
    while the oldest waits for its last write to be a window old)."""
    s = ProducerIdSettings(window_size_s=1.0, layer_count=4)
    quota = 400
    f = LayeredBloomFilter(s.policy(quota))
    per_id_ms = s.window_ms / quota
    for i in range(5 * quota):
        f.track(i, int(i * per_id_ms))
        assert f.live_layers <= s.layer_count + 1
    assert f.live_layers >= s.layer_count


# --- LayeredBloomFilter: properties -------------------------------------------------------------

op = st.one_of(
    st.tuples(st.just("track"), st.integers(0, 24), st.integers(0, 120)),  # (id, ms since previous op)
    st.tuples(st.just("reshape"), st.integers(1, 8), st.just(0)),  # quota change: a new shape
)


@given(
    window_ms=st.integers(8, 100),
    layer_count=st.integers(1, 5),
    expected=st.integers(1, 6),  # tiny: layers close early because full all the time
    ops=st.lists(op, min_size=1, max_size=80),
)
@settings(max_examples=300, deadline=None)
def test_no_false_negative_within_the_window(window_ms, layer_count, expected, ops):
    fpr = 0.05

    def policy(n):
        return LayerPolicy(window_ms, layer_count, BloomShape.for_items(n, fpr))

    f = LayeredBloomFilter(policy(expected))
    last_seen: dict[int, int] = {}
    t = 0
    for kind, arg, step in ops:
        t += step
        if kind == "reshape":
            f.policy = policy(arg)
            continue
        item = arg
        seen = item in last_seen and t < last_seen[item] + window_ms
        got = f.track(item, t)
        if seen:
            assert got is True, (item, last_seen[item], t)
        last_seen[item] = t
        live = {i: s for i, s in last_seen.items() if t < s + window_ms}
        assert all(f.contains(i, t) for i in live)
        # Look ahead on a copy (contains drops expired layers, so the clock may only go forward
        # on the filter itself): every live id until the last instant of its window.
        ahead = copy.deepcopy(f)
        for i, s in sorted(live.items(), key=lambda kv: kv[1]):
            for t2 in (t + (s + window_ms - 1 - t) // 2, s + window_ms - 1):
                assert ahead.contains(i, t2), (i, s, t2)


@given(
    window_ms=st.integers(10, 400),
    layer_count=st.integers(1, 6),
    expected=st.integers(1, 50),
    gaps=st.lists(st.floats(0, 1, exclude_max=True), min_size=20, max_size=120),
    noise=st.integers(0, 5),
)
@settings(max_examples=200, deadline=None)
def test_long_lived_id_is_never_new_again(window_ms, layer_count, expected, gaps, noise):
    """An id seen at least once per window stays seen however many layers rotate past, with
    other (new) ids filling and closing layers in between."""
    f = layered(window_ms, layer_count, expected, fpr=0.01)
    long_lived = -7
    assert f.track(long_lived, 0) is False
    t = 0
    fresh = 0
    for g in gaps:
        gap = int(g * window_ms)  # strictly less than a window since the previous sighting
        for k in range(noise):
            fresh += 1
            f.track(fresh, t + gap * k // (noise + 1))
        t += gap
        assert f.track(long_lived, t) is True, t
    assert f.contains(long_lived, t + window_ms - 1)


@given(
    window_ms=st.integers(10, 400),
    layer_count=st.integers(1, 6),
    times=st.lists(st.integers(0, 2000), min_size=1, max_size=60),
)
@settings(max_examples=200, deadline=None)
def test_every_id_is_gone_a_window_and_a_span_after_its_last_sighting(window_ms, layer_count, times):
    f = layered(window_ms, layer_count, expected=4, fpr=0.01)
    last_seen = {}
    for i, t in enumerate(sorted(times)):
        f.track(i % 7, t)
        last_seen[i % 7] = t
    end = max(last_seen.values())
    for layer in f.layers:
        # Written only while it is the newest and younger than a span.
        assert layer.opened_ms <= layer.last_write_ms < layer.opened_ms + f.policy.layer_span_ms
    # Every layer's last write is at most the last sighting: all gone a window after it.
    f.cleanup(end + window_ms)
    assert f.live_layers == 0
    assert not any(f.contains(i, end + window_ms) for i in last_seen)


# --- LayeredBloomFilter: false-positive rate ----------------------------------------------------


@pytest.mark.parametrize("fpr", [0.001, 0.01])
def test_measured_false_positive_rate_within_twice_the_configured_rate(fpr):
    """Shapes as the quota manager builds them; ``quota`` distinct ids over one window is the load
    the filter is sized for. Probed with 200,000 ids never added (sequential, as Kafka allocates
    them, and random 63-bit)."""
    settings_ = ProducerIdSettings(window_size_s=3600, layer_count=4, false_positive_rate=fpr)
    quota = 20_000
    f = LayeredBloomFilter(settings_.policy(quota))
    window = settings_.window_ms
    for i in range(quota):
        f.track(i, i * window // quota)
    now = window - 1
    assert f.live_layers == 4
    assert all(f.contains(i, now) for i in range(0, quota, 97))
    rng = random.Random(936)
    probes = [quota + 1_000_000 + i for i in range(100_000)]
    probes += [rng.getrandbits(63) | 1 << 62 for _ in range(100_000)]  # ≥ 2**62: never added
    false_positives = sum(1 for p in probes if f.contains(p, now))
    measured = false_positives / len(probes)
    assert measured <= 2 * fpr, (measured, fpr)
    assert 0 < f.estimated_fpr() <= 2 * fpr
    # And the estimate is an estimate of the same thing.
    assert measured == pytest.approx(f.estimated_fpr(), rel=0.5)


# --- Known problem ------------------------------------------------------------------------------


def test_refreshing_the_same_ids_does_not_multiply_layers():
    # 5,000 distinct ids, a layer expecting 10,000, no time passing: one layer is enough. The
    # exact per-layer cache of confirmed ids holds 4,096, so past that a re-add counts again.
    f = layered(window_ms=1000, layer_count=4, expected=10_000, fpr=0.001)
    for _ in range(20):
        for i in range(5000):
            f.track(i, 0)
    assert f.live_layers == 1  # 10 today
