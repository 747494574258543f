"""The fleet's usage exchange, the pure part: the report an instance publishes every sync
interval, its binary encoding, and who is in the fleet.

A report says what one instance charged each quota entity since its previous report (per kind,
the entity named by its state labels, as ``ResolvedQuota.key``), with who sent it (instance id
and incarnation) and when. Every report is also a heartbeat, entries or not.

Encoding (``struct``, big-endian, version 1): ``b"KQPU"``, version u8, incarnation u64, seq u64,
sent_at_ms i64, interval_ms u32, instance id (u16 length + UTF-8), entry count u32, then per
entry: kind u8 (an index into :data:`KINDS`, never reordered), user and client id (i16 length
+ UTF-8, -1 for none), amount f64.

Input from the topic is untrusted: :func:`decode_report` reads within the record's own length,
never allocates by a count it was given, and refuses (:class:`BadReport`, with a reason for the
counter) a record that is short, long, of another version, or carries an amount that is not a
finite number in [0, :data:`MAX_AMOUNT`]. Pure: no I/O, time is an argument.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from operator import itemgetter
from typing import NamedTuple

from quotas.common import (
    CONSUMER_BYTE_RATE,
    CONSUMER_RECORD_RATE,
    CONTROLLER_MUTATION_RATE,
    PRODUCER_BATCH_RATE,
    PRODUCER_BYTE_RATE,
    PRODUCER_IDS_RATE,
    PRODUCER_RECORD_RATE,
    REQUEST_RATE,
)

MAGIC = b"KQPU"
VERSION = 1
# Wire indexes of the kinds: append only.
KINDS = (PRODUCER_BYTE_RATE, CONSUMER_BYTE_RATE, REQUEST_RATE, CONTROLLER_MUTATION_RATE, PRODUCER_RECORD_RATE,
         CONSUMER_RECORD_RATE, PRODUCER_BATCH_RATE, PRODUCER_IDS_RATE)
_KIND_INDEX = {k: i for i, k in enumerate(KINDS)}
MAX_AMOUNT = 1e13  # per entity and interval: 10 TB, or ten trillion requests or records
MAX_RECORD_BYTES = 1 << 20  # a report larger than this is split into several records
# A report of more entries is split too: a reader applies a record whole or not at all, and
# fleet.max_remote_entries_per_s is at least this.
MAX_RECORD_ENTRIES = 10_000
_MAX_NAME_BYTES = 2**15 - 1

_HEAD = struct.Struct(">4sBQQqI")  # magic, version, incarnation, seq, sent_at_ms, interval_ms
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_I16 = struct.Struct(">h")
_ENTRY_TAIL = struct.Struct(">d")
_MIN_ENTRY_BYTES = 1 + 2 + 2 + 8


class BadReport(ValueError):
    """A record that is not a report this version reads; ``reason`` names it for a counter."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class UsageEntry:
    """What one instance charged one entity for one kind since its previous report."""

    kind: str
    user: str | None
    client_id: str | None
    amount: float


@dataclass(frozen=True, slots=True)
class UsageReport:
    instance_id: str
    incarnation: int  # differs at every start of the instance
    seq: int  # counts this incarnation's records
    sent_at_ms: int
    interval_ms: int
    entries: tuple[UsageEntry, ...] = ()


def encode_report(report: UsageReport, max_bytes: int = MAX_RECORD_BYTES,
                  max_entries: int = MAX_RECORD_ENTRIES) -> list[bytes]:
    """The report as one record value or, past ``max_bytes`` or ``max_entries``, several (each
    a report of its own, with consecutive sequence numbers from ``report.seq``)."""
    return [value for value, _ in encode_chunks(report, max_bytes, max_entries)]


def encode_chunks(report: UsageReport, max_bytes: int = MAX_RECORD_BYTES,
                  max_entries: int = MAX_RECORD_ENTRIES) -> list[tuple[bytes, tuple[UsageEntry, ...]]]:
    """:func:`encode_report`, each record value with the entries it carries (so that a writer
    sending them one by one knows what each one that landed has told)."""
    instance = report.instance_id.encode()
    if len(instance) > _MAX_NAME_BYTES:
        raise ValueError("instance id too long")
    chunks: list[list[tuple[bytes, UsageEntry]]] = [[]]
    size = head_size = _HEAD.size + 2 + len(instance) + 4
    for e in report.entries:
        body = entry_bytes(e)
        if chunks[-1] and (size + len(body) > max_bytes or len(chunks[-1]) >= max_entries):
            chunks.append([])
            size = head_size
        chunks[-1].append((body, e))
        size += len(body)
    out = []
    for i, chunk in enumerate(chunks):
        head = _HEAD.pack(MAGIC, VERSION, report.incarnation, report.seq + i, report.sent_at_ms, report.interval_ms)
        value = b"".join([head, _U16.pack(len(instance)), instance, _U32.pack(len(chunk)), *(b for b, _ in chunk)])
        out.append((value, tuple(e for _, e in chunk)))
    return out


