"""Walks ShareFetch and ShareAcknowledge response bodies (KIP-932) without decoding them.

As protocol.scan does for Fetch: fixed-width fields and lengths only, records skipped by their
size, so the hot path learns whether a response needs rewriting (a moved partition, a
``NodeEndpoints`` entry) without copying records. Unlike Fetch, ``CurrentLeader`` and
``NodeEndpoints`` are ordinary fields (protocol.share_messages); the body ends with the
top-level tagged fields, which must end it exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from struct import Struct
from typing import NamedTuple

from .apis import ApiKey
from .frames import Buffer
from .headers import read_uvarint, skip_tagged_fields
from .records import ALL_ENTRIES, FetchRecords, RecordsError, all_steps, counted_batches
from .scan import _SHORT, ResponseScan, ScanError

_INT16 = Struct(">h")
_INT64_INT64 = Struct(">qq")


class ShareFetchBody(NamedTuple):
    scan: ResponseScan
    delivered: FetchRecords  # what the consumer is handed: see count_share_fetch_records


def _compact_len(buf: Buffer, pos: int) -> tuple[int, int]:
    n, pos = read_uvarint(buf, pos)
    if n - 1 > len(buf) - pos:
        raise ScanError(f"a length of {n - 1} at {pos} runs past the body")
    return n - 1, pos


def _skip_compact_bytes(buf: Buffer, pos: int) -> int:
    n, pos = _compact_len(buf, pos)
    return pos + max(n, 0)


def _node_endpoints(body: Buffer, pos: int) -> int:
    """The NodeEndpoints array, then the top-level tagged fields, which must end the body;
    returns the number of entries."""
    count, pos = _compact_len(body, pos)
    for _ in range(max(count, 0)):
        pos = _skip_compact_bytes(body, pos + 4)  # node id, host
        pos = _skip_compact_bytes(body, pos + 4)  # port, rack
        pos = skip_tagged_fields(body, pos)
    pos = skip_tagged_fields(body, pos)
    if pos != len(body):
        raise ScanError(f"the body ends at {pos}, it has {len(body)} bytes")
    return max(count, 0)


_KNOWN_VERSIONS = 2  # protocol/schemas: a later version may move fields, so it is not guessed at
# Where AcquisitionLockTimeoutMs (after the top-level error message) first appears.
_LOCK_TIMEOUT_SINCE: dict[int, int] = {ApiKey.SHARE_FETCH: 1,
                                       ApiKey.SHARE_ACKNOWLEDGE: 2}  # KIP-1222: renewing extends the lock


def _head(body: Buffer, version: int, api_key: int) -> int:
    """The position of Responses: after throttle_time_ms, error code, error message (and
    AcquisitionLockTimeoutMs: ShareFetch v1+, ShareAcknowledge v2+)."""
    if not 0 <= version <= _KNOWN_VERSIONS:
        raise ScanError(f"{'ShareFetch' if api_key == ApiKey.SHARE_FETCH else 'ShareAcknowledge'}Response "
                        f"v{version} is not a version the proxy knows")
    pos = _skip_compact_bytes(body, 4 + 2)
    if version >= _LOCK_TIMEOUT_SINCE[api_key]:
        pos += 4
    return pos


def scan_share_fetch(body: Buffer, version: int) -> ShareFetchBody:
    """ShareFetchResponse v0+: partition error codes, NodeEndpoints entries, and the records
    delivered. Raises :class:`~protocol.scan.ScanError` for a body that does not match the
    schema (:class:`~protocol.records.RecordsError` for record batches that do not add up)."""
    return all_steps(scan_share_fetch_steps(body, version, ALL_ENTRIES))


def scan_share_fetch_steps(body: Buffer, version: int, entries_per_step: int) -> Iterator[ShareFetchBody | None]:
    """:func:`scan_share_fetch` in steps: yields None after every ``entries_per_step``
    partitions and batches (a pause only when more follow), then the scan. The same result and
    the same errors, raised by the step that meets them; ``body`` must not change meanwhile."""
    try:
        yield from _scan_share_fetch(body, version, entries_per_step)
    except RecordsError:
        raise
    except _SHORT as exc:
        raise ScanError(f"malformed ShareFetchResponse v{version}: {exc}") from exc


def _scan_share_fetch(body: Buffer, version: int, step: int) -> Iterator[ShareFetchBody | None]:
    errors: set[int] = set()
    batches = in_batches = acquired = 0
    in_step = 0  # partitions and batches read since the last pause
    topics, pos = _compact_len(body, _head(body, version, ApiKey.SHARE_FETCH))
    for _ in range(max(topics, 0)):
        parts, pos = _compact_len(body, pos + 16)  # topic id
        for _ in range(max(parts, 0)):
            if in_step >= step:
                yield None
                in_step = 0
            in_step += 1
            errors.add(_INT16.unpack_from(body, pos + 4)[0])
            pos = _skip_compact_bytes(body, pos + 4 + 2)  # index, error code, error message
            pos = _skip_compact_bytes(body, pos + 2)  # acknowledge error code and message
            pos = skip_tagged_fields(body, pos + 8)  # CurrentLeader: leader id, epoch
            size, pos = _compact_len(body, pos)
            if size > 0:
                tally = [batches, in_batches, in_step]
                yield from counted_batches(body, pos, pos + size, step, tally, fetched=True)
                batches, in_batches, in_step = tally
                pos += size
            ranges, pos = _compact_len(body, pos)
            for _ in range(max(ranges, 0)):
                first, last = _INT64_INT64.unpack_from(body, pos)
                acquired += max(last - first + 1, 0)
                pos = skip_tagged_fields(body, pos + 8 + 8 + 2)  # delivery count
            pos = skip_tagged_fields(body, pos)
        pos = skip_tagged_fields(body, pos)
    scan = ResponseScan(0, frozenset(errors), _node_endpoints(body, pos))
    yield ShareFetchBody(scan, FetchRecords(batches, min(in_batches, acquired)))


def scan_share_acknowledge(body: Buffer, version: int) -> ResponseScan:
    """ShareAcknowledgeResponse v0+: partition error codes and NodeEndpoints entries."""
    try:
        errors: set[int] = set()
        topics, pos = _compact_len(body, _head(body, version, ApiKey.SHARE_ACKNOWLEDGE))
        for _ in range(max(topics, 0)):
            parts, pos = _compact_len(body, pos + 16)  # topic id
            for _ in range(max(parts, 0)):
                errors.add(_INT16.unpack_from(body, pos + 4)[0])
                pos = _skip_compact_bytes(body, pos + 4 + 2)  # index, error code, error message
                pos = skip_tagged_fields(body, pos + 8)  # CurrentLeader
                pos = skip_tagged_fields(body, pos)
            pos = skip_tagged_fields(body, pos)
        return ResponseScan(0, frozenset(errors), _node_endpoints(body, pos))
    except _SHORT as exc:
        raise ScanError(f"malformed ShareAcknowledgeResponse v{version}: {exc}") from exc


def scan_share_response(body: Buffer, version: int, api_key: int) -> ResponseScan:
    """Either share response's :class:`~protocol.scan.ResponseScan`."""
    if api_key == ApiKey.SHARE_FETCH:
        return scan_share_fetch(body, version).scan
    return scan_share_acknowledge(body, version)
