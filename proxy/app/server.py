"""The proxy process: listeners, filter chain, metadata refresh, metrics endpoint."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Collection, Coroutine
from dataclasses import replace
from typing import Any

from prometheus_client import CollectorRegistry

from config import ConfigError
from config.engines import producer_id_manager_for, quota_manager_for
from config.model import Config, unenforced_kinds
from proxy.cluster.brokers import Cluster
from proxy.cluster.leaders import ExpeditedRefresher, LeaderCache, LeaderCollector
from proxy.cluster.metadata_learner import MetadataLearner
from proxy.cluster.refresh import refresh_once
from proxy.cluster.topics import TopicCache
from proxy.control.fleet import FleetExchange
from proxy.control.fleet_metrics import FleetCollector
from proxy.control.fleet_owners import OwnersExchange
from proxy.control.quota_store import OverlayStore, QuotaStore
from proxy.control.quota_store_metrics import QuotaStoreCollector
from proxy.control.quota_topic_store import TopicStore
from proxy.control.worker_link import SharedOverlayStore, WorkerLink
from proxy.dataplane.connection import ClientConnection
from proxy.dataplane.environment import ConnectionEnv, Served
from proxy.dataplane.filters import FilterChain
from proxy.dataplane.filters.api_versions import ApiVersionsFilter
from proxy.dataplane.filters.client_quotas import ClientQuotasFilter
from proxy.dataplane.filters.controller_mutation import ControllerMutationFilter
from proxy.dataplane.filters.endpoints import EndpointRewriteFilter
from proxy.dataplane.filters.leaders import LeaderHintFilter, UpliftFilter
from proxy.dataplane.filters.limiters import RateLimiterFilter
from proxy.dataplane.filters.plugins import build_plugins
from proxy.dataplane.filters.producer_ids import ProducerIdQuotaFilter
from proxy.dataplane.filters.quotas import RateQuotaFilter, now_ms
from proxy.dataplane.filters.records import FetchCountFilter, ProduceScanFilter
from proxy.dataplane.filters.sasl import SaslFilter
from proxy.dataplane.filters.usage import UsageFilter
from proxy.dataplane.guard import ConnectionGuard, GuardCollector
from proxy.identity.tls import server_tls
from proxy.observability.http import MetricsEndpoint
from proxy.observability.quota_metrics import ProducerIdCollector, QuotaCollector
from proxy.observability.readiness import Readiness
from proxy.observability.stats import ProxyStats, StatsCollector
from proxy.observability.usage_log import UsageLog, UsageLogCollector
from quotas import QuotaManager
from quotas.changes import quota_changes
from quotas.client_quota_admin import QuotaEntity, quotas_from_rules, rules_from_quotas
from quotas.common import SHADOW
from quotas.entities import QuotaRule
from quotas.limiters import LimiterContext, RateLimiter
from quotas.producer_ids import ProducerIdObserver

log = logging.getLogger(__name__)


def default_chain(
    config: Config,
    quota_manager: QuotaManager,
    topics: TopicCache,
    producer_ids: ProducerIdQuotaFilter,
    limiters: RateLimiterFilter,
    leader_hints: LeaderHintFilter,
    usage: UsageFilter | None = None,
    client_quotas: ClientQuotasFilter | None = None,
    learner: MetadataLearner | None = None,
) -> FilterChain:
    # The client-quota APIs the proxy answers itself are offered whatever the broker supports.
    offered = client_quotas.offered if client_quotas is not None else {}
    api_versions = ApiVersionsFilter(uplift=config.leader_discovery.uplift, offered=offered)
    sasl = SaslFilter()
    w = config.quota_windows
    rates = RateQuotaFilter(quota_manager, max(w.quota_window_num - 1, 1) * w.quota_window_size_seconds)
    mutations = ControllerMutationFilter(
        quota_manager, topics, config.controller_mutation.num_partitions_fallback,
        config.upstream.connect_timeout_s, count_all=usage is not None,
    )
    counting = [usage] if usage is not None else []
    admin = [client_quotas] if client_quotas is not None else []
    plugins = build_plugins(config.filters)  # the operator's own (filters:); ConfigError names filters[i]
    # A Produce's batches are read in slices before the filters that read them (a big one deferred).
    produce_scan = ProduceScanFilter([*plugins.request, *counting, producer_ids, limiters])
    # A (Share)Fetch response's records are counted in slices before the filters that read them
    # (a big one held), after the byte quota may have emptied it.
    endpoints = EndpointRewriteFilter(learner)
    fetch_count = FetchCountFilter([limiters, *(u for u in counting if u.count_fetch_records)],
                                   share_walkers=[leader_hints, endpoints])
    return FilterChain(
        # Client-quota requests are charged their request_rate, then answered once the principal
        # is known. The operator's filters (filters:) see a request after the proxy's bookkeeping
        # (request_rate charged, SASL followed) and before any quota charges what it asks for (a
        # broker runs its policies before its controller mutation quota). A Produce rejected for
        # its producer ids is not shown to the record limiters (the usage log sees its ids first).
        # Uplift last: every filter reads the request at the version the client used.
        request_filters=[rates, api_versions, sasl, *admin, produce_scan, *plugins.request, mutations, *counting,
                         producer_ids, limiters, UpliftFilter()],
        # Record limiters see a Fetch response after the byte quota may have emptied it; leader
        # hints are filled in with broker addresses before the endpoint filter rewrites them. The
        # operator's filters come last: they see the response as the client will, and what the
        # proxy learns from it (principals, partition counts) is learned from the broker's.
        response_filters=[rates, fetch_count, limiters, *counting, api_versions, leader_hints, endpoints, sasl,
                          mutations, *plugins.response],
    )


def rate_limiters_for(config: Config, manager: QuotaManager,
                      existing: dict[str, RateLimiter] | None = None) -> list[RateLimiter]:
    """The configured limiters, built (or reused from ``existing``, by target) and configured.

    Raises ConfigError naming ``rate_limiters[i]`` when a limiter refuses its configuration.
    """
    w = config.quota_windows
    limiters = []
    for i, spec in enumerate(config.rate_limiters):
        limiter = (existing or {}).get(spec.target) or spec.cls()
        try:
            limiter.check_settings(spec.settings)
            limiter.configure(LimiterContext(
                rules=config.quotas,
                quota_window_num=w.quota_window_num,
                quota_window_size_s=w.quota_window_size_seconds,
                manager=manager,
                settings=spec.settings,
            ))
        except (ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"rate_limiters[{i}]", f"{spec.target} refused its configuration: {exc!r}") from exc
        limiters.append(limiter)
    return limiters


class ProxyServer:
    """One proxy process: alone, or with ``worker`` one of a host's workers (proxy.app.worker):
    its listeners shared with the others (``SO_REUSEPORT``), connection admission, quota usage
    and the memory quota store the host's, its metrics scraped by the supervisor."""

    def __init__(self, config: Config, registry: CollectorRegistry | None = None,
                 worker: WorkerLink | None = None) -> None:
        self.config = config
        self.worker = worker
        self.stats = ProxyStats()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.quotas = quota_manager_for(config)
        self.registry.register(StatsCollector(self.stats))
        self.registry.register(QuotaCollector(self.quotas, now_ms, fleet=config.fleet.enabled))
        self.producer_ids = producer_id_manager_for(config)
        self.limiters = rate_limiters_for(config, self.quotas)
        self.cluster = Cluster(config, self.stats, self._serve_node,
                               worker.broker_port if worker is not None else None)
        # Quotas set through AlterClientQuotas, over the file's (config.quotas): the rules in
        # force are rules_in_force (see quota_rules_over).
        self._file_quotas: tuple[tuple[QuotaRule, ...], dict[QuotaEntity, dict[str, float]]] | None = None
        self.quota_store: QuotaStore = (OverlayStore(self._file_keys) if worker is None
                                        else SharedOverlayStore(self._file_keys, worker))
        self.topic_store: TopicStore | None = None
        admin = config.quota_admin
        if admin.enabled and admin.store == "topic":
            self.topic_store = TopicStore(admin.topic, self.cluster, config.upstream.connect_timeout_s,
                                          self.quota_store_changed, self._file_keys,
                                          write_deadline_s=admin.write_deadline_ms / 1000)
            self.quota_store = self.topic_store
            self.registry.register(QuotaStoreCollector(self.topic_store))
        self.fleet: FleetExchange | None = None
        if config.fleet.enabled:
            w = config.quota_windows
            window_ms = int(1000 * max(w.quota_window_num * w.quota_window_size_seconds,
                                       w.controller_quota_window_num * w.controller_quota_window_size_seconds))
            exchange = OwnersExchange if config.fleet.aggregation == "owners" else FleetExchange
            self.fleet = exchange(config.fleet, self.cluster, self.quotas, config.upstream.connect_timeout_s,
                                  window_ms, now_ms, self.producer_ids)
            self.registry.register(FleetCollector(self.fleet, now_ms))
            if worker is not None and config.fleet.instance_id:
                self.fleet.instance_id = f"{config.fleet.instance_id}/w{worker.worker_id}"  # each a member
        elif worker is not None:
            worker.share_usage(self.quotas, self.producer_ids)  # the host's workers share as a fleet
        self.rules_in_force = config.quotas
        self.client_quotas = ClientQuotasFilter(config.quota_admin, self.quota_store, self)
        self.producer_id_filter = ProducerIdQuotaFilter(self.producer_ids, config.producer_id_quota.reaction)
        self.limiter_filter = RateLimiterFilter(self.limiters)
        self.registry.register(ProducerIdCollector(self.producer_ids, self.producer_id_filter, self.limiter_filter,
                                                   now_ms))
        self.topics = TopicCache()
        self.producer_id_observer: ProducerIdObserver | None = None  # with the usage log only
        self.usage, usage_filter = self._usage_log(config)
        self.leaders = LeaderCache()
        # What clients' Metadata responses and the proxy's own refreshes teach, a slice at a time.
        self.metadata_learner = MetadataLearner(self.stats)
        ld = config.leader_discovery
        self.refresher = ExpeditedRefresher(self.cluster, self.leaders, self.stats, config.upstream.connect_timeout_s,
                                            ld.expedited_refresh_min_interval_ms / 1000,
                                            learner=self.metadata_learner, topics=self.topics)
        self.registry.register(LeaderCollector(self.leaders, self.stats))
        chain = default_chain(config, self.quotas, self.topics, self.producer_id_filter, self.limiter_filter,
                              LeaderHintFilter(self.leaders, self.refresher, ld.fill_hints, ld.hint_wait_ms / 1000),
                              usage_filter, self.client_quotas, self.metadata_learner)
        self.connections: set[Served] = set()
        # TLS termination on the client listeners (None: plaintext); ConfigError for a bad file.
        self.tls = server_tls(config.listen.tls) if config.listen.tls is not None else None
        self.guard = ConnectionGuard(config.connections, config.quota_windows, host=worker)
        up = config.upstream
        self._readiness = Readiness(self.stats, self.cluster, 2 * up.metadata_refresh_interval_s + up.connect_timeout_s)
        self.registry.register(GuardCollector(self.guard))
        # What every client connection is given: the parts, not this server.
        self.env = ConnectionEnv(chain, self.stats, self.guard, self.cluster, self.topics, self.leaders,
                                 self.usage, config.upstream, config.listen.max_frame_bytes, self.connections,
                                 lambda: self.tls)
        self._servers: list[asyncio.AbstractServer] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.bootstrap_address: tuple[str, int] | None = None
        self.metrics_address: tuple[str, int] | None = None

    @property
    def chain(self) -> FilterChain:
        """The filter chain new connections are given."""
        return self.env.chain

    @chain.setter
    def chain(self, chain: FilterChain) -> None:
        """Another chain for the connections accepted from now on (those open keep theirs)."""
        self.env = replace(self.env, chain=chain)

    def _usage_log(self, config: Config) -> tuple[UsageLog | None, UsageFilter | None]:
        u = config.usage_log
        if u.directory is None:  # the log is off (UsageLogConfig.enabled)
            return None, None
        usage = UsageLog(u.directory, u.interval_seconds, u.max_keys_per_interval,
                         u.proxy_name or socket.gethostname(), u.max_pending_intervals,
                         fleet=config.fleet.topic if config.fleet.enabled else "")
        self.registry.register(UsageLogCollector(usage))
        self.producer_id_observer = ProducerIdObserver(config.producer_id_quota.settings(),
                                                       config.quota_entities.max_live)
        return usage, UsageFilter(self.producer_id_observer, u.count_fetch_records)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        listen = self.config.listen
        server = await loop.create_server(
            lambda: ClientConnection(self.env, None), listen.host, listen.bootstrap_port,
            reuse_address=True, reuse_port=self.worker is not None or None, backlog=1024,
        )
        self._servers.append(server)
        self.bootstrap_address = server.sockets[0].getsockname()[:2]
        log.info("bootstrap listener on %s:%d", *self.bootstrap_address)
        if self.config.metrics.enabled and self.worker is None:  # a worker's: the supervisor's one endpoint
            endpoint = MetricsEndpoint(self.registry, self.health, self.ready, self.config.metrics.max_entity_series)
            m = self.config.metrics
            http = await endpoint.start_server(m.host, m.port)
            self._servers.append(http)
            self.metrics_address = http.sockets[0].getsockname()[:2]
            log.info("metrics on http://%s:%d/metrics", *self.metrics_address)
        self.cluster.dialer.announce_identity()  # before the first connection: who the brokers will see
        up = self.config.upstream
        answered = await refresh_once(self.cluster, self.stats, up.connect_timeout_s)
        if not answered:
            log.warning("no bootstrap server answered yet; brokers will be learned when one does")
        if self.topic_store is not None:
            # Read to its end before the proxy can be ready; with no broker answering, not waited
            # for (the file's quotas are in force until it is read).
            await self.topic_store.start(wait_s=2 * up.connect_timeout_s if answered else 0.0)
        if self.fleet is not None:
            suffix = f"/w{self.worker.worker_id}" if self.worker is not None else ""
            self.fleet.start(f"{self.config.listen.advertised_host}:{self.bootstrap_address[1]}{suffix}")
        self._spawn(self.refresher.refresh_periodically(up.metadata_refresh_interval_s, up.connect_timeout_s, answered))
        self._spawn(self._expire_quota_entities())
        self._spawn(self._sweep_connections())
        self._spawn(self._clean_producer_ids())
        if self.usage is not None:
            self.usage.start()
            log.info("usage log: every %ds to %s", self.config.usage_log.interval_seconds,
                     self.config.usage_log.directory)

    async def _expire_quota_entities(self) -> None:
        while True:
            await asyncio.sleep(60)
            self.quotas.expire(now_ms())
            if self.producer_id_observer is not None:
                self.producer_id_observer.cleanup(now_ms())

    async def _sweep_connections(self) -> None:
        """Closes idle connections and unfinished frames past their deadlines (see
        ConnectionGuard.sweep), a slice of connections at a time so the loop never stalls."""
        interval_s = self.guard.sweep_interval_s
        while True:
            await asyncio.sleep(interval_s)
            self.guard.expire()
            connections = list(self.connections)
            for i in range(0, len(connections), 512):
                self.guard.sweep(connections[i : i + 512], time.monotonic())
                await asyncio.sleep(0)

    async def _clean_producer_ids(self) -> None:
        # KIP-936's producer.id.quota.cache.cleanup.scheduler.interval.ms.
        interval_s = self.config.producer_id_quota.producer_id_quota_cache_cleanup_interval_ms / 1000
        manager = self.producer_ids
        while True:
            # Nothing to clean while no user is tracked: no need to wake the loop 100 times a
            # second (a user tracked meanwhile is looked at within a second).
            await asyncio.sleep(interval_s if manager.tracked_users else max(interval_s, 1.0))
            manager.cleanup(now_ms())

    def quota_rules_over(self, base: tuple[QuotaRule, ...], mode: str | None = None) -> tuple[QuotaRule, ...]:
        """The rules in force over the file's ``base``: the quota store's overlay on top. An
        entity keeps the mode its file entry gives it; one only the API set takes the file's
        global ``mode`` (the configuration in force when None): the API carries values only."""
        if not len(self.quota_store):
            return base  # the very tuple: nothing set through the API
        shadow_of = {(r.user, r.client_id): r.shadow for r in base}
        default = (self.config.mode if mode is None else mode) == SHADOW
        return tuple(replace(r, shadow=shadow_of.get((r.user, r.client_id), default))
                     for r in rules_from_quotas(self.quota_store.merged(base)))

    def _file_keys(self, entity: QuotaEntity) -> Collection[str]:
        """The keys the file's quotas set for ``entity`` (a removal of another key masks nothing)."""
        rules = self.config.quotas
        if self._file_quotas is None or self._file_quotas[0] is not rules:  # once per configuration, not per entity
            self._file_quotas = (rules, quotas_from_rules(rules))
        return self._file_quotas[1].get(entity, {}).keys()

    def quota_store_changed(self) -> None:
        """The quota topic changed (another instance's Alter, or read at start): its quotas
        over the file's in force, as a reload puts them (entities keep their rate state)."""
        try:
            self.apply_quota_rules(self.quota_rules_over(self.config.quotas))
        except ConfigError as exc:
            log.error("quotas read from the quota topic not put in force, a rate limiter refused them: %s", exc)

    def apply_quota_rules(self, rules: tuple[QuotaRule, ...]) -> None:
        """Puts ``rules`` in force for every connection (the quota engine, the producer-id quota,
        the rate limiters, the filter chain), as a reload does, without touching the file's
        configuration. Raises ConfigError (nothing changed) when a rate limiter refuses them."""
        self._put_in_force(self.config, rules)

    def _put_in_force(self, live: Config, rules: tuple[QuotaRule, ...]) -> None:
        """``rules`` in force, with ``live``'s rate limiters and producer-id reaction; ConfigError
        (nothing changed) when a rate limiter refuses."""
        existing = {spec.target: lim for spec, lim in zip(self.config.rate_limiters, self.limiters)}
        limiters = rate_limiters_for(replace(live, quotas=rules), self.quotas, existing)  # first: it may refuse
        for limiter in self.limiters:
            if limiter not in limiters:
                close_limiter(limiter)
        self.quotas.replace_rules(rules)
        self.producer_ids.replace_rules(rules)
        self.rules_in_force = rules
        self.limiters = limiters
        self.limiter_filter.set_limiters(limiters)
        self.producer_id_filter.reaction = live.producer_id_quota.reaction
        self.chain.refresh()  # filters idle before may have work now, and the other way round
        for conn in self.connections:
            conn.chain_changed()

    def reload(self, config: Config) -> None:
        """Applies the quotas, rate limiters and producer-id reaction of a new, already validated
        configuration; connections stay. The quotas set through the Admin API stay on top of the
        file's (see proxy.control.quota_store). Raises ConfigError (nothing changed) when a rate limiter
        refuses its new configuration. Logs each quota in force it removes at WARNING (an entity
        losing them all, or one value) and each one it adds or changes at INFO, then one INFO line
        counting the quota entries in force and those added, removed and changed."""
        before = self.config
        rules_before = self.rules_in_force
        live = replace(before, quotas=config.quotas, rate_limiters=config.rate_limiters, mode=config.mode,
                       producer_id_quota=replace(before.producer_id_quota, reaction=config.producer_id_quota.reaction))
        rules = self.quota_rules_over(config.quotas, config.mode)
        self._put_in_force(live, rules)
        self.config = live
        # Every quota the reload takes away is named: a cut-short file must not pass unnoticed.
        for change in quota_changes(rules_before, rules):
            log.log(logging.WARNING if change.removes_a_quota else logging.INFO, "reload %s", change.describe())
        shadow_before = {(r.user, r.client_id): r.shadow for r in rules_before}
        for r in rules:
            was = shadow_before.get((r.user, r.client_id))
            if was is not None and was != r.shadow:
                # Its entities keep their state: what shadow mode counted is what is now enforced.
                log.warning("reload puts the quotas of %s in %s mode", r.describe(),
                            "shadow (counted, not applied)" if r.shadow else "enforce")
        if len(self.quota_store):
            log.info("reload: %d quota values set or removed through the Admin API stay over the file's",
                     len(self.quota_store))
        unenforced = unenforced_kinds(config.rate_limiters)
        for rule in rules:
            for kind in sorted(unenforced & rule.values.keys()):
                log.warning("reload: %s %s (set through the Admin API) is not enforced: no configured rate "
                            "limiter enforces it", rule.describe(), kind)
        restart = [name for name, value in vars(config).items() if getattr(live, name) != value]
        if restart:  # the reload: section included, which the watcher read at start
            log.warning("reload applied quotas, mode, rate_limiters and producer_id_quota.reaction; "
                        "changed settings that need a restart: %s", ", ".join(restart))
        added, removed, changed = _entry_changes(rules_before, rules)
        log.info("reloaded: %s in force (%d added, %d removed, %d changed), %s",
                 _count(len(rules), "quota entry", "quota entries"), added, removed, changed,
                 _count(len(self.limiters), "rate limiter", "rate limiters"))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _serve_node(self, node_id: int, sock: socket.socket) -> None:
        async def serve() -> None:
            loop = asyncio.get_running_loop()
            server = await loop.create_server(lambda: ClientConnection(self.env, node_id), sock=sock)
            self._servers.append(server)

        self._spawn(serve())

    def health(self) -> tuple[bool, str]:
        """Liveness (``/healthz``): every listener of the proxy's own is serving."""
        ok = bool(self._servers) and all(s.is_serving() for s in self._servers)
        detail = f"{'ok' if ok else 'not serving'}; brokers known: {sorted(self.cluster.brokers)}"
        if self.topic_store is not None:
            detail += "; " + self.topic_store.state()[1]
        if self.fleet is not None:
            detail += "; " + self.fleet.state()[1]
        return ok, detail

    def ready(self) -> tuple[bool, str]:
        """Readiness (``/readyz``): serving, a broker known, and a metadata refresh answered
        within two refresh intervals (plus a connect timeout): see proxy.observability.readiness."""
        ready, detail = self._readiness.check(self.health()[0])
        # The quota store read once, the fleet's usage inside the window read once.
        for part in (self.topic_store, self.fleet):
            if part is None:
                continue
            done, line = part.state()
            if not done:
                detail = ("not ready: " if ready else detail + "; ") + line
                ready = False
            else:
                detail += "; " + line
        return ready, detail

    async def drain(self, timeout_s: float) -> None:
        """A graceful stop's first half: no connection accepted from now on; each open one
        stops being read and closes once its responses owed are sent, within ``timeout_s``
        (:meth:`stop` then closes what is left)."""
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            conn.drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if self.connections:
            log.info("draining %d connections (at most %g s)", len(self.connections), timeout_s)
        while self.connections and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.connections:
            log.warning("%d connections still owed responses after %g s: closing them", len(self.connections),
                        timeout_s)

    async def stop(self, drain_s: float = 0.0) -> None:
        """Stops the proxy; with ``drain_s``, a graceful stop (:meth:`drain` first)."""
        if drain_s:
            await self.drain(drain_s)
        for task in list(self._tasks):
            task.cancel()
        if self.topic_store is not None:
            await self.topic_store.stop()
        if self.fleet is not None:
            await self.fleet.stop()
        self.refresher.close()
        self.metadata_learner.close()
        for limiter in self.limiters:
            close_limiter(limiter)
        self.limiters = []
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            conn.close()
        for server in self._servers:
            await server.wait_closed()
        if self.usage is not None:
            await self.usage.close()


def _entry_changes(before: tuple[QuotaRule, ...], after: tuple[QuotaRule, ...]) -> tuple[int, int, int]:
    """(added, removed, changed): the quota entries (entities) ``after`` has and ``before`` has
    not, the other way round, and those in both whose values or mode differ."""
    old = {(r.user, r.client_id): r for r in before}
    new = {(r.user, r.client_id): r for r in after}
    changed = sum(1 for key, r in new.items()
                  if key in old and (old[key].values != r.values or old[key].shadow != r.shadow))
    return len(new.keys() - old.keys()), len(old.keys() - new.keys()), changed


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def close_limiter(limiter: RateLimiter) -> None:
    try:
        limiter.close()
    except Exception:
        log.exception("rate limiter %s failed to close", type(limiter).__qualname__)

