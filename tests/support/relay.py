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

from proxy.app import procnet
from tests.support.threaded_server import ThreadedServer, pipe


@dataclass
class RelayedConnection:
    peer: tuple[str, int]
    pid: int | None  # None when no process visible here holds the peer socket
    answered_bytes: int = 0  # bytes the broker sent back on it


class CountingRelay(ThreadedServer):
    thread_name = "counting-relay"

    def __init__(self, host: str = "127.0.0.1", target: tuple[str, int] | None = None,
                 candidate_pids: tuple[int, ...] = ()) -> None:
        super().__init__(host, target)
        # Pids checked first when looking for a peer socket's owner (then all of /proc).
        self.candidate_pids: list[int] = list(candidate_pids)
        self._connections: list[RelayedConnection] = []
        self._cut_target: tuple[str, int] | None = None  # the target while cut

    # -- what tests read ------------------------------------------------------------------

    @property
    def connections(self) -> list[RelayedConnection]:
        with self._lock:
            return list(self._connections)

    def connections_not_from(self, pid: int) -> list[RelayedConnection]:
        return [c for c in self.connections if c.pid != pid]

    def escapes(self, pid: int) -> list[RelayedConnection]:
        """Connections the broker answered that did not come from ``pid``. A socket closed
        before the relay could find its owner (the proxy dropping a broker connection it opened
        for a client that left meanwhile) has no pid; it counts only if the broker answered
        it, since a client that escaped would have waited for an answer."""
        return [c for c in self.connections if c.pid != pid and (c.pid is not None or c.answered_bytes)]

    def connections_from(self, pid: int) -> list[RelayedConnection]:
        return [c for c in self.connections if c.pid == pid]

    def cut(self) -> None:
        """The broker gone, as seen through the relay: every relayed connection closed, new ones
        accepted and closed at once, until :meth:`restore`."""
        self._cut_target, self.target = self.target, None
        self.drop_connections()

    def restore(self) -> None:
        self.target = self._cut_target

    # -- relaying -------------------------------------------------------------------------

    async def _owner(self, peer: tuple[str, int], local: tuple[str, int]) -> int | None:
        """The pid holding the peer socket. /proc/net/tcp is read in pieces, and a socket table
        changing meanwhile (clients connecting and closing) can leave a live socket out of one
        reading, so a miss is read again a few times; the peer waits for its first answer."""
        for attempt in range(5):
            inode = procnet.connection_inode(local=peer, remote=local)
            pid = procnet.owner_of(inode, self.candidate_pids) if inode else None
            if pid is not None:
                return pid
            await asyncio.sleep(0.002 * (attempt + 1))
        return None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            # Look the peer up before anything else: the client's socket must still exist.
            peer = writer.get_extra_info("peername")[:2]
            local = writer.get_extra_info("sockname")[:2]
            pid = await self._owner(peer, local)
            connection = RelayedConnection(peer=peer, pid=pid)
            with self._lock:
                self._connections.append(connection)
            upstream = await self._connect_target()
            if upstream is None:
                return
            up_reader, up_writer = upstream
            try:
                def answered(data: bytes) -> None:
                    with self._lock:
                        connection.answered_bytes += len(data)

                await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer, answered))
            finally:
                up_writer.close()
        finally:
            writer.close()
