"""A minimal asyncio HTTP endpoint for ``GET /metrics`` and ``GET /healthz``.

Served on the event loop so collectors read engine state without locks.
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger("proxy.http")


class MetricsEndpoint:
    def __init__(self, registry: CollectorRegistry, healthy) -> None:
        self._registry = registry
        self._healthy = healthy  # () -> (bool, str)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), 10)
            while (await asyncio.wait_for(reader.readline(), 10)) not in (b"\r\n", b"\n", b""):
                pass
            parts = request_line.decode("latin-1").split()
            path = parts[1] if len(parts) >= 2 else ""
            if len(parts) < 2 or parts[0] not in ("GET", "HEAD"):
                self._write(writer, 405, "text/plain", b"method not allowed\n")
            elif path.split("?")[0] == "/metrics":
                self._write(writer, 200, CONTENT_TYPE_LATEST, generate_latest(self._registry))
            elif path.split("?")[0] == "/healthz":
                ok, detail = self._healthy()
                self._write(writer, 200 if ok else 503, "text/plain", detail.encode() + b"\n")
            else:
                self._write(writer, 404, "text/plain", b"not found\n")
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    @staticmethod
    def _write(writer, status: int, content_type: str, body: bytes) -> None:
        reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}[status]
        head = (
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        writer.write(head.encode("latin-1") + body)
