"""The quota engines a configuration describes, built the same way for the proxy and for the
pipeline's what-if replay (so a replay decides exactly as the proxy would)."""

from __future__ import annotations

from quotas import QuotaManager
from quotas.producer_ids import ProducerIdQuotaManager

from .model import Config


def quota_manager_for(config: Config) -> QuotaManager:
    w = config.quota_windows
    return QuotaManager(
        config.quotas,
        quota_window_num=w.quota_window_num,
        quota_window_size_s=w.quota_window_size_seconds,
        controller_quota_window_num=w.controller_quota_window_num,
        controller_quota_window_size_s=w.controller_quota_window_size_seconds,
        idle_ms=int(config.quota_entities.idle_seconds * 1000),
        max_entities=config.quota_entities.max_live,
    )


def producer_id_manager_for(config: Config) -> ProducerIdQuotaManager:
    return ProducerIdQuotaManager(config.quotas, config.producer_id_quota.settings())
