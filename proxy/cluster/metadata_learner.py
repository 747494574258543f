"""What the proxy learns from Metadata responses, a slice at a time.

A Metadata response is rewritten and sent on as soon as its broker list is (see
``protocol.metadata_scan``); its topics are learned here, off the response's path: the first
slice at once (a response of a few topics is learned before it is sent on, as before), the rest
by a task that reads :data:`SLICE_PARTITIONS` partitions per turn of the event loop. So an
all-topics Metadata of a million partitions holds the loop for one slice at a time, never for
the whole walk, and no client waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from protocol.frames import Buffer
from protocol.metadata_scan import MetadataTopic, TopicWalk
from protocol.scan import ScanError
from proxy.cluster.topics import TopicCache
from proxy.observability.logs import LogLimiter
from proxy.observability.stats import ProxyStats

if TYPE_CHECKING:  # the leader cache's refresher learns through this module
    from proxy.cluster.leaders import LeaderCache

log = logging.getLogger(__name__)

# About 1-2 ms of the event loop a slice on a 2-core VM (0.6-1 µs a partition): the longest
# any other client of the process waits for this work.
SLICE_PARTITIONS = 2_000
# Responses waiting to be learned hold their bytes: past this many, the oldest waiting one is
# dropped (a newer one tells at least as much), never the one being read.
MAX_PENDING_BYTES = 64 << 20
# The topics of the last response learned are kept (as bytes) up to this size: a response whose
# topics are the very same bytes (a cluster that did not change, asked again and again by
# pattern-subscribing consumers and admin tools) is not walked again.
MAX_REMEMBERED_BYTES = 16 << 20


# What a learned response's topics were learned into: the caches, as they were (their
# generations change when they forget or drop topics), and the version read.
_Into = tuple[int, int, int, int, int]


@dataclass
class _Learning:
    walk: TopicWalk
    topics: TopicCache
    leaders: LeaderCache
    size: int
    done: asyncio.Future[int] | None = None  # resolved with the number of leaders changed
    changed: int = 0
    into: _Into | None = None
    region: bytes | None = None  # its topics, to remember once learned


class MetadataLearner:
    """Feeds the topic and leader caches from Metadata response bodies (see the module doc).

    Guarantees: responses are learned in the order they were given; at most
    ``slice_partitions`` partitions are read per turn of the event loop; the bytes waiting
    are bounded by ``max_pending_bytes``; a body that does not match its schema is dropped
    with a rate-limited log line and a count (``stats.metadata_learned["malformed"]``); a
    response whose topics are byte for byte those of the last one learned into the same caches
    (which forgot and dropped nothing since) is not walked again (``"unchanged"``)."""

    def __init__(self, stats: ProxyStats | None = None, slice_partitions: int = SLICE_PARTITIONS,
                 max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        self.stats = stats
        self.slice_partitions = slice_partitions
        self.max_pending_bytes = max_pending_bytes
        self._queue: deque[_Learning] = deque()
        self._pending_bytes = 0
        self._task: asyncio.Task[None] | None = None
        self._log = LogLimiter(log)
        self.dropped = 0  # responses dropped unlearned: too many bytes waiting
        self.malformed = 0
        self._learned: tuple[_Into, bytes] | None = None  # the last response learned, its topics

    @property
    def pending(self) -> int:
        return len(self._queue)

    def learn(self, topics: TopicCache, leaders: LeaderCache, body: Buffer, version: int, topics_at: int) -> None:
        """Learns the topics of ``body`` (which must not change: bytes, or a view of bytes),
        starting at ``topics_at``. The first slice is read now, unless earlier responses are
        still being read; the rest later, in order."""
        self._start(topics, leaders, body, version, topics_at, None)

    def learn_all(self, topics: TopicCache, leaders: LeaderCache, body: Buffer, version: int,
                  topics_at: int) -> asyncio.Future[int]:
        """As :meth:`learn`; the future resolves with the number of leaders that changed once
        every topic is learned (0 for a body dropped or malformed)."""
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._start(topics, leaders, body, version, topics_at, done)
        return done

    def _start(self, topics: TopicCache, leaders: LeaderCache, body: Buffer, version: int, topics_at: int,
               done: asyncio.Future[int] | None) -> None:
        into = (id(topics), id(leaders), version, topics.generation, leaders.generation)
        region = bytes(body[topics_at:]) if len(body) - topics_at <= MAX_REMEMBERED_BYTES else None
        if region is not None and not self._queue and self._learned == (into, region):
            self._count("unchanged")  # the same topics, learned into the same caches: nothing to walk
            if done is not None:
                done.set_result(0)
            return
        try:
            walk = TopicWalk(body, version, topics_at)
        except ScanError as exc:
            self._malformed(exc, done)
            return
        job = _Learning(walk, topics, leaders, len(body), done, into=into, region=region)
        if not self._queue and self._slice(job):
            return
        self._queue.append(job)
        self._pending_bytes += job.size
        while self._pending_bytes > self.max_pending_bytes and len(self._queue) > 2:
            dropped = self._queue[1]  # the oldest not yet started: [0] is being read
            del self._queue[1]
            self._pending_bytes -= dropped.size
            self.dropped += 1
            self._count("dropped")
            if dropped.done is not None and not dropped.done.done():
                dropped.done.set_result(0)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self._queue:
            job = self._queue[0]  # never dropped: only jobs behind it are
            if self._slice(job):
                self._queue.popleft()
                self._pending_bytes -= job.size
            await asyncio.sleep(0)

    def _slice(self, job: _Learning) -> bool:
        """Reads one slice of ``job``; True once it is finished (learned or malformed)."""
        try:
            learned = job.walk.step(self.slice_partitions)
        except ScanError as exc:
            self._malformed(exc, job.done)
            return True
        job.changed += _apply(job.topics, job.leaders, learned)
        if not job.walk.done:
            return False
        self._count("responses")
        if job.region is not None and job.into is not None:
            self._learned = (job.into, job.region)
        if job.done is not None and not job.done.done():
            job.done.set_result(job.changed)
        return True

    def _malformed(self, exc: ScanError, done: asyncio.Future[int] | None) -> None:
        self.malformed += 1
        self._count("malformed")
        self._log.log(logging.WARNING, "a Metadata response could not be read for its topics (%s); it went "
                      "on as the broker sent it", exc)
        if done is not None and not done.done():
            done.set_result(0)

    def _count(self, outcome: str) -> None:
        if self.stats is not None:
            self.stats.metadata_learned[outcome] += 1

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for job in self._queue:
            if job.done is not None and not job.done.done():
                job.done.cancel()
        self._queue.clear()
        self._pending_bytes = 0


def _apply(topics: TopicCache, leaders: LeaderCache, learned: list[MetadataTopic]) -> int:
    """Records the topics that came back without error; returns the leaders changed."""
    now_s = time.monotonic()
    changed = 0
    for t in learned:
        if t.error_code != 0 or not t.name:
            continue
        topics.put_scanned(t.name, t.partition_count, t.topic_id)
        changed += leaders.observe_topic(t.name, t.topic_id, t.partitions, now_s)
    return changed
