"""The fleet's usage summed by partition owners, the pure part (``fleet.aggregation: owners``).

Every member still writes its reports to its own partition of the usage topic (quotas.fleet).
Each partition has one **owner**, a member chosen by rendezvous hashing over the members every
member knows (:func:`owner_of`): the owner alone reads that partition, sums what its members
charged each entity (:class:`PartitionSums`), and every sync interval publishes the sums as a
**totals** record to the totals topic, which every member reads. A member so reads one record
per partition per interval, each naming the entities the partition's members reported (the
same hot principals on every member: as many as one member reports), instead of every member's
report: what it reads grows with the partitions, not with the members.

A totals record covers the usage-topic offsets ``[from_offset, next_offset)`` of its partition,
and lists, for each member whose reports it sums, the first and last sequence numbers of them
(:class:`Included`). So:

- a reader subtracts its own part (:class:`OwnReports`: what it reported under those sequence
  numbers), which is already in its samples;
- a reader applies a partition's ranges in order and never the same offsets twice
  (:class:`TotalsRanges`): while ownership moves, two members may publish the same range, and
  only the first read counts;
- a new owner goes on from the last range published (``next_offset``): nothing is summed twice
  and nothing is lost when an owner fails.

Encoding (``struct``, big-endian, version 1): ``b"KQPT"``, version u8, owner incarnation u64,
partition u32, from_offset i64, next_offset i64, sent_at_ms i64, interval_ms u32, owner id
(u16 length + UTF-8), member count u32, per member: incarnation u64, first seq u64, last seq
u64, id (u16 length + UTF-8); entry count u32 and the entries as a report's (quotas.fleet).
Untrusted input, read as reports are: within its own length, never allocating by a count it was
given, BadReport (with a reason) otherwise. Pure: no I/O, time is an argument.
"""

from __future__ import annotations

import struct
import zlib
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
MAX_INCLUDED = 4096  # members one record may name (FleetMembers tracks at most 1,024)
_HEAD = struct.Struct(">4sBQIqqqI")  # magic, version, incarnation, partition, from, next, sent_at_ms, interval_ms
_MEMBER = struct.Struct(">QQQB")  # incarnation, first seq, last seq, fresh
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")


