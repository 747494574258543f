"""A counting TCP relay in front of a broker, on its own thread and event loop.

The broker listens on its real port but advertises the relay's port, so any client that learns
the broker's address from Metadata or FindCoordinator can reach it only through the relay. For
every accepted connection the relay records the peer address and the pid of the process that
owns the peer socket, so a test can assert that only the proxy ever talked to the broker.

    relay = CountingRelay().start()
    broker = TansuBroker(advertised_port=relay.port).start()
    relay.target = (broker.host, broker.port)
    ...
    assert relay.connections_not_from(proxy.pid) == []
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

from proxy import procnet


@dataclass(frozen=True)
class RelayedConnection:
    peer: tuple[str, int]
    pid: int | None  # None when no process visible here holds the peer socket


class CountingRelay:
    def __init__(self, host: str = "127.0.0.1", target: tuple[str, int] | None = None,
                 candidate_pids: tuple[int, ...] = ()) -> None:
        self.host = host
        self.port = 0
        self.target = target
        # Pids checked first when looking for a peer socket's owner (then all of /proc).
        self.candidate_pids: list[int] = list(candidate_pids)
        self._connections: list[RelayedConnection] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="counting-relay", daemon=True)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> CountingRelay:
        self._thread.start()
        self._call(self._start())
        return self

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def _call(self, coro, timeout_s: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def __enter__(self) -> CountingRelay:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- what tests read ------------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def connections(self) -> list[RelayedConnection]:
        with self._lock:
            return list(self._connections)

    def connections_not_from(self, pid: int) -> list[RelayedConnection]:
        return [c for c in self.connections if c.pid != pid]

    def connections_from(self, pid: int) -> list[RelayedConnection]:
        return [c for c in self.connections if c.pid == pid]

    # -- relaying -------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            # Look the peer up before anything else: the client's socket must still exist.
            peer = writer.get_extra_info("peername")[:2]
            local = writer.get_extra_info("sockname")[:2]
            inode = procnet.connection_inode(local=peer, remote=local)
            pid = procnet.owner_of(inode, self.candidate_pids) if inode else None
            with self._lock:
                self._connections.append(RelayedConnection(peer=peer, pid=pid))
            if self.target is None:
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
            except OSError:
                return
            try:
                await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
            finally:
                up_writer.close()
        finally:
            writer.close()
            self._tasks.discard(task)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()
