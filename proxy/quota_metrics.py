"""Per-entity quota metrics, built from the quota engine's state at scrape time.

Series exist only while their entity does: an expired entity's series vanish with it. Labels
are the entity's user and client id as matched ("" when not part of the entity), as in
Kafka's quota metric tags.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from quotas import QuotaManager

_LABELS = ["kind", "user", "client_id"]


class QuotaCollector(Collector):
    def __init__(self, manager: QuotaManager, clock_ms) -> None:
        self._manager = manager
        self._clock_ms = clock_ms

    def collect(self):
        m = self._manager
        rate = GaugeMetricFamily("kqp_quota_rate", "Observed rate per second over the quota window", labels=_LABELS)
        bound = GaugeMetricFamily("kqp_quota_bound", "The quota in force (per second)", labels=_LABELS)
        tokens = GaugeMetricFamily(
            "kqp_quota_tokens", "Token-bucket tokens left (negative: debt), KIP-599", labels=_LABELS
        )
        throttle = GaugeMetricFamily(
            "kqp_quota_throttle_time_ms", "What is left of the entity's last throttle", labels=_LABELS
        )
        for s in m.entity_stats(self._clock_ms()):
            labels = [s.kind, s.user, s.client_id]
            rate.add_metric(labels, s.rate)
            bound.add_metric(labels, s.quota)
            throttle.add_metric(labels, s.throttle_ms)
            if s.tokens is not None:
                tokens.add_metric(labels, s.tokens)
        yield from (rate, bound, tokens, throttle)
        throttled = CounterMetricFamily("kqp_quota_throttled", "Requests throttled, by quota kind", labels=["kind"])
        rejected = CounterMetricFamily(
            "kqp_quota_rejected", "Requests (topics) rejected with THROTTLING_QUOTA_EXCEEDED", labels=["kind"]
        )
        for c in m.kind_counters():
            throttled.add_metric([c.kind], c.throttled)
            rejected.add_metric([c.kind], c.rejected)
        yield throttled
        yield rejected
        yield GaugeMetricFamily("kqp_quota_live_entities", "Quota entities holding state", value=m.live_entities)
