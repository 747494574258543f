"""Walks Produce and Fetch response bodies without decoding them.

The hot path must not copy record sets to learn whether a response needs rewriting. These
scanners read only fixed-width fields and lengths, skipping records by their size prefix, and
report where the top-level tagged fields start (KIP-951's ``NodeEndpoints`` live there).
"""

from __future__ import annotations

from struct import Struct
from struct import error as struct_error
from typing import NamedTuple

from .errors import ProtocolError
from .frames import Buffer
from .headers import HeaderError, read_uvarint, skip_tagged_fields

_INT16 = Struct(">h")
# How a walk below fails on a body that ends early or lies about a length: a varint cut short
# (HeaderError), a fixed-width read past the end (struct.error), an index past it.
_SHORT = (HeaderError, struct_error, IndexError)


class ScanError(ProtocolError):
    """A request or response body, read in place without decoding, that does not match its
    schema."""


def need_bytes(buf: Buffer, pos: int, size: int, what: str) -> None:
    """Raises :class:`ScanError` unless ``buf`` holds ``size`` bytes from ``pos``: the check
    before a fixed-width read, so a short body is reported as what it is."""
    if pos < 0 or pos + size > len(buf):
        raise ScanError(f"{what}: {size} bytes at {pos} run past the {len(buf)} there are")


class ResponseScan(NamedTuple):
    throttle_offset: int  # offset of throttle_time_ms within the body
    error_codes: frozenset[int]  # partition-level error codes seen (0 included)
    # Entries in the top-level NodeEndpoints (tag 0, KIP-951); brokers such as Tansu send the
    # tag with an empty array on every response, which needs no rewrite.
    node_endpoints: int


def _compact_len(buf: Buffer, pos: int) -> tuple[int, int]:
    """A compact (nullable) length: uvarint N+1; returns (N or -1 for null, next pos)."""
    n, pos = read_uvarint(buf, pos)
    return n - 1, pos


def _skip_compact_bytes(buf: Buffer, pos: int) -> int:
    n, pos = _compact_len(buf, pos)
    if n > 0:
        pos += n
    if pos > len(buf):
        raise ScanError("length runs past the body")
    return pos


def scan_produce_response(body: Buffer, version: int) -> ResponseScan:
    """ProduceResponse v9+ (flexible)."""
    if version < 9:
        raise ScanError("only flexible ProduceResponse versions are scanned")
    try:
        errors: set[int] = set()
        pos = 0
        topics, pos = _compact_len(body, pos)
        for _ in range(max(topics, 0)):
            if version >= 13:
                pos += 16  # topic id
            else:
                pos = _skip_compact_bytes(body, pos)
            parts, pos = _compact_len(body, pos)
            for _ in range(max(parts, 0)):
                errors.add(_INT16.unpack_from(body, pos + 4)[0])
                pos += 4 + 2 + 8 + 8 + 8  # index, error, base offset, append time, start offset
                record_errors, pos = _compact_len(body, pos)
                for _ in range(max(record_errors, 0)):
                    pos = _skip_compact_bytes(body, pos + 4)
                    pos = skip_tagged_fields(body, pos)
                pos = _skip_compact_bytes(body, pos)  # error message
                pos = skip_tagged_fields(body, pos)
            pos = skip_tagged_fields(body, pos)
        throttle_offset = pos
        pos += 4
        return ResponseScan(throttle_offset, frozenset(errors), _node_endpoints(body, pos))
    except _SHORT as exc:  # a read past the end of the body
        raise ScanError(f"malformed ProduceResponse v{version}: {exc}") from exc


def scan_fetch_response(body: Buffer, version: int) -> ResponseScan:
    """FetchResponse v12+ (flexible)."""
    _check_flexible_fetch(version)
    try:
        errors: set[int] = set()
        topics, pos = _compact_len(body, 4 + 2 + 4)  # after throttle, error code, session id
        for _ in range(max(topics, 0)):
            parts, pos = _fetch_topic_head(body, pos, version)
            for _ in range(max(parts, 0)):
                code, records, pos = _fetch_partition_head(body, pos)
                errors.add(code)
                pos += max(records, 0)
                if pos > len(body):
                    raise ScanError("length runs past the body")
                pos = skip_tagged_fields(body, pos)
            pos = skip_tagged_fields(body, pos)
        return ResponseScan(0, frozenset(errors), _node_endpoints(body, pos))
    except _SHORT as exc:
        raise ScanError(f"malformed FetchResponse v{version}: {exc}") from exc


