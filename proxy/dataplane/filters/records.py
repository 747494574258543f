"""Batch headers read once per request (Produce) or response (Fetch) for every filter that needs them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import TypeVar

from protocol.apis import ApiKey
from protocol.errors import ProtocolError
from protocol.frames import Buffer
from protocol.headers import RequestHeader, response_body_offset
from protocol.records import ALL_ENTRIES, FetchRecords, ProduceScan, RecordsError, count_fetch_steps, scan_produce_steps
from protocol.scan import ResponseScan, scan_fetch_response, scan_produce_response
from protocol.share_scan import ShareFetchBody, scan_share_acknowledge, scan_share_fetch, scan_share_fetch_steps
from proxy.dataplane.filters.api import Defer, FilterContext, FilterSpec, Frame, Hold, checked_spec
from proxy.dataplane.inflight import InFlight
from proxy.observability.logs import LogLimiter

log = logging.getLogger(__name__)
_unreadable = LogLimiter(log)  # a client can send unreadable batches at will
_T = TypeVar("_T")

# The responses KIP-951 and KIP-932 filters walk (error codes, NodeEndpoints), by API.
_RESPONSE_SCANNERS: dict[int, Callable[[Buffer, int], ResponseScan]] = {
    ApiKey.PRODUCE: scan_produce_response, ApiKey.FETCH: scan_fetch_response,
    ApiKey.SHARE_FETCH: lambda body, version: scan_share_fetch(body, version).scan,
    ApiKey.SHARE_ACKNOWLEDGE: scan_share_acknowledge,
}


def response_scan(entry: InFlight, frame: Buffer, offset: int | None = None) -> ResponseScan:
    """The walk of ``frame``, a Produce, Fetch, ShareFetch or ShareAcknowledge response (no size
    prefix; its body at ``offset`` when the caller knows it): the one a filter before this one
    left on ``entry`` for this very frame (``entry.scan``), or made now. The caller notes it on
    the entry when it passes the frame on unchanged."""
    if entry.scan is not None:
        return entry.scan
    key, version = entry.api_key, entry.api_version
    body = memoryview(frame)
    return _RESPONSE_SCANNERS[key](body[response_body_offset(body, key, version) if offset is None else offset:],
                                   version)


def produce_scan(ctx: FilterContext, header: RequestHeader, frame: Frame, entry: InFlight) -> ProduceScan | None:
    """The request's :class:`ProduceScan`, cached on its in-flight entry (made by
    :class:`ProduceScanFilter` when it runs first, as in the proxy's chain).

    None for a request whose records cannot be read: it is counted and logged, then forwarded
    as it is, uncharged; the broker answers it (CORRUPT_MESSAGE) as it would without the proxy.
    """
    scan = entry.produce
    if scan is not None or header.body_offset < 0:
        return scan or None
    steps = scan_produce_steps(frame, header.body_offset, header.api_version, ALL_ENTRIES)
    _step(ctx, header, entry, steps)
    return entry.produce or None


def _step(ctx: FilterContext, header: RequestHeader, entry: InFlight, steps: Iterator[ProduceScan | None]) -> bool:
    """Takes the next step of a Produce's scan; whether it is done (``entry.produce`` set: the
    scan, or False for records that cannot be read, counted and logged)."""
    try:
        scan = next(steps)
    except RecordsError as exc:
        ctx.stats.records_scan_failures["Produce"] += 1
        _unreadable.log(logging.WARNING, "unreadable record batches from %s (client_id=%s): %s; forwarded uncharged",
                        ctx.label, header.client_id, exc)
        entry.produce = False
        return True
    if scan is None:
        return False
    entry.produce = scan
    entry.records, entry.batches = scan.records, scan.batches
    return True


SCAN_SLICE_ENTRIES = 2_000  # partitions and batches: about 2.5 ms of the loop a slice


class ProduceScanFilter:
    """Reads a Produce's record batches for the filters after it that read them, 2,000
    partitions and batches at a time: the first slice at once (every Produce a client normally
    sends fits in it), the rest between turns of the event loop, the request deferred meanwhile
    (later requests on its connection wait their turn, as behind any deferred decision). So a
    Produce of a million partitions, or of one partition of a million batches, holds the loop
    about as long as one of 2,000."""

    def __init__(self, readers: Sequence[object]) -> None:
        self.readers = tuple(readers)  # the filters that call produce_scan

    @property
    def spec(self) -> FilterSpec:
        """Produce requests, while a filter that reads their batches is busy with them."""
        return FilterSpec(request_keys=frozenset({ApiKey.PRODUCE}),
                          idle=not any(_sees_produce(checked_spec(f)) for f in self.readers))

    def on_request(self, ctx: FilterContext, header: RequestHeader, frame: Frame, entry: InFlight) -> Defer | None:
        if entry.produce is not None or header.body_offset < 0:
            return None
        # The frame is the client's bytes or the proxy's own buffer of them: nothing changes it
        # while the scan goes on.
        steps = scan_produce_steps(frame, header.body_offset, header.api_version, SCAN_SLICE_ENTRIES)
        if _step(ctx, header, entry, steps):
            return None
        return Defer(_in_slices(partial(_step, ctx, header, entry, steps), None))


def _sees_produce(spec: FilterSpec) -> bool:
    return not spec.idle and (spec.request_keys is None or ApiKey.PRODUCE in spec.request_keys)


def count_fetched(ctx: FilterContext, entry: InFlight, frame: Frame) -> bool:
    """Counts a Fetch (or ShareFetch) response's records and batches onto its in-flight entry,
    once (by :class:`FetchCountFilter` when it runs first, as in the proxy's chain).

    False for a response whose batches cannot be read: it is counted and logged, and passes on
    as it is, uncounted and uncharged.
    """
    if entry.records is None:
        _count_step(ctx, entry, _count_steps(entry, frame, ALL_ENTRIES))
    return not entry.records_unreadable


def _count_steps(entry: InFlight, frame: Frame, step: int) -> Iterator[FetchRecords | ShareFetchBody | None]:
    # The broker's bytes, or the proxy's own buffer of them: nothing changes them meanwhile.
    body = memoryview(frame)[response_body_offset(frame, entry.api_key, entry.api_version):]
    if entry.api_key == ApiKey.SHARE_FETCH:
        return scan_share_fetch_steps(body, entry.api_version, step)
    return count_fetch_steps(body, entry.api_version, step)


def _count_step(ctx: FilterContext, entry: InFlight, steps: Iterator[FetchRecords | ShareFetchBody | None]) -> bool:
    """Takes the next step of a (Share)Fetch response's count; whether it is done
    (``entry.records`` set, and a ShareFetch's ``entry.scan`` for the filters after;
    ``records_unreadable`` for batches that cannot be read, counted and logged)."""
    try:
        counted = next(steps)
    except ProtocolError as exc:  # batches that do not add up, or a ShareFetch body that does not scan
        api = "ShareFetch" if entry.api_key == ApiKey.SHARE_FETCH else "Fetch"
        ctx.stats.records_scan_failures[api] += 1
        _unreadable.log(logging.WARNING, "unreadable record batches in a %s response for %s: %s; not counted or "
                        "charged", api, ctx.label, exc)
        entry.records = 0
        entry.records_unreadable = True
        return True
    if counted is None:
        return False
    if isinstance(counted, ShareFetchBody):
        entry.scan = counted.scan  # what the leader and endpoint filters read of it
        counted = counted.delivered
    entry.records, entry.batches = counted.records, counted.batches
    return True


class FetchCountFilter:
    """Counts a Fetch or ShareFetch response's records for the filters after it that read them,
    2,000 partitions and batches at a time: the first slice at once, the rest between turns of
    the event loop, the response held meanwhile (it keeps its place; those behind it wait). A
    response of a million small batches holds the loop about as long as one of 2,000."""

    def __init__(self, counters: Sequence[object], share_walkers: Sequence[object] = ()) -> None:
        self.counters = tuple(counters)  # the filters that call count_fetched
        self.share_walkers = tuple(share_walkers)  # the filters that walk every ShareFetch response

    @property
    def spec(self) -> FilterSpec:
        """The (Share)Fetch responses a filter after it is busy reading."""
        keys = {key for f in self.counters for key in _busy_keys(f) if key in (ApiKey.FETCH, ApiKey.SHARE_FETCH)}
        keys.update(key for f in self.share_walkers for key in _busy_keys(f) if key == ApiKey.SHARE_FETCH)
        return FilterSpec(response_keys=frozenset(keys), idle=not keys)

    def on_response(self, ctx: FilterContext, entry: InFlight, frame: Frame) -> Frame | Hold:
        if entry.records is not None:
            return frame
        steps = _count_steps(entry, frame, SCAN_SLICE_ENTRIES)
        if _count_step(ctx, entry, steps):
            return frame
        return Hold(_in_slices(partial(_count_step, ctx, entry, steps), frame))


def _busy_keys(f: object) -> frozenset[int]:
    spec = checked_spec(f)
    return frozenset() if spec.idle else spec.response_keys


async def _in_slices(step: Callable[[], bool], result: _T) -> _T:
    """Takes ``step`` once a turn of the loop until it is done; then ``result``."""
    while True:
        await asyncio.sleep(0)  # another turn of the loop between two slices
        if step():
            return result
