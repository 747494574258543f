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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

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


def encode_report(report: UsageReport, max_bytes: int = MAX_RECORD_BYTES) -> list[bytes]:
    """The report as one record value or, past ``max_bytes``, several (each a report of its
    own, with consecutive sequence numbers from ``report.seq``)."""
    return [value for value, _ in encode_chunks(report, max_bytes)]


def encode_chunks(report: UsageReport, max_bytes: int = MAX_RECORD_BYTES) -> list[tuple[bytes, tuple[UsageEntry, ...]]]:
    """:func:`encode_report`, each record value with the entries it carries (so that a writer
    sending them one by one knows what each one that landed has told)."""
    instance = report.instance_id.encode()
    if len(instance) > _MAX_NAME_BYTES:
        raise ValueError("instance id too long")
    chunks: list[list[tuple[bytes, UsageEntry]]] = [[]]
    size = head_size = _HEAD.size + 2 + len(instance) + 4
    for e in report.entries:
        body = _entry_bytes(e)
        if chunks[-1] and size + len(body) > max_bytes:
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


def _entry_bytes(e: UsageEntry) -> bytes:
    return b"".join([bytes([_KIND_INDEX[e.kind]]), _name(e.user), _name(e.client_id), _ENTRY_TAIL.pack(e.amount)])


def _name(s: str | None) -> bytes:
    if s is None:
        return _I16.pack(-1)
    b = s.encode()
    if len(b) > _MAX_NAME_BYTES:
        raise ValueError("entity name too long")
    return _I16.pack(len(b)) + b


def decode_report(data: bytes) -> UsageReport:
    """The report in ``data``; BadReport (see the module docstring) otherwise."""
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
    if count * _MIN_ENTRY_BYTES > reader.left():
        raise BadReport("truncated", f"{count} entries announced, {reader.left()} bytes left")
    entries = []
    for _ in range(count):
        index = reader.u8()
        if index >= len(KINDS):
            raise BadReport("unknown_kind", f"kind {index}")
        user, client_id = reader.name(), reader.name()
        amount = reader.f64()
        if not (math.isfinite(amount) and 0 <= amount <= MAX_AMOUNT):
            raise BadReport("bad_amount", f"{amount!r} for {KINDS[index]}")
        entries.append(UsageEntry(KINDS[index], user, client_id, amount))
    if reader.left():
        raise BadReport("trailing_bytes", f"{reader.left()} bytes after the entries")
    if not instance:
        raise BadReport("no_instance", "empty instance id")
    return UsageReport(instance, incarnation, seq, sent_at_ms, interval_ms, tuple(entries))


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

    def u8(self) -> int:
        return self._take(1)[0]

    def u16(self) -> int:
        return int(_U16.unpack(self._take(2))[0])

    def u32(self) -> int:
        return int(_U32.unpack(self._take(4))[0])

    def f64(self) -> float:
        return float(_ENTRY_TAIL.unpack(self._take(8))[0])

    def text(self, n: int) -> str:
        try:
            return str(self._take(n), "utf-8")
        except UnicodeDecodeError as exc:
            raise BadReport("bad_text", str(exc)) from None

    def name(self) -> str | None:
        (n,) = _I16.unpack(self._take(2))
        if n < -1:
            raise BadReport("bad_text", f"length {n}")
        return None if n == -1 else self.text(n)


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


def usage_entries(pending: Iterable[tuple[tuple[str, str | None, str | None], float]]) -> tuple[UsageEntry, ...]:
    """Report entries from ((kind, user, client id), amount) pairs, the positive amounts only."""
    return tuple(UsageEntry(k, u, c, a) for (k, u, c), a in pending if a > 0 and k in _KIND_INDEX)
