"""One ``/metrics`` for the host: the Prometheus text expositions (format 0.0.4) of N worker
processes merged into one, as the supervisor serves it (no I/O here: texts in, bytes out).

What the merge guarantees:

- **One family per name**, each with the first worker's HELP and TYPE, in the order families
  were first seen (worker 0's order, then what later workers add); within a family, one sample
  per (sample name, labels), in the order first seen. A family or series some workers lack is
  merged from the workers that have it (one worker's only: passed through as it is).
- **Counters, histograms (every ``_bucket``, ``_count``, ``_sum``) and summaries are summed**:
  each worker counted its own requests, so the host's count is their sum. The text parser strips
  ``_total`` from a counter family's name; the samples keep it, and so does the output.
- **``_created``** (prometheus_client writes it as a gauge family of its own after a Counter,
  Histogram or Summary): the earliest worker's, ``min``, never a sum of timestamps.
- **Gauges** by :data:`GAUGE_AGGREGATION`: ``sum`` for what each worker holds its own share of
  (connections, bytes, entities it tracks); ``max``/``min`` for what every worker already shows
  host-wide (workers add their siblings' quota usage to their own windows, so per-entity rates,
  throttles and bounds are the host's in each) and for flags and ages, where the worst worker is
  what an operator must see. A gauge not in the table is **summed**: the one kind of gauge that
  is right to sum can't be told apart from the rest by its name, while a forgotten host-wide gauge
  shows up as N times too large, which an operator notices. The unit test holds every ``kqp_``
  gauge the code declares to an entry, so a new gauge needs a decision. Two shapes keep their
  meaning without an entry: a ``*_info`` gauge (prometheus_client's Info) and a state set (Enum:
  a label named after the family) are ``max``, 1 where any worker says 1.
- **Untyped** families: the first worker's value of each series (a value of undeclared meaning
  is neither summed nor ordered).
- A family whose TYPE differs from the first worker's (a mixed-version host) is left out for that
  worker; timestamps are dropped (prometheus_client writes none).
- The output is :func:`prometheus_client.generate_latest`'s, which
  ``text_string_to_metric_families`` parses back into the same families.

Assumes the workers run one build: same histogram buckets, same label sets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

Aggregation = Literal["sum", "max", "min", "first"]

GAUGE_AGGREGATION: Final[Mapping[str, Aggregation]] = {
    # Each worker's own share of the host (connections it accepted, bytes it holds, the entities
    # and keys it tracks, its own memory pool and Bloom filters): the host holds the sum.
    "kqp_open_connections": "sum",  # observability/stats.py
    "kqp_muted_connections": "sum",
    "kqp_memory_held_bytes": "sum",  # dataplane/guard.py
    "kqp_memory_budget_bytes": "sum",  # one pool per worker: the host's budget is all of them
    "kqp_memory_paused_connections": "sum",
    "kqp_connection_quota_ips": "sum",
    # The supervisor's own (no worker reports them): passed through.
    "kqp_workers": "max",
    "kqp_workers_running": "max",
    "kqp_quota_live_entities": "sum",  # observability/quota_metrics.py
    "kqp_quota_folded_entities": "sum",
    "kqp_quota_local_rate": "sum",  # this worker's part of kqp_quota_rate: the host's part is the sum
    "kqp_producer_ids_tracked_users": "sum",
    "kqp_producer_ids_folded_users": "sum",
    "kqp_producer_ids_live_layers": "sum",  # each worker's Bloom filter stays its own (fleet.py)
    "kqp_producer_ids_filter_bits_set": "sum",
    "kqp_producer_ids_filter_bits": "sum",
    "kqp_producer_ids_filter_bytes": "sum",
    "kqp_usage_log_keys": "sum",  # observability/usage_log.py: one aggregator and queue per worker
    "kqp_usage_log_pending_intervals": "sum",
    # Per-entity quota state: usage is shared, so each worker's value is already the host's; the
    # worker that has seen the most of it (highest rate and throttle, lowest tokens: most debt)
    # is the freshest view. Bounds are configuration: the same in every worker.
    "kqp_quota_rate": "max",
    "kqp_quota_bound": "max",
    "kqp_quota_throttle_time_ms": "max",
    "kqp_quota_tokens": "min",
    "kqp_producer_ids_rate": "max",
    "kqp_producer_ids_quota": "max",
    "kqp_producer_ids_throttle_time_ms": "max",
    "kqp_producer_ids_tokens": "min",
    "kqp_producer_ids_filter_false_positive_rate": "max",  # the worst filter (as its (other) row)
    # Fleet membership and fallback (control/fleet.py): every worker sees the same fleet; a flag
    # is 1 on the host while any worker is in fallback, and a lag is the stalest worker's.
    "kqp_fleet_members": "max",
    "kqp_fleet_sync_lag_seconds": "max",
    "kqp_fleet_fallback": "max",
    "kqp_fleet_partitions_owned": "sum",  # each worker is a member of its own: the host owns them all
    # The quota store each worker follows (control/quota_store_metrics.py): the worker furthest
    # behind; the host is loaded once every worker is.
    "kqp_quota_store_last_applied_offset": "min",
    "kqp_quota_store_lag_records": "max",
    "kqp_quota_store_loaded": "min",
    # Copies of one cluster's shape in every worker (cluster/leaders.py, the per-broker
    # listeners behind the shared ports): the count of one copy, a sum would grow with N.
    "kqp_broker_listeners": "max",
    "kqp_metadata_cache_partitions": "max",
    # Ages and durations: the stalest cache, the slowest write (a -1 "never" shows only when
    # no worker has a value).
    "kqp_metadata_cache_age_seconds": "max",
    "kqp_usage_log_last_write_seconds": "max",
}

_SUMMED_TYPES = frozenset({"counter", "histogram", "summary", "gaugehistogram"})
_CREATED = "_created"

_LabelKey = tuple[tuple[str, str], ...]
_SampleKey = tuple[str, _LabelKey]

_COMBINE: Final[Mapping[Aggregation, Callable[[float, float], float]]] = {
    "sum": lambda a, b: a + b,
    "max": max,
    "min": min,
    "first": lambda a, _b: a,
}


@dataclass
class _Family:
    """A family being merged: the first worker's name, HELP and TYPE, and each series' values."""

    name: str
    documentation: str
    type: str
    labels: dict[_SampleKey, dict[str, str]] = field(default_factory=dict)
    values: dict[_SampleKey, list[float]] = field(default_factory=dict)

    def add(self, family: Metric) -> None:
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            if key not in self.values:
                self.labels[key] = dict(sample.labels)
                self.values[key] = []
            self.values[key].append(float(sample.value))


def merge_expositions(texts: Sequence[bytes | str]) -> bytes:
    """The workers' ``texts`` (Prometheus text format, one per worker, in worker order) merged
    into one exposition, as the module docstring says. No text, or only empty ones: ``b""``.

    Raises ValueError naming the worker (its index in ``texts``) whose text does not parse."""
    families: dict[str, _Family] = {}
    for index, text in enumerate(texts):
        decoded = text.decode("utf-8") if isinstance(text, bytes) else text
        try:
            parsed = list(text_string_to_metric_families(decoded))
        except ValueError as e:
            raise ValueError(f"worker {index}: the metrics text does not parse: {e}") from e
        for family in parsed:
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = _Family(family.name, family.documentation, family.type)
            elif merged.type != family.type:
                continue  # one name, two types: keep the first worker's meaning
            merged.add(family)
    if not families:
        return b""
    return generate_latest(_Collected(_render(f, _aggregation(f, families)) for f in families.values()))


def _aggregation(family: _Family, families: Mapping[str, _Family]) -> Aggregation:
    """How the values of ``family``'s series across workers become one."""
    if family.type in _SUMMED_TYPES:
        return "sum"
    if family.type != "gauge":
        return "first"  # untyped (the 0.0.4 parser yields no info or stateset types)
    if family.name in GAUGE_AGGREGATION:
        return GAUGE_AGGREGATION[family.name]
    base = families.get(family.name.removesuffix(_CREATED))
    if family.name.endswith(_CREATED) and base is not None and base.type in _SUMMED_TYPES:
        return "min"  # a Counter's, Histogram's or Summary's creation time: the earliest worker's
    if family.name.endswith("_info") or _is_state_set(family):
        return "max"
    return "sum"


def _is_state_set(family: _Family) -> bool:
    """An Enum as prometheus_client writes it in 0.0.4: a gauge, every series labelled with the
    family's own name (``name{name="state"} 1``)."""
    return bool(family.labels) and all(family.name in labels for labels in family.labels.values())


def _render(family: _Family, aggregation: Aggregation) -> Metric:
    combine = _COMBINE[aggregation]
    metric = Metric(family.name, family.documentation, family.type)
    for key, values in family.values.items():
        value = values[0]
        for other in values[1:]:
            value = combine(value, other)
        metric.add_sample(key[0], family.labels[key], value)
    return metric


class _Collected:
    """Metric families already built, as ``generate_latest`` takes them (its Collector)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> list[Metric]:
        return self._families
