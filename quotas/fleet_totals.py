"""The fleet's usage summed by partition owners, the pure part (``fleet.aggregation: owners``).

Every member writes what it charged each entity to the partition of the usage topic that entity
hashes to (:func:`entity_partition`; quotas.fleet's report format, one record per partition it
has entries for), and a heartbeat (a report without entries) to the totals topic every few
intervals. Every member reads the totals topic, so every member knows the same members, and
each partition of the usage topic has one **owner**, chosen by rendezvous hashing over them
(:func:`owner_of`, :class:`Ownership`): the owner alone reads that partition, sums what the
members charged each of its entities (:class:`PartitionSums`), and every sync interval publishes
the sums as a **totals** record to the totals topic. Each entity's fleet-wide usage is so in
exactly one partition's totals: a member reads each entity the fleet reports once an interval,
however many members charge it, and an owner reads what the members charged its partitions'
entities (with about as many partitions as members, about what one member reports). What grows
with the members is their heartbeats: one small record each every few intervals.

A totals record covers the usage-topic offsets ``[from_offset, next_offset)`` of its partition.
So:

- a reader subtracts its own part (:class:`OwnReports`: what it wrote at those offsets), which
  is already in its samples;
- a reader applies a partition's ranges in order and never the same offsets twice
  (:class:`TotalsRanges`): while ownership moves, two members may publish the same range, and
  only the first read counts;
- a new owner goes on from the last range published (``next_offset``): nothing is summed twice
  and nothing is lost when an owner fails;
- a reader applies a partition's totals only from its owner (a made-up owner changes nothing).

Encoding (``struct``, big-endian, version 1): ``b"KQPT"``, version u8, owner incarnation u64,
partition u32, from_offset i64, next_offset i64, sent_at_ms i64, interval_ms u32, owner id
(u16 length + UTF-8), entry count u32 and the entries as a report's (quotas.fleet). Untrusted
input, read as reports are: within its own length, never allocating by a count it was given,
BadReport (with a reason) otherwise. Pure: no I/O, time is an argument.
"""

from __future__ import annotations

import struct
import zlib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from quotas.fleet import (
    MAX_RECORD_BYTES,
    MAX_RECORD_ENTRIES,
    BadReport,
    EntityKey,
    ReportHead,
    UsageEntry,
    UsageReport,
    decode_usage,
    entry_bytes,
)

MAGIC = b"KQPT"
VERSION = 1
_HEAD = struct.Struct(">4sBQIqqqI")  # magic, version, incarnation, partition, from, next, sent_at_ms, interval_ms
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")


def entity_partition(key: EntityKey, partitions: int) -> int:
    """The usage-topic partition the entity ``key`` ((kind, user, client id)) is summed in."""
    kind, user, client_id = key
    # \x00 separates the labels; \x01 marks a label the entity does not have (never "" for None).
    raw = "\x00".join([kind, "\x01" if user is None else user, "\x01" if client_id is None else client_id])
    return zlib.crc32(raw.encode()) % partitions


@dataclass(frozen=True, slots=True)
class Totals:
    """What the members of one partition charged each entity in the reports at usage-topic
    offsets ``[from_offset, next_offset)``, summed by the partition's owner."""

    owner_id: str
    owner_incarnation: int
    partition: int
    from_offset: int
    next_offset: int
    sent_at_ms: int
    interval_ms: int
    entries: tuple[UsageEntry, ...] = ()


def owner_of(partition: int, members: Iterable[str]) -> str | None:
    """The member that owns ``partition`` among ``members`` (rendezvous hashing: the highest
    hash of member and partition), None for no members. Every member that knows the same
    members picks the same owner, and a member joining or leaving moves only the partitions it
    takes or held."""
    best: tuple[int, str] | None = None
    for member in members:
        score = (zlib.crc32(f"{partition}/{member}".encode()), member)
        if best is None or score > best:
            best = score
    return None if best is None else best[1]


