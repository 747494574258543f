"""The proxy's configuration as frozen, typed objects. Nothing downstream sees a raw dict."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from quotas.common import RECORD_KINDS
from quotas.entities import QuotaRule
from quotas.limiters import BUILT_IN, BatchRateLimiter, RateLimiter, RecordRateLimiter
from quotas.producer_ids import ProducerIdSettings


@dataclass(frozen=True)
class UpstreamTlsConfig:
    """TLS to the brokers (Kafka's client ssl.* settings, in PEM)."""

    ca: str | None = None  # PEM bundle the brokers' certificates chain to; None: the system's
    # Kafka's ssl.endpoint.identification.algorithm=https: the certificate must name the host
    # the proxy connects to (a bootstrap server or the host a broker advertises).
    verify_hostname: bool = True
    certificate: str | None = None  # a client certificate chain for mTLS to the brokers
    key: str | None = None
    key_password_file: str | None = None
    key_password_env: str | None = None


SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER")


@dataclass(frozen=True)
class UpstreamSaslConfig:
    """How the proxy's own connections (metadata refresh, topic lookups) authenticate. Secrets
    come from files or environment variables only, read at each connection (a rotated password
    or a refreshed token is picked up)."""

    mechanism: str  # one of SASL_MECHANISMS
    username: str | None = None  # PLAIN and SCRAM
    password_file: str | None = None
    password_env: str | None = None
    token_file: str | None = None  # OAUTHBEARER: a file holding the bearer token (a JWT)
    token_env: str | None = None


@dataclass(frozen=True)
class UpstreamConfig:
    bootstrap_servers: tuple[str, ...]
    connect_timeout_s: float = 10.0
    # Attempts per client connection before it is closed (each tries the next bootstrap server).
    connect_attempts: int = 3
    metadata_refresh_interval_s: float = 30.0
    tls: UpstreamTlsConfig | None = None  # None: plaintext to the brokers
    sasl: UpstreamSaslConfig | None = None  # None: the proxy's own connections do not authenticate


@dataclass(frozen=True)
class ListenTlsConfig:
    """TLS termination on the client listeners (Kafka's ssl.* listener settings, in PEM)."""

    certificate: str  # the certificate chain, PEM, leaf first
    key: str  # its private key, PEM
    # The key's password, from a file or an environment variable; never inline in the YAML.
    key_password_file: str | None = None
    key_password_env: str | None = None
    client_auth: str = "none"  # Kafka's ssl.client.auth: none | requested | required
    ca: str | None = None  # PEM bundle of the CAs client certificates must chain to
    handshake_timeout_ms: int = 10_000
    # Kafka's ssl.principal.mapping.rules: a client certificate's DN to a principal name.
    principal_mapping_rules: str = "DEFAULT"


@dataclass(frozen=True)
class ListenConfig:
    host: str = "127.0.0.1"
    advertised_host: str = "127.0.0.1"
    bootstrap_port: int = 9092
    # Node N is served on broker_port_base + N; 0 lets the OS pick a port per node.
    broker_port_base: int = 9100
    node_ports: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}))
    max_frame_bytes: int = 104_857_600
    tls: ListenTlsConfig | None = None  # None: plaintext listeners


@dataclass(frozen=True)
class ConnectionsConfig:
    """What one client connection, one IP and all clients together may hold, under Kafka's
    broker setting names (dots as underscores) where Kafka has one. None: no limit."""

    # Kafka's connections.max.idle.ms: nothing read, written or awaited for this long closes it.
    connections_max_idle_ms: int = 600_000
    # A frame started and not finished this long after its first byte closes the connection
    # (time with reading paused by the proxy itself does not count).
    partial_request_timeout_ms: int = 30_000
    # Kafka's max.connections (Kafka: unlimited); client connections on all listeners.
    max_connections: int | None = 10_000
    # Kafka's max.connections.per.ip and max.connections.per.ip.overrides.
    max_connections_per_ip: int | None = None
    max_connections_per_ip_overrides: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    # Kafka's max.connection.creation.rate (all listeners): a connection over it is accepted later.
    max_connection_creation_rate: float | None = None
    # Kafka's per-IP connection_creation_rate quota (KIP-612), default and per IP: a connection
    # over it is closed after the throttle time (ConnectionQuotas).
    connection_creation_rate: float | None = None
    connection_creation_rate_overrides: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    # Kafka's queued.max.request.bytes: bytes held by all connections in partial frames and
    # requests waiting their turn; over it, the connections holding the most stop being read.
    queued_max_request_bytes: int = 104_857_600


