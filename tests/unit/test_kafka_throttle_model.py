"""The reference model of Kafka's produce byte quota (tests/support/kafka_throttle_model.py).

First against Kafka's own tests (RateTest, SampledStatTest, ClientQuotaManagerTest, whose
numbers are copied here), then against the figures the greedy-client issue gives for what
Kafka lets an obedient greedy client send at 1 MiB/s with the default 11 × 1 s windows.

What the model gives for one connection, 30 s, service 0.5-10 ms (any of them: the same to
within 0.003 × and 0.1 MB):

=================  ============  ===============  ==================
request bytes      0-30 s        10-30 s          largest 2 s burst
=================  ============  ===============  ==================
100 000            1.13-1.14 ×   1.11 ×           11.6-11.7 MB
262 144            1.17 ×        1.13 ×           11.8 MB
500 000            1.24 ×        1.17 ×           12.5 MB
1 000 000          1.27 ×        1.19 ×           13.0 MB
=================  ============  ===============  ==================

The issue says 1.13-1.27 ×, 1.16-1.20 × and 11.6-12.0 MB. The first column agrees at both
ends. The other two agree at 1 MB (10-30 s) and at 100 KB-300 KB (burst) only: with Kafka's
code as it is, a greedy connection of 100 KB requests gets 1.11 × from 10 s to 30 s (its
second burst comes at ~12 s, the third at ~23-24 s, ~0.1 MB/s between), and one of 1 MB
requests gets 13.0 MB in its first 2 s: eleven requests before the first throttle (10 MB is
under 10 s × 1 MiB/s), the twelfth 461 ms later and the thirteenth 950 ms after that
(record-then-check admits each request the mute lets in). The pre-3.8 sample arithmetic
(``samples`` slots, purged by start) gives the same figures on this load. The tests below
hold the model to its own figures, which are the issue's with those two ranges widened.
"""

from __future__ import annotations

import pytest

from tests.support.kafka_throttle_model import KafkaRate, bytes_between, greedy_producers, largest_burst

MIB = 1024 * 1024
QUOTA = MIB  # producer_byte_rate, bytes/s
RUN_S = 30.0
SIZES = (100_000, 256 * 1024, 500_000, 1_000_000)


# -- Kafka's Rate, against Kafka's own tests ---------------------------------------------------


@pytest.mark.parametrize(("samples", "window_s"), [(1, 1), (1, 11), (11, 1), (11, 11)])
def test_rate_with_no_prior_samples_assumes_samples_minus_one_empty_windows(samples, window_s):
    # RateTest.testRateWithNoPriorAvailableSamples
    rate = KafkaRate(samples, window_s * 1000)
    rate.record(50.0, 0)
    now_ms = window_s * 1000 - 1
    assert rate.measure(now_ms) == pytest.approx(50.0 / (now_ms / 1000 + (samples - 1) * window_s))


def test_rate_is_consistent_after_the_first_window():
    # RateTest.testRateIsConsistentAfterTheFirstWindow: events every ~100 ms, 2 × 1 s samples.
    rate = KafkaRate(2, 1000)
    steps = [0, 99] + [100] * 9
    now = 0
    for step in steps:
        now += step
        rate.record(1, now)
    now += 101
    for step in steps:
        now += step
        rate.record(1, now)
        assert 10 <= rate.measure(now) <= 11


def _complete_sample(rate: KafkaRate, now: int) -> int:
    rate.record(1, now)
    now += rate.window_ms - 1
    rate.record(1, now)
    return now + 1


def test_sample_is_purged_only_when_it_no_longer_overlaps_the_window():
    # SampledStatTest: a sample whose last event is samples × window old is purged, not before.
    rate = KafkaRate(2, 1000)
    now = _complete_sample(rate, 0)
    assert rate.measure(now + 1500) > 0
    rate = KafkaRate(2, 1000)
    now = _complete_sample(rate, 0)
    assert rate.measure(now + 2500) == 0
    # ... and samples + 1 of them are kept (the extra one overlapping the window's start).
    rate = KafkaRate(2, 1000)
    now = _complete_sample(rate, 0)
    now = _complete_sample(rate, now + 100)
    rate.record(1, now + 100)
    assert len([s for s in rate._samples if s.value]) == 3


def test_throttle_time_as_client_quota_manager_test_computes_it():
    # ClientQuotaManagerTest.testQuotaViolation: 500 B/s, 10 × 400 B one second apart, then
    # 2300 B at 10.5 s: 6300 B / 10.5 s = 600 B/s; (600 − 500) / 500 × 10.5 s = 2100 ms.
    rate = KafkaRate(11, 1000)
    for i in range(10):
        assert rate.record_and_throttle_ms(400, 500, i * 1000) == 0
    assert rate.record_and_throttle_ms(2300, 500, 10_500) == 2100
    now = 10_500 + 2100
    for _ in range(10):
        rate.record_and_throttle_ms(400, 500, now)
        now += 1000
    assert rate.record_and_throttle_ms(0, 500, now) == 0  # the bursty sample has rolled over


def test_window_is_at_least_samples_minus_one_windows_and_grows_to_the_oldest_sample():
    rate = KafkaRate(11, 1000)
    rate.record(1, 0)
    assert rate.window_size_ms(0) == 10_000
    assert rate.window_size_ms(500) == 10_500
    assert rate.window_size_ms(1000) == 10_000  # one full window: 1 s + 9 assumed
    assert rate.window_size_ms(10_700) == 10_700
    # 11 s after its only event the sample is purged (reset to start now): 10 assumed windows again.
    assert rate.window_size_ms(11_000) == 10_000
    assert rate.measure(11_000) == 0


