"""Per-entity quota metrics, built from the quota engine's state at scrape time.

Series exist only while their entity does: an expired entity's series vanish with it. Labels
are the entity's user and client id as matched ("" when not part of the entity), as in
Kafka's quota metric tags.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from quotas import QuotaManager
from quotas.producer_ids import ProducerIdQuotaManager

from .stats import counter_by

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


class ProducerIdCollector(Collector):
    """KIP-936's ProducerIds metrics (rate, tokens, throttle-time per user) and the state of each
    user's layered Bloom filter; plus the rate limiters' failure count."""

    def __init__(self, manager: ProducerIdQuotaManager, pid_filter, limiter_filter, clock_ms) -> None:
        self._manager = manager
        self._pid_filter = pid_filter
        self._limiter_filter = limiter_filter
        self._clock_ms = clock_ms

    def collect(self):
        m = self._manager
        user = ["user"]
        families = {
            "rate": GaugeMetricFamily("kqp_producer_ids_rate", "New producer ids per second (KIP-936 ProducerIds rate)", labels=user),
            "quota": GaugeMetricFamily("kqp_producer_ids_quota", "producer_ids_rate in force: new ids per window", labels=user),
            "tokens": GaugeMetricFamily("kqp_producer_ids_tokens", "Tokens left: new producer ids admissible now", labels=user),
            "throttle_ms": GaugeMetricFamily(
                "kqp_producer_ids_throttle_time_ms", "What is left of the user's last producer-id throttle", labels=user
            ),
            "live_layers": GaugeMetricFamily("kqp_producer_ids_live_layers", "Live Bloom filter layers", labels=user),
            "bits_set": GaugeMetricFamily("kqp_producer_ids_filter_bits_set", "Bits set over the live layers", labels=user),
            "bits": GaugeMetricFamily("kqp_producer_ids_filter_bits", "Bits in the live layers", labels=user),
            "estimated_fpr": GaugeMetricFamily(
                "kqp_producer_ids_filter_false_positive_rate",
                "Estimated chance that an unseen producer id is taken for a seen one", labels=user,
            ),
            "memory_bytes": GaugeMetricFamily("kqp_producer_ids_filter_bytes", "Memory of the live layers", labels=user),
        }
        rejected = CounterMetricFamily(
            "kqp_producer_ids_user_rejected", "Produce requests of this user rejected for new producer ids "
            "(since the user's state was created)", labels=user,
        )
        for s in m.user_stats(self._clock_ms()):
            for name, family in families.items():
                family.add_metric([s.user], getattr(s, name))
            rejected.add_metric([s.user], s.rejected)
        yield from families.values()
        yield rejected
        yield GaugeMetricFamily("kqp_producer_ids_tracked_users", "Users with producer-id state", value=m.tracked_users)
        yield CounterMetricFamily("kqp_producer_ids_new", "Producer ids admitted as new", value=m.new_ids_total)
        yield CounterMetricFamily(
            "kqp_producer_ids_rejected", "Produce requests rejected for new producer ids over the quota",
            value=m.rejected_total,
        )
        yield CounterMetricFamily(
            "kqp_producer_ids_delayed", "Produce requests held until the producer-id quota admitted them",
            value=self._pid_filter.delayed_total,
        )
        yield CounterMetricFamily(
            "kqp_producer_ids_users_removed", "Users dropped once no layer of theirs was live",
            value=m.users_removed_total,
        )
        yield counter_by("kqp_rate_limiter_failures", "Rate limiter calls that raised", "limiter",
                         self._limiter_filter.failures)