@dataclass(frozen=True)
class MetricsConfig:
    host: str = "127.0.0.1"
    port: int = 9404
    enabled: bool = True
    # Per-entity series at most, per metric family: the most throttled and most active
    # entities first, the rest summed into one "(other)" series.
    max_entity_series: int = 1000


@dataclass(frozen=True)
class ReloadConfig:
    """When a change to the configuration file is applied."""

    # The file must be unchanged for this long before it is read (a write in progress is not).
    debounce_ms: int = 500
    # Only a file replaced by a rename (a new inode) is reloaded; changes written in place are
    # logged and ignored until SIGHUP.
    require_atomic_rename: bool = False


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
class LeaderDiscovery:
    """KIP-951 through the proxy."""

    # Fill CurrentLeader + NodeEndpoints from the leader cache when the broker sent none.
    fill_hints: bool = True
    # Offer Produce v10 / Fetch v16 to clients of brokers that stop at Produce v9 / Fetch v15.
    uplift: bool = True
    # At most one expedited metadata refresh per this interval (topics asked for meanwhile wait).
    expedited_refresh_min_interval_ms: int = 50
    # A failed partition with no hint to give waits up to this long for the expedited refresh
    # it started, so even the first failure after a move can carry the new leader (0: no wait).
    hint_wait_ms: int = 100


@dataclass(frozen=True)
class ProducerIdQuota:
    """KIP-936's broker settings under their Kafka names (dots as underscores), and what the
    proxy does with a request that brings a producer id over the quota."""

    producer_id_quota_window_size_seconds: float = 3600.0
    producer_id_quota_window_num: int = 11
    producer_id_quota_cache_layer_count: int = 4
    producer_id_quota_false_positive_rate: float = 0.001
    producer_id_quota_cache_cleanup_interval_ms: int = 10
    # reject: THROTTLING_QUOTA_EXCEEDED on every partition, throttle time, mute (KIP-219);
    # delay: hold the request until the quota admits it.
    reaction: str = "reject"

    def settings(self) -> ProducerIdSettings:
        return ProducerIdSettings(
            window_size_s=self.producer_id_quota_window_size_seconds,
            window_num=self.producer_id_quota_window_num,
            layer_count=self.producer_id_quota_cache_layer_count,
            false_positive_rate=self.producer_id_quota_false_positive_rate,
            cleanup_interval_ms=self.producer_id_quota_cache_cleanup_interval_ms,
        )


@dataclass(frozen=True)
class RateLimiterSpec:
    """One entry of ``rate_limiters``: the class (already imported) and its own settings."""

    target: str  # package.module:ClassName
    cls: type[RateLimiter]
    settings: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


DEFAULT_RATE_LIMITERS = (
    RateLimiterSpec(BUILT_IN[0], RecordRateLimiter),
    RateLimiterSpec(BUILT_IN[1], BatchRateLimiter),
)


@dataclass(frozen=True)
class FilterPlugin:
    """One entry of ``filters``: a filter factory (already imported, and tried on ``settings``
    when the file was read) and its own settings. The proxy calls ``factory(settings)`` when it
    builds its filter chain; what comes back is a filter (proxy.dataplane.filters.api). Two
    entries are equal when the file says the same (``target`` and ``settings``)."""

    target: str  # package.module:Factory
    factory: Callable[[Mapping[str, Any]], object] = field(compare=False)
    settings: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


def unenforced_kinds(limiters: tuple[RateLimiterSpec, ...]) -> frozenset[str]:
    """The record and batch quota kinds that none of ``limiters`` enforces: a quota of one of
    them would silently do nothing."""
    enforced: frozenset[str] = frozenset().union(*(s.cls.kinds for s in limiters))
    return RECORD_KINDS - enforced


@dataclass(frozen=True)
class UsageLogConfig:
    """Where and how often the proxy writes its usage log (off while ``directory`` is None)."""

    directory: str | None = None
    interval_seconds: int = 10
    max_keys_per_interval: int = 10_000
    # Walk Fetch responses' batch headers to count the records delivered (costs consume throughput).
    count_fetch_records: bool = True
    proxy_name: str = ""  # "": this host's name
    max_pending_intervals: int = 60

    @property
    def enabled(self) -> bool:
        return self.directory is not None


QUOTA_ADMIN_DESCRIBE = ("anyone", "admins")


FLEET_FALLBACKS = ("share", "local")
FLEET_AGGREGATIONS = ("flat", "owners")


