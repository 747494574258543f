"""The batch headers of a Produce request, read once per request for every filter that needs them."""

from __future__ import annotations

import logging

from protocol.records import ProduceScan, RecordsError, scan_produce_request

log = logging.getLogger("proxy.records")


def produce_scan(conn, header, frame, entry) -> ProduceScan | None:
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
        conn.stats.records_scan_failures["Produce"] += 1
        log.warning("unreadable record batches from %s (client_id=%s): %s; forwarded uncharged",
                    conn.label, header.client_id, exc)
        entry.produce = False
        return None
    entry.produce = scan
    return scan
