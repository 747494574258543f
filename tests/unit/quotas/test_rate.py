"""WindowedRate: Kafka's sample arithmetic over synthetic instants, and against a literal model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quotas.common import MAX_THROTTLE_MS
from quotas.rate import WindowedRate
from tests.unit.quotas.kafka_model import ModelRate, java_round

# 3 samples of 1 s, bound 100/s. Each row: (instant ms, amount recorded or None, expected
# window ms, expected rate /s, expected throttle ms at bound 100).
TABLE = [
    (0, 100, 2000, 50.0, 0),  # first sample; window padded to num-1 = 2 full windows
    (500, 100, 2500, 80.0, 0),  # same sample (500 ms < 1 s)
    (1000, 100, 2000, 150.0, 1000),  # a new sample opens at this record; 1 full window + 1 padded
    (2500, 300, 2500, 240.0, 3500),  # third sample at 2500: no padding any more
    (3600, None, 2600, 400 / 2.6, 1400),  # the t=0 sample's last event (500) is 3 s old: reset
    (3700, 50, 2700, 450 / 2.7, 1800),  # fourth slot (num + 1) opens at 3700
    (3650, 10, 2700, 460 / 2.7, 1900),  # time went back: counts as 3700, lands in the same sample
    # slot 0 (the reset one) is recycled at 4700; the t=1000 sample is now 3 s old: reset too
    (4700, 10, 2200, 370 / 2.2, 1500),
]


def test_table_of_instants():
    rate = WindowedRate(3, 1000)
    for now_ms, amount, window_ms, per_s, throttle_ms in TABLE:
        if amount is not None:
            rate.record_at(amount, now_ms)
        assert rate.window_ms_at(now_ms) == window_ms, now_ms
        assert rate.rate_at(now_ms) == pytest.approx(per_s), now_ms
        assert rate.throttle_ms_at(100, now_ms) == throttle_ms, now_ms


def test_rate_before_any_record_is_zero_over_padded_window():
    rate = WindowedRate(11, 1000)
    assert rate.rate_at(5000) == 0.0
    assert rate.window_ms_at(5000) == 10_000
    # SampledStat.oldest created a sample at 5000: a record at 6000 opens the next one.
    rate.record_at(10, 6000)
    assert rate.window_ms_at(6000) == 10_000


def test_one_sample_window_has_a_one_ms_floor():
    rate = WindowedRate(1, 1000)
    rate.record_at(5, 0)
    assert rate.window_ms_at(0) == 1
    assert rate.rate_at(0) == 5000.0
    assert rate.throttle_ms_at(10, 0) == 499  # (5000 − 10) / 10 × 1 ms


def test_everything_forgotten_after_num_windows_of_silence():
    rate = WindowedRate(11, 1000)
    rate.record_at(1_000_000, 0)
    assert rate.throttle_ms_at(1000, 10_999) > 0
    assert rate.total_at(11_000) == 0.0
    assert rate.throttle_ms_at(1000, 11_000) == 0


def test_throttle_formula_and_half_up_rounding():
    rate = WindowedRate(11, 1000)
    rate.record_at(2000, 0)  # 2000 over a 10 s window = 200/s
    assert rate.throttle_ms_at(100, 0) == 10_000  # (200 − 100) / 100 × 10 000
    rate2 = WindowedRate(2, 1000)
    rate2.record_at(1001, 0)  # 1001/s over 1000 ms, bound 1000: 0.5 ms → rounds up to 1
    assert rate2.throttle_ms_at(1000, 0) == 1


def test_bound_is_inclusive_and_caps_apply():
    rate = WindowedRate(11, 1000)
    rate.record_at(1000, 0)
    assert rate.throttle_ms_at(100, 0) == 0  # exactly at the bound: Quota.acceptable
    rate.record_at(1, 0)
    assert rate.throttle_ms_at(100, 0) == 10  # 0.1 % over → 10 ms over a 10 s window
    rate.record_at(1_000_000, 0)
    assert rate.throttle_ms_at(100, 0, max_throttle_ms=1000) == 1000  # boundedThrottleTime
    assert rate.throttle_ms_at(0, 0) == MAX_THROTTLE_MS  # a zero bound cannot be divided by


def test_record_then_check():
    rate = WindowedRate(11, 1000)
    assert rate.record_and_throttle_at(1000, 100, 0) == 0
    assert rate.record_and_throttle_at(1000, 100, 0) == 10_000


def test_unrecord_gives_back_in_the_current_sample():
    rate = WindowedRate(5, 1000)
    rate.record_at(500, 0)
    rate.record_at(700, 1500)  # second sample
    rate.unrecord_at(700, 1600)
    assert rate.total_at(1600) == 500
    rate.record_at(300, 2600)  # third sample
    rate.unrecord_at(300, 3600)  # opens a fourth sample, as Kafka's negative record does
    assert rate.total_at(3600) == 500
    assert rate.window_ms_at(3600) == 4600  # 3 full windows, padded to 4


ops_st = st.lists(
    st.tuples(
        st.sampled_from(["record", "unrecord", "measure"]),
        st.integers(min_value=-3000, max_value=4000),  # time step, may go backwards
        st.integers(min_value=0, max_value=5000),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(
    num=st.integers(min_value=1, max_value=12),
    window_ms=st.sampled_from([1, 7, 100, 1000, 30_000]),
    bound=st.sampled_from([1.0, 50.0, 1000.0, 12_345.5]),
    ops=ops_st,
)
def test_matches_literal_kafka_model(num, window_ms, bound, ops):
    rate = WindowedRate(num, window_ms)
    model = ModelRate(num, window_ms)
    now = 10_000
    for op, step, amount in ops:
        now += step
        if op == "record":
            throttle = rate.record_and_throttle_at(amount, bound, now)
            model.record(amount, now)
            assert throttle == model.throttle(bound, now)
        elif op == "unrecord":
            rate.unrecord_at(amount, now)
            model.record(-amount, now)
        else:
            assert rate.window_ms_at(now) == model.window(now)
            assert rate.rate_at(now) == pytest.approx(model.rate(now))
            assert rate.throttle_ms_at(bound, now, 1000) == model.throttle(bound, now, 1000)


@settings(max_examples=200, deadline=None)
@given(ops=ops_st, bound=st.sampled_from([10.0, 333.0, 5000.0]))
def test_throttle_is_the_formula_to_the_millisecond(ops, bound):
    rate = WindowedRate(11, 1000)
    now = 0
    for _, step, amount in ops:
        now += abs(step)
        throttle = rate.record_and_throttle_at(amount, bound, now)
        observed = rate.rate_at(now)
        window_ms = rate.window_ms_at(now)
        expected = 0 if observed <= bound else java_round((observed - bound) / bound * window_ms)
        assert throttle == expected
        # Waiting out the throttle brings the rate back to the bound (nothing else recorded).
        if throttle:
            assert observed * window_ms / (window_ms + throttle) == pytest.approx(bound, rel=1e-3, abs=1e-3)
