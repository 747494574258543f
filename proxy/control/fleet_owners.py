"""``fleet.aggregation: owners``: the fleet's usage summed by partition owners (the scheme and its
pure part: quotas.fleet_totals), so that what a member reads grows with the entities the fleet
reports, not with the members times them.

- **Publish.** Every sync interval, every member writes what it charged each entity worth
  reporting (as with the flat exchange, proxy.control.fleet) to the partition of ``fleet.topic``
  that entity hashes to, a record per partition it has entries for. It remembers what it wrote
  at which offset of which partition (OwnReports). Every few intervals it writes a heartbeat
  to the totals topic, ``<fleet.topic>-totals`` (one partition), which every member reads: so
  every member knows the same members.
- **Own.** Each partition of the usage topic is owned by one member (rendezvous hashing over
  the live members, Ownership). An owner reads its partitions from where the last totals of
  each ended (none known: from the oldest record inside the quota window), sums the reports
  per entity, and every sync interval writes one totals record per partition it owns to the
  totals topic.
- **Read.** Every member follows the totals topic (from the oldest record inside the quota
  window at start: ``/readyz`` waits for it) and applies each partition's totals from that
  partition's owner, each range of usage-topic offsets once (TotalsRanges), less its own part
  (its usage is in its samples already): the others' usage, into the same samples as the flat
  exchange's.
- **Failure.** An owner whose heartbeats stop is dropped after ``member_timeout_ms``; the
  members that own its partitions then (rendezvous: only those move) go on from the last range
  it published, so their usage is late, not lost. Meanwhile the burst pacing
  (QuotaManager.paced_ms, two reports in flight) holds each member to its part of what the
  window allows.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from config.model import FleetConfig
from proxy.cluster.brokers import Cluster
from proxy.control.fleet import APPLY_SLICE_ENTRIES, FleetExchange, sum_into
from proxy.control.fleet_reader import FAILURES, RecordsFrom, TopicReader, leaders
from proxy.control.quota_topic_producer import PartitionProducer, StoreError
from quotas.fleet import MAGIC as REPORT_MAGIC
from quotas.fleet import BadReport, EntityKey, FleetMembers, UsageEntry, UsageReport, encode_chunks, encode_report
from quotas.fleet_totals import (
    Ownership,
    OwnReports,
    PartitionSums,
    TotalsRanges,
    encode_totals,
    entity_partition,
    totals_head,
)
from quotas.manager import QuotaManager
from quotas.producer_ids import ProducerIdQuotaManager

log = logging.getLogger(__name__)

_GZIP = 1  # Kafka's compression codec id
TOTALS_SUFFIX = "-totals"
_MAX_UNSENT_TOTALS = 64  # totals kept for the next interval while the totals topic cannot be written
_BATCH_BYTES = 512 << 10


def totals_topic(usage_topic: str) -> str:
    return usage_topic + TOTALS_SUFFIX


def heartbeat_ms(config: FleetConfig) -> int:
    """How often a member says it is there: four times in a member timeout, at most once an interval."""
    return max(config.sync_interval_ms, config.member_timeout_ms // 4)


class OwnersExchange(FleetExchange):
    """See the module docstring; the same interface as FleetExchange."""

    REPORTS_IN_FLIGHT = 2  # a report reaches the others through its owner's next totals: one interval more

    def __init__(self, config: FleetConfig, cluster: Cluster, manager: QuotaManager, timeout_s: float,
                 window_ms: int, clock: Callable[[], int], producer_ids: ProducerIdQuotaManager | None = None) -> None:
        super().__init__(config, cluster, manager, timeout_s, window_ms, clock, producer_ids)
        wait_ms = max(config.sync_interval_ms // 2, 10)
        self.ownership = Ownership(self.instance_id, config.partitions)
        self._ranges = TotalsRanges()
        # Totals come back within a few intervals; ten member timeouts of records a partition is plenty.
        self._own = OwnReports(max(64, 10 * config.member_timeout_ms // config.sync_interval_ms))
        self._sums: dict[int, PartitionSums] = {}
        # Who wrote to each partition owned here, and their latest sequence number there: a record
        # read twice is not summed twice.
        self._senders: dict[int, FleetMembers] = {}
        self._unsent: list[bytes] = []
        self._totals_producer: PartitionProducer | None = None
        self._totals_lock = asyncio.Lock()
        self.totals_sent = self.totals_dropped = 0
        self._applied_from: dict[str, int] = {}  # owner -> when its last totals were applied
        # The usage topic: only the partitions this member owns, each from where its totals end.
        self._reader = TopicReader(config.topic, cluster, timeout_s, wait_ms, window_ms, self._apply_owned,
                                   self._owned_fetched, self._read_failed, self._ensure_topic, self._owned,
                                   self._ranges.end)
        self._totals = TopicReader(totals_topic(config.topic), cluster, timeout_s, wait_ms, window_ms,
                                   self._apply_totals, self._fetched, self._read_failed, self._ensure_totals_topic)

    def start(self, instance_id: str) -> None:
        super().start(instance_id)
        self.ownership.me = self.instance_id
        loop = asyncio.get_running_loop()
        self._tasks += [loop.create_task(self._totals.run()), loop.create_task(self._publish_totals()),
                        loop.create_task(self._heartbeats())]

    async def stop(self) -> None:
        await super().stop()
        if self._totals_producer is not None:
            self._totals_producer.close()

    @property
    def bytes_read(self) -> int:
        return self._reader.bytes_read + self._totals.bytes_read

    def member_ages(self) -> list[tuple[str, int]]:
        """(owner, this instance's clock when its last totals were applied) for every partition
        owner now, this one included: how fresh the fleet's usage read here is (``kqp_fleet_sync_lag_seconds``)."""
        owners = set(self.ownership.owners(self._live()))
        return sorted((owner, at) for owner, at in self._applied_from.items() if owner in owners)

    def owned(self) -> list[int]:
        """The partitions this member owns now (none until the totals inside the window are read)."""
        if not self.loaded.is_set():
            return []
        return self.ownership.owned(self._live())

    def _live(self) -> list[str]:
        """The live members (their heartbeats), this one included."""
        return [self.instance_id, *(member for member, _ in self.members.live())]

    # -- publishing -----------------------------------------------------------------------

    async def _send_report(self, report: UsageReport) -> None:
        """The report's entries each to its entity's partition: sequence numbers go on across them."""
        by_partition: dict[int, list[UsageEntry]] = {}
        partitions = self.config.partitions
        for e in report.entries:
            by_partition.setdefault(entity_partition((e.kind, e.user, e.client_id), partitions), []).append(e)
        for partition, entries in by_partition.items():
            part = UsageReport(report.instance_id, report.incarnation, self._seq, report.sent_at_ms,
                               report.interval_ms, tuple(entries))
            await self._send(encode_chunks(part), partition)

    def _landed(self, partition: int, offset: int, entries: tuple[UsageEntry, ...]) -> None:
        self._own.note(partition, offset, entries)

    async def _heartbeats(self) -> None:
        period_s = heartbeat_ms(self.config) / 1000
        while True:
            try:
                async with asyncio.timeout(max(self._timeout_s, period_s)):
                    await self._write_totals(encode_report(UsageReport(
                        self.instance_id, self.incarnation, self._seq, int(time.time() * 1000),
                        self.config.sync_interval_ms)))
                self._seq += 1
            except FAILURES as exc:
                self._totals_failed(exc)
            await asyncio.sleep(period_s)

    async def _publish_totals(self) -> None:
        interval_s = self.config.sync_interval_ms / 1000
        while True:
            await asyncio.sleep(interval_s)
            sent_at_ms = int(time.time() * 1000)
            for partition in self.owned():
                sums = self._sums.get(partition)
                if sums is not None:  # every interval, read or not: its owner is at work
                    self._unsent += encode_totals(sums.take(self.instance_id, self.incarnation, sent_at_ms,
                                                            self.config.sync_interval_ms))
            if len(self._unsent) > _MAX_UNSENT_TOTALS:  # the totals topic out of reach for long
                self.totals_dropped += len(self._unsent) - _MAX_UNSENT_TOTALS
                del self._unsent[:-_MAX_UNSENT_TOTALS]
            try:
                async with asyncio.timeout(max(self._timeout_s, interval_s)):
                    while self._unsent:
                        # An interval's totals in one batch (within half of Kafka's default
                        # max.message.bytes): one round trip, however many partitions owned.
                        n, size = 1, len(self._unsent[0])
                        while n < len(self._unsent) and size + len(self._unsent[n]) <= _BATCH_BYTES:
                            size += len(self._unsent[n])
                            n += 1
                        await self._write_totals(self._unsent[:n])
                        del self._unsent[:n]
                        self.totals_sent += n
            except FAILURES as exc:
                self._totals_failed(exc)

    def _totals_failed(self, exc: BaseException) -> None:
        self._failed("write", exc)
        if self._totals_producer is not None:
            self._totals_producer.failed(exc)

    async def _write_totals(self, values: list[bytes]) -> None:
        # Heartbeats and totals share the producer: one batch at a time (its sequence numbers).
        async with self._totals_lock:
            await self._ensure_totals_topic()
            if self._totals_producer is None:
                self._totals_producer = PartitionProducer(self._totals.topic, self._cluster.dialer, self._timeout_s,
                                                          self._totals_leader, lambda metadata: None, 0,
                                                          compression_type=_GZIP)
            key = self.instance_id.encode()
            await self._totals_producer.send([(key, value) for value in values])
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
            self._senders.pop(partition, None)
        return owned

    def _owned_fetched(self, caught_up: bool) -> None:
        now = self._clock()
        for senders in self._senders.values():
            senders.expire(now)

    async def _apply_owned(self, data: bytes, offsets: dict[int, int], partition: int) -> None:
        """Sums the reports in ``data`` from ``offsets[partition]`` on into the partition's next
        totals (this member's own reports too: every reader takes its own part out)."""
        records = RecordsFrom(data, offsets[partition])
        sums = self._sums.get(partition)
        if sums is None:
            sums = self._sums[partition] = PartitionSums(partition, records.end)
        senders = self._senders.setdefault(partition, FleetMembers(self.config.member_timeout_ms))
        now = self._clock()
        read = 0
        for value in records:
            decoded = self._decoded(value, now, own=True, counts=False)
            if decoded is not None and senders.admit(decoded[0], now):
                sums.add(decoded[1], records.end)
                read += len(decoded[1])
            if read >= APPLY_SLICE_ENTRIES:
                sums.moved_to(records.end)
                offsets[partition] = self._reader.next_offsets[partition] = records.end
                read = 0
                await asyncio.sleep(0)
                now = self._clock()
        sums.moved_to(records.end)
        offsets[partition] = self._reader.next_offsets[partition] = records.end

    # -- reading the totals topic: heartbeats and totals ----------------------------------

    async def _apply_totals(self, data: bytes, offsets: dict[int, int], partition: int) -> None:
        """Applies the heartbeats and totals in ``data`` from ``offsets[partition]`` on, a slice
        at a time as the flat exchange applies reports."""
        await self._apply_read(self._totals, data, offsets, partition, self._read_totals_topic)

    def _read_totals_topic(self, value: bytes | None, now: int, sums: dict[EntityKey, list[float]]) -> int:
        value = value or b""
        if value[:4] == REPORT_MAGIC:
            self._decoded(value, now)  # a heartbeat: who is in the fleet
            return 0
        return self._read_totals(value, now, sums)

    def _read_totals(self, value: bytes, now: int, sums: dict[EntityKey, list[float]]) -> int:
        """Adds the others' part of one totals record to ``sums``; the entries read."""
        try:
            head = totals_head(value)
            totals = head.totals
            owners = self.ownership.owners(self._live())
            # Only from the partition's owner here: a made-up owner, or one whose partition moved,
            # changes nothing. The history read at start is taken from whoever owned it then
            # (each range once): a restart does not forget the usage inside the window.
            if totals.partition >= len(owners) or (owners[totals.partition] != totals.owner_id
                                                   and self.loaded.is_set()):
                self.ignored["not_owner"] += 1
                return 0
            count = head.read.announced
            if count and not self._within_budget(count, now, "totals", totals.owner_id):
                return 0
            _, entries = self._decoder.decode(value, head.read)
        except BadReport as exc:
            self._ignore(exc)
            return 0
        # Accepted once read whole: a record that does not decode moves no range on.
        if not self._ranges.accept(totals):
            self.ignored["duplicate"] += 1
            return 0
        if len(self._applied_from) > 2 * self.members.max_members:  # owners long gone
            self._applied_from.clear()
        self._applied_from[totals.owner_id] = now
        return sum_into(sums, entries, self._own.part(totals.partition, totals.from_offset, totals.next_offset))
