"""A TCP server on its own thread and event loop, for test stand-ins (relays, fronts) that a
synchronous test starts, reads and stops. Listens on ``host`` at a port the OS picks."""

from __future__ import annotations

import asyncio
import threading


class ThreadedServer:
    """Subclasses implement ``async _handle(reader, writer)``; every handler task is cancelled
    and awaited by :meth:`stop`. ``target`` is where a relaying subclass connects upstream
    (settable until traffic arrives)."""

    thread_name = "threaded-server"

    def __init__(self, host: str = "127.0.0.1", target: tuple[str, int] | None = None) -> None:
        self.host = host
        self.port = 0
        self.target = target
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=self.thread_name, daemon=True)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def _connect_target(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A connection to ``target``, or None when there is none or it cannot be reached."""
        if self.target is None:
            return None
        try:
            return await asyncio.open_connection(*self.target)
        except OSError:
            return None

    def start(self):
        self._thread.start()
        self._call(self._start())
        return self

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._tracked, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _tracked(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            await self._handle(reader, writer)
        finally:
            self._tasks.discard(task)

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

    def drop_connections(self) -> None:
        """Closes every connection being handled (the server keeps listening)."""
        self._call(self._drop())

    async def _drop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _call(self, coro, timeout_s: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, on_data=None) -> None:
    """Copies bytes until end of stream, then half-closes ``writer`` (closes it on an error).
    ``on_data`` sees each chunk before it is written on."""
    try:
        while data := await reader.read(65536):
            if on_data is not None:
                on_data(data)
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()