def entry_bytes(e: UsageEntry) -> bytes:
    return b"".join([bytes([_KIND_INDEX[e.kind]]), _name(e.user), _name(e.client_id), _ENTRY_TAIL.pack(e.amount)])


def _name(s: str | None) -> bytes:
    if s is None:
        return _I16.pack(-1)
    b = s.encode()
    if len(b) > _MAX_NAME_BYTES:
        raise ValueError("entity name too long")
    return _I16.pack(len(b)) + b


class ReportHead(NamedTuple):
    """A report read up to its entries."""

    report: UsageReport  # without its entries
    announced: int  # the entries it announces (within what its length can hold)
    entries_at: int  # where they start


def report_head(data: bytes) -> ReportHead:
    """The report in ``data`` up to its entries: what a reader checks before spending anything on
    them, and hands to :func:`decode_usage` so it is not read again. BadReport as
    :func:`decode_report` for a record whose head does not read (its entries are checked only
    when decoded)."""
    view = memoryview(data)
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise BadReport("not_a_report", f"starts {bytes(view[:8])!r}")
    if len(view) < _HEAD.size:
        raise BadReport("truncated", f"{len(view)} bytes")
    _, version, incarnation, seq, sent_at_ms, interval_ms = _HEAD.unpack_from(view)
    if version != VERSION:
        raise BadReport("unknown_version", f"version {version}")
    reader = _Reader(view, _HEAD.size)
    instance = reader.text(reader.u16())
    count = reader.u32()
    if not instance:
        raise BadReport("no_instance", "empty instance id")
    if count * _MIN_ENTRY_BYTES > reader.left():
        raise BadReport("truncated", f"{count} entries announced, {reader.left()} bytes left")
    return ReportHead(UsageReport(instance, incarnation, seq, sent_at_ms, interval_ms), count, reader.pos)


def worth_reporting(amount: float, bound: float, interval_ms: int, members: int, threshold: float) -> bool:
    """Whether ``amount``, what one member charged an entity in one sync interval, is worth the
    other members' reading: at least ``threshold`` x the entity's ``bound`` over the interval,
    divided among the ``members``. When no member reports an entity, each charged it less than
    that, so the fleet's rate of it stays under ``threshold`` x its bound and no member would
    throttle it had they all heard (the guarantee of Raghavan et al.'s distributed rate limiting,
    SIGCOMM 2007: coordinate only where demand nears the limit). ``threshold`` 0: every amount."""
    return amount >= threshold * bound * interval_ms / 1000 / max(members, 1)


EntityKey = tuple[str, str | None, str | None]  # (kind, user, client id), as QuotaManager keys an entity


def decode_report(data: bytes) -> UsageReport:
    """The report in ``data``; BadReport (see the module docstring) otherwise."""
    head, amounts = decode_usage(data)
    return UsageReport(head.instance_id, head.incarnation, head.seq, head.sent_at_ms, head.interval_ms,
                       tuple(UsageEntry(kind, user, client_id, amount) for (kind, user, client_id), amount in amounts))


def decode_usage(data: bytes, read: ReportHead | None = None) -> tuple[UsageReport, list[tuple[EntityKey, float]]]:
    """:func:`decode_report`, the entries as ((kind, user, client id), amount) pairs, the report
    without them: what a member applies, read with no object made per entry (a member reads
    tens of thousands a second). ``read``: ``report_head(data)``, when the caller has it."""
    head, count, pos = read or report_head(data)
    data = bytes(data)
    size = len(data)
    n_kinds = len(KINDS)
    entries: list[tuple[EntityKey, float]] = []
    try:
        for _ in range(count):
            index = data[pos]
            if index >= n_kinds:
                raise BadReport("unknown_kind", f"kind {index}")
            user, pos = _read_name(data, pos + 1, size)
            client_id, pos = _read_name(data, pos, size)
            (amount,) = _ENTRY_TAIL.unpack_from(data, pos)
            pos += 8
            if not 0 <= amount <= MAX_AMOUNT:  # NaN fails both comparisons; infinities the second
                raise BadReport("bad_amount", f"{amount!r} for {KINDS[index]}")
            entries.append(((KINDS[index], user, client_id), amount))
    except (IndexError, struct.error):
        raise BadReport("truncated", f"an entry runs past the record's {size} bytes") from None
    if pos != size:
        raise BadReport("trailing_bytes", f"{size - pos} bytes after the entries")
    return head, entries