@dataclass(frozen=True)
class FleetConfig:
    """One quota for the whole fleet: instances share their usage through a Kafka topic
    (proxy.control.fleet, quotas.fleet). Off by default: each instance enforces alone."""

    enabled: bool = False
    topic: str = "__kqp_quota_usage"
    partitions: int = 1  # flat: each instance writes one (by its id), reads them all; owners: the shards
    retention_ms: int = 600_000  # the topic's retention.ms when the proxy creates it
    sync_interval_ms: int = 250  # how often each instance publishes its usage (and a heartbeat)
    member_timeout_ms: int = 5_000  # silent this long: a member has left; the topic out of reach: fallback
    # When the topic cannot be written or read for member_timeout_ms: "share" enforces bound /
    # the members last known here (never more than the quota in total), "local" the whole bound.
    fallback: str = "share"
    instance_id: str | None = None  # None: the advertised host and bootstrap port
    # An entity is reported only when this instance charged it at least this fraction of its
    # bound / the members over an interval, or the fleet shares it already (0: every entity).
    report_threshold: float = 0.5
    # The other members' entries this instance applies a second at most (a record past it is
    # counted and dropped unread): what a flood on the topic can cost it.
    max_remote_entries_per_s: int = 50_000
    # "flat": every member reads every member's reports; "owners": each partition's reports are
    # summed by one member, every member reads the sums (``<topic>-totals``): for large fleets.
    aggregation: str = "flat"


MAX_WORKERS = 256
HEARTBEAT_INTERVAL_MS = 1_000  # how often a worker tells the supervisor its event loop turns


@dataclass(frozen=True)
class WorkersConfig:
    """Worker processes behind the same listeners (proxy.app.supervisor): ``workers: N``,
    ``workers: auto`` or this mapping. One worker (the default) is the plain single process."""

    count: int = 1  # 0: auto, the cores this process may run on
    # How often each worker hands its quota usage to the others (fleet semantics, on the host).
    sync_interval_ms: int = 100
    # A worker whose event loop has not answered for this long is killed and replaced.
    heartbeat_timeout_ms: int = 10_000
    # SIGTERM: stop accepting, let the requests in flight be answered for up to this, then close.
    drain_timeout_ms: int = 30_000


@dataclass(frozen=True)
class QuotaAdminConfig:
    """DescribeClientQuotas and AlterClientQuotas answered by the proxy (off: forwarded)."""

    enabled: bool = False
    # Who may alter quotas (and describe them with describe: admins): principal names as the
    # proxy sees them (SASL user, mapped certificate name, ANONYMOUS), a leading "User:" removed.
    principals: tuple[str, ...] = ()
    # Kafka asks DESCRIBE_CONFIGS on the cluster to describe, ALTER_CONFIGS to alter: both are
    # admins' by default; "anyone" lets every client describe.
    describe: str = "admins"
    # Where the quotas set through the API are kept: "topic" (the compacted topic below, shared
    # by every proxy instance, kept across restarts) or "memory" (this process only, lost on restart).
    store: str = "topic"
    topic: str = "__kqp_client_quotas"
    # How long an Alter may take, from its arrival: waiting for the Alters before it, and the
    # store's write with its retries (a new cluster answers InitProducerId
    # COORDINATOR_LOAD_IN_PROGRESS for a while). Then it is answered REQUEST_TIMED_OUT with the
    # cause. Within the 30 s an admin client waits for an answer (request.timeout.ms).
    write_deadline_ms: int = 25_000

    def may_alter(self, principal: str) -> bool:
        return principal in self.principals

    def may_describe(self, principal: str) -> bool:
        return self.describe == "anyone" or principal in self.principals


@dataclass(frozen=True)
class Config:
    upstream: UpstreamConfig
    listen: ListenConfig = field(default_factory=ListenConfig)
    connections: ConnectionsConfig = field(default_factory=ConnectionsConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    reload: ReloadConfig = field(default_factory=ReloadConfig)
    quota_windows: QuotaWindows = field(default_factory=QuotaWindows)
    quota_entities: QuotaEntities = field(default_factory=QuotaEntities)
    quotas: tuple[QuotaRule, ...] = ()
    controller_mutation: ControllerMutation = field(default_factory=ControllerMutation)
    producer_id_quota: ProducerIdQuota = field(default_factory=ProducerIdQuota)
    rate_limiters: tuple[RateLimiterSpec, ...] = DEFAULT_RATE_LIMITERS
    # Filters of the operator's own: requests meet them before the quota filters, responses
    # after the proxy's own filters (proxy.app.server.default_chain). A change needs a restart.
    filters: tuple[FilterPlugin, ...] = ()
    leader_discovery: LeaderDiscovery = field(default_factory=LeaderDiscovery)
    usage_log: UsageLogConfig = field(default_factory=UsageLogConfig)
    quota_admin: QuotaAdminConfig = field(default_factory=QuotaAdminConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    # The quota entries' mode unless an entry sets its own: enforce, or shadow (every quota
    # computed and counted, nothing throttled, refused, muted or rewritten).
    mode: str = "enforce"