def encode_totals(totals: Totals, max_bytes: int = MAX_RECORD_BYTES,
                  max_entries: int = MAX_RECORD_ENTRIES) -> list[bytes]:
    """The totals as one record value or, past ``max_bytes`` or ``max_entries``, several, each
    with the same range (a reader applies them as one: :class:`TotalsRanges`)."""
    owner = totals.owner_id.encode()
    head = b"".join([
        _HEAD.pack(MAGIC, VERSION, totals.owner_incarnation, totals.partition, totals.from_offset,
                   totals.next_offset, totals.sent_at_ms, totals.interval_ms),
        _U16.pack(len(owner)), owner])
    chunks: list[list[bytes]] = [[]]
    size = len(head) + 4
    for e in totals.entries:
        body = entry_bytes(e)
        if chunks[-1] and (size + len(body) > max_bytes or len(chunks[-1]) >= max_entries):
            chunks.append([])
            size = len(head) + 4
        chunks[-1].append(body)
        size += len(body)
    return [b"".join([head, _U32.pack(len(chunk)), *chunk]) for chunk in chunks]


class TotalsHead(NamedTuple):
    """A totals record without its entries; ``read`` hands them to quotas.fleet.decode_usage."""

    totals: Totals
    read: ReportHead


def totals_head(data: bytes) -> TotalsHead:
    """The totals record in ``data`` up to its entries; BadReport for one whose head does not
    read."""
    view = memoryview(data)
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise BadReport("not_totals", f"starts {bytes(view[:8])!r}")
    if len(view) < _HEAD.size:
        raise BadReport("truncated", f"{len(view)} bytes")
    _, version, incarnation, partition, from_offset, next_offset, sent_at_ms, interval_ms = _HEAD.unpack_from(view)
    if version != VERSION:
        raise BadReport("unknown_version", f"version {version}")
    if not 0 <= from_offset <= next_offset:
        raise BadReport("bad_range", f"offsets {from_offset} to {next_offset}")
    pos = _HEAD.size
    owner, pos = _text(view, pos)
    if not owner:
        raise BadReport("no_instance", "empty owner id")
    entries, pos = _u32(view, pos)
    if entries * 13 > len(view) - pos:  # an entry is 13 bytes at least (quotas.fleet)
        raise BadReport("truncated", f"{entries} entries announced, {len(view) - pos} bytes left")
    totals = Totals(owner, incarnation, partition, from_offset, next_offset, sent_at_ms, interval_ms)
    # The entries are read as a report's: keyed by partition for quotas.fleet.UsageDecoder's layouts.
    as_report = UsageReport(f"totals/{partition}", incarnation, 0, sent_at_ms, interval_ms)
    return TotalsHead(totals, ReportHead(as_report, entries, pos))


def decode_totals(data: bytes) -> tuple[Totals, list[tuple[EntityKey, float]]]:
    """The totals record in ``data`` (its entries as (entity, amount) pairs); BadReport otherwise."""
    head = totals_head(data)
    _, entries = decode_usage(data, head.read)
    return head.totals, entries


def _u32(view: memoryview, pos: int) -> tuple[int, int]:
    if pos + 4 > len(view):
        raise BadReport("truncated", f"a count at {pos}")
    return int(_U32.unpack_from(view, pos)[0]), pos + 4


def _text(view: memoryview, pos: int) -> tuple[str, int]:
    if pos + 2 > len(view):
        raise BadReport("truncated", f"a name at {pos}")
    n = int(_U16.unpack_from(view, pos)[0])
    end = pos + 2 + n
    if end > len(view):
        raise BadReport("truncated", f"a name of {n} bytes at {pos}")
    try:
        return str(view[pos + 2 : end], "utf-8"), end
    except UnicodeDecodeError as exc:
        raise BadReport("bad_text", str(exc)) from None


@dataclass
class PartitionSums:
    """An owner's sums for one partition since its last totals: the entries of the reports read
    at offsets from ``from_offset`` on, per entity."""

    partition: int
    from_offset: int
    sums: dict[EntityKey, float] = field(default_factory=dict)
    next_offset: int = -1

    def __post_init__(self) -> None:
        self.next_offset = max(self.next_offset, self.from_offset)

    def add(self, entries: Iterable[tuple[EntityKey, float]], next_offset: int) -> None:
        """One report's entries, read at an offset before ``next_offset``."""
        sums = self.sums
        for key, amount in entries:
            sums[key] = sums.get(key, 0.0) + amount
        self.next_offset = max(self.next_offset, next_offset)

    def moved_to(self, next_offset: int) -> None:
        """Read up to ``next_offset`` (records that summed nothing: bad ones, duplicates)."""
        self.next_offset = max(self.next_offset, next_offset)

    def take(self, owner_id: str, owner_incarnation: int, sent_at_ms: int, interval_ms: int) -> Totals:
        """The totals since the last take, the sums then starting again where they end; of an
        empty range when nothing was read since (the partition's owner is at work all the same)."""
        totals = Totals(owner_id, owner_incarnation, self.partition, self.from_offset, self.next_offset, sent_at_ms,
                        interval_ms, tuple(UsageEntry(k, u, c, a) for (k, u, c), a in self.sums.items() if a > 0))
        self.from_offset = self.next_offset
        self.sums = {}
        return totals


