"""One quota for the whole fleet: this instance's usage published to, and the other members'
read from, a Kafka topic on the cluster the proxies front (``fleet:``; the pure part is
quotas.fleet).

- **Publish.** Every ``sync_interval_ms`` one report goes to this instance's partition of
  ``fleet.topic`` (its id's hash): what it charged each quota entity worth reporting since the
  last report (``QuotaManager.take_local_usage`` at ``fleet.report_threshold``: an entity near
  its bound, or one the fleet shares), and a heartbeat even when that is nothing. Written with the
  proxy's own idempotent producer (proxy.control.quota_topic_producer) over the upstream TLS/SASL
  settings. A report that could not be written is carried into the next: no usage is lost.
- **Read.** Every partition is followed from the offset of ``now − the longest quota window``
  (ListOffsets by time), so a starting or restarted instance first reads the usage still inside
  the window, and is not ready (``/readyz``) until it has; then from there on. Each other
  member's reports of one read are summed per entity and added to the same samples as this
  instance's own usage (``QuotaManager.add_remote``), a slice at a time: windowed rates, KIP-599
  buckets, KIP-731 record and batch rates throttle on the fleet's rate, by Kafka's formulas. A
  principal seen by one instance only keeps its whole quota. Records are untrusted input: at
  most ``fleet.max_remote_entries_per_s`` entries decoded a second (past it a record is dropped
  unread, a heartbeat still), each within its own length, a bad one counted by reason and
  ignored (quotas.fleet.decode_usage); a record read twice is not counted twice.
- **Membership.** A member not heard from for ``member_timeout_ms`` has left; its usage ages out
  of the windows as any usage does.
- **Fallback.** When the topic could not be written, or not read, for ``member_timeout_ms``:
  ``share`` divides every bound by the members last known (never more than the quota in total),
  ``local`` enforces each whole bound here (as without a fleet). Logged when it starts and ends,
  counted, shown on ``/healthz`` and ``/readyz`` and in ``kqp_fleet_fallback``; sharing resumes
  by itself once the topic answers again.

The KIP-936 producer-id quota is shared too: new ids admitted by one member take the others'
tokens for that user (each member's Bloom filter stays its own, so an id seen on one member and
new on another counts there).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import zlib
from collections import Counter
from collections.abc import Callable
from typing import Any

from kafka.protocol.consumer import FetchRequest, ListOffsetsRequest
from kafka.record import MemoryRecords

from config.model import FleetConfig
from proxy.cluster.brokers import Cluster
from proxy.cluster.dialer import OwnConnection
from proxy.cluster.kafka_retry import KAFKA_BACKOFF
from proxy.cluster.refresh import fetch_topic_metadata
from proxy.control.quota_topic_producer import PartitionProducer, StoreError, broker_error
from proxy.control.topic_admin import create_topic
from quotas.common import PRODUCER_IDS_RATE
from quotas.fleet import (
    BadReport,
    EntityKey,
    EntryBudget,
    FleetMembers,
    UsageDecoder,
    UsageEntry,
    UsageReport,
    encode_chunks,
    report_head,
    usage_entries,
)
from quotas.manager import QuotaManager
from quotas.producer_ids import ProducerIdQuotaManager

log = logging.getLogger(__name__)

_UNKNOWN_TOPIC_OR_PARTITION = 3
_MAX_FETCH_BYTES = 4 << 20  # per partition and fetch: a hostile writer cannot make a read unbounded
_GZIP = 1  # Kafka's compression codec id
_FAILURES = (OSError, TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError)
APPLY_SLICE_ENTRIES = 500  # the other members' entries applied between two turns of the loop (a few ms)


def _monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


class FleetExchange:
    """See the module docstring. ``window_ms``: the longest quota window (history to read at
    start); ``clock``: the quota engines' clock (ms)."""

    def __init__(self, config: FleetConfig, cluster: Cluster, manager: QuotaManager, timeout_s: float,
                 window_ms: int, clock: Callable[[], int] = _monotonic_ms,
                 producer_ids: ProducerIdQuotaManager | None = None) -> None:
        self.config = config
        self._cluster = cluster
        self._manager = manager
        self._producer_ids = producer_ids
        self._timeout_s = timeout_s
        self._window_ms = window_ms
        self._clock = clock
        self.instance_id = config.instance_id or ""
        self.incarnation = secrets.randbits(63)
        self._started_at_ms = int(time.time() * 1000)  # wall clock: what reports carry
        self.id_conflicts = 0  # reports of another live instance using this instance's id
        self.members = FleetMembers(config.member_timeout_ms)
        self.loaded = asyncio.Event()  # the usage inside the window read once
        self.fallback = False
        self.fallback_total = 0  # times the fallback started
        self.fallback_since_ms = 0  # the clock when the last fallback started
        self.errors: Counter[str] = Counter()  # op -> failures
        self.ignored: Counter[str] = Counter()  # reason -> records ignored
        self.reports_sent = self.entries_sent = 0
        self.bytes_sent = 0
        self.bytes_read = 0
        self.remote_applied = 0
        self.remote_dropped = 0  # entries dropped unread, past max_remote_entries_per_s
        self._budget = EntryBudget(config.max_remote_entries_per_s, window_ms, clock())
        self._decoder = UsageDecoder()
        self._seq = 0
        self._carry: dict[tuple[str, str | None, str | None], float] = {}
        self.last_write_ms = self.last_read_ms = clock()  # the last write and read that succeeded
        self._known_members = 1  # the fleet's size before the topic went out of reach (with us)
        self._tasks: list[asyncio.Task[None]] = []
        self._producer: PartitionProducer | None = None
        self._created = False
        self._caught_up: set[int] = set()  # partitions read up to their end once
        self._next_offsets: dict[int, int] = {}  # partition -> the next offset to read
        self._read_retries = 0  # failed reads in a row: the backoff before the next

    # -- lifecycle ------------------------------------------------------------------------

    def start(self, instance_id: str) -> None:
        if not self.instance_id:
            self.instance_id = instance_id
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._publish()), loop.create_task(self._follow()),
                       loop.create_task(self._watch())]
        log.info("fleet: instance %s sharing usage through %s every %d ms (member timeout %d ms, fallback %s)",
                 self.instance_id, self.config.topic, self.config.sync_interval_ms, self.config.member_timeout_ms,
                 self.config.fallback)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._producer is not None:
            self._producer.close()

    @property
    def withheld_total(self) -> int:
        return self._manager.withheld_total

    def state(self) -> tuple[bool, str]:
        """(ready, a line for /healthz and /readyz)."""
        line = f"fleet {self.config.topic}: {len(self.members) + 1} members"
        if self.fallback:
            line += f"; FALLBACK ({self._fallback_text()}), the usage topic out of reach"
        if not self.loaded.is_set():
            return False, line + "; the usage inside the quota window not read yet"
        return True, line

    # -- publishing -----------------------------------------------------------------------

    @property
    def partition(self) -> int:
        return zlib.crc32(self.instance_id.encode()) % self.config.partitions

    async def _publish(self) -> None:
        interval_s = self.config.sync_interval_ms / 1000
        while True:
            await asyncio.sleep(interval_s)
            local = self._manager.take_local_usage(self._clock(), self.config.report_threshold)
            if self._producer_ids is not None:
                local += self._producer_ids.take_local_usage()
            for key, amount in local:
                self._carry[key] = self._carry.get(key, 0.0) + amount
            report = UsageReport(self.instance_id, self.incarnation, self._seq, int(time.time() * 1000),
                                 self.config.sync_interval_ms, usage_entries(self._carry.items()))
            try:
                async with asyncio.timeout(max(self._timeout_s, interval_s)):
                    await self._send(encode_chunks(report))
            except _FAILURES as exc:
                self._failed("write", exc)
                if self._producer is not None:
                    self._producer.failed(exc)
            else:
                self._carry.clear()  # entries the report did not carry (amounts of 0) included
                self.last_write_ms = self._clock()
            self._check_fallback()

    async def _send(self, chunks: list[tuple[bytes, tuple[UsageEntry, ...]]]) -> None:
        """Writes a report's records each in a batch of its own (a report larger than the broker's
        max.message.bytes, a client-id flood's, still goes), each taken out of what is carried to
        the next report once it landed: a failure leaves only what did not land to send again."""
        for value, entries in chunks:
            await self._write(value)
            self._seq += 1
            self.reports_sent += 1
            self.entries_sent += len(entries)
            self.bytes_sent += self._producer.last_batch_bytes if self._producer is not None else 0
            for e in entries:
                self._carry.pop((e.kind, e.user, e.client_id), None)

    async def _write(self, value: bytes) -> None:
        if not self._created:
            await self._ensure_topic()
        if self._producer is None:
            # gzip: a report's entity names and counts compress to about 40 % (zlib is always there).
            self._producer = PartitionProducer(self.config.topic, self._cluster.dialer, self._timeout_s,
                                               self._partition_leader, lambda metadata: None, self.partition,
                                               compression_type=_GZIP)
        key = self.instance_id.encode()
        await self._producer.send([(key, value)])

    # -- reading --------------------------------------------------------------------------

    async def _follow(self) -> None:
        while True:
            try:
                if not self._created:
                    await self._ensure_topic()
                leaders = self._leaders(await self._metadata())
                async with asyncio.TaskGroup() as group:  # one connection per leader; one failing ends all
                    for leader, partitions in leaders.items():
                        group.create_task(self._follow_leader(leader, partitions))
            except* _FAILURES as failures:
                self._failed("read", failures.exceptions[0])
                self._check_fallback()
                await asyncio.sleep(KAFKA_BACKOFF.delay_s(self._read_retries, 0.5))
                self._read_retries = min(self._read_retries + 1, 10)

    async def _follow_leader(self, leader: tuple[str, int], partitions: list[int]) -> None:
        async with await self._cluster.dialer.open(leader, self._timeout_s) as conn:
            async with asyncio.timeout(self._timeout_s):
                ends = await self._offsets(conn, partitions, -1)
                new = [p for p in partitions if p not in self._next_offsets]
                if new:  # the first time: from the oldest usage still inside the window
                    start = await self._offsets(conn, new, int(time.time() * 1000) - self._window_ms)
                    self._next_offsets.update({p: (start[p] if start[p] >= 0 else ends[p]) for p in new})
            # A reconnect goes on where the last connection stopped: nothing is read twice.
            offsets = {p: self._next_offsets[p] for p in partitions}
            wait_ms = max(self.config.sync_interval_ms // 2, 10)
            while True:
                async with asyncio.timeout(self._timeout_s + wait_ms / 1000):
                    highs = await self._fetch(conn, offsets, wait_ms)
                self._next_offsets.update(offsets)
                self.last_read_ms = self._clock()
                self._read_retries = 0  # the next outage backs off from Kafka's first retry again
                self._expire_members()
                self._check_fallback()
                if not self.loaded.is_set() and all(offsets[p] >= max(highs.get(p, 0), ends[p]) for p in partitions):
                    self._caught_up.update(partitions)
                    if len(self._caught_up) >= self.config.partitions:
                        log.info("fleet: read the usage inside the last %d ms: %d other members", self._window_ms,
                                 len(self.members))
                        self.loaded.set()

    async def _offsets(self, conn: OwnConnection, partitions: list[int], timestamp: int) -> dict[int, int]:
        """ListOffsets: the first offset at or after ``timestamp`` (-1: latest) per partition."""
        version = min(conn.api_versions.get(ListOffsetsRequest.API_KEY, (0, 0))[1], 5)
        if version < 1:
            raise StoreError(f"the broker offers no ListOffsets version >= 1 ({version})", retriable=False)
        T = ListOffsetsRequest[version].ListOffsetsTopic
        parts = [T.ListOffsetsPartition(partition_index=p, current_leader_epoch=-1, timestamp=timestamp)
                 for p in partitions]
        resp = await conn.round_trip(ListOffsetsRequest[version](replica_id=-1, isolation_level=0,
                                                                 topics=[T(name=self.config.topic, partitions=parts)]))
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

    async def _fetch(self, conn: OwnConnection, offsets: dict[int, int], wait_ms: int) -> dict[int, int]:
        """One Fetch of every partition from ``offsets`` (moved past what was read); the high
        watermarks."""
        version = min(conn.api_versions.get(FetchRequest.API_KEY, (0, 0))[1], 12)  # v13+: topic ids
        if version < 4:
            raise StoreError(f"the broker offers no Fetch version >= 4 ({version})", retriable=False)
        T = FetchRequest[version].FetchTopic
        parts = [T.FetchPartition(partition=p, current_leader_epoch=-1, fetch_offset=o, last_fetched_epoch=-1,
                                  log_start_offset=-1, partition_max_bytes=_MAX_FETCH_BYTES)
                 for p, o in offsets.items()]
        resp: Any = await conn.round_trip(FetchRequest[version](
            replica_id=-1, max_wait_ms=wait_ms, min_bytes=1, max_bytes=_MAX_FETCH_BYTES, isolation_level=0,
            session_id=0, session_epoch=-1, topics=[T(topic=self.config.topic, partitions=parts)],
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

    async def _apply(self, data: bytes, offsets: dict[int, int], partition: int) -> None:
        """Applies the reports in ``data`` from ``offsets[partition]`` on. Their entries are summed
        per entity first and each entity's sum applied once (the same samples, at the same
        instant: a member's cost grows with the entities, not with the reports naming them), a
        slice of about APPLY_SLICE_ENTRIES entries at a time, the loop given a turn between two.
        ``offsets[partition]`` (and where a reconnect reads from) moves past a slice only once it
        is applied: a read cut short applies nothing twice and loses nothing read."""
        records = MemoryRecords(data)
        offset = offsets[partition]
        now = self._clock()
        sums: dict[EntityKey, list[float]] = {}  # entity -> [amount, entries]
        read = 0  # entries summed since the last slice was applied
        while (batch := records.next_batch()) is not None:
            for record in batch:
                if record.offset < offset:
                    continue
                offset = record.offset + 1
                read += self._read_value(record.value, now, sums)
                if read >= APPLY_SLICE_ENTRIES:
                    self._add(sums, now)
                    offsets[partition] = self._next_offsets[partition] = offset
                    sums, read = {}, 0
                    await asyncio.sleep(0)
                    now = self._clock()
            offset = max(offset, getattr(batch, "next_offset", offset))
        self._add(sums, now)
        offsets[partition] = self._next_offsets[partition] = offset

    def _expire_members(self) -> None:
        for member in self.members.expire(self._clock()):
            log.info("fleet: member %s left (silent for %d ms)", member, self.config.member_timeout_ms)
        self._pace()

    def _pace(self) -> None:
        """The quota engines pace bursts by the members sharing now (none while in fallback)."""
        members = 1 if self.fallback else len(self.members) + 1
        self._manager.set_fleet(members, self.config.sync_interval_ms)

    def _read_value(self, value: bytes | None, now: int, sums: dict[EntityKey, list[float]]) -> int:
        """Adds one record's entries to ``sums``; how many (0 when it was not decoded)."""
        try:
            head, count, _ = read = report_head(value or b"")
            if head.instance_id == self.instance_id and head.incarnation == self.incarnation:
                return 0  # our own: already in our samples
            if count and not self._budget.take(count, now, self.loaded.is_set()):
                # Its entries are dropped unread; it still tells who is in the fleet.
                self.ignored["over_budget"] += 1
                self.remote_dropped += count
                self._cluster.dialer.log_failure(
                    "fleet_budget", logging.WARNING, "fleet topic %s: a report of %d entries from %s dropped unread: "
                    "past fleet.max_remote_entries_per_s (%d)", self.config.topic, count, head.instance_id,
                    self.config.max_remote_entries_per_s)
                self._counts(head, now)
                return 0
            head, entries = self._decoder.decode(value or b"", read)
        except BadReport as exc:
            self.ignored[exc.reason] += 1
            self._cluster.dialer.log_failure("fleet_record", logging.WARNING,
                                             "fleet topic %s: record ignored: %s", self.config.topic, exc)
            return 0
        if not self._counts(head, now):
            return 0
        for key, amount in entries:
            summed = sums.get(key)
            if summed is None:
                sums[key] = [amount, 1]
            else:
                summed[0] += amount
                summed[1] += 1
        return len(entries)

    def _counts(self, report: UsageReport, now: int) -> bool:
        """Whether the usage of ``report`` counts here (it is news), noting its sender as a member."""
        if report.instance_id == self.instance_id:
            # A former incarnation of this instance (a restart): its usage still counts; it is not a member.
            if report.sent_at_ms > self._started_at_ms:  # no former incarnation writes after we started
                self.id_conflicts += 1
                self._cluster.dialer.log_failure(
                    "fleet_instance_id", logging.WARNING, "fleet topic %s: another running instance reports as "
                    "%s (its usage counts, but the fleet miscounts its members): give each a fleet.instance_id "
                    "of its own", self.config.topic, self.instance_id)
            return True
        if time.time() * 1000 - report.sent_at_ms >= self.config.member_timeout_ms:
            # History read at start: the usage counts, but its sender may be long gone (by its own clock).
            return True
        if not self.members.admit(report, now):
            self.ignored["duplicate"] += 1
            return False
        return True

    def _add(self, sums: dict[EntityKey, list[float]], now: int) -> None:
        manager, producer_ids = self._manager, self._producer_ids
        for (kind, user, client_id), (amount, entries) in sums.items():
            if kind == PRODUCER_IDS_RATE:
                applied = (producer_ids is not None and user is not None and client_id is None
                           and producer_ids.add_remote(user, amount, now))
            else:
                applied = manager.add_remote(kind, user, client_id, amount, now)
            if applied:  # else no rule here gives it (or it would evict an entity of ours)
                self.remote_applied += int(entries)

    # -- fallback -------------------------------------------------------------------------

    async def _watch(self) -> None:
        """Checks for the fallback on a clock of its own: a write or read that fails slowly (a
        producer retrying, a reconnect's backoff) must not put off the fallback past
        ``member_timeout_ms`` plus one check."""
        period_s = min(self.config.sync_interval_ms, self.config.member_timeout_ms) / 1000 / 2
        while True:
            await asyncio.sleep(period_s)
            self._check_fallback()

    def _check_fallback(self) -> None:
        now = self._clock()
        timeout = self.config.member_timeout_ms
        unwritten_ms, unread_ms = now - self.last_write_ms, now - self.last_read_ms
        out_of_reach = unwritten_ms >= timeout or unread_ms >= timeout
        if out_of_reach and not self.fallback:
            self.fallback = True
            self.fallback_total += 1
            self.fallback_since_ms = now
            self._known_members = len(self.members) + 1
            if self.config.fallback == "share":
                self._manager.set_share(self._known_members)
            self._pace()
            self.loaded.set()  # ready all the same: what is enforced is the fallback's
            log.warning("fleet: the usage topic %s is out of reach (not written for %d ms, not read for %d ms; "
                        "member timeout %d ms): fallback %s", self.config.topic, unwritten_ms, unread_ms, timeout,
                        self._fallback_text())
        elif not out_of_reach and self.fallback:
            self.fallback = False
            self._manager.set_share(1)
            self._pace()
            log.warning("fleet: the usage topic %s answers again: sharing resumed", self.config.topic)

    def _fallback_text(self) -> str:
        if self.config.fallback == "share":
            return f"share: each bound / {self._known_members} members"
        return "local: each whole bound enforced here alone"

    def _failed(self, op: str, exc: BaseException) -> None:
        self.errors[op] += 1
        self._cluster.dialer.log_failure(f"fleet_{op}", logging.WARNING, "fleet topic %s: %s failed: %s",
                                         self.config.topic, op, str(exc) or type(exc).__name__)

    # -- the topic ------------------------------------------------------------------------

    async def _metadata(self) -> Any:
        """The topic's metadata; a topic found missing (deleted since) is made again by the next
        write or read."""
        address = self._cluster.upstream_address(None, 0)
        metadata = await fetch_topic_metadata(self._cluster.dialer, address, [self.config.topic], [],
                                              self._timeout_s)
        if any(t.name == self.config.topic and t.error_code == _UNKNOWN_TOPIC_OR_PARTITION for t in metadata.topics):
            self._created = False
        return metadata

    def _leaders(self, metadata: Any) -> dict[tuple[str, int], list[int]]:
        brokers = {b.node_id: (b.host, b.port) for b in metadata.brokers}
        out: dict[tuple[str, int], list[int]] = {}
        for topic in metadata.topics:
            if topic.name != self.config.topic:
                continue
            if topic.error_code:
                raise broker_error("Metadata", topic.error_code, self.config.topic)
            for p in topic.partitions:
                if p.leader_id in brokers:
                    out.setdefault(brokers[p.leader_id], []).append(p.partition_index)
        if not out:
            raise StoreError(f"no leader known for {self.config.topic}")
        return out

    async def _partition_leader(self) -> tuple[str, int]:
        for leader, partitions in self._leaders(await self._metadata()).items():
            if self.partition in partitions:
                return leader
        raise StoreError(f"no leader known for {self.config.topic}-{self.partition}")

    async def _ensure_topic(self) -> None:
        metadata = await self._metadata()
        known = [t for t in metadata.topics if t.name == self.config.topic]
        if known and known[0].error_code == 0:
            self._created = True
            return
        brokers = {b.node_id: (b.host, b.port) for b in metadata.brokers}
        target = brokers.get(metadata.controller_id) or next(iter(brokers.values()), None)
        if target is None:
            raise StoreError("no broker known to create the fleet topic")
        replication = min(3, len(brokers))
        code = await create_topic(self._cluster.dialer, target, self.config.topic, self.config.partitions, replication,
                                  {"cleanup.policy": "delete", "retention.ms": str(self.config.retention_ms)},
                                  self._timeout_s)
        if code == 0:
            log.info("created the fleet topic %s (%d partitions, replication factor %d, retention.ms %d)",
                     self.config.topic, self.config.partitions, replication, self.config.retention_ms)
        self._created = True
