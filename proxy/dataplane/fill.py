"""Reading the rest of a large frame straight into its buffer.

A frame that spans chunks costs a Python proxy two copies per byte on top of the kernel's: the
event loop makes a bytes object of each chunk it reads, and the chunks are joined into the
frame. Once a large frame has a buffer of its own (``FrameReader.fill_buffer``), the transport's
reads are handed to a :class:`FrameFill` (an ``asyncio.BufferedProtocol``) that has the kernel
read into that buffer directly, exactly up to the frame's last byte, then hands the transport
back to its owner with the frame, as Kafka's ``NetworkReceive`` reads into a buffer of the
announced size.

Guarantees: the owner sees the same frames, in the same order, as if it had read every chunk
itself; every byte read is reported to it as it arrives (its accounting and deadlines go on);
the transport's other callbacks (connection lost, write pauses, end of stream) reach the owner
while it is lent; nothing is read past the frame's end.
"""

from __future__ import annotations

import asyncio
from typing import Protocol, cast

from protocol.frames import FrameReader


class FillOwner(Protocol):
    """The protocol a transport is lent from: told of each read and of the frame it completes."""

    def filled(self, nbytes: int, frame: memoryview | None) -> None: ...

    def connection_lost(self, exc: Exception | None) -> None: ...

    def pause_writing(self) -> None: ...

    def resume_writing(self) -> None: ...

    def eof_received(self) -> bool | None: ...


class FrameFill(asyncio.BufferedProtocol):
    """The transport's protocol while the rest of one frame is read into its buffer."""

    __slots__ = ("owner", "reader", "transport")

    def __init__(self, owner: FillOwner, reader: FrameReader, transport: asyncio.Transport) -> None:
        self.owner = owner
        self.reader = reader
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        view = self.reader.fill_buffer()
        if view is None:  # never lent without one (see lend_for_fill); a loop that asks twice
            raise RuntimeError("no frame is being filled")
        return view

    def buffer_updated(self, nbytes: int) -> None:
        frame = self.reader.filled(nbytes)
        if frame is not None:
            # Given back before the owner acts: it may lend it again. (The owner is the
            # transport's own protocol, an asyncio.Protocol.)
            self.transport.set_protocol(cast(asyncio.BaseProtocol, self.owner))
        self.owner.filled(nbytes, frame)

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.owner.pause_writing()

    def resume_writing(self) -> None:
        self.owner.resume_writing()

    def eof_received(self) -> bool | None:
        return self.owner.eof_received()


def lend_for_fill(transport: asyncio.Transport | None, owner: FillOwner, reader: FrameReader) -> bool:
    """Lends ``transport`` to a :class:`FrameFill` when ``reader`` has a frame to fill; whether it did."""
    if transport is None or reader.fill_buffer() is None or transport.is_closing():
        return False
    transport.set_protocol(FrameFill(owner, reader, transport))
    return True
