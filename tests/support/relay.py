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
from dataclasses import dataclass

from proxy import procnet
from tests.support.threaded_server import ThreadedServer, pipe


@dataclass(frozen=True)
class RelayedConnection:
    peer: tuple[str, int]
    pid: int | None  # None when no process visible here holds the peer socket


class CountingRelay(ThreadedServer):
    thread_name = "counting-relay"

    def __init__(self, host: str = "127.0.0.1", target: tuple[str, int] | None = None,
                 candidate_pids: tuple[int, ...] = ()) -> None:
        super().__init__(host, target)
        # Pids checked first when looking for a peer socket's owner (then all of /proc).
        self.candidate_pids: list[int] = list(candidate_pids)
        self._connections: list[RelayedConnection] = []

    # -- what tests read ------------------------------------------------------------------

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
        try:
            # Look the peer up before anything else: the client's socket must still exist.
            peer = writer.get_extra_info("peername")[:2]
            local = writer.get_extra_info("sockname")[:2]
            inode = procnet.connection_inode(local=peer, remote=local)
            pid = procnet.owner_of(inode, self.candidate_pids) if inode else None
            with self._lock:
                self._connections.append(RelayedConnection(peer=peer, pid=pid))
            upstream = await self._connect_target()
            if upstream is None:
                return
            up_reader, up_writer = upstream
            try:
                await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
            finally:
                up_writer.close()
        finally:
            writer.close()
