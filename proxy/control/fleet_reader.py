"""Follows partitions of one fleet topic (proxy.control.fleet): the usage topic's, or the
totals topic's (``fleet.aggregation: owners``). One connection per partition leader, a Fetch
long-polled for half a sync interval, records handed to the caller's ``apply`` in order. A
partition is first read from the caller's start offset, or from the oldest record still inside
the quota window (ListOffsets by time); a reconnect goes on where the last read stopped, so
nothing is applied twice. The partitions followed may change (``wanted``): the reader then
starts again with the new set, keeping where each partition it still follows was."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from kafka.protocol.consumer import FetchRequest, ListOffsetsRequest
from kafka.record import MemoryRecords

from proxy.cluster.brokers import Cluster
from proxy.cluster.dialer import OwnConnection
from proxy.cluster.kafka_retry import KAFKA_BACKOFF
from proxy.cluster.refresh import fetch_topic_metadata
from proxy.control.quota_topic_producer import StoreError, broker_error

_UNKNOWN_TOPIC_OR_PARTITION = 3
_MAX_FETCH_BYTES = 4 << 20  # per partition and fetch: a hostile writer cannot make a read unbounded
FAILURES = (OSError, TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError)

# (records of one partition, offsets (moved past what was applied), partition)
Apply = Callable[[bytes, dict[int, int], int], Awaitable[None]]


class _Reassigned(Exception):
    """The partitions to follow changed."""


class TopicReader:
    """See the module docstring. ``wanted``: the partitions to follow now (None: all of the
    topic's); ``start``: where a partition newly followed starts (None: the quota window's
    oldest record); ``fetched``: after every read that succeeded, with whether every followed
    partition has been read to its end at least once; ``failed``: a read that failed (the
    reader then backs off and starts again)."""

    def __init__(self, topic: str, cluster: Cluster, timeout_s: float, wait_ms: int, window_ms: int, apply: Apply,
                 fetched: Callable[[bool], None], failed: Callable[[BaseException], None],
                 ensure_topic: Callable[[], Awaitable[None]], wanted: Callable[[], list[int] | None] = lambda: None,
                 start: Callable[[int], int | None] = lambda partition: None) -> None:
        self.topic = topic
        self._cluster = cluster
        self._timeout_s = timeout_s
        self._wait_ms = wait_ms
        self._window_ms = window_ms
        self._apply = apply
        self._fetched = fetched
        self._failed = failed
        self._ensure_topic = ensure_topic
        self._wanted = wanted
        self._start = start
        self.bytes_read = 0
        self.next_offsets: dict[int, int] = {}  # partition -> the next offset to read
        self._caught_up: set[int] = set()  # partitions read up to their end once
        self._following: list[int] = []
        self._retries = 0  # failed reads in a row: the backoff before the next

    async def run(self) -> None:
        while True:
            failure: BaseException | None = None
            try:
                await self._ensure_topic()
                leaders = self._leaders(await self.metadata())
                async with asyncio.TaskGroup() as group:  # one connection per leader; one failing ends all
                    for leader, partitions in leaders.items():
                        group.create_task(self._follow_leader(leader, partitions))
                    if not leaders:
                        group.create_task(self._idle())
            except* _Reassigned:
                pass  # started again at once with the new set
            except* FAILURES as failures:
                failure = failures.exceptions[0]
            if failure is not None:
                self._failed(failure)
                await asyncio.sleep(KAFKA_BACKOFF.delay_s(self._retries, 0.5))
                self._retries = min(self._retries + 1, 10)

    async def _idle(self) -> None:
        """Nothing to follow: waits for that to change (and says all is read meanwhile)."""
        while not self._changed():
            self._fetched(True)
            await asyncio.sleep(self._wait_ms / 1000)
        raise _Reassigned

    def _changed(self) -> bool:
        wanted = self._wanted()
        return wanted is not None and sorted(wanted) != self._following

    async def _follow_leader(self, leader: tuple[str, int], partitions: list[int]) -> None:
        async with await self._cluster.dialer.open(leader, self._timeout_s) as conn:
            async with asyncio.timeout(self._timeout_s):
                ends = await self._offsets(conn, partitions, -1)
                new = [p for p in partitions if p not in self.next_offsets]
                starts = {p: self._start(p) for p in new}
                by_time = [p for p in new if starts[p] is None]
                if by_time:  # from the oldest usage still inside the window
                    found = await self._offsets(conn, by_time, int(time.time() * 1000) - self._window_ms)
                    starts.update({p: (found[p] if found[p] >= 0 else ends[p]) for p in by_time})
                self.next_offsets.update({p: int(starts[p] or 0) for p in new})
            # A reconnect goes on where the last connection stopped: nothing is read twice.
            offsets = {p: self.next_offsets[p] for p in partitions}
            while True:
                async with asyncio.timeout(self._timeout_s + self._wait_ms / 1000):
                    highs = await self._fetch(conn, offsets)
                self.next_offsets.update(offsets)
                self._retries = 0  # the next outage backs off from Kafka's first retry again
                if all(offsets[p] >= max(highs.get(p, 0), ends[p]) for p in partitions):
                    self._caught_up.update(partitions)
                self._fetched(all(p in self._caught_up for p in self._following))
                if self._changed():
                    raise _Reassigned

    async def _offsets(self, conn: OwnConnection, partitions: list[int], timestamp: int) -> dict[int, int]:
        """ListOffsets: the first offset at or after ``timestamp`` (-1: latest) per partition."""
        version = min(conn.api_versions.get(ListOffsetsRequest.API_KEY, (0, 0))[1], 5)
        if version < 1:
            raise StoreError(f"the broker offers no ListOffsets version >= 1 ({version})", retriable=False)
        T = ListOffsetsRequest[version].ListOffsetsTopic
        parts = [T.ListOffsetsPartition(partition_index=p, current_leader_epoch=-1, timestamp=timestamp)
                 for p in partitions]
        resp = await conn.round_trip(ListOffsetsRequest[version](replica_id=-1, isolation_level=0,
                                                                 topics=[T(name=self.topic, partitions=parts)]))
        out = {}
        for topic in resp.topics:
            for part in topic.partitions:
                if part.error_code:
                    raise broker_error("ListOffsets", part.error_code)
                out[part.partition_index] = int(part.offset)
        missing = [p for p in partitions if p not in out]
        if missing:
            raise StoreError(f"ListOffsets answered nothing for partitions {missing}")
        return out

    async def _fetch(self, conn: OwnConnection, offsets: dict[int, int]) -> dict[int, int]:
        """One Fetch of every partition from ``offsets`` (moved past what was applied); the
        high watermarks."""
        version = min(conn.api_versions.get(FetchRequest.API_KEY, (0, 0))[1], 12)  # v13+: topic ids
        if version < 4:
            raise StoreError(f"the broker offers no Fetch version >= 4 ({version})", retriable=False)
        T = FetchRequest[version].FetchTopic
        parts = [T.FetchPartition(partition=p, current_leader_epoch=-1, fetch_offset=o, last_fetched_epoch=-1,
                                  log_start_offset=-1, partition_max_bytes=_MAX_FETCH_BYTES)
                 for p, o in offsets.items()]
        resp: Any = await conn.round_trip(FetchRequest[version](
            replica_id=-1, max_wait_ms=self._wait_ms, min_bytes=1, max_bytes=_MAX_FETCH_BYTES, isolation_level=0,
            session_id=0, session_epoch=-1, topics=[T(topic=self.topic, partitions=parts)],
            forgotten_topics_data=[], rack_id=""))
        if getattr(resp, "error_code", 0):
            raise broker_error("Fetch", resp.error_code)
        highs = {}
        for topic in resp.responses:
            for part in topic.partitions:
                if part.error_code:
                    raise broker_error("Fetch", part.error_code)
                if part.partition_index not in offsets:
                    continue
                highs[part.partition_index] = int(part.high_watermark)
                data = bytes(part.records or b"")
                self.bytes_read += len(data)
                await self._apply(data, offsets, part.partition_index)
        return highs

    # -- the topic ------------------------------------------------------------------------

    async def metadata(self) -> Any:
        address = self._cluster.upstream_address(None, 0)
        return await fetch_topic_metadata(self._cluster.dialer, address, [self.topic], [], self._timeout_s)

    def _leaders(self, metadata: Any) -> dict[tuple[str, int], list[int]]:
        wanted = self._wanted()
        if wanted is not None:  # a partition followed again later starts afresh (``start``)
            for p in set(self.next_offsets) - set(wanted):
                del self.next_offsets[p]
                self._caught_up.discard(p)
        self._following = []
        out: dict[tuple[str, int], list[int]] = {}
        for p, leader in leaders(metadata, self.topic).items():
            if wanted is None or p in wanted:
                out.setdefault(leader, []).append(p)
                self._following.append(p)
        self._following.sort()
        leaderless = sorted(set(wanted or ()) - set(self._following))
        if leaderless:
            raise StoreError(f"no leader known for {self.topic} partitions {leaderless}")
        return out


class RecordsFrom:
    """The values of the records in ``data`` (one partition's, as a Fetch returns them) from
    ``offset`` on, in order; ``end``: the offset after the last one yielded (past a batch's end
    once it is read whole), where a read that stops here goes on."""

    def __init__(self, data: bytes, offset: int) -> None:
        self._records = MemoryRecords(data)
        self.end = offset

    def __iter__(self) -> Iterator[bytes | None]:
        while (batch := self._records.next_batch()) is not None:
            for record in batch:
                if record.offset < self.end:
                    continue  # read before (a fetch answers from the batch's start)
                self.end = record.offset + 1
                yield record.value
            self.end = max(self.end, getattr(batch, "next_offset", self.end))


def missing(metadata: Any, topic: str) -> bool:
    """Whether ``metadata`` says the broker does not know ``topic``."""
    return any(t.name == topic and t.error_code == _UNKNOWN_TOPIC_OR_PARTITION for t in metadata.topics)


def leaders(metadata: Any, topic: str) -> dict[int, tuple[str, int]]:
    """Partition -> its leader's address, for ``topic`` in ``metadata``; StoreError when the
    topic has an error or no leader is known."""
    brokers = {b.node_id: (b.host, b.port) for b in metadata.brokers}
    out: dict[int, tuple[str, int]] = {}
    for t in metadata.topics:
        if t.name != topic:
            continue
        if t.error_code:
            raise broker_error("Metadata", t.error_code, topic)
        for p in t.partitions:
            if p.leader_id in brokers:
                out[p.partition_index] = brokers[p.leader_id]
    if not out:
        raise StoreError(f"no leader known for {topic}")
    return out
