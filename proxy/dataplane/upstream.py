"""The broker side of one client connection: opening it, and framing the broker's responses
back to the client (transport only; the client connection and its response queue decide).

Guarantees:
- the oldest response due goes back on its planned route (proxy.dataplane.routes): written from the
  chunk it came in, rewritten on that chunk, or streamed as it arrives, and otherwise framed and
  handed to the client connection; nothing is written between the chunks of a streamed response;
- a streamed response whose tail its filters must see has that tail held back until they
  accept it unchanged, else the client's connection is closed (its size already went);
- a failure on a response (an undecodable body, a filter that raised or broke its contract)
  closes this client's connection only, with the reason counted;
- the broker is read no faster than the client reads (its writes pause our reads).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from struct import Struct
from typing import TYPE_CHECKING, Protocol, cast

from protocol.apis import api_name
from protocol.errors import ProtocolError
from protocol.frames import Buffer, FrameError, FrameReader
from proxy.dataplane.filters.api import FilterContractError
from proxy.dataplane.filters.chain import UNFILTERED
from proxy.dataplane.inflight import Frame, InFlight
from proxy.dataplane.reads import OWN_READS_FROM_BYTES, OwnReads
from proxy.dataplane.response_queue import UnexpectedResponse
from proxy.dataplane.routes import AS_READ, StreamRoute

if TYPE_CHECKING:
    from proxy.dataplane.environment import ConnectionEnv
    from proxy.dataplane.filters.api import FilterContext
    from proxy.dataplane.filters.chain import FilterChain
    from proxy.dataplane.flow import ReadGate
    from proxy.dataplane.raw_sasl import RawSasl
    from proxy.dataplane.response_queue import ResponseQueue
    from proxy.observability.stats import ProxyStats

log = logging.getLogger(__name__)

_RESPONSE_HEAD = Struct(">ii")  # size, correlation id
_WRITE_HIGH_BYTES = 1 << 20
_WRITE_LOW_BYTES = 1 << 18


def tune(transport: asyncio.Transport) -> None:
    """Small requests go out at once; a whole large fetch response may sit in the write buffer
    before the other side is paused (the default 64 KiB high-water mark would pause and resume
    the broker side for every large response)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
    transport.set_write_buffer_limits(high=_WRITE_HIGH_BYTES, low=_WRITE_LOW_BYTES)


class UpstreamClient(Protocol):
    """What the broker side asks of the client connection it serves."""

    @property
    def env(self) -> ConnectionEnv: ...

    @property
    def ctx(self) -> FilterContext: ...

    @property
    def queue(self) -> ResponseQueue: ...

    @property
    def stats(self) -> ProxyStats: ...

    @property
    def chain(self) -> FilterChain: ...

    @property
    def closed(self) -> bool: ...

    @property
    def gate(self) -> ReadGate | None: ...

    @property
    def raw_sasl(self) -> RawSasl | None: ...

    def close(self) -> None: ...

    def reject(self, reason: str, detail: str, drain: bool = False) -> None: ...


