"""Kafka's size-prefixed framing: ``int32 size`` followed by ``size`` bytes.

No I/O happens here: bytes go in through :meth:`FrameReader.feed`, whole frames come out.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from struct import Struct

from .errors import ProtocolError

_INT32 = Struct(">i")
# A frame this large gets a buffer of its own once a quarter of it has arrived (FrameReader).
CONTIGUOUS_MIN_BYTES = 64 * 1024
# A frame that starts this near the beginning of a chunk and takes the rest of it keeps a
# slice of the chunk (not a copy) until it is complete.
_KEEP_SLICE_BYTES = 64


def _uninitialized_bytearray() -> Callable[[int], bytearray]:
    """bytearray(n) without zeroing it first (CPython's PyByteArray_FromStringAndSize(NULL, n)):
    a frame's buffer is written whole before anything reads it, and zeroing a megabyte costs
    a third of copying it. bytearray itself where that function cannot be reached."""
    try:
        make = ctypes.pythonapi.PyByteArray_FromStringAndSize
    except (AttributeError, ValueError):
        return bytearray
    make.restype = ctypes.py_object
    make.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
    return lambda size: make(None, size)


new_buffer = _uninitialized_bytearray()

# The bytes-like objects the protocol readers take: frames, bodies and slices of them.
Buffer = bytes | bytearray | memoryview


class FrameError(ProtocolError):
    """The byte stream cannot be framed; the connection it came from must be closed.

    ``frames`` holds the complete frames that preceded the bad bytes in the same chunk.
    """

    def __init__(self, message: str, frames: list[memoryview | bytes] | None = None) -> None:
        super().__init__(message)
        self.frames = frames if frames is not None else []


class FrameReader:
    """Splits a byte stream into frames without the 4-byte size prefix.

    Guarantees: a frame's size is checked against ``max_frame_bytes`` before anything is kept
    for it; unless the peer is a ``sized_peer`` (a broker), nothing is allocated by an
    announced size until a quarter of the frame has arrived: a frame still arriving holds the
    chunks it came in, so a peer that announces 100 MB and sends 1 byte costs 1 byte, and a
    frame of ``CONTIGUOUS_MIN_BYTES`` or more, once a quarter of it is here (a sized peer's at
    once), holds one buffer of its size (at most four times what arrived) that the rest is
    copied, or read (:meth:`fill_buffer`), into; a frame is
    returned only when complete (chunks joined once, then, or the buffer as it was filled);
    bytes after the last complete frame are kept for the next :meth:`feed`. Frames that
    arrive whole inside one chunk are returned as zero-copy ``memoryview`` slices of that
    chunk, valid until the caller drops it.
    """

    __slots__ = ("max_frame_bytes", "idle", "frames_started", "_parts", "_buf", "_have", "_need", "_size_prefix",
                 "_keep", "sized_peer", "_base")

    def __init__(self, max_frame_bytes: int, sized_peer: bool = False) -> None:
        self.max_frame_bytes = max_frame_bytes
        # The peer sends what it announces (a broker, as Kafka's NetworkReceive allocates the
        # announced size): a large frame gets its buffer as soon as its size is read.
        self.sized_peer = sized_peer
        self._parts: list[Buffer] | None = None  # the arrived chunks of a frame still arriving
        self._buf: bytearray | None = None  # or, for a large one, one buffer of its size
        self._base = 0  # where in _buf the frame starts (a read's buffer taken over: see _taken_over)
        self._have = 0  # how many bytes arrived
        self._need = 0  # bytes still missing from it
        self._size_prefix = b""  # a size prefix split across chunks
        self.idle = True  # nothing buffered: the next chunk starts with a size prefix
        # Frames that did not arrive whole in one chunk (size prefix included), counted when
        # they start: tells a frame that stays unfinished from frames each finished in time.
        self.frames_started = 0
        self._keep = False  # the chunk being fed may be kept by reference (see feed)

    @property
    def filling(self) -> bool:
        """Whether the frame being read has a buffer of its own (:meth:`fill_buffer`)."""
        return self._buf is not None

    @property
    def buffered_bytes(self) -> int:
        """Bytes held for an incomplete frame, its size prefix included (0 between frames): what
        arrived, or the size of the frame's buffer once it has one."""
        if self._buf is not None:
            return len(self._buf) + 4
        if self._parts is not None:
            return self._have + 4
        return len(self._size_prefix)

    @property
    def missing_bytes(self) -> int:
        """Bytes still to come before the frame being read is complete (0 between frames; the
        body of a frame whose size prefix is cut counts as unknown, 1)."""
        if self._parts is not None or self._buf is not None:
            return self._need
        return 4 - len(self._size_prefix) + 1 if self._size_prefix else 0

    def fill_buffer(self) -> memoryview | None:
        """Where the rest of the frame being read may be read straight into (exactly the bytes
        still missing from it, no more), once it has a buffer of its own; else None. Report
        what was read there with :meth:`filled`."""
        buf = self._buf
        return None if buf is None else memoryview(buf)[self._base + self._have : self._base + self._have + self._need]

    def filled(self, nbytes: int) -> memoryview | None:
        """``nbytes`` were read into :meth:`fill_buffer`'s view: the frame, when that completed it."""
        self._have += nbytes
        self._need -= nbytes
        if self._need:
            return None
        self.idle = True
        return self._finish_buffer()

    def feed(self, data: bytes | bytearray | memoryview) -> list[memoryview | bytes]:
        """Consumes ``data``; returns the frames it completed, in order.

        ``data`` given as bytes, or as a view of memory nothing writes to again (the proxy's
        own reads, proxy.dataplane.reads), may be kept by reference, in frames and in the parts
        of one still arriving; a bytearray is copied from.

        Raises :class:`FrameError` for a negative size or one above ``max_frame_bytes``; the
        frames completed before the bad size are on the exception.
        """
        if self.idle and len(data) >= 4:
            # The common case, one whole frame per chunk: no loop, one slice.
            size = _INT32.unpack_from(data)[0]
            if size == len(data) - 4 and size <= self.max_frame_bytes:
                return [memoryview(data)[4:]]
        frames: list[memoryview | bytes] = []
        self._keep = type(data) is not bytearray
        try:
            self._feed(memoryview(data), frames)
        except FrameError as exc:
            exc.frames = frames
            raise
        finally:
            self.idle = self._parts is None and self._buf is None and not self._size_prefix
        return frames

    def _feed(self, view: memoryview, frames: list[memoryview | bytes]) -> None:
        pos = 0
        end = len(view)
        if self._buf is not None:
            take = min(self._need, end)
            have = self._have
            at = self._base + have
            self._buf[at : at + take] = view[:take]
            self._have = have + take
            self._need -= take
            pos = take
            if self._need:
                return
            frames.append(self._finish_buffer())
        elif self._parts is not None:
            take = min(self._need, end)
            self._need -= take
            self._have += take
            pos = take
            if self._need:
                # A chunk that is ours to keep is kept as it came (a quarter of what it holds at
                # least); else it is copied.
                self._parts.append(view if self._keep and end * 4 >= held_bytes(view) else bytes(view))
                self._maybe_contiguous()
                return
            # The frame ends in this chunk: its last part is copied once, by the join.
            self._parts.append(view[:take])
            frames.append(b"".join(self._parts))
            self._parts = None
        if self._size_prefix:
            missing = 4 - len(self._size_prefix)
            if end - pos < missing:
                self._size_prefix += bytes(view[pos:end])
                return
            prefix = self._size_prefix + bytes(view[pos : pos + missing])
            self._size_prefix = b""
            pos += missing
            size = self._check(_INT32.unpack(prefix)[0])
            if end - pos >= size:
                frames.append(view[pos : pos + size])
                pos += size
            else:
                pos = self._start_partial(view, pos, end, size, started=True)
        while pos < end:
            if end - pos < 4:
                self._size_prefix = bytes(view[pos:end])
                self.frames_started += 1
                break
            size = self._check(_INT32.unpack_from(view, pos)[0])
            pos += 4
            if end - pos >= size:
                frames.append(view[pos : pos + size])
                pos += size
            else:
                pos = self._start_partial(view, pos, end, size)

    def _check(self, size: int) -> int:
        if size < 0:
            raise FrameError(f"negative frame size {size}")
        if size > self.max_frame_bytes:
            raise FrameError(f"frame size {size} exceeds max_frame_bytes {self.max_frame_bytes}")
        return size

    def _start_partial(self, view: memoryview, pos: int, end: int, size: int, started: bool = False) -> int:
        """Keeps the start of a frame; ``started``: it was counted when its size prefix began."""
        have = end - pos
        self._have = have
        self._need = size - have
        if not started:
            self.frames_started += 1
        if size >= CONTIGUOUS_MIN_BYTES and (have * 4 >= size or self.sized_peer):
            if self._keep and self._taken_over(view, pos, have, size):
                return end
            buf = self._buf = new_buffer(size)  # every byte is written before the frame is returned
            self._base = 0
            buf[:have] = view[pos:end]
        elif self._keep and end == len(view) and (
            pos < _KEEP_SLICE_BYTES if type(view.obj) is bytes else have * 4 >= held_bytes(view)
        ):
            # The frame takes (nearly) all of an immutable chunk, or a quarter of the buffer of
            # a long read: a slice of it saves a copy and holds at most four times its bytes.
            self._parts = [view[pos:end]]
        else:
            self._parts = [bytes(view[pos:end])]
        return end

    def _maybe_contiguous(self) -> None:
        """Gives a large frame one buffer of its size once a quarter of it has arrived: the
        rest is copied or read into it, never joined."""
        have = self._have
        size = have + self._need
        if size >= CONTIGUOUS_MIN_BYTES and have * 4 >= size and self._parts is not None:
            buf = new_buffer(size)  # every byte is written before the frame is returned
            at = 0
            for part in self._parts:
                buf[at : at + len(part)] = part
                at += len(part)
            self._buf, self._parts, self._base = buf, None, 0

    def _taken_over(self, view: memoryview, pos: int, have: int, size: int) -> bool:
        """Makes the buffer of the read ``view`` is a chunk of the frame's own, when the frame
        fits in it and arrived for a quarter of it at least (a read's buffer given to the
        reader, proxy.dataplane.reads): the rest is read after what arrived, nothing copied."""
        obj = view.obj
        if type(obj) is not bytearray or have * 4 < len(obj):
            return False
        start = _address(view) + pos - _address(obj)
        if start + size > len(obj):
            return False
        self._buf, self._base = obj, start
        return True

    def _finish_buffer(self) -> memoryview:
        buf = self._buf
        assert buf is not None  # called when the buffer's frame is complete
        self._buf = None
        return memoryview(buf)[self._base : self._base + self._have]


def _address(buffer: bytearray | memoryview) -> int:
    """Where a writable buffer's first byte is in memory."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def held_bytes(view: memoryview) -> int:
    """The bytes a view keeps alive: the whole object it is a view of."""
    obj = view.obj
    return len(obj) if isinstance(obj, (bytes, bytearray)) else view.nbytes


def frame(payload: bytes | bytearray | memoryview) -> bytes:
    """Prefixes ``payload`` with its int32 size."""
    return _INT32.pack(len(payload)) + bytes(payload)
