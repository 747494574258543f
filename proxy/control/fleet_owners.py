"""``fleet.aggregation: owners``: the fleet's usage summed by partition owners (the pure part and
the scheme: quotas.fleet_totals), so that what a member reads grows with the partitions of the
usage topic, not with the members.

- **Publish.** As with the flat exchange (proxy.control.fleet), every member writes a report to
  its own partition of ``fleet.topic`` every sync interval, a heartbeat when it charged nothing
  worth reporting. It remembers what it reported under each sequence number (OwnReports).
- **Own.** Each partition is owned by one member (rendezvous hashing over the members this one
  knows, OwnersView). An owner reads its partitions of the usage topic from where the last
  totals of each ended (or, none known, from the oldest record inside the quota window), sums
  the reports per entity, and every sync interval writes one totals record per partition it
  read something of to the totals topic, ``<fleet.topic>-totals`` (one partition).
- **Read.** Every member follows the totals topic (from the oldest record inside the quota
  window at start: ``/readyz`` waits for it), applies each partition's totals from that
  partition's owner, each range of usage-topic offsets once (TotalsRanges), less its own part
  (its usage is in its samples already): the others' usage, into the same samples as the flat
  exchange's.
- **Failure.** An owner that stops publishing is dropped after ``member_timeout_ms``; the
  members that own its partitions then (rendezvous: only those move) go on from the last range
  it published, so its partitions' usage is late, not lost. Meanwhile the burst pacing
  (QuotaManager.paced_ms) holds each member to its part of what the window allows.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kafka.record import MemoryRecords

from config.model import FleetConfig
from proxy.cluster.brokers import Cluster
from proxy.control.fleet import APPLY_SLICE_ENTRIES, FleetExchange
from proxy.control.fleet_reader import FAILURES, TopicReader, leaders
from proxy.control.quota_topic_producer import PartitionProducer, StoreError
from quotas.fleet import BadReport, EntityKey, UsageEntry
from quotas.fleet_totals import OwnersView, OwnReports, PartitionSums, TotalsRanges, encode_totals, totals_head
from quotas.manager import QuotaManager
from quotas.producer_ids import ProducerIdQuotaManager

log = logging.getLogger(__name__)

_GZIP = 1  # Kafka's compression codec id
TOTALS_SUFFIX = "-totals"
_MAX_UNSENT_TOTALS = 64  # totals kept for the next interval while the totals topic cannot be written


def totals_topic(usage_topic: str) -> str:
    return usage_topic + TOTALS_SUFFIX


class OwnersExchange(FleetExchange):
    """See the module docstring; the same interface as FleetExchange."""

    REPORTS_IN_FLIGHT = 2  # a report reaches the others through its owner's next totals: one interval more

    def __init__(self, config: FleetConfig, cluster: Cluster, manager: QuotaManager, timeout_s: float,
                 window_ms: int, clock: Callable[[], int], producer_ids: ProducerIdQuotaManager | None = None) -> None:
        super().__init__(config, cluster, manager, timeout_s, window_ms, clock, producer_ids)
        wait_ms = max(config.sync_interval_ms // 2, 10)
        self.view = OwnersView(self.instance_id or "?", config.partitions, config.member_timeout_ms)
        self._ranges = TotalsRanges()
        # Totals come back within a few intervals; ten member timeouts of reports is plenty.
        self._own = OwnReports(max(64, 10 * config.member_timeout_ms // config.sync_interval_ms))
        self._sums: dict[int, PartitionSums] = {}
        self._unsent: list[bytes] = []
        self._totals_producer: PartitionProducer | None = None
        self.totals_sent = self.totals_dropped = 0
        self._live: set[str] = set()  # the members last seen live (for the log)
        # The usage topic: only the partitions this member owns, each from where its totals end.
        self._reader = TopicReader(config.topic, cluster, timeout_s, wait_ms, window_ms, self._apply_owned,
                                   self._owned_fetched, self._read_failed, self._ensure_topic, self._owned,
                                   self._ranges.end)
        self._totals = TopicReader(totals_topic(config.topic), cluster, timeout_s, wait_ms, window_ms,
                                   self._apply_totals, self._fetched, self._read_failed, self._ensure_totals_topic)

    def start(self, instance_id: str) -> None:
        super().start(instance_id)
        self.view.me = self.instance_id
        self._live = {self.instance_id}
        loop = asyncio.get_running_loop()
        self._tasks += [loop.create_task(self._totals.run()), loop.create_task(self._publish_totals())]

    async def stop(self) -> None:
        await super().stop()
        if self._totals_producer is not None:
            self._totals_producer.close()

    def size(self) -> int:
        return len(self.view.live(self._clock()))

    def member_ages(self) -> list[tuple[str, int]]:
        return self.view.seen()

    @property
    def bytes_read(self) -> int:
        return self._reader.bytes_read + self._totals.bytes_read

    def owned(self) -> list[int]:
        """The partitions this member owns now (none until the totals inside the window are read)."""
        return self.view.owned(self._clock()) if self.loaded.is_set() else []

    # -- publishing -----------------------------------------------------------------------

    def _sending(self, seq: int, entries: tuple[UsageEntry, ...]) -> None:
        self._own.note(seq, entries)

    async def _publish_totals(self) -> None:
        interval_s = self.config.sync_interval_ms / 1000
        while True:
            await asyncio.sleep(interval_s)
            sent_at_ms = int(time.time() * 1000)
            for partition in self.owned():
                sums = self._sums.get(partition)
                # A report sent 3/4 of a member timeout ago or earlier is a failed member's, read
                # late (clocks within a second or so of each other, as for the history at start).
                # Every interval, read or not: an owner's totals also say it is there.
                if sums is not None:
                    self._unsent += encode_totals(sums.take(
                        self.instance_id, self.incarnation, sent_at_ms, self.config.sync_interval_ms,
                        self.config.member_timeout_ms * 3 // 4))
            if len(self._unsent) > _MAX_UNSENT_TOTALS:  # the totals topic out of reach for long
                self.totals_dropped += len(self._unsent) - _MAX_UNSENT_TOTALS
                del self._unsent[:-_MAX_UNSENT_TOTALS]
            try:
                async with asyncio.timeout(max(self._timeout_s, interval_s)):
                    while self._unsent:
                        await self._write_totals(self._unsent[0])
                        self._unsent.pop(0)
                        self.totals_sent += 1
            except FAILURES as exc:
                self._failed("write", exc)
                if self._totals_producer is not None:
                    self._totals_producer.failed(exc)

    async def _write_totals(self, value: bytes) -> None:
        await self._ensure_totals_topic()
        if self._totals_producer is None:
            self._totals_producer = PartitionProducer(self._totals.topic, self._cluster.dialer, self._timeout_s,
                                                      self._totals_leader, lambda metadata: None, 0,
                                                      compression_type=_GZIP)
        await self._totals_producer.send([(self.instance_id.encode(), value)])
        self.bytes_sent += self._totals_producer.last_batch_bytes

    async def _totals_leader(self) -> tuple[str, int]:
        leader = leaders(await self._metadata(self._totals), self._totals.topic).get(0)
        if leader is None:
            raise StoreError(f"no leader known for {self._totals.topic}-0")
        return leader

    async def _ensure_totals_topic(self) -> None:
        await self._ensure(self._totals, 1)

    # -- owning: the usage topic's partitions this member sums ----------------------------

    def _owned(self) -> list[int]:
        owned = self.owned()
        for partition in set(self._sums) - set(owned):
            del self._sums[partition]  # another member sums it now, from where its totals end
        return owned

    def _owned_fetched(self, caught_up: bool) -> None:
        self.members.expire(self._clock())

    def _expire_members(self) -> None:
        """Notes who joined and left (as this member sees the totals), and paces by them."""
        now = self._clock()
        self.members.expire(now)  # the senders of the partitions owned here: read twice is not news
        live = set(self.view.live(now))
        for member in sorted(live - self._live):
            log.info("fleet: member %s joined (%d members)", member, len(live))
        for member in sorted(self._live - live):
            log.info("fleet: member %s left (silent for %d ms)", member, self.config.member_timeout_ms)
        self._live = live
        self._pace()

    async def _apply_owned(self, data: bytes, offsets: dict[int, int], partition: int) -> None:
        """Sums the reports in ``data`` from ``offsets[partition]`` on into the partition's next
        totals (this member's own reports too: every reader takes its own part out)."""
        offset = offsets[partition]
        sums = self._sums.get(partition)
        if sums is None:
            sums = self._sums[partition] = PartitionSums(partition, offset)
        records = MemoryRecords(data)
        now = self._clock()
        read = 0
        while (batch := records.next_batch()) is not None:
            for record in batch:
                if record.offset < offset:
                    continue
                offset = record.offset + 1
                decoded = self._decoded(record.value, now, own=True)
                if decoded is not None:
                    sums.add(decoded[0], decoded[1], offset)
                    read += len(decoded[1])
                if read >= APPLY_SLICE_ENTRIES:
                    sums.moved_to(offset)
                    offsets[partition] = self._reader.next_offsets[partition] = offset
                    read = 0
                    await asyncio.sleep(0)
                    now = self._clock()
            offset = max(offset, getattr(batch, "next_offset", offset))
        sums.moved_to(offset)
        offsets[partition] = self._reader.next_offsets[partition] = offset

    # -- reading the totals ---------------------------------------------------------------

    async def _apply_totals(self, data: bytes, offsets: dict[int, int], partition: int) -> None:
        """Applies the totals in ``data`` from ``offsets[partition]`` on, a slice at a time as
        the flat exchange applies reports."""
        records = MemoryRecords(data)
        offset = offsets[partition]
        now = self._clock()
        sums: dict[EntityKey, list[float]] = {}
        read = 0
        while (batch := records.next_batch()) is not None:
            for record in batch:
                if record.offset < offset:
                    continue
                offset = record.offset + 1
                read += self._read_totals(record.value or b"", now, sums)
                if read >= APPLY_SLICE_ENTRIES:
                    self._add(sums, now)
                    offsets[partition] = self._totals.next_offsets[partition] = offset
                    sums, read = {}, 0
                    await asyncio.sleep(0)
                    now = self._clock()
            offset = max(offset, getattr(batch, "next_offset", offset))
        self._add(sums, now)
        offsets[partition] = self._totals.next_offsets[partition] = offset

    def _read_totals(self, value: bytes, now: int, sums: dict[EntityKey, list[float]]) -> int:
        """Adds the others' part of one totals record to ``sums``; the entries read."""
        try:
            head = totals_head(value)
            totals = head.totals
            why = self.view.read(totals, now)
            if why is not None or not self._ranges.accept(totals):
                self.ignored[why or "duplicate"] += 1
                return 0
            count = head.read.announced
            if count and not self._budget.take(count, now, self.loaded.is_set()):
                self.ignored["over_budget"] += 1
                self.remote_dropped += count
                self._cluster.dialer.log_failure(
                    "fleet_budget", logging.WARNING, "fleet topic %s: totals of %d entries from %s dropped unread: "
                    "past fleet.max_remote_entries_per_s (%d)", self._totals.topic, count, totals.owner_id,
                    self.config.max_remote_entries_per_s)
                return 0
            _, entries = self._decoder.decode(value, head.read)
        except BadReport as exc:
            self._ignore(exc)
            return 0
        mine: dict[EntityKey, float] = {}
        for m in totals.members:
            if m.instance_id == self.instance_id and m.incarnation == self.incarnation:
                mine = self._own.part(m.first_seq, m.last_seq)
        for key, amount in entries:
            amount -= mine.get(key, 0.0)
            if amount > 0:
                summed = sums.get(key)
                if summed is None:
                    sums[key] = [amount, 1]
                else:
                    summed[0] += amount
                    summed[1] += 1
        return len(entries)
