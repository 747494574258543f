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
from array import array
from collections.abc import Iterable, Iterator
from typing import NamedTuple, TypeAlias

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from protocol.errors import ProtocolError
from protocol.metadata_scan import read_metadata_head
from proxy.cluster.brokers import Cluster
from proxy.cluster.metadata_learner import MetadataLearner
from proxy.cluster.refresh import fetch_topic_metadata_body, refresh_once
from proxy.cluster.topics import TopicCache
from proxy.observability.stats import ProxyStats, counter_by

log = logging.getLogger(__name__)
# The most topics one periodic leader refresh asks for: a Metadata response of a bounded size
# however big the cluster (the cache is walked round, this many topics an interval).
PERIODIC_REFRESH_TOPICS = 1_000

_NO_ID_BYTES = bytes(16)


class PartitionLeader(NamedTuple):
    leader: int
    epoch: int  # -1: unknown (Metadata before v7 carries no leader epoch)


# A topic's partitions as Metadata lists them: (error code, index, leader id, leader epoch), four
# int32s each, in one array (protocol.metadata_scan.MetadataTopic.partitions): 16 bytes a
# partition, where a dict entry per partition cost about 250.
Quads: TypeAlias = "array[int]"


class LeaderCache:
    """(topic name, partition) → leader and leader epoch; topic id → name.

    Kept per topic as one array of four int32s a partition, so a million partitions cost about
    16 MB plus about 300 bytes a topic (its name, its id, two dict entries, the array's head).
    Bounded by ``max_partitions``: when full, the oldest topics are dropped until half of it is
    left (they are learned again when next seen). A leader of -1 (LEADER_NOT_AVAILABLE and
    friends) is kept as it came but names no leader."""

    def __init__(self, max_partitions: int = 1_000_000) -> None:
        self._topics: dict[str, Quads] = {}
        self._ids: dict[bytes, str] = {}  # the 16 bytes of a topic id → its name
        self._partitions = 0
        self._max = max_partitions
        self.updated_at_s: float | None = None  # monotonic time of the last change
        self.stale_ignored = 0  # observations older than what the cache holds
        self.generation = 0  # counts evictions: what was learned may be gone

    def __len__(self) -> int:
        """Partitions held."""
        return self._partitions

    def leader(self, topic: str, partition: int) -> PartitionLeader | None:
        quads = self._topics.get(topic)
        if quads is None:
            return None
        at = _position(quads, partition)
        if at < 0 or quads[at + 2] < 0:
            return None
        return PartitionLeader(quads[at + 2], quads[at + 3])

    def name_of(self, topic_id: uuid.UUID | None) -> str | None:
        return None if topic_id is None else self._ids.get(topic_id.bytes)

    def learn_id(self, topic_id: uuid.UUID, name: str) -> None:
        if topic_id.int:
            self._ids[topic_id.bytes] = name

    def topics(self) -> list[str]:
        """The topics held, oldest first."""
        return list(self._topics)

    def observe(self, topic: str, partition: int, leader: int, epoch: int, now_s: float) -> bool:
        """Records a leader; True if the cache changed. An epoch below the cached one is stale
        and ignored; at the same epoch the cache keeps what it has (an epoch names one leader)."""
        quads = self._topics.get(topic)
        if quads is None:
            self._insert(topic, array("i", (0, partition, leader, epoch)))
            self.updated_at_s = now_s
            return True
        at = _position(quads, partition)
        if at < 0:
            quads.extend((0, partition, leader, epoch))
            self._partitions += 1
            self.updated_at_s = now_s
            return True
        if not self._newer(quads[at + 2], quads[at + 3], leader, epoch):
            return False
        quads[at + 2], quads[at + 3] = leader, epoch
        self.updated_at_s = now_s
        return True

    def _newer(self, known_leader: int, known_epoch: int, leader: int, epoch: int) -> bool:
        """Whether (leader, epoch) replaces what is known; counts a stale one."""
        if known_leader < 0:
            return True
        if epoch < known_epoch or (epoch == known_epoch and epoch >= 0):
            # An unknown epoch (Metadata before v7) says nothing against a known one.
            if epoch >= 0 and (epoch < known_epoch or leader != known_leader):
                self.stale_ignored += 1
            return False
        return True

    def observe_topic(self, name: str, topic_id: bytes | None, partitions: Quads, now_s: float) -> int:
        """Takes a topic of a Metadata response that came back without error (its partitions
        as ``protocol.metadata_scan`` reads them: the cache keeps that very array, so it must not
        change afterwards); returns how many leaders changed. A topic the cache holds exactly so
        (the common case: nothing moved) costs one comparison."""
        if topic_id is not None and topic_id != _NO_ID_BYTES:
            self._ids[topic_id] = name
        known = self._topics.get(name)
        if known is None:
            self._insert(name, partitions)
            leaders = partitions[2::4]
            changed = len(leaders) - leaders.count(-1)  # -1: no leader (and no other negative is sent)
        elif known == partitions:
            return 0
        else:
            changed = 0
            for i in range(0, len(partitions), 4):
                # LEADER_NOT_AVAILABLE (5) and friends carry leader -1: nothing to learn.
                leader = partitions[i + 2]
                if leader >= 0:
                    changed += self.observe(name, partitions[i + 1], leader, partitions[i + 3], now_s)
            return changed
        if changed:
            self.updated_at_s = now_s
        return changed

    def _insert(self, name: str, quads: Quads) -> None:
        count = len(quads) // 4
        if count > self._max:
            return  # a topic bigger than the whole cache is not kept
        if self._partitions + count > self._max:
            self._evict(min(self._max // 2, self._max - count))
        self._topics[name] = quads
        self._partitions += count

    def _evict(self, keep: int) -> None:
        """Drops the oldest topics until at most ``keep`` partitions are left."""
        while self._topics and self._partitions > keep:
            name = next(iter(self._topics))
            self._partitions -= len(self._topics.pop(name)) // 4
        held = self._topics
        self._ids = {i: n for i, n in self._ids.items() if n in held}
        self.generation += 1

    def age_s(self, now_s: float) -> float | None:
        return None if self.updated_at_s is None else now_s - self.updated_at_s


def _position(quads: Quads, partition: int) -> int:
    """Where ``partition``'s four ints start in ``quads`` (-1: not there). Partitions are
    usually listed in index order, so the index is tried first."""
    at = 4 * partition
    if 0 <= at < len(quads) and quads[at + 1] == partition:
        return at
    for at in range(1, len(quads), 4):
        if quads[at] == partition:
            return at - 1
    return -1


class ExpeditedRefresher:
    """Refreshes the metadata of topics whose partitions just answered NOT_LEADER_OR_FOLLOWER or
    FENCED_LEADER_EPOCH without a leader hint (brokers before KIP-951), so the next failure can
    be answered with one. One refresh at a time; topics asked for meanwhile join the next."""

    def __init__(self, cluster: Cluster, cache: LeaderCache, stats: ProxyStats, timeout_s: float,
                 min_interval_s: float = 0.05, learner: MetadataLearner | None = None,
                 topics: TopicCache | None = None) -> None:
        self.cluster = cluster
        self.cache = cache
        self.learner = learner if learner is not None else MetadataLearner(stats)
        self.topics = topics if topics is not None else TopicCache()
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
                body, version = await fetch_topic_metadata_body(self.cluster.dialer, address, topics, list(topic_ids),
                                                                self.timeout_s)
                head = read_metadata_head(body, version)
            except (TimeoutError, OSError, asyncio.IncompleteReadError, ConnectionError, ValueError,
                    ProtocolError) as exc:
                self.cluster.dialer.log_failure(f"{reason}_refresh", logging.WARNING, "%s metadata refresh from %s:%d "
                                                "failed: %s", reason, *address, exc or type(exc).__name__)
                continue
            for b in head.brokers:
                self.cluster.advertise(b.node_id, b.host, b.port)
            # Read a slice at a time, as clients' responses are: a refresh of many topics never
            # holds the event loop.
            changed = await self.learner.learn_all(self.topics, self.cache, body, version, head.topics_at)
            self.stats.metadata_refreshes[reason] += 1
            log.debug("%s metadata refresh of %d topics: %d leaders changed", reason, len(topics), changed)
            return True
        self.stats.metadata_refreshes[f"{reason}_failure"] += 1
        return False

    async def refresh_periodically(self, interval_s: float, timeout_s: float, answered: bool) -> None:
        """The proxy's own metadata refresh: the brokers and the leaders of up to
        :data:`PERIODIC_REFRESH_TOPICS` of the topics the cache holds come in one Metadata
        response, the next ones in the next refresh, round the cache (never every topic of a
        big cluster at once, never all topics); with no such topic (or no broker answering
        it), the brokers alone, from the bootstrap servers. After a refresh no broker answered
        (unreachable, or refusing the proxy's TLS or SASL), the next comes sooner: 1 s, then
        twice as long each time, up to the interval."""
        backoff_s = 1.0
        cursor = 0
        while True:
            if answered:
                backoff_s = 1.0
                await asyncio.sleep(interval_s)
            else:
                await asyncio.sleep(min(backoff_s, interval_s))
                backoff_s *= 2
            held = self.cache.topics()
            cursor = cursor if cursor < len(held) else 0
            topics = held[cursor : cursor + PERIODIC_REFRESH_TOPICS]
            cursor += len(topics)
            answered = bool(topics) and await self.refresh(sorted(topics), "periodic_leaders")
            if not answered:
                answered = await refresh_once(self.cluster, self.stats, timeout_s)

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
