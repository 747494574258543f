"""The quota engines a configuration describes, built the same way for the proxy and for the
pipeline's what-if replay (so a replay decides exactly as the proxy would)."""

from __future__ import annotations

from quotas import QuotaManager
from quotas.connections import ConnectionLimits
from quotas.entities import EntityResolver
from quotas.producer_ids import ProducerIdQuotaManager

from .model import Config, ConnectionsConfig, QuotaWindows


def quota_manager_for(config: Config, resolver: EntityResolver | None = None) -> QuotaManager:
    """``resolver``: ``config.quotas`` already indexed (the replay builds engines per user)."""
    w = config.quota_windows
    return QuotaManager(
        resolver or config.quotas,
        quota_window_num=w.quota_window_num,
        quota_window_size_s=w.quota_window_size_seconds,
        controller_quota_window_num=w.controller_quota_window_num,
        controller_quota_window_size_s=w.controller_quota_window_size_seconds,
        idle_ms=int(config.quota_entities.idle_seconds * 1000),
        max_entities=config.quota_entities.max_live,
    )


def producer_id_manager_for(config: Config, resolver: EntityResolver | None = None) -> ProducerIdQuotaManager:
    return ProducerIdQuotaManager(resolver or config.quotas, config.producer_id_quota.settings())


def connection_limits_for(c: ConnectionsConfig, w: QuotaWindows) -> ConnectionLimits:
    """``connections:``'s counts and creation rates, rated over the quota windows (as Kafka's
    ConnectionQuotas rates them over quota.window.num x quota.window.size.seconds)."""
    return ConnectionLimits(
        max_connections=c.max_connections,
        max_connections_per_ip=c.max_connections_per_ip,
        max_connections_per_ip_overrides=dict(c.max_connections_per_ip_overrides),
        max_connection_creation_rate=c.max_connection_creation_rate,
        connection_creation_rate=c.connection_creation_rate,
        connection_creation_rate_overrides=dict(c.connection_creation_rate_overrides),
        window_num=w.quota_window_num,
        window_size_ms=w.quota_window_size_seconds * 1000,
    )
