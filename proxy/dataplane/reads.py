"""Sockets read into the proxy's own buffers, not the event loop's.

The event loop reads a plain ``asyncio.Protocol``'s socket into a buffer of its own, then copies
each read into a new bytes object: every byte costs a copy on top of the kernel's, and a large
frame that filters must see whole costs another one where it is put together. Both sides of a
proxied connection are instead ``asyncio.BufferedProtocol`` (:class:`OwnReads`): the kernel reads
into a buffer of the proxy's (:class:`ReadBuffer`, 1 MiB, one per proxy and event loop), or
straight into the buffer of the large frame being read (``FrameReader.fill_buffer``, exactly up
to its last byte, as Kafka's ``NetworkReceive`` reads into a buffer of the announced size).

A read of a quarter of the buffer or more is given away as it is: the buffer becomes that
chunk's and the next read gets a new one, so a Produce of librdkafka's batches or a Fetch
response that arrives in one read is never copied by the proxy. A smaller read is copied out
and the buffer read into again.

Guarantees: the owner sees the same chunks' bytes, in the same order, as from ``data_received``;
a chunk is never written to after it is handed over (the owner may keep views of it); a chunk
holds at most four times its bytes (1 MiB for at least 256 KiB); nothing is read past a large
frame's end into its buffer.
"""

from __future__ import annotations

import asyncio
import sys

from protocol.frames import Buffer, FrameReader, new_buffer

READ_BUFFER_BYTES = 1 << 20  # the largest read; librdkafka's batch.size is 1,000,000 bytes
KEPT_READ_BYTES = READ_BUFFER_BYTES // 4  # a read this long takes the buffer with it


class ReadBuffer:
    """The buffer one event loop's connections read into, one read at a time (the loop calls
    ``get_buffer`` and ``buffer_updated`` back to back)."""

    __slots__ = ("view", "_given")

    def __init__(self) -> None:
        # Where the next read goes: written by each read before it is read.
        self.view = memoryview(new_buffer(READ_BUFFER_BYTES))
        self._given: bytearray | None = None  # the buffer the last long read took

    def take(self, nbytes: int) -> Buffer:
        """The ``nbytes`` just read, as a chunk no later read writes to: the buffer itself for a
        long read, a copy of a short one. After a long read the next one goes to the buffer the
        long read before took if nothing holds any of it any more (still warm in the caches),
        else to a new one."""
        view = self.view
        if nbytes < KEPT_READ_BYTES:
            return view[:nbytes].tobytes()
        given, self._given = self._given, view.obj  # type: ignore[assignment]  # a bytearray: new_buffer's
        # Three references: ``given`` here, getrefcount's argument, and none elsewhere: free.
        self.view = memoryview(given if given is not None and sys.getrefcount(given) == 2
                               else new_buffer(READ_BUFFER_BYTES))
        return view[:nbytes]


class OwnReads(asyncio.BufferedProtocol):
    """A protocol whose socket is read into :class:`ReadBuffer` or the large frame being read
    (see the module docstring). Its class sets ``_reader`` and ``_reads``, and takes what was
    read with ``data_received`` (a chunk) and ``filled`` (bytes read into a frame's buffer)."""

    __slots__ = ()
    _reader: FrameReader
    _reads: ReadBuffer

    def get_buffer(self, sizehint: int) -> memoryview:
        view = self._reader.fill_buffer()
        return self._reads.view if view is None else view

    def buffer_updated(self, nbytes: int) -> None:
        reader = self._reader
        if reader.filling:
            self.filled(nbytes, reader.filled(nbytes))
        else:
            self.data_received(self._reads.take(nbytes))

    def data_received(self, data: Buffer) -> None:
        """A chunk read (bytes, or a view of a buffer given to this protocol: it may keep it)."""
        raise NotImplementedError

    def filled(self, nbytes: int, frame: memoryview | None) -> None:
        """``nbytes`` of a large frame were read into its buffer, completing it when ``frame`` is given."""
        raise NotImplementedError