def _read_name(data: bytes, pos: int, size: int) -> tuple[str | None, int]:
    """An entity name (i16 length + UTF-8, -1: none) at ``pos``, and where it ends."""
    (n,) = _I16.unpack_from(data, pos)
    pos += 2
    if n == -1:
        return None, pos
    if n < -1:
        raise BadReport("bad_text", f"length {n}")
    end = pos + n
    if end > size:
        raise BadReport("truncated", f"a name of {n} bytes at {pos}, {size - pos} left")
    try:
        return data[pos:end].decode(), end
    except UnicodeDecodeError as exc:
        raise BadReport("bad_text", str(exc)) from None


class UsageDecoder:
    """:func:`decode_usage`, with what each member's last report named remembered: a member's
    next report usually names the same entities (those near their bound stay so for a while),
    and then its entries are read with one ``struct`` call and checked by comparing a few tuples,
    not entry by entry. The same results and the same errors as :func:`decode_usage` (a report
    that differs in anything but its amounts, or whose amounts would be refused, is read the
    slow way). At most ``max_entries`` entries are remembered, all members together (the
    oldest member's forgotten first), and only of reports of at most ``max_report_entries``
    (building a report's struct costs about 2 µs an entry, once)."""

    def __init__(self, max_entries: int = 100_000, max_report_entries: int = 2_000) -> None:
        self.max_entries = max_entries
        self.max_report_entries = max_report_entries
        self._layouts: dict[str, _Layout] = {}
        self._entries = 0  # remembered, all layouts together

    def decode(self, data: bytes, read: ReportHead | None = None) -> tuple[UsageReport, list[tuple[EntityKey, float]]]:
        """:func:`decode_usage` (``read``: ``report_head(data)``, when the caller has it)."""
        read = read or report_head(data)
        head, count, pos = read
        layout = self._layouts.get(head.instance_id)
        if layout is not None and layout.count == count and len(data) - pos == layout.struct.size:
            fields = layout.struct.unpack_from(data, pos)
            if layout.names_of(fields) == layout.names:
                amounts = layout.amounts_of(fields)
                # A NaN or an infinity makes the sum so; then the slow way says which.
                if math.isfinite(sum(amounts)) and min(amounts) >= 0 and max(amounts) <= MAX_AMOUNT:
                    return head, list(zip(layout.keys, amounts, strict=True))
        head, entries = decode_usage(data, read)
        if 2 <= count <= min(self.max_report_entries, self.max_entries):
            old = self._layouts.pop(head.instance_id, None)
            self._entries -= old.count if old is not None else 0
            while self._entries + count > self.max_entries:
                self._entries -= self._layouts.pop(next(iter(self._layouts))).count
            self._layouts[head.instance_id] = _Layout([key for key, _ in entries])
            self._entries += count
        return head, entries


class _Layout:
    """A report's entries as one struct: kind, then each name's length and bytes, then the
    amount, entry after entry; what is not an amount is compared whole with ``names``."""

    __slots__ = ("count", "keys", "struct", "names", "names_of", "amounts_of")

    def __init__(self, keys: list[EntityKey]) -> None:
        fmt = [">"]
        names: list[object] = []
        name_at: list[int] = []
        amount_at: list[int] = []
        n = 0
        for kind, user, client_id in keys:
            fmt.append("B")
            names.append(_KIND_INDEX[kind])
            name_at.append(n)
            n += 1
            for name in (user, client_id):
                if name is None:
                    fmt.append("h")
                    names.append(-1)
                    name_at.append(n)
                    n += 1
                else:
                    raw = name.encode()
                    fmt.append(f"h{len(raw)}s")
                    names += [len(raw), raw]
                    name_at += [n, n + 1]
                    n += 2
            fmt.append("d")
            amount_at.append(n)
            n += 1
        self.count = len(keys)
        self.keys = tuple(keys)
        self.struct = struct.Struct("".join(fmt))
        self.names = tuple(names)
        self.names_of: Callable[[tuple[object, ...]], tuple[object, ...]] = itemgetter(*name_at)
        self.amounts_of: Callable[[tuple[object, ...]], tuple[float, ...]] = itemgetter(*amount_at)


