"""Sockets read into the proxy's own buffers, not the event loop's.

The event loop reads a plain ``asyncio.Protocol``'s socket into a buffer of its own, then copies
each read into a new bytes object: every byte costs a copy on top of the kernel's, and a large
frame that filters must see whole costs another one where it is put together. A proxied
connection that carries long reads or a large frame is instead read as an
``asyncio.BufferedProtocol`` (:class:`OwnReads` switches its transport to :class:`OwnBuffers`):
the kernel reads into a buffer of the proxy's (:class:`ReadBuffer`, 1 MiB, one per proxy and
event loop), or straight into the buffer of the large frame being read
(``FrameReader.fill_buffer``, exactly up to its last byte, as Kafka's ``NetworkReceive`` reads
into a buffer of the announced size). After a few short reads in a row it is handed back to the
loop's reads: a buffered read costs two calls into Python (``get_buffer``, then
``buffer_updated``) where the loop's costs one, about 4 us a small round trip's read on a
2-core VM, more than a copy of a few KiB.

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
# A chunk the loop read this long: the socket is read into the proxy's buffers from then on
# (the loop's copy of it costs more than the second call into Python per read).
OWN_READS_FROM_BYTES = 64 << 10
SHORT_READ_BYTES = 16 << 10  # this many short reads in a row, none into a frame's buffer: the
PLAIN_AFTER_SHORT_READS = 4  # loop reads the socket again


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


class OwnBuffers(asyncio.BufferedProtocol):
    """What an :class:`OwnReads` connection's transport reads for while its socket is read into
    the proxy's buffers: the owner's own methods, bound, so the loop calls them with no frame of
    this object's in between."""

    def __init__(self, owner: OwnReads) -> None:
        for name in ("get_buffer", "buffer_updated", "eof_received", "connection_lost", "pause_writing",
                     "resume_writing"):
            setattr(self, name, getattr(owner, name))


class OwnReads(asyncio.Protocol):
    """A protocol whose socket the event loop reads until a chunk is long (:meth:`read_own`),
    then read into :class:`ReadBuffer` or the large frame being read until its reads are short
    again (see the module docstring). Its class sets ``_reader``, ``_reads``, ``transport``,
    ``_own`` (False) and ``_short_reads`` (0), calls :meth:`read_own` where a chunk is long or
    a frame is being filled, and takes what was read with ``data_received`` (a chunk) and
    ``filled`` (bytes read into a frame's buffer)."""

    # _own: the socket is read into the proxy's buffers (the transport reads for OwnBuffers);
    # _short_reads: short reads in a row since then, none into a frame's buffer.
    __slots__ = ("_own", "_short_reads")
    _own: bool
    _short_reads: int
    _reader: FrameReader
    _reads: ReadBuffer
    transport: asyncio.Transport | None

    def read_own(self) -> None:
        """From the next read on, the socket is read into the proxy's buffers."""
        if not self._own and self.transport is not None:
            self._own = True
            self._short_reads = 0
            self.transport.set_protocol(OwnBuffers(self))

    def get_buffer(self, sizehint: int) -> memoryview:
        view = self._reader.fill_buffer()
        return self._reads.view if view is None else view

    def buffer_updated(self, nbytes: int) -> None:
        reader = self._reader
        if reader.filling:
            self._short_reads = 0
            self.filled(nbytes, reader.filled(nbytes))
            return
        if nbytes >= SHORT_READ_BYTES:
            self._short_reads = 0
        else:
            self._short_reads += 1
            if self._short_reads == PLAIN_AFTER_SHORT_READS and self.transport is not None:
                # Round trips again: the loop's reads cost one call into Python, not two.
                self._own = False
                self.transport.set_protocol(self)
        self.data_received(self._reads.take(nbytes))

    def data_received(self, data: Buffer) -> None:
        """A chunk read (bytes, or a view of a buffer given to this protocol: it may keep it)."""
        raise NotImplementedError

    def filled(self, nbytes: int, frame: memoryview | None) -> None:
        """``nbytes`` of a large frame were read into its buffer, completing it when ``frame`` is given."""
        raise NotImplementedError