# -- the greedy connection ---------------------------------------------------------------------


def test_first_burst_is_every_request_until_one_is_throttled_then_one_per_mute():
    run = greedy_producers(quota_bytes_per_s=QUOTA, request_bytes=1_000_000, service_s=0.003, run_s=2.0)
    # 10 MB over the assumed 10 s (+ 27 ms) is under 1 MiB/s; the 11th request, 30 ms after the
    # first, makes it 11 MB / 10.030 s, throttled for (observed − quota) / quota × 10 030 ms.
    assert run.throttles_ms[:10] == [0] * 10
    assert run.throttles_ms[10] == round((11e6 / 10.030 - QUOTA) / QUOTA * 10_030)
    # The next request is read when the mute ends, and is admitted whatever it costs.
    assert run.admitted[11][0] == pytest.approx(0.033 + run.throttles_ms[10] / 1000 + 0.003)
    assert len(run.admitted) == 13


@pytest.mark.parametrize("request_bytes", SIZES)
def test_one_greedy_connection_matches_the_issues_kafka_figures(request_bytes):
    run = greedy_producers(quota_bytes_per_s=QUOTA, request_bytes=request_bytes, service_s=0.002, run_s=RUN_S)
    total = run.bytes_between(0, RUN_S) / RUN_S / QUOTA
    late = run.bytes_between(10, RUN_S) / (RUN_S - 10) / QUOTA
    burst_mb = run.largest_burst(2.0) / 1e6
    print(f"\n{request_bytes} B: {total:.3f} × over 30 s, {late:.3f} × from 10 s, burst {burst_mb:.2f} MB")
    assert 1.125 <= total <= 1.275  # the issue: 1.13-1.27
    assert 1.10 <= late <= 1.20  # the issue: 1.16-1.20 (see the module docstring)
    assert 11.55 <= burst_mb <= 13.05  # the issue: 11.6-12.0 (see the module docstring)


@pytest.mark.parametrize("request_bytes", (256 * 1024, 1_000_000))
def test_service_time_barely_matters_for_requests_of_256_kib_and_more(request_bytes):
    runs = [greedy_producers(quota_bytes_per_s=QUOTA, request_bytes=request_bytes, service_s=s, run_s=RUN_S)
            for s in (0.0005, 0.002, 0.010)]
    totals = [r.bytes_between(0, RUN_S) for r in runs]
    bursts = [r.largest_burst() for r in runs]
    assert max(totals) - min(totals) <= 0.01 * max(totals)
    assert max(bursts) - min(bursts) <= request_bytes


def test_more_connections_of_one_client_id_get_one_more_request_each_per_mute():
    one = greedy_producers(quota_bytes_per_s=QUOTA, request_bytes=256 * 1024, connections=1, run_s=RUN_S)
    four = greedy_producers(quota_bytes_per_s=QUOTA, request_bytes=256 * 1024, connections=4, run_s=RUN_S)
    assert one.largest_burst() < four.largest_burst() <= one.largest_burst() + 8 * 256 * 1024
    assert one.bytes_between(0, RUN_S) < four.bytes_between(0, RUN_S) <= 1.2 * one.bytes_between(0, RUN_S)


@pytest.mark.parametrize("request_bytes", SIZES)
@pytest.mark.parametrize("connections", (1, 4))
def test_admitted_never_exceeds_the_windows_allowance_plus_one_request_per_mute(request_bytes, connections):
    """In any stretch of ``d`` seconds Kafka admits at most 11 s of quota plus what the mutes
    let in: one request per connection per throttled round, and rounds are ≥ 1 ms apart."""
    run = greedy_producers(quota_bytes_per_s=QUOTA, request_bytes=request_bytes, connections=connections,
                           run_s=RUN_S)
    assert bytes_between(run.admitted, 0, RUN_S) <= (RUN_S + 11) * QUOTA + 16 * connections * request_bytes
    assert largest_burst(run.admitted, 2.0) <= 13 * QUOTA + 4 * connections * request_bytes


def test_bursts_are_counted_over_any_window_not_whole_seconds():
    events = [(0.9, 5), (1.1, 7), (2.95, 11), (3.5, 1)]
    assert largest_burst(events, 2.0) == 18  # [1.1, 3.1)
    assert bytes_between(events, 1.0, 3.0) == 18
    assert largest_burst([], 2.0) == 0


def test_requests_of_several_sizes_are_taken_in_order_and_the_last_repeats():
    run = greedy_producers(quota_bytes_per_s=QUOTA, request_bytes=[100_000, 1_000_000], run_s=2.0)
    assert [n for _, n in run.admitted] == [100_000] + [1_000_000] * (len(run.admitted) - 1)
    # 100 KB and ten 1 MB requests are under 10 s of quota: one request more than 1 MB ones alone.
    assert run.throttles_ms[:11] == [0] * 11 and run.throttles_ms[11] > 0


def test_a_bad_load_is_refused():
    with pytest.raises(ValueError):
        greedy_producers(quota_bytes_per_s=QUOTA, request_bytes=0)
    with pytest.raises(ValueError):
        greedy_producers(quota_bytes_per_s=QUOTA, request_bytes=1, connections=0)
    with pytest.raises(ValueError):
        greedy_producers(quota_bytes_per_s=QUOTA, request_bytes=[])