class _Reader:
    __slots__ = ("view", "pos")

    def __init__(self, view: memoryview, pos: int) -> None:
        self.view, self.pos = view, pos

    def left(self) -> int:
        return len(self.view) - self.pos

    def _take(self, n: int) -> memoryview:
        if n > self.left():
            raise BadReport("truncated", f"{n} bytes wanted at {self.pos}, {self.left()} left")
        part = self.view[self.pos : self.pos + n]
        self.pos += n
        return part

    def u16(self) -> int:
        return int(_U16.unpack(self._take(2))[0])

    def u32(self) -> int:
        return int(_U32.unpack(self._take(4))[0])

    def text(self, n: int) -> str:
        try:
            return str(self._take(n), "utf-8")
        except UnicodeDecodeError as exc:
            raise BadReport("bad_text", str(exc)) from None


@dataclass
class _Member:
    incarnation: int
    seq: int
    last_seen_ms: int  # this instance's clock when its latest report was read
    sent_at_ms: int  # the member's own clock on that report


@dataclass
class FleetMembers:
    """Who is in the fleet: each instance id heard from within ``timeout_ms``, its incarnation
    and latest sequence number. At most ``max_members`` are tracked (a flood of made-up ids
    cannot grow it): a new one past that is not admitted until one times out."""

    timeout_ms: int
    max_members: int = 1024
    _members: dict[str, _Member] = field(default_factory=dict)

    def admit(self, report: UsageReport, now_ms: int) -> bool:
        """Whether ``report`` is news: from a new member, a new incarnation, or a later
        sequence number of a known one (a record read twice, or an old one, is not)."""
        m = self._members.get(report.instance_id)
        if m is None:
            if len(self._members) >= self.max_members:
                self.expire(now_ms)
                if len(self._members) >= self.max_members:
                    return False
            self._members[report.instance_id] = _Member(report.incarnation, report.seq, now_ms, report.sent_at_ms)
            return True
        if m.incarnation == report.incarnation and report.seq <= m.seq:
            return False
        m.incarnation, m.seq, m.last_seen_ms, m.sent_at_ms = report.incarnation, report.seq, now_ms, report.sent_at_ms
        return True

    def expire(self, now_ms: int) -> list[str]:
        """Drops the members not heard from within the timeout; their ids."""
        gone = [i for i, m in self._members.items() if now_ms - m.last_seen_ms >= self.timeout_ms]
        for i in gone:
            del self._members[i]
        return gone

    def live(self) -> Iterator[tuple[str, int]]:
        """(instance id, last seen ms) of every member."""
        for i, m in self._members.items():
            yield i, m.last_seen_ms

    def __len__(self) -> int:
        return len(self._members)


class EntryBudget:
    """How many of the other members' entries a member may still apply, or refuse whole: at most
    ``per_s`` a second once the history is read, and up to ``window_ms`` of them (the history
    inside the quota window) until then. A flood on the topic costs a member that much and no
    more; a member's own records hold at most MAX_RECORD_ENTRIES, never more than a second's worth
    (fleet.max_remote_entries_per_s is at least that). Pure: time is an argument."""

    __slots__ = ("per_s", "left", "at_ms")

    def __init__(self, per_s: int, window_ms: int, now_ms: int) -> None:
        self.per_s = per_s
        self.left = float(per_s) * max(window_ms / 1000, 1.0)
        self.at_ms = now_ms

    def take(self, entries: int, now_ms: int, loaded: bool) -> bool:
        """Whether ``entries`` may be applied now (then they are taken from what is left).
        ``loaded``: the history has been read, so what is left refills, up to a second's worth."""
        elapsed_ms = now_ms - self.at_ms
        if elapsed_ms > 0:
            self.at_ms = now_ms
            if loaded:
                self.left = min(float(self.per_s), self.left + self.per_s * elapsed_ms / 1000)
        if entries > self.left:
            return False
        self.left -= entries
        return True


def usage_entries(pending: Iterable[tuple[tuple[str, str | None, str | None], float]]) -> tuple[UsageEntry, ...]:
    """Report entries from ((kind, user, client id), amount) pairs, the positive amounts only."""
    return tuple(UsageEntry(k, u, c, a) for (k, u, c), a in pending if a > 0 and k in _KIND_INDEX)
