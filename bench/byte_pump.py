"""A plain asyncio byte pump: the ceiling for any Python Kafka proxy.

Every accepted client connection gets one upstream connection; bytes are copied both ways with
``asyncio.Protocol`` callbacks and nothing is parsed, so broker addresses inside Metadata are
not rewritten. To keep clients inside the pump, start the broker with its advertised listener
set to the pump's port (``bench.run`` does this).

    python -m bench.byte_pump --listen 127.0.0.1:0 --upstream 127.0.0.1:9092 --ready-file F
    python -m bench.byte_pump ... --tls-cert server.pem --tls-key server.key   # TLS to clients

With ``--tls-cert``/``--tls-key`` the listener terminates TLS (the event loop's own TLS layer,
``create_server(ssl=...)``; the context is built as proxy/tls.py's ``server_tls`` builds it:
PROTOCOL_TLS_SERVER, TLS 1.2 at least, no client certificates) and the broker side stays
plaintext. The protocol classes are the same either way, so the plaintext path is unchanged.
The pump sets glibc's malloc thresholds as the proxy does (``proxy.app.heap.tune_malloc``).

The ready file gets ``{"pid", "bootstrap": [host, port]}`` once the pump listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import socket
import ssl
from pathlib import Path

from proxy.app.heap import tune_malloc

HIGH_WATER = 1 << 20  # bytes buffered towards one peer before we stop reading the other
LOW_WATER = 1 << 18


def _nodelay(transport: asyncio.Transport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


class _Side(asyncio.Protocol):
    """One end of a pumped connection; ``peer`` is the other end."""

    __slots__ = ("transport", "peer", "pending", "closed")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.pending: list[bytes] | None = None  # client bytes received before upstream is up
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        _nodelay(transport)
        transport.set_write_buffer_limits(high=HIGH_WATER, low=LOW_WATER)

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.write(data)
        elif self.pending is not None:
            self.pending.append(data)

    def eof_received(self):
        self._close_both()
        return False

    def connection_lost(self, exc) -> None:
        self.closed = True
        self._close_both()

    # Our transport is full: stop reading from the peer until it drains.
    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None and not self.peer.closed:
            self.peer.transport.resume_reading()

    def _close_both(self) -> None:
        if self.transport is not None:
            self.transport.close()
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.close()  # flushes whatever is still buffered


class _Client(_Side):
    __slots__ = ("upstream",)

    def __init__(self, upstream: tuple[str, int]) -> None:
        super().__init__()
        self.upstream = upstream
        self.pending = []

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, up = await loop.create_connection(_Side, *self.upstream)
        except OSError:
            self.transport.close()
            return
        if self.closed:
            up.transport.close()
            return
        up.peer, self.peer = self, up
        pending, self.pending = self.pending, None
        for chunk in pending:
            up.transport.write(chunk)


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """The proxy's server context (proxy/tls.py ``server_tls``, client_auth none)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_file, key_file)
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


async def serve(listen: tuple[str, int], upstream: tuple[str, int], ready_file: str | None,
                tls: ssl.SSLContext | None = None) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(upstream), *listen, backlog=4096, reuse_address=True,
                                      ssl=tls)
    host, port = server.sockets[0].getsockname()[:2]
    if ready_file:
        tmp = Path(ready_file).with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "bootstrap": [host, port]}))
        tmp.replace(ready_file)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.byte_pump", description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", default="127.0.0.1:0", help="host:port to accept clients on")
    p.add_argument("--upstream", required=True, help="host:port of the broker")
    p.add_argument("--ready-file", help="write {pid, bootstrap} here as JSON once listening")
    p.add_argument("--no-uvloop", action="store_true", help="use the default asyncio event loop")
    p.add_argument("--tls-cert", help="terminate TLS on the listener with this PEM chain (leaf first)")
    p.add_argument("--tls-key", help="the private key of --tls-cert")
    args = p.parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None):
        p.error("--tls-cert and --tls-key go together")
    tls = None
    if args.tls_cert:
        tls = server_context(args.tls_cert, args.tls_key)
    raise_nofile()
    tune_malloc()  # as the proxy does
    coro = serve(_hostport(args.listen), _hostport(args.upstream), args.ready_file, tls)
    if not args.no_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            uvloop.run(coro)
            return 0
    asyncio.run(coro)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
