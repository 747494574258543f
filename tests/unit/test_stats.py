"""The proxy's counters: what the hot paths increment is what /metrics reports."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from protocol.apis import SPECS
from proxy.observability.stats import (
    LATENCY_BUCKETS_S,
    SLOT_KEYS,
    SLOT_VERSIONS,
    LatencyByApi,
    LatencyHistogram,
    ProxyStats,
    StatsCollector,
    VersionCounts,
)


def test_every_api_the_proxy_knows_has_count_slots():
    # The request hot path counts a known API's request in its slot without a range check.
    assert max(SPECS) < SLOT_KEYS
    assert min(SPECS) >= 0


def test_version_counts_read_as_a_mapping_of_the_pairs_counted():
    counts = VersionCounts()
    counts.slots[3 * SLOT_VERSIONS + 12] += 2  # as the hot path counts Metadata v12
    counts.add(3, 12)
    counts.add(0, SLOT_VERSIONS)  # past the slots
    counts.add(-1, 0)  # never wraps into a slot from the end
    counts.add(SLOT_KEYS, 0)
    counts.add(7, -1)
    assert dict(counts) == {(3, 12): 3, (0, SLOT_VERSIONS): 1, (-1, 0): 1, (SLOT_KEYS, 0): 1, (7, -1): 1}
    assert sum(counts.slots) == 3
    assert (3, 11) not in counts and len(counts) == 5


def test_latency_buckets_count_observations_at_or_below_their_bound():
    h = LatencyHistogram()
    for seconds in (0.0001, LATENCY_BUCKETS_S[0], 0.00051, 0.001, 0.0011, 99.0):
        h.observe(seconds)
    assert h.counts[0] == 2  # 0.1 ms and exactly 0.5 ms
    assert h.counts[1] == 2  # above 0.5 ms up to 1 ms
    assert h.counts[2] == 1
    assert h.counts[-1] == 1  # +Inf
    assert h.count == 6 and abs(h.sum_s - 99.00321) < 1e-9


def test_latency_by_api_lists_only_apis_observed():
    latency = LatencyByApi()
    latency.slots[18].observe(0.0002)
    latency.histogram(1000).observe(0.002)
    assert sorted(latency) == [18, 1000]
    assert latency[1000].count == 1 and 0 not in latency


def test_the_collector_reports_slots_and_the_rest_alike():
    stats = ProxyStats()
    stats.requests.slots[18 * SLOT_VERSIONS + 3] += 2
    stats.requests.add(200, 1)
    stats.responses.add(18, 3, 2)
    stats.latency.slots[18].observe(0.0003)
    stats.latency.slots[18].observe(0.03)
    registry = CollectorRegistry()
    registry.register(StatsCollector(stats))
    text = generate_latest(registry).decode()
    assert 'kqp_requests_total{api="ApiVersions",version="3"} 2.0' in text
    assert 'version="1"} 1.0' in text and "kqp_requests_total" in text
    assert 'kqp_responses_total{api="ApiVersions",version="3"} 2.0' in text
    assert 'kqp_request_latency_seconds_bucket{api="ApiVersions",le="0.0005"} 1.0' in text
    assert 'kqp_request_latency_seconds_bucket{api="ApiVersions",le="0.05"} 2.0' in text
    assert 'kqp_request_latency_seconds_count{api="ApiVersions"} 2.0' in text
    assert text.count("kqp_request_latency_seconds_count") == 1  # no series for APIs never seen