class Included(NamedTuple):
    """The reports of one member a totals record sums: sequence numbers ``first_seq`` to
    ``last_seq`` of incarnation ``incarnation``. ``fresh``: the last was sent recently (by the
    owner's clock, :meth:`PartitionSums.take`): the member is alive, not a failed member's
    reports read late, by an owner taking its partition over."""

    instance_id: str
    incarnation: int
    first_seq: int
    last_seq: int
    fresh: bool = True


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
    members: tuple[Included, ...] = ()
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
    with the same range and members (a reader applies them as one: :class:`TotalsRanges`)."""
    owner = totals.owner_id.encode()
    head = b"".join([
        _HEAD.pack(MAGIC, VERSION, totals.owner_incarnation, totals.partition, totals.from_offset,
                   totals.next_offset, totals.sent_at_ms, totals.interval_ms),
        _U16.pack(len(owner)), owner, _U32.pack(len(totals.members)),
        *(_MEMBER.pack(m.incarnation, m.first_seq, m.last_seq, m.fresh)
          + _U16.pack(len(i := m.instance_id.encode())) + i
          for m in totals.members)])
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
    count, pos = _u32(view, pos)
    if count > MAX_INCLUDED or count * (_MEMBER.size + 2) > len(view) - pos:
        raise BadReport("truncated", f"{count} members announced, {len(view) - pos} bytes left")
    members = []
    for _ in range(count):
        if pos + _MEMBER.size > len(view):
            raise BadReport("truncated", f"a member at {pos}")
        member_incarnation, first, last, fresh = _MEMBER.unpack_from(view, pos)
        member, pos = _text(view, pos + _MEMBER.size)
        if not member or first > last or fresh > 1:
            raise BadReport("bad_member", f"member {member!r}, seqs {first} to {last}, fresh {fresh}")
        members.append(Included(member, member_incarnation, first, last, bool(fresh)))
    entries, pos = _u32(view, pos)
    if entries * 13 > len(view) - pos:  # an entry is 13 bytes at least (quotas.fleet)
        raise BadReport("truncated", f"{entries} entries announced, {len(view) - pos} bytes left")
    totals = Totals(owner, incarnation, partition, from_offset, next_offset, sent_at_ms, interval_ms, tuple(members))
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
    at offsets from ``from_offset`` on, per entity, and who sent them."""

    partition: int
    from_offset: int
    sums: dict[EntityKey, float] = field(default_factory=dict)
    # (id, incarnation) -> [first seq, last seq, the latest sent_at_ms]
    members: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    next_offset: int = -1

    def __post_init__(self) -> None:
        self.next_offset = max(self.next_offset, self.from_offset)

    def add(self, report: UsageReport, entries: Iterable[tuple[EntityKey, float]], next_offset: int) -> None:
        """One report, read at an offset before ``next_offset``."""
        sums = self.sums
        for key, amount in entries:
            sums[key] = sums.get(key, 0.0) + amount
        seqs = self.members.get((report.instance_id, report.incarnation))
        if seqs is None:
            self.members[(report.instance_id, report.incarnation)] = [report.seq, report.seq, report.sent_at_ms]
        else:
            seqs[0], seqs[1] = min(seqs[0], report.seq), max(seqs[1], report.seq)
            seqs[2] = max(seqs[2], report.sent_at_ms)
        self.next_offset = max(self.next_offset, next_offset)

    def moved_to(self, next_offset: int) -> None:
        """Read up to ``next_offset`` (records that summed nothing: ours, bad ones, duplicates)."""
        self.next_offset = max(self.next_offset, next_offset)

    def take(self, owner_id: str, owner_incarnation: int, sent_at_ms: int, interval_ms: int,
             fresh_ms: int) -> Totals:
        """The totals since the last take, the sums then starting again where they end; of an
        empty range when nothing was read since (it still says the owner is there). A member is
        named fresh when its last report was sent less than ``fresh_ms`` before ``sent_at_ms``
        (both wall clocks)."""
        totals = Totals(owner_id, owner_incarnation, self.partition, self.from_offset, self.next_offset, sent_at_ms,
                        interval_ms, tuple(Included(i, inc, f, la, sent_at_ms - at < fresh_ms)
                                           for (i, inc), (f, la, at) in self.members.items()),
                        tuple(UsageEntry(k, u, c, a) for (k, u, c), a in self.sums.items() if a > 0))
        self.from_offset = self.next_offset
        self.sums, self.members = {}, {}
        return totals


class OwnReports:
    """What this member reported under each of its recent sequence numbers, to take its own
    part out of the totals that sum it (its usage is in its samples already). At most
    ``max_reports`` are kept: the totals of an older one, unknown here, are applied whole (this
    member's usage then counts twice for a while: more throttling, never less)."""

    def __init__(self, max_reports: int) -> None:
        self.max_reports = max_reports
        self._reports: dict[int, dict[EntityKey, float]] = {}  # seq -> amounts, oldest first

    def note(self, seq: int, entries: Iterable[UsageEntry]) -> None:
        """Report ``seq`` is being written with ``entries`` (again, after a write that failed:
        what it carries now replaces what it carried)."""
        self._reports.pop(seq, None)
        self._reports[seq] = {(e.kind, e.user, e.client_id): e.amount for e in entries}
        while len(self._reports) > self.max_reports:
            del self._reports[next(iter(self._reports))]

    def part(self, first_seq: int, last_seq: int) -> dict[EntityKey, float]:
        """What this member reported under ``first_seq`` to ``last_seq``, per entity."""
        out: dict[EntityKey, float] = {}
        for seq, amounts in self._reports.items():
            if first_seq <= seq <= last_seq:
                for key, amount in amounts.items():
                    out[key] = out.get(key, 0.0) + amount
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


