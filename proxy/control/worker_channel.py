"""The line between the supervisor and each of its workers: JSON messages, each behind its length
(4 bytes, big-endian), over a Unix socket pair the supervisor made.

Guarantees: a message is read whole or not at all; one announcing more than
``MAX_MESSAGE_BYTES``, or not a JSON object with a string ``t`` (its type), ends the channel with
:class:`ChannelError`; a peer that stops reading is cut off once ``MAX_BUFFERED_BYTES`` wait for
it, rather than the writer's memory growing without end.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

MAX_MESSAGE_BYTES = 64 << 20
MAX_BUFFERED_BYTES = 256 << 20
_HEAD = 4

Message = dict[str, Any]


class ChannelError(Exception):
    """The peer sent something that is not a message: the channel is over."""


def encode(message: Message) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return len(body).to_bytes(_HEAD, "big") + body


def decode(body: bytes) -> Message:
    try:
        message = json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ChannelError(f"not JSON: {exc}") from None
    if not isinstance(message, dict) or not isinstance(message.get("t"), str):
        raise ChannelError("not a message (a JSON object with a string t)")
    return message


class Channel:
    """One end of a supervisor-worker line, on the running event loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self.closed = False

    @classmethod
    async def over(cls, sock: socket.socket) -> Channel:
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        return cls(reader, writer)

    def send(self, message: Message) -> bool:
        """Queues ``message``; False (and the channel closed) when it is closed or the peer has
        let ``MAX_BUFFERED_BYTES`` pile up."""
        if self.closed:
            return False
        if self._writer.transport.get_write_buffer_size() > MAX_BUFFERED_BYTES:
            self.close()
            return False
        self._writer.write(encode(message))
        return True

    async def receive(self) -> Message | None:
        """The next message; None when the peer closed its end. Raises ChannelError."""
        try:
            head = await self._reader.readexactly(_HEAD)
            size = int.from_bytes(head, "big")
            if size > MAX_MESSAGE_BYTES:
                raise ChannelError(f"a message of {size} bytes (at most {MAX_MESSAGE_BYTES})")
            return decode(await self._reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError):
            return None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._writer.close()


def blocking_request(sock: socket.socket, message: Message) -> Message:
    """``message`` over a blocking socket (with its timeout) and the one answer; OSError (a
    timeout included) or ChannelError when there is none."""
    sock.sendall(encode(message))
    size = int.from_bytes(_read_exactly(sock, _HEAD), "big")
    if size > MAX_MESSAGE_BYTES:
        raise ChannelError(f"a message of {size} bytes (at most {MAX_MESSAGE_BYTES})")
    return decode(_read_exactly(sock, size))


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("the supervisor closed the channel")
        out += chunk
    return bytes(out)
