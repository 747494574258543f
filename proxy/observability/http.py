"""The proxy's HTTP endpoint: ``GET /metrics``, ``/healthz`` (liveness), ``/readyz`` (readiness).

Served on the event loop, so collectors read engine state without locks; and so it must never
hold the loop long. Guarantees:

* ``/metrics`` gives the loop back every ``slice_s`` (0.25 ms) of work: collectors' per-entity work
  (see ``stats.Scrape``) and the text formatting both run as steps in slices. One
  scrape renders at a time; the others wait their turn.
* Every input has a budget and every wait a deadline (:class:`HttpLimits`): a request line
  longer than ``max_request_line_bytes`` is answered 414, a header line or all of them too
  long or too many 431, anything else unreadable 400; the request (line and headers) must
  arrive whole within ``request_timeout_s`` (408 otherwise), the answer be taken within
  ``write_timeout_s``. Beyond ``max_connections`` at once, a connection is answered 503 unread.
* Nothing a client sends produces a traceback in the log.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from http import HTTPStatus
from typing import TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from proxy.observability.quota_metrics import DEFAULT_MAX_ENTITY_SERIES
from proxy.observability.stats import SAMPLES_PER_STEP, Scrape, Steps

log = logging.getLogger(__name__)

Check = Callable[[], tuple[bool, str]]  # () -> (ok, detail)
_T = TypeVar("_T")

_OPENMETRICS_SUFFIXES = ("_created", "_gsum", "_gcount")  # generate_latest moves these to a family's end


@dataclass(frozen=True)
class HttpLimits:
    max_request_line_bytes: int = 8192  # also each header line's (the StreamReader's limit)
    max_header_bytes: int = 16384  # all header lines together
    max_headers: int = 100
    request_timeout_s: float = 10.0  # for the request line and every header, together
    write_timeout_s: float = 10.0  # for the client to take the answer
    max_connections: int = 16
    # After an error answer, input still arriving is read and dropped for this long (or this
    # much) before closing, so the client reads the answer instead of a reset.
    linger_s: float = 1.0
    linger_bytes: int = 1 << 21


class HttpError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class MetricsEndpoint:
    def __init__(self, registry: CollectorRegistry, healthy: Check, ready: Check | None = None,
                 max_entity_series: int = DEFAULT_MAX_ENTITY_SERIES, limits: HttpLimits = HttpLimits(),
                 slice_s: float = 0.00025) -> None:
        self._registry = registry
        self._healthy = healthy
        self._ready = ready
        self._max_entity_series = max_entity_series
        self.limits = limits
        self._slice_s = slice_s
        self._connections = 0
        self._render_lock = asyncio.Lock()
        self._render_failure_logged_s = -1e9

    async def start_server(self, host: str, port: int) -> asyncio.Server:
        # The StreamReader's limit bounds every line read, and what one connection buffers.
        return await asyncio.start_server(self.handle, host, port, reuse_address=True,
                                          limit=self.limits.max_request_line_bytes)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._connections >= self.limits.max_connections:
            self._write(writer, 503, "text/plain", b"too many connections\n")
            writer.close()
            return
        self._connections += 1
        try:
            await self._serve(reader, writer)
        except (OSError, EOFError, TimeoutError):
            pass  # the client went away (EOFError: IncompleteReadError) or did not take the answer
        except asyncio.CancelledError:
            # The server is stopping. Python 3.11's start_server logs an error for a handler
            # that ends cancelled (it asks the task for its exception): this one just ends.
            pass
        finally:
            self._connections -= 1
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(self.limits.request_timeout_s):
                method, path = await self._read_head(reader)
        except HttpError as exc:
            await self._refuse(reader, writer, exc.status)
            return
        except TimeoutError:
            # A client still trickling its head would get a reset, not the 408, on a plain close.
            await self._refuse(reader, writer, 408)
            return
        status, content_type, body = await self._answer(method, path)
        self._write(writer, status, content_type, body, head_only=method == "HEAD")
        await self._drain(writer)

    async def _read_head(self, reader: asyncio.StreamReader) -> tuple[str, str]:
        """The method and path of the request line; the headers are read and dropped."""
        line = await _read_line(reader, 414)
        try:
            method, target, version = line.decode("ascii").split()
        except ValueError:  # not three words, or not ASCII
            raise HttpError(400) from None
        if not version.startswith("HTTP/"):
            raise HttpError(400)
        header_bytes = 0
        for _ in range(self.limits.max_headers + 1):
            header = await _read_line(reader, 431)
            if header in (b"\r\n", b"\n"):
                return method, target.split("?", 1)[0]
            header_bytes += len(header)
            if header_bytes > self.limits.max_header_bytes:
                break
        raise HttpError(431)

    async def _answer(self, method: str, path: str) -> tuple[int, str, bytes]:
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"method not allowed\n"
        if path == "/metrics":
            return await self._metrics()
        check = {"/healthz": self._healthy, "/readyz": self._ready}.get(path)
        if check is None:
            return 404, "text/plain", b"not found\n"
        ok, detail = check()
        return 200 if ok else 503, "text/plain", detail.encode() + b"\n"

    async def _metrics(self) -> tuple[int, str, bytes]:
        try:
            return 200, CONTENT_TYPE_LATEST, await self.render()
        except Exception:
            # A collector's bug, not the client's doing; but any client can ask again at once.
            now_s = time.monotonic()
            if now_s - self._render_failure_logged_s >= 60:
                self._render_failure_logged_s = now_s
                log.exception("/metrics failed to render (logged at most once a minute)")
            return 500, "text/plain", b"metrics failed to render\n"

    async def render(self) -> bytes:
        """The exposition text, built a slice at a time (see the module's guarantees)."""
        async with self._render_lock:
            slicer = _Slicer(self._slice_s)
            with Scrape(self._max_entity_series) as scrape:
                # One collector's families at a time; the long ones hand steps to the scrape.
                families = await slicer.run(_collect_steps(self._registry))
            for steps in scrape.deferred:
                families.extend(await slicer.run(steps))
            return await slicer.run(exposition_steps(families))

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status: int) -> None:
        """Answers ``status``, then drops what the client is still sending for a while: closing
        with unread input would reset the connection before the client reads the answer."""
        self._write(writer, status, "text/plain", f"{HTTPStatus(status).phrase}\n".encode())
        limits = self.limits
        try:
            async with asyncio.timeout(limits.linger_s):
                await writer.drain()
                if writer.can_write_eof():
                    writer.write_eof()
                left = limits.linger_bytes
                while left > 0 and (chunk := await reader.read(min(left, 65536))):
                    left -= len(chunk)
        except TimeoutError:
            pass

    async def _drain(self, writer: asyncio.StreamWriter) -> None:
        async with asyncio.timeout(self.limits.write_timeout_s):
            await writer.drain()

    @staticmethod
    def _write(writer: asyncio.StreamWriter, status: int, content_type: str, body: bytes,
               head_only: bool = False) -> None:
        head = (
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        writer.write(head.encode("latin-1") if head_only else head.encode("latin-1") + body)


async def _read_line(reader: asyncio.StreamReader, too_long: int) -> bytes:
    """One line (with its newline); HttpError(too_long) past the reader's limit;
    IncompleteReadError when the client closes first."""
    try:
        return await reader.readuntil(b"\n")
    except asyncio.LimitOverrunError:
        raise HttpError(too_long) from None


class _Slicer:
    """Runs step generators one after another, giving the event loop back once ``slice_s``
    of work has been done since it last had it."""

    def __init__(self, slice_s: float) -> None:
        self._slice_s = slice_s
        self._deadline_s = time.perf_counter() + slice_s

    async def run(self, steps: Generator[None, None, _T]) -> _T:
        """Runs ``steps`` to its end; returns what it returns."""
        while True:
            try:
                next(steps)
            except StopIteration as stop:
                value: _T = stop.value  # the generator's return value (StopIteration.value is untyped)
                return value
            if time.perf_counter() >= self._deadline_s:
                await asyncio.sleep(0)
                self._deadline_s = time.perf_counter() + self._slice_s


def _collect_steps(registry: CollectorRegistry) -> Steps:
    families: list[Metric] = []
    for family in registry.collect():
        families.append(family)
        yield
    return families


class _Families:
    """A collector of metric families already built (what generate_latest formats)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def exposition_steps(families: list[Metric]) -> Generator[None, None, bytes]:
    """The Prometheus text format of ``families``, exactly as ``generate_latest`` writes it,
    formatted SAMPLES_PER_STEP samples at a time (a family's HELP and TYPE lines once)."""
    parts = []
    for family in families:
        samples = family.samples
        if len(samples) <= SAMPLES_PER_STEP or any(s.name.endswith(_OPENMETRICS_SUFFIXES) for s in samples):
            parts.append(generate_latest(_Families([family])))
            yield
            continue
        for start in range(0, len(samples), SAMPLES_PER_STEP):
            piece = copy.copy(family)
            piece.samples = samples[start:start + SAMPLES_PER_STEP]
            text = generate_latest(_Families([piece]))
            parts.append(text if start == 0 else text.split(b"\n", 2)[2])
            yield
    return b"".join(parts)
