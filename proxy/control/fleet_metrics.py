"""``kqp_fleet_*``: what the fleet's usage exchange (proxy.control.fleet) shows on ``/metrics``."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from proxy.control.fleet import FleetExchange
from proxy.control.fleet_owners import OwnersExchange


class FleetCollector:
    """``kqp_fleet_*``: members, how fresh their usage is, fallback, failures, ignored records."""

    def __init__(self, fleet: FleetExchange, clock: Callable[[], int]) -> None:
        self._fleet = fleet
        self._clock = clock

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        f = self._fleet
        now = self._clock()
        yield GaugeMetricFamily("kqp_fleet_members", "Instances sharing usage, this one included",
                                value=f.size())
        lag = GaugeMetricFamily("kqp_fleet_sync_lag_seconds", "Age of the freshest usage read from each member",
                                labels=["member"])
        for member, seen_ms in f.member_ages():
            lag.add_metric([member], max(now - seen_ms, 0) / 1000)
        yield lag
        yield GaugeMetricFamily("kqp_fleet_fallback", "1 while the usage topic is out of reach and the fallback "
                                "is enforced", value=1 if f.fallback else 0)
        yield CounterMetricFamily("kqp_fleet_fallbacks", "Times the fallback started", value=f.fallback_total)
        errors = CounterMetricFamily("kqp_fleet_sync_errors", "Usage topic operations that failed", labels=["op"])
        for op in ("write", "read"):
            errors.add_metric([op], f.errors[op])
        yield errors
        ignored = CounterMetricFamily("kqp_fleet_records_ignored", "Usage topic records ignored, by reason",
                                      labels=["reason"])
        for reason, n in sorted(f.ignored.items()):
            ignored.add_metric([reason], n)
        yield ignored
        yield CounterMetricFamily("kqp_fleet_reports_sent", "Usage reports written", value=f.reports_sent)
        yield CounterMetricFamily("kqp_fleet_entries_sent", "Usage entries written (an entity's usage of an "
                                  "interval each)", value=f.entries_sent)
        sync = CounterMetricFamily("kqp_fleet_sync_bytes", "Usage topic bytes written and read",
                                   labels=["direction"])
        sync.add_metric(["written"], f.bytes_sent)
        sync.add_metric(["read"], f.bytes_read)
        yield sync
        yield CounterMetricFamily("kqp_fleet_remote_entries", "Other members' usage entries applied here",
                                  value=f.remote_applied)
        yield CounterMetricFamily("kqp_fleet_remote_entries_dropped", "Other members' usage entries dropped unread, "
                                  "past fleet.max_remote_entries_per_s", value=f.remote_dropped)
        yield CounterMetricFamily("kqp_fleet_entries_withheld", "Entities' interval usage left out of this "
                                  "instance's reports (under fleet.report_threshold, not shared by the fleet)",
                                  value=f.withheld_total)
        if isinstance(f, OwnersExchange):
            yield GaugeMetricFamily("kqp_fleet_partitions_owned", "Usage topic partitions this instance sums for "
                                    "the fleet (fleet.aggregation: owners)", value=len(f.owned()))
            yield CounterMetricFamily("kqp_fleet_totals_sent", "Totals records written (fleet.aggregation: owners)",
                                      value=f.totals_sent)
            yield CounterMetricFamily("kqp_fleet_totals_dropped", "Totals records dropped unwritten, the totals "
                                      "topic out of reach too long (fleet.aggregation: owners)",
                                      value=f.totals_dropped)
        yield CounterMetricFamily("kqp_fleet_instance_id_conflicts", "Reports from another running instance "
                                  "with this instance's fleet.instance_id", value=f.id_conflicts)