class OwnersView:
    """Who is in the fleet and who owns which partition, as one member sees it from the totals
    it reads.

    - A member is live while trusted totals name it fresh (their owner read its reports, sent
      recently) within ``timeout_ms``; an owner also while it publishes. A member of a partition whose owner went
      silent is named by no one until a new owner takes the partition over: it stays live
      meanwhile (its silence is its owner's), for at most three timeouts. So an owner that fails
      is dropped after ``timeout_ms``, its partitions owned by others from then on, and its
      partitions' members are not dropped with it.
    - Totals are trusted when their owner is this member or a live one: a record from a made-up
      owner changes nothing (neither who is live nor any usage). A member that starts knows only
      itself, owns every partition until its own totals name the others, and so learns them.
    - A partition's totals are applied only from its owner in this view (:meth:`read`).
    """

    def __init__(self, me: str, partitions: int, timeout_ms: int, max_members: int = 1024) -> None:
        self.me = me
        self.partitions = partitions
        self.timeout_ms = timeout_ms
        self.max_members = max_members
        self._named: dict[str, int] = {}  # member -> when trusted totals last named it
        self._published: dict[str, int] = {}  # owner -> when it last published trusted totals
        self._heard: dict[int, int] = {}  # partition -> when its last trusted totals were read
        # Computed again when a member is first named or published, or one's time is up (a
        # member's time only grows while the cache stands: at worst it is dropped a little late).
        self._live: list[str] | None = None
        self._live_until_ms = 0

    def read(self, totals: Totals, now_ms: int) -> str | None:
        """``totals`` was read: None to apply it, else why it is not ("untrusted_owner", or
        "not_owner": published by a live member that does not own its partition in this view,
        while ownership moves)."""
        live = self.live(now_ms)
        owner = totals.owner_id
        if owner != self.me and owner not in live:
            return "untrusted_owner"
        self._heard[totals.partition] = now_ms
        if owner not in self._published:
            self._live = None
        self._note(self._published, owner, now_ms)
        for m in totals.members:
            if not m.fresh:
                continue  # a failed member's reports, read late: they say nothing of it now
            if m.instance_id not in self._named:
                self._live = None
            self._note(self._named, m.instance_id, now_ms)
        if owner_of(totals.partition, self.live(now_ms)) != owner:
            return "not_owner"
        return None

    def _note(self, seen: dict[str, int], member: str, now_ms: int) -> None:
        if member in seen or len(seen) < self.max_members:  # a flood of names is not kept past the cap
            seen[member] = now_ms

    def home(self, member: str) -> int:
        """The partition ``member`` writes its reports to (proxy.control.fleet)."""
        return zlib.crc32(member.encode()) % self.partitions

    def live(self, now_ms: int) -> list[str]:
        """The live members, this one included (sorted)."""
        if self._live is not None and now_ms < self._live_until_ms:
            return self._live
        out = {self.me}
        timeout = self.timeout_ms
        next_change = now_ms + timeout
        for member in list(self._named.keys() | self._published.keys()):
            if member == self.me:
                continue
            named, published = self._named.get(member, -1), self._published.get(member)
            last = max(named, published if published is not None else -1)
            orphaned = published is None and self._heard.get(self.home(member), -1) <= named
            until = last + (3 * timeout if orphaned else timeout)
            if now_ms < until:
                out.add(member)
                next_change = min(next_change, until)
            else:
                self._named.pop(member, None)
                self._published.pop(member, None)
        self._live = sorted(out)
        self._live_until_ms = next_change
        return self._live

    def seen(self) -> list[tuple[str, int]]:
        """(member, when last heard of) for every other member known."""
        out = dict(self._named)
        for member, at in self._published.items():
            out[member] = max(at, out.get(member, at))
        out.pop(self.me, None)
        return sorted(out.items())

    def owned(self, now_ms: int) -> list[int]:
        """The partitions this member owns now."""
        members = self.live(now_ms)
        return [p for p in range(self.partitions) if owner_of(p, members) == self.me]
