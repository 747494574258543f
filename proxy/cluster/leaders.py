"""KIP-951 leader discovery: what the proxy knows of partition leaders, and how it learns more.

:class:`LeaderCache` keeps, per partition, the leader with the highest leader epoch seen in any
Metadata response that passes through, in the proxy's own refreshes, and in the ``CurrentLeader``
hints brokers send; an older epoch never rolls it back (as a client's ``Metadata.updateLatest``
refuses a stale epoch). :class:`ExpeditedRefresher` asks a broker for the metadata of topics whose
leader just moved, at most once per ``min_interval_s`` per batch of topics, off the request path.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.cluster.brokers import Cluster
from proxy.cluster.refresh import fetch_topic_metadata
from proxy.observability.stats import ProxyStats, counter_by

log = logging.getLogger(__name__)

_NO_ID = uuid.UUID(int=0)


class PartitionLeader(NamedTuple):
    leader: int
    epoch: int  # -1: unknown (Metadata before v7 carries no leader epoch)


class LeaderCache:
    """(topic name, partition) → leader and leader epoch; topic id → name. Bounded: when full,
    the oldest half of the partitions is dropped (they are learned again when next seen)."""

    def __init__(self, max_partitions: int = 1_000_000) -> None:
        self._leaders: dict[tuple[str, int], PartitionLeader] = {}
        self.names: dict[uuid.UUID, str] = {}
        self._max = max_partitions
        self.updated_at_s: float | None = None  # monotonic time of the last change
        self.stale_ignored = 0  # observations older than what the cache holds

    def __len__(self) -> int:
        return len(self._leaders)

    def leader(self, topic: str, partition: int) -> PartitionLeader | None:
        return self._leaders.get((topic, partition))

    def name_of(self, topic_id: uuid.UUID | None) -> str | None:
        return None if topic_id is None else self.names.get(topic_id)

    def topics(self) -> set[str]:
        return {name for name, _ in self._leaders}

    def observe(self, topic: str, partition: int, leader: int, epoch: int, now_s: float) -> bool:
        """Records a leader; True if the cache changed. An epoch below the cached one is stale
        and ignored; at the same epoch the cache keeps what it has (an epoch names one leader)."""
        key = (topic, partition)
        known = self._leaders.get(key)
        if known is not None:
            if epoch < known.epoch or (epoch == known.epoch and epoch >= 0):
                # An unknown epoch (Metadata before v7) says nothing against a known one.
                if epoch >= 0 and (epoch < known.epoch or leader != known.leader):
                    self.stale_ignored += 1
                return False
        if len(self._leaders) >= self._max:
            for old in list(self._leaders)[: self._max // 2]:
                del self._leaders[old]
        self._leaders[key] = PartitionLeader(leader, epoch)
        self.updated_at_s = now_s
        return True

    def observe_metadata(self, topics: Iterable[Any], now_s: float) -> int:
        """Takes every partition of a MetadataResponse's topics (decoded by kafka-python, untyped);
        returns how many changed."""
        changed = 0
        for t in topics:
            if t.error_code != 0 or not t.name:
                continue
            topic_id = getattr(t, "topic_id", None)
            if topic_id is not None and topic_id != _NO_ID:
                self.names[topic_id] = t.name
            for p in t.partitions:
                # LEADER_NOT_AVAILABLE (5) and friends carry leader -1: nothing to learn.
                if p.leader_id >= 0:
                    changed += self.observe(t.name, p.partition_index, p.leader_id,
                                            getattr(p, "leader_epoch", -1), now_s)
        return changed

    def age_s(self, now_s: float) -> float | None:
        return None if self.updated_at_s is None else now_s - self.updated_at_s


class ExpeditedRefresher:
    """Refreshes the metadata of topics whose partitions just answered NOT_LEADER_OR_FOLLOWER or
    FENCED_LEADER_EPOCH without a leader hint (brokers before KIP-951), so the next failure can
    be answered with one. One refresh at a time; topics asked for meanwhile join the next."""

    def __init__(self, cluster: Cluster, cache: LeaderCache, stats: ProxyStats, timeout_s: float,
                 min_interval_s: float = 0.05) -> None:
        self.cluster = cluster
        self.cache = cache
        self.stats = stats
        self.timeout_s = timeout_s
        self.min_interval_s = min_interval_s
        self._pending: set[str] = set()
        self._pending_ids: set[uuid.UUID] = set()
        self._waiters: list[asyncio.Future[None]] = []  # resolved when the next round is done
        self._round_waiters: list[asyncio.Future[None]] = []  # resolved when any round is done
        self._task: asyncio.Task[None] | None = None
        self._last_s = 0.0
        self._next_broker = 0  # rounds go round the brokers: one that lags is not asked twice running

    def request(self, topics: Iterable[str], topic_ids: Iterable[uuid.UUID] = ()) -> asyncio.Future[None]:
        """Asks for the topics' metadata (by name, or by id for topics only known by id, as
        Fetch v13+ names them); the future is done once a refresh that includes them has
        finished (whether or not a broker answered). Never cancel it: wait on it."""
        self._pending.update(topics)
        self._pending_ids.update(topic_ids)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(done)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        return done

    def round_end(self) -> asyncio.Future[None]:
        """Done when the refresh round now running (or, if none is, the next one) ends."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._round_waiters.append(done)
        return done

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for waiter in self._round_waiters:
            waiter.cancel()
        self._pending.clear()
        self._pending_ids.clear()
        for waiter in self._waiters:
            waiter.cancel()

    async def _run(self) -> None:
        while self._pending or self._pending_ids or self._waiters:
            wait_s = self._last_s + self.min_interval_s - time.monotonic()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            topics, self._pending = sorted(self._pending), set()
            ids, self._pending_ids = list(self._pending_ids), set()
            waiters, self._waiters = self._waiters, []
            self._last_s = time.monotonic()
            try:
                if topics or ids:
                    await self.refresh(topics, "expedited", ids)
            finally:
                ended, self._round_waiters = self._round_waiters, []
                for waiter in (*waiters, *ended):
                    if not waiter.done():
                        waiter.set_result(None)

    async def refresh(self, topics: list[str], reason: str, topic_ids: Iterable[uuid.UUID] = ()) -> bool:
        """Metadata for ``topics`` (and ``topic_ids``) from the first broker that answers, into
        the cache."""
        start = self._next_broker
        self._next_broker += 1
        for attempt in range(max(len(self.cluster.brokers), len(self.cluster.bootstrap))):
            address = self._address(start + attempt)
            try:
                resp = await fetch_topic_metadata(self.cluster.dialer, address, topics, list(topic_ids), self.timeout_s)
            except (TimeoutError, OSError, asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
                self.cluster.dialer.log_failure(f"{reason}_refresh", logging.WARNING, "%s metadata refresh from %s:%d "
                                                "failed: %s", reason, *address, exc or type(exc).__name__)
                continue
            for b in resp.brokers:
                self.cluster.advertise(b.node_id, b.host, b.port)
            changed = self.cache.observe_metadata(resp.topics, time.monotonic())
            self.stats.metadata_refreshes[reason] += 1
            log.debug("%s metadata refresh of %d topics: %d leaders changed", reason, len(topics), changed)
            return True
        self.stats.metadata_refreshes[f"{reason}_failure"] += 1
        return False

    def _address(self, attempt: int) -> tuple[str, int]:
        brokers = list(self.cluster.brokers.values())
        if brokers:
            return brokers[attempt % len(brokers)]
        return self.cluster.upstream_address(None, attempt)


class LeaderCollector(Collector):
    """The leader cache's size and age, and the KIP-951 hint counters."""

    def __init__(self, cache: LeaderCache, stats: ProxyStats) -> None:
        self._cache = cache
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats
        yield counter_by(
            "kqp_leader_hints", "NOT_LEADER_OR_FOLLOWER / FENCED_LEADER_EPOCH partitions by what the client got",
            "source", s.leader_hints,
        )
        yield counter_by(
            "kqp_uplifted_requests", "Requests sent to the broker one version lower than the client used",
            "api", s.uplifted_requests,
        )
        yield GaugeMetricFamily(
            "kqp_metadata_cache_partitions", "Partitions in the leader cache", value=len(self._cache)
        )
        age = self._cache.age_s(time.monotonic())
        yield GaugeMetricFamily(
            "kqp_metadata_cache_age_seconds", "Seconds since the leader cache last changed (-1: never)",
            value=-1.0 if age is None else age,
        )
        yield CounterMetricFamily(
            "kqp_metadata_cache_stale_ignored", "Leader observations older than the cached epoch (ignored)",
            value=self._cache.stale_ignored,
        )
