"""A filter that breaks its contract closes that one connection, with a log line and a counter,
instead of leaving it waiting forever: a request filter that returns bytes instead of
Forward(...), a response filter that returns None."""

from __future__ import annotations

import asyncio
import logging
import struct

from config import parse_config
from proxy.app.server import ProxyServer
from proxy.dataplane.filters.api import FilterSpec
from proxy.dataplane.filters.chain import FilterChain

from .test_connection_paths import BASE, Pair, list_offsets

LIST_OFFSETS = 2


class BytesInsteadOfForward:
    spec = FilterSpec(request_keys=frozenset({LIST_OFFSETS}))

    def on_request(self, conn, header, frame, entry):
        return bytes(frame)  # should have been Forward(bytes(frame))


class NoneInsteadOfFrame:
    spec = FilterSpec(response_keys=frozenset({LIST_OFFSETS}))

    def on_response(self, conn, entry, frame):
        return None  # should have returned frame


def _pair(request_filters, response_filters) -> Pair:
    server = ProxyServer(parse_config(BASE))
    server.chain = FilterChain(request_filters, response_filters)
    return Pair(server=server)


def test_a_request_filter_that_returns_bytes_closes_its_connection(caplog):
    async def go():
        pair = _pair([BytesInsteadOfForward()], [])
        with caplog.at_level(logging.WARNING, logger="proxy.dataplane.connection"):
            pair.conn.data_received(list_offsets(1, "app"))
        assert pair.client.closed and pair.requests_seen_by_broker() == []
        assert pair.server.stats.frames_rejected["filter_error"] == 1
        assert any("a request filter decided bytes on ListOffsets" in r.getMessage()
                   for r in caplog.records), caplog.text

    asyncio.run(go())


def test_a_response_filter_that_returns_none_closes_its_connection(caplog):
    async def go():
        pair = _pair([], [NoneInsteadOfFrame()])
        pair.conn.data_received(list_offsets(1, "app"))
        assert len(pair.requests_seen_by_broker()) == 1
        body = struct.pack(">i", 1) + b"\0\0\0\0"  # ListOffsets v1: no topics
        with caplog.at_level(logging.WARNING, logger="proxy.dataplane.connection"):
            pair.up.data_received(struct.pack(">i", len(body)) + body)
        assert pair.client.closed and pair.client.writes == []
        assert pair.server.stats.frames_rejected["filter_error"] == 1
        assert any("NoneInsteadOfFrame.on_response returned NoneType" in r.getMessage() for r in caplog.records)

    asyncio.run(go())
