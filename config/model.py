"""The proxy's configuration as frozen, typed objects. Nothing downstream sees a raw dict."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from quotas.entities import QuotaRule


@dataclass(frozen=True)
class UpstreamConfig:
    bootstrap_servers: tuple[str, ...]
    connect_timeout_s: float = 10.0
    # Attempts per client connection before it is closed (each tries the next bootstrap server).
    connect_attempts: int = 3
    metadata_refresh_interval_s: float = 30.0


@dataclass(frozen=True)
class ListenConfig:
    host: str = "127.0.0.1"
    advertised_host: str = "127.0.0.1"
    bootstrap_port: int = 9092
    # Node N is served on broker_port_base + N; 0 lets the OS pick a port per node.
    broker_port_base: int = 9100
    node_ports: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}))
    max_frame_bytes: int = 104_857_600


@dataclass(frozen=True)
class MetricsConfig:
    host: str = "127.0.0.1"
    port: int = 9404
    enabled: bool = True


@dataclass(frozen=True)
class QuotaWindows:
    """Kafka's broker settings for quota sampling, with Kafka's defaults."""

    quota_window_num: int = 11
    quota_window_size_seconds: int = 1
    controller_quota_window_num: int = 11
    controller_quota_window_size_seconds: int = 1


@dataclass(frozen=True)
class QuotaEntities:
    # Kafka drops a quota sensor after one hour without use (ClientQuotaManager).
    idle_seconds: float = 3600.0
    max_live: int = 100_000


@dataclass(frozen=True)
class ControllerMutation:
    # Charged for CreateTopics with NumPartitions = -1 when the broker's num.partitions cannot
    # be read with DescribeConfigs.
    num_partitions_fallback: int = 1


@dataclass(frozen=True)
class Config:
    upstream: UpstreamConfig
    listen: ListenConfig = field(default_factory=ListenConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    quota_windows: QuotaWindows = field(default_factory=QuotaWindows)
    quota_entities: QuotaEntities = field(default_factory=QuotaEntities)
    quotas: tuple[QuotaRule, ...] = ()
    controller_mutation: ControllerMutation = field(default_factory=ControllerMutation)
