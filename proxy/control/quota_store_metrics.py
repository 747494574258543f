"""``kqp_quota_store_*``: what a scrape reads of the quota store kept in a topic."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from proxy.control.quota_topic_store import TopicStore


class QuotaStoreCollector:
    """``kqp_quota_store_*``: where the follower is, and what failed."""

    def __init__(self, store: TopicStore) -> None:
        self._store = store

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._store
        yield GaugeMetricFamily("kqp_quota_store_last_applied_offset",
                                "Offset of the last quota topic record read (-1: none)", value=s.last_applied_offset)
        yield GaugeMetricFamily("kqp_quota_store_lag_records",
                                "Quota topic records not read yet (high watermark - next offset)",
                                value=max(s.high_watermark - s.next_offset, 0))
        yield GaugeMetricFamily("kqp_quota_store_loaded", "1 once the quota topic was read to its end at start",
                                value=1 if s.loaded.is_set() else 0)
        yield CounterMetricFamily("kqp_quota_store_topic_lost", "Times the quota topic was found deleted or "
                                  "replaced (then recreated, and the quotas in force written back)",
                                  value=s.topic_lost)
        yield CounterMetricFamily("kqp_quota_store_write_retries", "Quota topic write attempts that failed and were "
                                  "tried again (Kafka's record-retry-total)", value=s.write_retries)
        errors = CounterMetricFamily("kqp_quota_store_errors", "Quota topic operations that failed", labels=["op"])
        for op in ("create", "read", "write"):
            errors.add_metric([op], s.errors[op])
        yield errors
        bad = CounterMetricFamily("kqp_quota_store_bad_records", "Quota topic records ignored (unreadable)",
                                  labels=["reason"])
        for reason, n in sorted(s.bad_records.items()):
            bad.add_metric([reason], n)
        yield bad