async def open_upstream(client: UpstreamClient) -> UpstreamConnection | None:
    """Connects to the broker behind ``client``'s listener, trying the configured number of
    times with back-off; None when every attempt failed or the client closed meanwhile (each
    failure counted and logged, rate-limited)."""
    env = client.env
    cfg = env.upstream
    dialer = env.cluster.dialer
    # TLS to the broker when upstream.tls is set; the client's own SASL frames pass through.
    handshake_timeout_s = None if dialer.tls is None else cfg.connect_timeout_s
    loop = asyncio.get_running_loop()
    for attempt in range(cfg.connect_attempts):
        address = host, port = env.cluster.upstream_address(client.ctx.node_id, attempt)
        try:
            _, protocol = await asyncio.wait_for(
                loop.create_connection(lambda: UpstreamConnection(client), host, port, ssl=dialer.tls,
                                       server_hostname=dialer.server_hostname(host),
                                       ssl_handshake_timeout=handshake_timeout_s),
                cfg.connect_timeout_s,
            )
        except (TimeoutError, OSError) as exc:
            if isinstance(exc, ssl.SSLError):
                dialer.failed("tls", address, exc)
            client.stats.upstream_connect_failures += 1
            env.guard.log(
                "broker_unreachable", logging.WARNING, "cannot reach broker %s:%s for %s (attempt %d/%d): %s",
                *address, client.ctx.label, attempt + 1, cfg.connect_attempts, exc or "timeout", logger=log,
            )
            if client.closed:
                return None
            await asyncio.sleep(min(0.1 * 2**attempt, 2.0))
            continue
        if client.closed:
            if protocol.transport is not None:  # set by connection_made, before this returns
                protocol.transport.close()
            return None
        return protocol
    env.guard.log("broker_unreachable_final", logging.ERROR, "giving up on %s: no broker reachable after %d "
                  "attempts", client.ctx.label, cfg.connect_attempts, logger=log)
    return None


def response_failed(client: UpstreamClient, exc: Exception) -> None:
    """A response filter or a write to the client raised: the client's connection is closed,
    with the reason counted."""
    if isinstance(exc, ProtocolError):
        upstream_failed(client, f"undecodable response: {exc}")  # counts the decode failure
    elif isinstance(exc, FilterContractError):
        client.reject("filter_error", str(exc))
    else:
        log.error("response filter failed for %s; closing it", client.ctx.label, exc_info=exc)
        client.reject("filter_error", "response filter raised")


def upstream_failed(client: UpstreamClient, reason: str) -> None:
    """The broker's side cannot be read (bad framing, an answer out of order, an undecodable
    body): the client's connection is closed."""
    # A client can make a broker's answer undecodable (an unknown version), so rate-limited.
    client.env.guard.log("upstream_failed", logging.ERROR, "broker connection for %s failed: %s; closing client",
                            client.ctx.label, reason, logger=log)
    client.stats.decode_failures += 1
    client.close()


