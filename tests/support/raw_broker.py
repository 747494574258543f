"""A byte-level scripted broker: records every frame it receives and answers by a script.

For what no real broker here can stage: an API key nobody knows, a broker that stops
mid-response or never answers. Listens on 127.0.0.1, port picked by the OS.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable

# A script maps a received frame (no size prefix) to bytes to send back (size prefix
# included, so a script can send partial frames), or None to answer nothing.
Script = Callable[[bytes], bytes | None]


def echo_correlation(frame: bytes) -> bytes:
    """Answers any request with a frame holding its correlation id and 4 marker bytes."""
    body = frame[4:8] + b"\xca\xfe\xba\xbe"
    return struct.pack(">i", len(body)) + body


class RawBroker:
    def __init__(
        self,
        script: Script = echo_correlation,
        close_after_answer: bool = False,
        script_factory: Callable[[], Script] | None = None,
    ) -> None:
        # A script_factory makes one script per connection, for stateful exchanges.
        self.script_factory = script_factory or (lambda: script)
        self.close_after_answer = close_after_answer
        self.frames: list[bytes] = []
        self.connections = 0
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.closed = threading.Event()  # set when a client connection reached EOF

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> RawBroker:
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._sock.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, conn: socket.socket) -> None:
        script = self.script_factory()
        with conn:
            while True:
                head = _recv_exact(conn, 4)
                if head is None:
                    break
                (size,) = struct.unpack(">i", head)
                frame = _recv_exact(conn, size)
                if frame is None:
                    break
                self.frames.append(frame)
                answer = script(frame)
                if answer is not None:
                    conn.sendall(answer)
                    if self.close_after_answer:
                        break
        self.closed.set()


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        try:
            chunk = conn.recv(n - len(buf))
        except OSError:
            return None
        if not chunk:
            return None
        buf += chunk
    return buf
