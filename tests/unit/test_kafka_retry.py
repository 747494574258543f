"""proxy.cluster.kafka_retry: Kafka's back-off (ExponentialBackoff with the clients' defaults) and when
the proxy's own clients give up, over synthetic instants."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.cluster.kafka_retry import FATAL, KAFKA_BACKOFF, RETRIABLE, UNREACHABLE, Backoff, Retries


@pytest.mark.parametrize("retries, expected_s", [(0, 0.1), (1, 0.2), (2, 0.4), (3, 0.8), (4, 1.0), (50, 1.0)])
def test_the_wait_doubles_from_retry_backoff_ms_up_to_its_max(retries, expected_s):
    assert KAFKA_BACKOFF.delay_s(retries, 0.5) == pytest.approx(expected_s)  # 0.5: no jitter


def test_jitter_varies_each_wait_by_a_fifth_and_never_past_the_max():
    assert KAFKA_BACKOFF.delay_s(0, 0.0) == pytest.approx(0.08)
    assert KAFKA_BACKOFF.delay_s(0, 0.999999) == pytest.approx(0.12, abs=1e-6)
    assert KAFKA_BACKOFF.delay_s(3, 0.999999) == pytest.approx(0.96, abs=1e-6)
    assert KAFKA_BACKOFF.delay_s(4, 0.999999) == 1.0  # 1.0 × 1.2, capped
    assert KAFKA_BACKOFF.delay_s(10, 0.0) == pytest.approx(0.8)  # jitter below the max stays


def test_a_backoff_that_cannot_grow_waits_its_max_without_jitter():
    assert Backoff(initial_s=2.0, max_s=1.0).delay_s(5, 0.0) == 1.0


@given(st.integers(min_value=-5, max_value=10_000), st.floats(min_value=0.0, max_value=1.0, exclude_max=True))
def test_every_wait_is_between_80_percent_of_the_first_and_the_max(retries, rand):
    assert 0.08 - 1e-9 <= KAFKA_BACKOFF.delay_s(retries, rand) <= 1.0


def test_the_attempts_within_a_deadline_are_bounded_whatever_the_jitter():
    """However the jitter falls, a write retried for 25 s makes a few dozen attempts, never a busy loop."""
    retries = Retries(unreachable_s=10.0, rand=lambda: 0.0)  # the shortest waits
    now, attempts = 0.0, 1
    while (delay := retries.delay_at(now, RETRIABLE, now)) is not None and now + delay < 25.0:
        now += delay
        attempts += 1
    assert 25 <= attempts <= 35


def test_an_error_retrying_would_not_change_ends_at_once():
    retries = Retries(unreachable_s=4.0, rand=lambda: 0.5)
    assert retries.delay_at(0.0, RETRIABLE, 0.0) == pytest.approx(0.1)
    assert retries.delay_at(0.1, FATAL, 0.1) is None
    assert retries.failures == 2


def test_retriable_answers_are_retried_with_growing_waits():
    retries = Retries(unreachable_s=4.0, rand=lambda: 0.5)
    waits = [retries.delay_at(float(i), RETRIABLE, float(i)) for i in range(6)]
    assert waits == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])


@pytest.mark.parametrize("instants, expected", [
    # (started_at, failed_at) of each attempt without an answer; None: given up after it.
    ([(0.0, 0.01), (0.1, 0.11), (0.3, 0.31), (0.7, 0.71), (1.5, 1.51), (2.5, 2.51), (3.5, 3.51), (4.5, 4.51)],
     [True] * 7 + [False]),  # connections refused: retried for unreachable_s, counted from the first attempt
    ([(0.0, 4.0)], [False]),  # one attempt that hung for unreachable_s: given up
    ([(0.0, 3.9), (4.0, 4.01)], [True, False]),
    ([(10.0, 10.1), (5.0, 5.1), (6.0, 6.1)], [True, True, True]),  # the clock going back: no time passed
])
def test_a_cluster_that_does_not_answer_is_retried_for_unreachable_s_in_a_row(instants, expected):
    retries = Retries(unreachable_s=4.0, rand=lambda: 0.5)
    assert [retries.delay_at(failed_at, UNREACHABLE, started_at) is not None
            for started_at, failed_at in instants] == expected


def test_an_answer_starts_the_unreachable_run_again():
    retries = Retries(unreachable_s=4.0, rand=lambda: 0.5)
    assert retries.delay_at(3.0, UNREACHABLE, 0.0) is not None
    assert retries.delay_at(3.5, RETRIABLE, 3.2) is not None  # the broker answered: it is there
    assert retries.delay_at(7.0, UNREACHABLE, 4.0) is not None  # 3 s without answer since
    assert retries.delay_at(8.1, UNREACHABLE, 8.0) is None  # 4.1 s
