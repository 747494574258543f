"""TokenBucket (KIP-599): tables of synthetic instants, the KIP's worked example, properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quotas.common import MAX_THROTTLE_MS, Decision
from quotas.token_bucket import TokenBucket, burst_for
from tests.unit.quotas.kafka_model import java_round


def kip599_bucket(now_ms: int = 0) -> TokenBucket:
    # Q = 5, S = 100, W = 1 s → R = 5/s, B = 500.
    return TokenBucket(5, 100, 1000, now_ms)


def test_burst_is_q_times_samples_times_window():
    assert burst_for(5, 100, 1000) == 500
    assert burst_for(10, 11, 1000) == 110
    assert burst_for(2, 4, 500) == 4
    assert kip599_bucket().tokens_at(0) == 500  # a new bucket is full


def test_kip599_worked_example_permissive():
    bucket = kip599_bucket()
    # 560 mutations in one go: tokens −60, throttle −(−60) / 5 = 12 s.
    assert bucket.record_and_throttle_at(560, 0) == Decision(True, 12_000)
    assert bucket.tokens_at(0) == -60
    assert bucket.throttle_ms_at(0) == 12_000


def test_kip599_worked_example_strict_seven_topics_of_80():
    bucket = kip599_bucket()
    decisions = [bucket.try_admit_at(80, 0) for _ in range(7)]
    assert decisions == [Decision(True, 0)] * 7  # K ≥ 0 before each, the 7th drives it to −60
    assert bucket.tokens_at(0) == -60
    assert bucket.try_admit_at(80, 0) == Decision(False, 12_000)
    assert bucket.tokens_at(0) == -60  # a rejection charges nothing


# (instant ms, operation, amount, expected decision or None, expected tokens afterwards)
TABLE = [
    (0, "strict", 560, Decision(True, 0), -60.0),
    (0, "strict", 1, Decision(False, 12_000), -60.0),
    (6000, "strict", 1, Decision(False, 6000), -30.0),  # refilled 30
    (5000, "strict", 1, Decision(False, 6000), -30.0),  # time went back: no time passes
    (5500, "strict", 1, Decision(False, 6000), -30.0),  # still before the latest instant seen
    (8000, "strict", 1, Decision(False, 4000), -20.0),  # only 8000 − 6000 counts, once
    (12_000, "strict", 10, Decision(True, 0), -10.0),  # K = 0 is enough
    (12_000, "permissive", 0, Decision(True, 2000), -10.0),
    (12_100, "permissive", 1, Decision(True, 2100), -10.5),  # +0.5 −1
    (12_100, "unrecord", 1, None, -9.5),
    (400_000, "tokens", 0, None, 500.0),  # refill stops at the burst
    (400_000, "unrecord", 50, None, 500.0),  # a give-back never overfills
    (400_001, "permissive", 499.999, Decision(True, 0), 0.001),  # full: the 1 ms refill is lost
]


def test_table_of_instants():
    bucket = kip599_bucket()
    for now_ms, op, amount, decision, tokens in TABLE:
        if op == "strict":
            assert bucket.try_admit_at(amount, now_ms) == decision, now_ms
        elif op == "permissive":
            assert bucket.record_and_throttle_at(amount, now_ms) == decision, now_ms
        elif op == "unrecord":
            bucket.record_at(-amount, now_ms)
        assert bucket.tokens_at(now_ms) == pytest.approx(tokens), now_ms


def test_tiny_debt_rejects_with_zero_throttle():
    bucket = TokenBucket(1000, 1, 1000, 0)
    bucket.record_at(1000.0001, 0)
    assert bucket.try_admit_at(1, 0) == Decision(False, 0)  # K < 0 rejects, −K/Q rounds to 0 ms


def test_throttle_rounds_half_up():
    bucket = TokenBucket(1000, 1, 1000, 0)  # B = 1000
    bucket.record_at(1000.5, 0)  # K = −0.5 → 0.5 ms: Math.round gives 1 (Python's round gives 0)
    assert bucket.throttle_ms_at(0) == 1
    bucket.record_at(2, 0)  # K = −2.5 → 2.5 ms → 3
    assert bucket.throttle_ms_at(0) == 3


def test_zero_rate_and_set_rate():
    bucket = TokenBucket(0, 11, 1000, 0)
    assert bucket.try_admit_at(3, 0) == Decision(True, 0)  # K = 0 ≥ 0
    assert bucket.try_admit_at(1, 10_000) == Decision(False, MAX_THROTTLE_MS)
    bucket.set_rate(10)  # keeps the debt, refills at the new rate
    assert bucket.tokens_at(10_000) == -3
    assert bucket.throttle_ms_at(10_100) == 200
    bucket.set_rate(1)  # lower burst caps the tokens at once
    assert bucket.tokens_at(1_000_000) == 11
    bucket.set_rate(0.5)
    assert bucket.tokens_at(1_000_000) == 5.5


def test_constructor_validates():
    with pytest.raises(ValueError):
        TokenBucket(-1, 11, 1000, 0)
    with pytest.raises(ValueError):
        TokenBucket(1, 0, 1000, 0)


steps_st = st.lists(
    st.tuples(
        st.integers(min_value=-5000, max_value=5000),  # time step in ms, may go backwards
        st.integers(min_value=0, max_value=200),  # partitions in one topic
        st.booleans(),  # strict (True) or permissive
    ),
    max_size=80,
)


@settings(max_examples=400, deadline=None)
@given(
    rate=st.sampled_from([0.5, 1.0, 5.0, 33.3, 1000.0]),
    samples=st.integers(min_value=1, max_value=100),
    window_ms=st.sampled_from([100, 1000, 30_000]),
    steps=st.lists(st.tuples(st.integers(-5000, 5000), st.integers(0, 200)), max_size=80),
)
def test_admitted_never_exceeds_burst_plus_rate_times_elapsed(rate, samples, window_ms, steps):
    """Strict mode: what was admitted before an admission ≤ B + R × elapsed, and so in total
    ≤ B + R × elapsed + the last topic (KIP-599 lets one topic drive the tokens negative)."""
    start_ms = 1_000_000
    bucket = TokenBucket(rate, samples, window_ms, start_ms)
    burst = burst_for(rate, samples, window_ms)
    now_ms = latest_ms = start_ms
    admitted = 0.0
    largest = 0
    for step, amount in steps:
        now_ms += step
        latest_ms = max(latest_ms, now_ms)  # time going back never adds refill
        allowance = burst + rate * (latest_ms - start_ms) / 1000.0
        if bucket.try_admit_at(amount, now_ms).admitted:
            assert admitted <= allowance + 1e-6
            admitted += amount
            largest = max(largest, amount)
        assert admitted <= allowance + largest + 1e-6
        # Exact accounting: admitted = B + refill − K, refill ≤ R × elapsed.
        assert admitted <= allowance - bucket.tokens_at(now_ms) + 1e-6


@settings(max_examples=400, deadline=None)
@given(
    rate=st.sampled_from([0.5, 1.0, 5.0, 33.3, 1000.0]),
    samples=st.integers(min_value=1, max_value=100),
    steps=steps_st,
)
def test_throttle_is_minus_tokens_over_rate_to_the_millisecond(rate, samples, steps):
    bucket = TokenBucket(rate, samples, 1000, 0)
    now_ms = 0
    for step, amount, strict in steps:
        now_ms += step
        tokens_before = bucket.tokens_at(now_ms)
        if strict:
            decision = bucket.try_admit_at(amount, now_ms)
            assert decision.admitted == (tokens_before >= 0)
            if not decision.admitted:
                assert decision.throttle_ms == java_round(-tokens_before / rate * 1000)
                assert bucket.tokens_at(now_ms) == tokens_before
            else:
                assert decision.throttle_ms == 0
        else:
            decision = bucket.record_and_throttle_at(amount, now_ms)
            tokens = bucket.tokens_at(now_ms)
            assert decision.admitted
            assert decision.throttle_ms == (java_round(-tokens / rate * 1000) if tokens < 0 else 0)
        assert bucket.tokens_at(now_ms) <= burst_for(rate, samples, 1000)