class UpstreamConnection(OwnReads):
    """The broker side of one client connection: frames responses back to it."""

    __slots__ = ("client", "queue", "transport", "_reader", "_through", "_streaming_size", "_tail", "_tail_route",
                 "_unheld", "_reads", "_peek")

    def __init__(self, client: UpstreamClient) -> None:
        self.client = client
        self.queue = client.queue
        self.transport: asyncio.Transport | None = None
        # Responses are bounded by what the client asked for; the client limit applies too.
        self._reader = FrameReader(2**31 - 1, sized_peer=True)
        self._reads = client.env.reads
        self._own, self._short_reads = False, 0  # read by the loop until a long read (OwnReads)
        # A large response was just read into its buffer: the next one's size is read first
        # (see get_buffer).
        self._peek = False
        # A response longer than the chunk it started in that goes back as it came is streamed
        # (see _stream): the bytes of it still to come, and its size without the size prefix.
        self._through = 0
        self._streaming_size = 0
        # A streamed response whose filters must see its tail first (a StreamRoute): the tail
        # received so far (None: no such response), its route, and the bytes still to send
        # before the tail starts.
        self._tail: bytearray | None = None
        self._tail_route: StreamRoute | None = None
        self._unheld = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = stream = cast(asyncio.Transport, transport)  # a TCP connection's (uvloop's or asyncio's)
        tune(stream)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._peek and self._reader.idle and not self._through:
            # After a large response read into its buffer (a Fetch its filters count, under
            # a quota), the next one's size prefix alone: if it is large too, all of it is
            # then read straight into its buffer, none of it into this one and copied.
            return self._reads.view[:4]
        return super().get_buffer(sizehint)

    def data_received(self, data: Buffer) -> None:  # noqa: C901 (a response's routes, inline on the hot path)
        n = len(data)
        if n > 4:  # not a peek: read as usual until a large frame is filled
            self._peek = False
            if not self._own and (n >= OWN_READS_FROM_BYTES or self._reader.filling):
                self.read_own()  # from the next read on
        if self._through:
            rest = self._stream(data)
            if rest is None:
                return
            data = rest
        queue = self.queue
        awaiting = queue.awaiting
        n = len(data)
        if n >= 8 and awaiting and self._reader.idle and type(data) is not bytearray:
            size, correlation_id = _RESPONSE_HEAD.unpack_from(data)
            entry = awaiting[0]
            transport = queue.transport  # None once the client's connection closed
            if correlation_id == entry.correlation_id and queue.pending[0] is entry and transport is not None:
                # The fast routes: the oldest answer due (what the queue would send first).
                try:
                    route = entry.route
                    if size != n - 4:
                        if size > n - 4:
                            # It starts this chunk and goes on past it. If nothing changes it,
                            # or its filters can tell from its head that they will not, it
                            # goes back as it comes (see _stream).
                            if route is AS_READ:
                                self._start_stream(entry, data, size)
                                return
                            if type(route) is StreamRoute:
                                hold_from = route.hold_from(self.client.ctx, entry, data, size)
                                if hold_from is not None:
                                    self._start_stream(entry, data, size, route, hold_from)
                                    return
                        out = None  # several responses, or a long one its filters see whole
                    elif route is AS_READ:
                        # Exactly one response, which nothing changes or whose one filter
                        # rewrites it as a chunk: it goes back at once, the bookkeeping follows.
                        out = data
                    elif route is not None:
                        out = route(self.client.ctx, entry, data)  # a chunk filter; None: assembled
                    else:
                        out = None
                    if out is not None:
                        if entry.forwarded_at:
                            entry.answered()
                        transport.write(out)
                        queue.head_written(len(out) - 4)
                        return
                except Exception as exc:  # as the assembled route: this connection only
                    response_failed(self.client, exc)
                    return
        try:
            frames = self._reader.feed(data)
        except FrameError as exc:
            upstream_failed(self.client, str(exc))
            return
        client = self.client
        for frame in frames:
            if client.closed:
                return
            try:
                self._on_frame(frame)
            except Exception as exc:
                response_failed(client, exc)
                return

    def filled(self, nbytes: int, frame: memoryview | None) -> None:
        """``nbytes`` of a large response were read into its buffer (proxy.dataplane.reads),
        completing it when ``frame`` is given."""
        if frame is None or self.client.closed:
            return
        self._peek = True
        try:
            self._on_frame(frame)
        except Exception as exc:
            response_failed(self.client, exc)

    def _on_frame(self, frame: Frame) -> None:
        """A response frame that no fast route took: answered as read, through the filters, or
        as a raw SASL token."""
        client = self.client
        try:
            entry = self.queue.take(frame)
        except UnexpectedResponse as exc:
            upstream_failed(client, str(exc))
            return
        if entry is None:
            return  # an answer to an acks=0 Produce
        if entry.raw:
            raw_sasl = client.raw_sasl  # made by the SaslHandshake v0 that made this entry raw
            if raw_sasl is not None:
                raw_sasl.on_response(frame)
            self.queue.answer(entry, frame)
        elif entry.route is AS_READ:
            self.queue.answer(entry, frame)
        else:
            self.queue.respond(entry, frame, client.chain.response.get(entry.api_key, UNFILTERED)[1])

    def _start_stream(self, entry: InFlight, data: Buffer, size: int, route: StreamRoute | None = None,
                      hold_from: int = 0) -> None:
        """Writes the first chunk of a response that goes back as it came and is longer than
        the chunk: the rest follows as it arrives, never assembled into a frame. Its entry
        stays at the head of the queues until its last byte is written, so nothing is written
        in between (an answer the proxy made itself waits behind it). With a ``route``, the
        bytes from ``hold_from`` on (the response's tail) are held back until its filters have
        seen them."""
        if entry.forwarded_at:
            entry.answered()
        n = len(data)
        self.client.stats.responses_streamed[entry.api_key] += 1
        transport = self.queue.transport
        assert transport is not None  # the caller's fast route checked it
        if route is None:
            transport.write(data)
        else:
            self._tail_route = route
            self._tail = bytearray(data[hold_from:])  # empty when the tail starts in a later chunk
            self._unheld = max(hold_from - n, 0)
            transport.write(data[:hold_from])  # the very chunk when it all goes
        self._through = size + 4 - n
        self._streaming_size = size

    def _stream(self, data: Buffer) -> Buffer | None:
        """Writes the part of ``data`` that belongs to the response being streamed. Returns
        what follows it (the next responses), or None when nothing does."""
        queue = self.queue
        through = self._through
        n = len(data)
        transport = queue.transport
        if transport is None:
            return None  # and whatever follows: nothing from this broker is read as a frame
        if isinstance(data, bytearray):
            data = bytes(data)  # a chunk that is not ours to keep
        try:
            self._through = max(through - n, 0)
            part = data if n <= through else data[:through]
            if self._tail is not None:
                self._stream_held(transport, part, n >= through)
            else:
                transport.write(part)
                if n >= through:
                    queue.head_written(self._streaming_size)  # its last byte is out
        except Exception as exc:  # as the assembled route: this connection only
            self._through = 0
            self._tail = self._tail_route = None
            response_failed(self.client, exc)
            return None
        return data[through:] if n > through and queue.transport is not None else None

    def _stream_held(self, transport: asyncio.Transport, part: Buffer, last: bool) -> None:
        """The next ``part`` of a streamed response whose tail is held back (see
        _start_stream); ``last``: it ends the response. The tail goes once every filter
        accepts it unchanged; otherwise the client's connection is closed (the response's size
        went first, so it cannot be changed), with a log line."""
        queue = self.queue
        unheld = self._unheld
        if unheld >= len(part) and not last:
            transport.write(part)
            self._unheld = unheld - len(part)
            return
        self._unheld = 0
        held = self._tail
        route = self._tail_route
        assert held is not None and route is not None  # set together by _start_stream
        held += part[unheld:] if unheld else part
        if not last:
            if unheld:
                transport.write(part[:unheld])
            return
        tail = bytes(held)
        self._tail = self._tail_route = None
        entry = queue.pending[0]
        if not route.tail_unchanged(self.client.ctx, entry, tail):
            log.error("%s v%d response to %s: a filter would change its end after it began streaming "
                      "(NodeEndpoints without a moved partition); closing the connection, the client asks again",
                      api_name(entry.api_key), entry.api_version, self.client.ctx.label)
            self.client.close()
            return
        transport.write(bytes(part[:unheld]) + tail if unheld else tail)
        queue.head_written(self._streaming_size)  # its last byte is out

    def pause_writing(self) -> None:  # the broker reads slower than the client sends
        gate = self.client.gate  # set once served, before any broker connection is opened
        if gate is not None:
            gate.pause("backpressure")

    def resume_writing(self) -> None:
        gate = self.client.gate
        if gate is not None:
            gate.resume("backpressure")

    def connection_lost(self, exc: Exception | None) -> None:
        client = self.client
        if client.closed:
            return
        if isinstance(exc, ssl.SSLError):
            # With TLS 1.3 a broker refusing the proxy's certificate (or its lack of one) says so
            # after the handshake, on the first read: a TLS failure all the same.
            peer = self.transport.get_extra_info("peername") if self.transport is not None else None
            client.env.cluster.dialer.failed("tls", tuple(peer[:2]) if peer else ("broker", 0), exc)
        if self.queue.pending:
            client.env.guard.log(
                "broker_closed", logging.WARNING, "broker closed the connection of %s with %d requests in flight%s",
                client.ctx.label, len(self.queue.pending), f": {exc}" if exc else "", logger=log,
            )
        client.close()
