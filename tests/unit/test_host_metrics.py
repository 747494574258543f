"""The supervisor's one /metrics: N workers' expositions merged (proxy.observability.host_metrics),
fed what the proxy's own collectors and prometheus_client's metrics really write."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, Info, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.control.fleet_metrics import FleetCollector
from proxy.observability.host_metrics import GAUGE_AGGREGATION, merge_expositions
from proxy.observability.quota_metrics import _USER_FAMILIES
from proxy.observability.stats import ProxyStats, StatsCollector

ROOT = Path(__file__).resolve().parents[2]

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def series(text: bytes) -> dict[str, Series]:
    """Family name -> {(sample name, sorted labels): value}, in the order parsed."""
    return {f.name: {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples}
            for f in text_string_to_metric_families(text.decode())}


def worker_stats(requests: int, connections: int, listeners: int, latencies: list[float]) -> bytes:
    stats = ProxyStats()
    stats.requests.add(0, 9, requests)  # Produce v9
    stats.requests.add(3, 12, 1)  # Metadata v12
    stats.bytes_client_to_upstream = 100 * requests
    stats.mutes_total = requests
    stats.open_connections = connections
    stats.broker_listeners = listeners
    for seconds in latencies:
        stats.latency.histogram(0).observe(seconds)
    registry = CollectorRegistry()
    registry.register(StatsCollector(stats))
    return generate_latest(registry)


class _Members:
    def __init__(self, seen_ms: dict[str, int]) -> None:
        self._seen_ms = seen_ms

    def live(self) -> Iterator[tuple[str, int]]:
        yield from self._seen_ms.items()

    def __len__(self) -> int:
        return len(self._seen_ms)


def worker_fleet(fallback: bool, seen_ms: dict[str, int], now_ms: int = 10_000) -> bytes:
    members = _Members(seen_ms)
    fleet = SimpleNamespace(
        size=lambda: len(members) + 1, member_ages=lambda: list(members.live()),
        fallback=fallback, fallback_total=int(fallback), errors={"write": 1, "read": 0},
        ignored={"bad_version": 2}, reports_sent=5, bytes_sent=10, bytes_read=20, remote_applied=3, id_conflicts=0,
        remote_dropped=0, withheld_total=0, entries_sent=0,
    )
    registry = CollectorRegistry()
    registry.register(FleetCollector(fleet, lambda: now_ms))  # type: ignore[arg-type]
    return generate_latest(registry)


def test_counters_are_summed_with_and_without_labels():
    a, b = worker_stats(3, 1, 2, []), worker_stats(4, 1, 2, [])
    merged, one, two = series(merge_expositions([a, b])), series(a), series(b)
    for name in ("kqp_requests", "kqp_bytes", "kqp_mutes"):
        assert merged[name] == {key: one[name][key] + two[name][key] for key in one[name]}
    assert merged["kqp_requests"][("kqp_requests_total", (("api", "Produce"), ("version", "9")))] == 7
    assert merged["kqp_mutes"][("kqp_mutes_total", ())] == 7


def test_a_histogram_sums_its_buckets_count_and_sum():
    a, b = worker_stats(1, 0, 0, [0.0003, 0.03]), worker_stats(1, 0, 0, [0.002])
    merged = series(merge_expositions([a, b]))["kqp_request_latency_seconds"]
    one, two = series(a)["kqp_request_latency_seconds"], series(b)["kqp_request_latency_seconds"]
    assert merged.keys() == one.keys() == two.keys()
    assert merged == {key: one[key] + two[key] for key in one}
    api = (("api", "Produce"),)
    assert merged[("kqp_request_latency_seconds_count", api)] == 3
    assert merged[("kqp_request_latency_seconds_sum", api)] == pytest.approx(0.0323)
    assert merged[("kqp_request_latency_seconds_bucket", (("api", "Produce"), ("le", "+Inf")))] == 3


def test_a_sum_gauge_sums_and_a_max_gauge_takes_the_largest():
    assert GAUGE_AGGREGATION["kqp_open_connections"] == "sum"
    assert GAUGE_AGGREGATION["kqp_broker_listeners"] == "max"
    merged = series(merge_expositions([worker_stats(1, 5, 3, []), worker_stats(1, 7, 2, [])]))
    assert merged["kqp_open_connections"] == {("kqp_open_connections", ()): 12}
    assert merged["kqp_broker_listeners"] == {("kqp_broker_listeners", ()): 3}


def test_fleet_flags_and_lags_show_the_worst_worker():
    a = worker_fleet(False, {"w1": 9_000, "other-host": 8_000})
    b = worker_fleet(True, {"w0": 9_500, "other-host": 4_000})
    merged = series(merge_expositions([a, b]))
    assert merged["kqp_fleet_fallback"] == {("kqp_fleet_fallback", ()): 1}
    assert merged["kqp_fleet_members"] == {("kqp_fleet_members", ()): 3}
    lag = merged["kqp_fleet_sync_lag_seconds"]
    assert lag == {("kqp_fleet_sync_lag_seconds", (("member", "w1"),)): 1.0,
                   ("kqp_fleet_sync_lag_seconds", (("member", "other-host"),)): 6.0,
                   ("kqp_fleet_sync_lag_seconds", (("member", "w0"),)): 0.5}
    assert merged["kqp_fleet_reports_sent"] == {("kqp_fleet_reports_sent_total", ()): 10}  # a counter


def test_a_family_one_worker_has_passes_through_in_first_seen_order():
    a, b = worker_stats(1, 1, 1, []), worker_stats(2, 1, 1, []) + worker_fleet(True, {"w0": 9_000})
    merged = merge_expositions([a, b])
    assert series(merged)["kqp_fleet_fallback"] == series(b)["kqp_fleet_fallback"]
    assert list(series(merged)) == list(series(b))  # a's families, then what b adds, each once
    assert series(merge_expositions([a])) == series(a)


def registry_of(counter_incs: dict[str, float], gauge: float, seconds: float) -> bytes:
    registry = CollectorRegistry()
    counter = Counter("jobs", "Jobs done", ["kind"], registry=registry)
    for kind, n in counter_incs.items():
        counter.labels(kind).inc(n)
    Gauge("queue_depth", "Not in the table: summed", registry=registry).set(gauge)
    Histogram("wait_seconds", "Waits", buckets=(0.1, 1.0), registry=registry).observe(seconds)
    Info("build", "Build", registry=registry).info({"version": "1.2"})
    Enum("phase", "Phase", states=["starting", "serving"], registry=registry).state("serving")
    return generate_latest(registry)


def test_created_is_kept_once_the_earliest_and_the_rest_merges_by_type():
    a, b = registry_of({"x": 1, "y": 2}, 3, 0.05), registry_of({"x": 10}, 4, 0.5)
    merged_text = merge_expositions([a, b])
    merged, one, two = series(merged_text), series(a), series(b)
    assert merged["jobs"] == {("jobs_total", (("kind", "x"),)): 11, ("jobs_total", (("kind", "y"),)): 2}
    created = merged["jobs_created"]
    x = ("jobs_created", (("kind", "x"),))
    assert created[x] == min(one["jobs_created"][x], two["jobs_created"][x])
    assert created[("jobs_created", (("kind", "y"),))] == one["jobs_created"][("jobs_created", (("kind", "y"),))]
    assert merged_text.count(b"# TYPE jobs_created gauge") == 1
    assert merged_text.count(b"# TYPE wait_seconds_created gauge") == 1
    assert merged["wait_seconds_created"][("wait_seconds_created", ())] == min(
        one["wait_seconds_created"][("wait_seconds_created", ())],
        two["wait_seconds_created"][("wait_seconds_created", ())])
    assert merged["queue_depth"] == {("queue_depth", ()): 7}
    assert merged["wait_seconds"][("wait_seconds_count", ())] == 2
    assert merged["wait_seconds"][("wait_seconds_bucket", (("le", "1.0"),))] == 2
    assert merged["wait_seconds"][("wait_seconds_bucket", (("le", "0.1"),))] == 1
    assert merged["build_info"] == {("build_info", (("version", "1.2"),)): 1}  # an Info: not 2
    assert merged["phase"] == {("phase", (("phase", "starting"),)): 0, ("phase", (("phase", "serving"),)): 1}


def test_the_output_parses_back_to_itself_with_help_and_type():
    merged = merge_expositions([worker_stats(3, 1, 2, [0.01]), registry_of({"x": 1}, 1, 0.2),
                                worker_stats(1, 2, 2, [0.2]).decode()])
    assert merge_expositions([merged]) == merged  # str and bytes alike; re-parsed, re-rendered unchanged
    assert b"# HELP kqp_open_connections Open client connections\n# TYPE kqp_open_connections gauge\n" in merged
    assert b"# TYPE kqp_requests_total counter\n" in merged
    assert merge_expositions([merged, merged]) == merge_expositions([merged, merged])  # deterministic


def test_no_input_gives_no_output():
    assert merge_expositions([]) == b""
    assert merge_expositions([b"", ""]) == b""


def test_untyped_keeps_the_first_value_and_a_mistyped_family_is_left_out():
    a = b"# TYPE legacy untyped\nlegacy 5\n# TYPE depth gauge\ndepth 1\n"
    b = b"# TYPE legacy untyped\nlegacy 9\nlegacy{shard=\"1\"} 2\n# TYPE depth counter\ndepth_total 4\n"
    merged = series(merge_expositions([a, b]))
    assert merged["legacy"] == {("legacy", ()): 5, ("legacy", (("shard", "1"),)): 2}
    assert merged["depth"] == {("depth", ()): 1}


def test_a_worker_text_that_does_not_parse_is_named():
    with pytest.raises(ValueError, match="worker 1"):
        merge_expositions([worker_stats(1, 1, 1, []), b"kqp_open_connections{ 1\n"])


# -- every gauge the proxy declares has an aggregation ---------------------------------------

_DECLARED = re.compile(r'\b(?:GaugeMetricFamily|Gauge)\(\s*"(kqp_\w+)"')


def declared_gauges() -> set[str]:
    names = {name for top in ("proxy", "quotas", "config") for path in (ROOT / top).rglob("*.py")
             for name in _DECLARED.findall(path.read_text(encoding="utf-8"))}
    return names | {name for name, _doc in _USER_FAMILIES}  # the per-user gauges, built in a loop


def test_every_gauge_the_proxy_declares_has_an_aggregation():
    declared = declared_gauges()
    assert len(declared) >= 30  # the scan still finds them
    assert sorted(declared - GAUGE_AGGREGATION.keys()) == []


def test_the_table_names_only_gauges_that_exist():
    sources = "".join(path.read_text(encoding="utf-8") for top in ("proxy", "quotas", "config")
                      for path in (ROOT / top).rglob("*.py") if path.name != "host_metrics.py")
    assert sorted(name for name in GAUGE_AGGREGATION if f'"{name}"' not in sources) == []
    assert set(GAUGE_AGGREGATION.values()) <= {"sum", "max", "min"}
