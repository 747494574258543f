"""Kafka's size-prefixed framing: ``int32 size`` followed by ``size`` bytes.

No I/O happens here: bytes go in through :meth:`FrameReader.feed`, whole frames come out.
"""

from __future__ import annotations

from struct import Struct

from .errors import ProtocolError

_INT32 = Struct(">i")

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
    for it; nothing is ever allocated by an announced size: a frame still arriving holds the
    bytes that arrived (as the chunks they came in) and no more, so a peer that announces
    100 MB and sends 1 byte costs 1 byte; a frame is returned only when complete (a frame
    that spanned chunks is joined once, then); bytes after the last complete frame are kept
    for the next :meth:`feed`. Frames that arrive whole inside one chunk are returned as
    zero-copy ``memoryview`` slices of that chunk, valid until the caller drops it.
    """

    __slots__ = ("max_frame_bytes", "idle", "frames_started", "_parts", "_have", "_need", "_size_prefix")

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._parts: list[bytes] | None = None  # the arrived bytes of a frame still arriving
        self._have = 0  # how many bytes they are
        self._need = 0  # bytes still missing from it
        self._size_prefix = b""  # a size prefix split across chunks
        self.idle = True  # nothing buffered: the next chunk starts with a size prefix
        # Frames that did not arrive whole in one chunk (size prefix included), counted when
        # they start: tells a frame that stays unfinished from frames each finished in time.
        self.frames_started = 0

    @property
    def buffered_bytes(self) -> int:
        """Bytes held for an incomplete frame, its size prefix included (0 between frames)."""
        if self._parts is not None:
            return self._have + 4
        return len(self._size_prefix)

    @property
    def missing_bytes(self) -> int:
        """Bytes still to come before the frame being read is complete (0 between frames; the
        body of a frame whose size prefix is cut counts as unknown, 1)."""
        if self._parts is not None:
            return self._need
        return 4 - len(self._size_prefix) + 1 if self._size_prefix else 0

    def feed(self, data: bytes | bytearray | memoryview) -> list[memoryview | bytes]:
        """Consumes ``data``; returns the frames it completed, in order.

        Raises :class:`FrameError` for a negative size or one above ``max_frame_bytes``; the
        frames completed before the bad size are on the exception.
        """
        if self.idle and len(data) >= 4:
            # The common case, one whole frame per chunk: no loop, one slice.
            size = _INT32.unpack_from(data)[0]
            if size == len(data) - 4 and size <= self.max_frame_bytes:
                return [memoryview(data)[4:]]
        frames: list[memoryview | bytes] = []
        try:
            self._feed(memoryview(data), frames)
        except FrameError as exc:
            exc.frames = frames
            raise
        finally:
            self.idle = self._parts is None and not self._size_prefix
        return frames

    def _feed(self, view: memoryview, frames: list[memoryview | bytes]) -> None:
        pos = 0
        end = len(view)
        if self._parts is not None:
            take = min(self._need, end)
            # A whole chunk is kept as the object it came in; a part is copied (the rest of the
            # chunk is the next frame's, and a slice would keep all of it alive).
            self._parts.append(view.obj if take == end and type(view.obj) is bytes else bytes(view[:take]))
            self._need -= take
            self._have += take
            pos = take
            if self._need:
                return
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
        self._parts = [bytes(view[pos:end])]
        self._have = end - pos
        self._need = size - self._have
        if not started:
            self.frames_started += 1
        return end


def frame(payload: bytes | bytearray | memoryview) -> bytes:
    """Prefixes ``payload`` with its int32 size."""
    return _INT32.pack(len(payload)) + bytes(payload)
