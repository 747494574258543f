"""Batch headers read once per request (Produce) or response (Fetch) for every filter that needs them."""

from __future__ import annotations

import logging

from protocol.apis import ApiKey
from protocol.errors import ProtocolError
from protocol.headers import RequestHeader, response_body_offset
from protocol.records import FetchRecords, ProduceScan, RecordsError, count_fetch_records, scan_produce_request
from protocol.share_scan import scan_share_fetch
from proxy.dataplane.filters.api import FilterContext, Frame
from proxy.dataplane.inflight import InFlight
from proxy.observability.logs import LogLimiter

log = logging.getLogger(__name__)
_unreadable = LogLimiter(log)  # a client can send unreadable batches at will


def produce_scan(ctx: FilterContext, header: RequestHeader, frame: Frame, entry: InFlight) -> ProduceScan | None:
    """The request's :class:`ProduceScan`, cached on its in-flight entry.

    None for a request whose records cannot be read: it is counted and logged, then forwarded
    as it is, uncharged; the broker answers it (CORRUPT_MESSAGE) as it would without the proxy.
    """
    scan = entry.produce
    if scan is not None or header.body_offset < 0:
        return scan or None
    try:
        scan = scan_produce_request(frame, header.body_offset, header.api_version)
    except RecordsError as exc:
        ctx.stats.records_scan_failures["Produce"] += 1
        _unreadable.log(logging.WARNING, "unreadable record batches from %s (client_id=%s): %s; forwarded uncharged",
                        ctx.label, header.client_id, exc)
        entry.produce = False
        return None
    entry.produce = scan
    entry.records, entry.batches = scan.records, scan.batches
    return scan


def count_fetched(ctx: FilterContext, entry: InFlight, frame: Frame) -> bool:
    """Counts a Fetch (or ShareFetch) response's records and batches onto its in-flight entry, once.

    False for a response whose batches cannot be read: it is counted and logged, and passes on
    as it is, uncounted and uncharged.
    """
    if entry.records is not None:
        return True
    offset = response_body_offset(frame, entry.api_key, entry.api_version)
    share = entry.api_key == ApiKey.SHARE_FETCH
    counted: FetchRecords
    try:
        if share:
            counted = scan_share_fetch(memoryview(frame)[offset:], entry.api_version).delivered
        else:
            counted = count_fetch_records(memoryview(frame)[offset:], entry.api_version)
    except ProtocolError as exc:  # RecordsError, or a ShareFetch body that does not scan
        api = "ShareFetch" if share else "Fetch"
        ctx.stats.records_scan_failures[api] += 1
        _unreadable.log(logging.WARNING,
                        "unreadable record batches in a %s response for %s: %s; not counted or charged",
                        api, ctx.label, exc)
        entry.records = 0
        return False
    entry.records, entry.batches = counted.records, counted.batches
    return True