def _check_flexible_fetch(version: int) -> None:
    if version < 12:
        raise ScanError("only flexible FetchResponse versions are scanned")


def _fetch_topic_head(body: Buffer, pos: int, version: int) -> tuple[int, int]:
    """A FetchResponse topic up to its partitions: (partition count, position of the first)."""
    pos = pos + 16 if version >= 13 else _skip_compact_bytes(body, pos)  # topic id / name
    return _compact_len(body, pos)


def _fetch_partition_head(body: Buffer, pos: int) -> tuple[int, int, int]:
    """A FetchResponse partition up to its records: (error code, records length or -1 for
    null, position of the records)."""
    code = _INT16.unpack_from(body, pos + 4)[0]
    pos += 4 + 2 + 8 + 8 + 8  # index, error, high watermark, LSO, log start
    aborted, pos = _compact_len(body, pos)
    for _ in range(max(aborted, 0)):
        pos = skip_tagged_fields(body, pos + 16)
    pos += 4  # preferred read replica
    records, pos = _compact_len(body, pos)
    return code, records, pos


class FetchHead(NamedTuple):
    """What the first part of a FetchResponse body tells before its records have arrived."""

    tail_offset: int  # where the last partition's records end: only tagged fields follow
    error_codes: frozenset[int]  # every partition's error code (0 included)


def scan_fetch_head(body: Buffer, version: int) -> FetchHead | None:
    """FetchResponse v12+ (flexible) of which ``body`` may hold only a first part: the head,
    when that part reaches the last partition's records length (every partition before it
    whole); None when it does not, or when the response has no partition."""
    _check_flexible_fetch(version)
    try:
        errors: set[int] = set()
        topics, pos = _compact_len(body, 4 + 2 + 4)  # after throttle, error code, session id
        for t in range(topics):
            parts, pos = _fetch_topic_head(body, pos, version)
            if parts <= 0:
                return None  # a topic without partitions: rare, assembled
            for p in range(parts):
                code, records, pos = _fetch_partition_head(body, pos)
                errors.add(code)
                if t == topics - 1 and p == parts - 1:
                    return FetchHead(pos + max(records, 0), frozenset(errors))
                pos += max(records, 0)
                pos = skip_tagged_fields(body, pos)  # raises past the end of this part
            pos = skip_tagged_fields(body, pos)
        return None  # no topic
    except (ScanError, *_SHORT):
        return None  # this part ends first (a malformed body fails when assembled)


def scan_fetch_tail(tail: Buffer) -> int:
    """The end of a FetchResponse body from its :attr:`FetchHead.tail_offset`: the last
    partition's, its topic's and the top-level tagged fields. Returns the number of
    NodeEndpoints entries (KIP-951, tag 0)."""
    try:
        pos = skip_tagged_fields(tail, 0)  # the last partition's
        pos = skip_tagged_fields(tail, pos)  # its topic's
        return _node_endpoints(tail, pos)
    except _SHORT as exc:
        raise ScanError(f"malformed FetchResponse end: {exc}") from exc


def _node_endpoints(body: Buffer, pos: int) -> int:
    """Walks the top-level tagged fields, which must end the body exactly; returns the number
    of NodeEndpoints entries (tag 0 in both ProduceResponse and FetchResponse)."""
    if pos >= len(body):
        raise ScanError("body ends before its tagged fields")
    endpoints = 0
    count, pos = read_uvarint(body, pos)
    for _ in range(count):
        tag, pos = read_uvarint(body, pos)
        size, pos = read_uvarint(body, pos)
        if tag == 0 and size:
            n, _ = _compact_len(body, pos)
            endpoints = max(n, 0)
        pos += size
    if pos != len(body):
        raise ScanError(f"tagged fields end at {pos}, body has {len(body)} bytes")
    return endpoints