class OwnReports:
    """What this member wrote to each partition of the usage topic, by offset, to take its own
    part out of the totals that sum it (its usage is in its samples already). Totals come in
    offset order per partition: what is before a range is dropped as it is passed. At most
    ``max_reports`` are kept a partition: the totals of an older one, unknown here, are applied
    whole (this member's usage then counts twice for a while: more throttling, never less)."""

    def __init__(self, max_reports: int) -> None:
        self.max_reports = max_reports
        self._written: dict[int, deque[tuple[int, dict[EntityKey, float]]]] = {}  # partition -> (offset, amounts)
        self._last: tuple[tuple[int, int, int], dict[EntityKey, float]] = ((-1, -1, -1), {})

    def note(self, partition: int, offset: int, entries: Iterable[UsageEntry]) -> None:
        """A report with ``entries`` landed at ``offset`` of ``partition``."""
        if not entries:
            return
        written = self._written.setdefault(partition, deque(maxlen=self.max_reports))
        written.append((offset, {(e.kind, e.user, e.client_id): e.amount for e in entries}))

    def part(self, partition: int, from_offset: int, next_offset: int) -> dict[EntityKey, float]:
        """What this member wrote to ``partition`` at offsets ``[from_offset, next_offset)``, per
        entity (the same again for the next chunk of the same totals)."""
        if self._last[0] == (partition, from_offset, next_offset):
            return self._last[1]
        out: dict[EntityKey, float] = {}
        written = self._written.get(partition)
        while written and written[0][0] < next_offset:
            offset, amounts = written.popleft()
            if offset >= from_offset:
                for key, amount in amounts.items():
                    out[key] = out.get(key, 0.0) + amount
        self._last = ((partition, from_offset, next_offset), out)
        return out


class TotalsRanges:
    """Which totals records a member applies: per partition, ranges in order, never one that
    overlaps what was applied (``next_offset`` of the last). The chunks of one record (the same
    owner, incarnation and range) are applied as one."""

    def __init__(self) -> None:
        self._ends: dict[int, tuple[int, tuple[str, int, int, int]]] = {}  # partition -> (end, last accepted)

    def accept(self, totals: Totals) -> bool:
        """Whether ``totals`` is news (then it is what was applied up to its end)."""
        ident = (totals.owner_id, totals.owner_incarnation, totals.from_offset, totals.next_offset)
        known = self._ends.get(totals.partition)
        if known is not None and totals.from_offset < known[0] and ident != known[1]:
            return False
        self._ends[totals.partition] = (max(totals.next_offset, known[0] if known else 0), ident)
        return True

    def end(self, partition: int) -> int | None:
        """Where the totals applied for ``partition`` end (None: none seen): a new owner's start."""
        known = self._ends.get(partition)
        return None if known is None else known[0]


class Ownership:
    """Which partitions a member owns among ``members`` (the live ones, this one included),
    worked out again only when they change (partitions x members hashes)."""

    def __init__(self, me: str, partitions: int) -> None:
        self.me = me
        self.partitions = partitions
        self._members: list[str] = []
        self._owners: list[str | None] = []

    def owners(self, members: Iterable[str]) -> list[str | None]:
        """Each partition's owner among ``members``."""
        live = sorted(members)
        if live != self._members:
            self._members = live
            self._owners = [owner_of(p, live) for p in range(self.partitions)]
        return self._owners

    def owned(self, members: Iterable[str]) -> list[int]:
        return [p for p, owner in enumerate(self.owners(members)) if owner == self.me]
