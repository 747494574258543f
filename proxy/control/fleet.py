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
from functools import partial
from typing import Any

from config.model import FleetConfig
from proxy.cluster.brokers import Cluster
from proxy.control.fleet_reader import FAILURES, RecordsFrom, TopicReader, leaders, missing
from proxy.control.quota_topic_producer import PartitionProducer, StoreError
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

_GZIP = 1  # Kafka's compression codec id
APPLY_SLICE_ENTRIES = 500  # the other members' entries applied between two turns of the loop (a few ms)


def _monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def sum_into(sums: dict[EntityKey, list[float]], entries: list[tuple[EntityKey, float]],
             less: dict[EntityKey, float] | None = None) -> int:
    """Adds ``entries`` to ``sums`` (entity -> [amount, entries]), each less its amount in ``less``
    (what is left, if anything); how many entries were read."""
    for key, amount in entries:
        if less:
            amount -= less.get(key, 0.0)
            if amount <= 0:
                continue
        summed = sums.get(key)
        if summed is None:
            sums[key] = [amount, 1]
        else:
            summed[0] += amount
            summed[1] += 1
    return len(entries)


class FleetExchange:
    """See the module docstring. ``window_ms``: the longest quota window (history to read at
    start); ``clock``: the quota engines' clock (ms)."""

    REPORTS_IN_FLIGHT = 1  # a report is read by the others within about one interval

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
        self.remote_applied = 0
        self.remote_dropped = 0  # entries dropped unread, past max_remote_entries_per_s
        self._budget = EntryBudget(config.max_remote_entries_per_s, window_ms, clock())
        self._decoder = UsageDecoder()
        self._seq = 0
        self._carry: dict[tuple[str, str | None, str | None], float] = {}
        self.last_write_ms = self.last_read_ms = clock()  # the last write and read that succeeded
        self._known_members = 1  # the fleet's size before the topic went out of reach (with us)
        self._tasks: list[asyncio.Task[None]] = []
        self._producers: dict[int, PartitionProducer] = {}  # partition -> the producer writing to it
        self._writing = -1  # the partition written last (whose producer a failure concerns)
        self._created_topics: set[str] = set()
        self._reader = TopicReader(config.topic, cluster, timeout_s, max(config.sync_interval_ms // 2, 10), window_ms,
                                   self._apply, self._fetched, self._read_failed, self._ensure_topic)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self, instance_id: str) -> None:
        if not self.instance_id:
            self.instance_id = instance_id
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._publish()), loop.create_task(self._reader.run()),
                       loop.create_task(self._watch())]
        log.info("fleet: instance %s sharing usage through %s every %d ms (member timeout %d ms, fallback %s)",
                 self.instance_id, self.config.topic, self.config.sync_interval_ms, self.config.member_timeout_ms,
                 self.config.fallback)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for producer in self._producers.values():
            producer.close()

    def size(self) -> int:
        """The members sharing usage now, this one included."""
        return len(self.members) + 1

    def member_ages(self) -> list[tuple[str, int]]:
        """(member, this instance's clock when its usage was last read) for every other member."""
        return list(self.members.live())

    @property
    def withheld_total(self) -> int:
        return self._manager.withheld_total

    def state(self) -> tuple[bool, str]:
        """(ready, a line for /healthz and /readyz)."""
        line = f"fleet {self.config.topic}: {self.size()} members"
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
                    await self._send_report(report)
            except FAILURES as exc:
                self._failed("write", exc)
                producer = self._producers.get(self._writing)
                if producer is not None:
                    producer.failed(exc)
            else:
                self._carry.clear()  # entries the report did not carry (amounts of 0) included
                self.last_write_ms = self._clock()
            self._check_fallback()

    async def _send_report(self, report: UsageReport) -> None:
        await self._send(encode_chunks(report), self.partition)

    async def _send(self, chunks: list[tuple[bytes, tuple[UsageEntry, ...]]], partition: int) -> None:
        """Writes a report's records to ``partition``, each in a batch of its own (a report
        larger than the broker's max.message.bytes, a client-id flood's, still goes), each taken
        out of what is carried to the next report once it landed: a failure leaves only what did
        not land to send again."""
        for value, entries in chunks:
            self._landed(partition, await self._write(value, partition), entries)
            self._seq += 1
            self.reports_sent += 1
            self.entries_sent += len(entries)
            producer = self._producers.get(partition)
            self.bytes_sent += producer.last_batch_bytes if producer is not None else 0
            for e in entries:
                self._carry.pop((e.kind, e.user, e.client_id), None)

    def _landed(self, partition: int, offset: int, entries: tuple[UsageEntry, ...]) -> None:
        """A record carrying ``entries`` landed at ``offset`` of ``partition``."""

    async def _write(self, value: bytes, partition: int) -> int:
        """Writes one record to ``partition``; its offset."""
        await self._ensure_topic()
        self._writing = partition
        producer = self._producers.get(partition)
        if producer is None:
            # gzip: a report's entity names and counts compress to about 40 % (zlib is always there).
            producer = self._producers[partition] = PartitionProducer(
                self.config.topic, self._cluster.dialer, self._timeout_s, partial(self._partition_leader, partition),
                lambda metadata: None, partition, compression_type=_GZIP)
        return await producer.send([(self.instance_id.encode(), value)])

    # -- reading --------------------------------------------------------------------------

    async def _apply(self, data: bytes, offsets: dict[int, int], partition: int) -> None:
        """Applies the reports in ``data`` from ``offsets[partition]`` on (see :meth:`_apply_read`)."""
        await self._apply_read(self._reader, data, offsets, partition, self._read_value)

    async def _apply_read(self, reader: TopicReader, data: bytes, offsets: dict[int, int], partition: int,
                          read_value: Callable[[bytes | None, int, dict[EntityKey, list[float]]], int]) -> None:
        """Applies what ``read_value`` makes of each record in ``data`` (one partition of
        ``reader``'s topic) from ``offsets[partition]`` on. Entries are summed per entity first and
        each entity's sum applied once (the same samples, at the same instant: a member's cost
        grows with the entities, not with the records naming them), a slice of about
        APPLY_SLICE_ENTRIES entries at a time, the loop given a turn between two.
        ``offsets[partition]`` (and where a reconnect reads from) moves past a slice only once it
        is applied: a read cut short applies nothing twice and loses nothing read."""
        records = RecordsFrom(data, offsets[partition])
        now = self._clock()
        sums: dict[EntityKey, list[float]] = {}  # entity -> [amount, entries]
        read = 0  # entries summed since the last slice was applied
        for value in records:
            read += read_value(value, now, sums)
            if read >= APPLY_SLICE_ENTRIES:
                self._add(sums, now)
                offsets[partition] = reader.next_offsets[partition] = records.end
                sums, read = {}, 0
                await asyncio.sleep(0)
                now = self._clock()
        self._add(sums, now)
        offsets[partition] = reader.next_offsets[partition] = records.end

    @property
    def bytes_read(self) -> int:
        return self._reader.bytes_read

    def _fetched(self, caught_up: bool) -> None:
        self.last_read_ms = self._clock()
        self._expire_members()
        self._check_fallback()
        if caught_up and not self.loaded.is_set():
            log.info("fleet: read the usage inside the last %d ms: %d other members", self._window_ms,
                     self.size() - 1)
            self.loaded.set()

    def _read_failed(self, exc: BaseException) -> None:
        self._failed("read", exc)
        self._check_fallback()

    def _expire_members(self) -> None:
        for member in self.members.expire(self._clock()):
            log.info("fleet: member %s left (silent for %d ms)", member, self.config.member_timeout_ms)
        self._pace()

    def _pace(self) -> None:
        """The quota engines pace bursts by the members sharing now (none while in fallback)."""
        members = 1 if self.fallback else self.size()
        self._manager.set_fleet(members, self.config.sync_interval_ms, self.REPORTS_IN_FLIGHT)

    def _read_value(self, value: bytes | None, now: int, sums: dict[EntityKey, list[float]]) -> int:
        """Adds one record's entries to ``sums``; how many (0 when it was not decoded)."""
        read = self._decoded(value, now)
        if read is None:
            return 0
        return sum_into(sums, read[1])

    def _decoded(self, value: bytes | None, now: int, own: bool = False,
                 counts: bool = True) -> tuple[UsageReport, list[tuple[EntityKey, float]]] | None:
        """The report in one record and its entries, when its usage counts here (news, within
        the read budget, decoded); ``own``: this incarnation's own reports count too;
        ``counts``: False leaves out whether it is news (the caller knows) and who sent it."""
        try:
            head, count, _ = read = report_head(value or b"")
            mine = head.instance_id == self.instance_id and head.incarnation == self.incarnation
            if mine and not own:
                return None  # our own: already in our samples
            if count and not mine and not self._within_budget(count, now, "a report", head.instance_id):
                if counts:  # its entries are dropped unread; it still tells who is in the fleet
                    self._counts(head, now)
                return None
            head, entries = self._decoder.decode(value or b"", read)
        except BadReport as exc:
            self._ignore(exc)
            return None
        if counts and not mine and not self._counts(head, now):
            return None
        return head, entries

    def _within_budget(self, count: int, now: int, what: str, sender: str) -> bool:
        """Whether ``count`` more entries may be read now (fleet.max_remote_entries_per_s); if
        not, they are counted as dropped and logged (rate-limited)."""
        if self._budget.take(count, now, self.loaded.is_set()):
            return True
        self.ignored["over_budget"] += 1
        self.remote_dropped += count
        self._cluster.dialer.log_failure(
            "fleet_budget", logging.WARNING, "fleet: %s of %d entries from %s dropped unread: past "
            "fleet.max_remote_entries_per_s (%d)", what, count, sender, self.config.max_remote_entries_per_s)
        return False

    def _ignore(self, exc: BadReport) -> None:
        self.ignored[exc.reason] += 1
        self._cluster.dialer.log_failure("fleet_record", logging.WARNING, "fleet topic %s: record ignored: %s",
                                         self.config.topic, exc)

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
            self._known_members = self.size()
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

    async def _metadata(self, reader: TopicReader | None = None) -> Any:
        """The metadata of the usage topic (or of ``reader``'s); a topic found missing (deleted
        since) is made again by the next write or read."""
        reader = reader or self._reader
        metadata = await reader.metadata()
        if missing(metadata, reader.topic):
            self._created_topics.discard(reader.topic)
        return metadata

    async def _partition_leader(self, partition: int) -> tuple[str, int]:
        leader = leaders(await self._metadata(), self.config.topic).get(partition)
        if leader is None:
            raise StoreError(f"no leader known for {self.config.topic}-{partition}")
        return leader

    async def _ensure_topic(self) -> None:
        await self._ensure(self._reader, self.config.partitions)

    async def _ensure(self, reader: TopicReader, partitions: int) -> None:
        """Creates ``reader``'s topic, of ``partitions``, unless it is there."""
        topic = reader.topic
        if topic in self._created_topics:
            return
        metadata = await self._metadata(reader)
        known = [t for t in metadata.topics if t.name == topic]
        if known and known[0].error_code == 0:
            self._created_topics.add(topic)
            return
        brokers = {b.node_id: (b.host, b.port) for b in metadata.brokers}
        target = brokers.get(metadata.controller_id) or next(iter(brokers.values()), None)
        if target is None:
            raise StoreError("no broker known to create the fleet topic")
        replication = min(3, len(brokers))
        code = await create_topic(self._cluster.dialer, target, topic, partitions, replication,
                                  {"cleanup.policy": "delete", "retention.ms": str(self.config.retention_ms)},
                                  self._timeout_s)
        if code == 0:
            log.info("created the fleet topic %s (%d partitions, replication factor %d, retention.ms %d)",
                     topic, partitions, replication, self.config.retention_ms)
        self._created_topics.add(topic)
