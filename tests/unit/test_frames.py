"""FrameReader: whole, byte by byte, any chunking, garbage after the last frame, bad sizes."""

from __future__ import annotations

import struct
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.frames import CONTIGUOUS_MIN_BYTES, FrameError, FrameReader, frame

MAX = 1 << 20  # 1 MiB

payloads_st = st.lists(st.binary(max_size=300), max_size=12)


def _stream(payloads: list[bytes]) -> bytes:
    return b"".join(frame(p) for p in payloads)


def _feed_chunks(reader: FrameReader, data: bytes, cuts: list[int]) -> list[bytes]:
    """Feeds ``data`` split at ``cuts``; returns every frame's bytes, checked as it came out."""
    out: list[bytes] = []
    start = 0
    for cut in [*sorted(set(cuts)), len(data)]:
        for f in reader.feed(data[start:cut]):
            assert isinstance(f, (memoryview, bytes))
            out.append(bytes(f))
        start = cut
    return out


def test_frame_prefixes_the_size():
    assert frame(b"abc") == b"\x00\x00\x00\x03abc"
    assert frame(b"") == b"\x00\x00\x00\x00"


def test_whole_stream_in_one_chunk():
    payloads = [b"first", b"", b"x" * 1000, b"last"]
    reader = FrameReader(MAX)
    frames = reader.feed(_stream(payloads))
    assert [bytes(f) for f in frames] == payloads
    assert reader.buffered_bytes == 0


def test_byte_by_byte():
    payloads = [b"hello", b"", b"\x00\x01\x02", b"y" * 600]
    data = _stream(payloads)
    reader = FrameReader(MAX)
    out = []
    for i in range(len(data)):
        out.extend(bytes(f) for f in reader.feed(data[i : i + 1]))
        # Nothing is returned before a frame's last byte arrives.
        complete = 0
        pos = 0
        for p in payloads:
            pos += 4 + len(p)
            if pos <= i + 1:
                complete += 1
        assert len(out) == complete
    assert out == payloads
    assert reader.buffered_bytes == 0


def test_empty_feed_returns_nothing():
    reader = FrameReader(MAX)
    assert reader.feed(b"") == []
    reader.feed(b"\x00\x00")
    assert reader.feed(b"") == []
    assert reader.buffered_bytes == 2


@settings(max_examples=300, deadline=None)
@given(payloads=payloads_st, data=st.data())
def test_any_chunking_gives_the_same_frames(payloads, data):
    stream = _stream(payloads)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=30))
    reader = FrameReader(MAX)
    assert _feed_chunks(reader, stream, cuts) == payloads
    assert reader.buffered_bytes == 0


@settings(max_examples=300, deadline=None)
@given(payloads=payloads_st, tail=st.binary(min_size=1, max_size=40), data=st.data())
def test_garbage_after_the_last_frame_stays_buffered(payloads, tail, data):
    # The tail is an incomplete frame: a size that promises more than the tail holds,
    # or fewer than 4 bytes of size prefix.
    if len(tail) >= 4:
        tail = struct.pack(">i", len(tail) - 4 + 1 + data.draw(st.integers(0, 1000))) + tail[4:]
    stream = _stream(payloads) + tail
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=20))
    reader = FrameReader(MAX)
    # Never a frame made of bytes past the end of a real frame.
    assert _feed_chunks(reader, stream, cuts) == payloads
    assert reader.buffered_bytes == len(tail)


def test_partial_frame_completes_on_later_feed():
    reader = FrameReader(MAX)
    assert reader.feed(frame(b"abcdef")[:7]) == []
    assert reader.buffered_bytes == 7
    assert [bytes(f) for f in reader.feed(b"def" + frame(b"gh"))] == [b"abcdef", b"gh"]
    assert reader.buffered_bytes == 0


def test_frame_of_exactly_max_bytes_is_accepted():
    reader = FrameReader(1024)
    assert [bytes(f) for f in reader.feed(frame(b"z" * 1024))] == [b"z" * 1024]


def test_size_one_above_max_is_rejected():
    reader = FrameReader(1024)
    with pytest.raises(FrameError, match="1025"):
        reader.feed(struct.pack(">i", 1025))


@pytest.mark.parametrize("size", [-1, -(2**31)])
def test_negative_size_is_rejected(size):
    reader = FrameReader(MAX)
    with pytest.raises(FrameError, match="negative"):
        reader.feed(struct.pack(">i", size) + b"\x00" * 8)


def test_negative_size_split_across_chunks_is_rejected():
    reader = FrameReader(MAX)
    reader.feed(b"\xff\xff")
    with pytest.raises(FrameError, match="negative"):
        reader.feed(b"\xff\xfe")


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefix", "prefix-byte-by-byte"])
def test_huge_size_raises_before_allocating(chunked):
    """A 2 GiB size with a 1 MiB limit must fail at once, not allocate 2 GiB."""
    prefix = struct.pack(">i", 2**31 - 1)
    reader = FrameReader(MAX)
    tracemalloc.start()
    try:
        with pytest.raises(FrameError, match="exceeds max_frame_bytes"):
            if chunked:
                for b in prefix:
                    reader.feed(bytes([b]))
            else:
                reader.feed(prefix + b"\x00" * 100)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MAX


def test_frame_error_carries_frames_completed_before_the_bad_size():
    reader = FrameReader(MAX)
    with pytest.raises(FrameError) as info:
        reader.feed(frame(b"one") + frame(b"two") + struct.pack(">i", -5))
    assert [bytes(f) for f in info.value.frames] == [b"one", b"two"]


def test_frame_error_after_a_split_frame_carries_it():
    reader = FrameReader(MAX)
    reader.feed(frame(b"abc")[:5])
    with pytest.raises(FrameError) as info:
        reader.feed(b"bc" + struct.pack(">i", MAX + 1))
    assert [bytes(f) for f in info.value.frames] == [b"abc"]


def test_memoryview_frames_stay_correct_after_later_feeds():
    reader = FrameReader(MAX)
    first_chunk = frame(b"alpha") + frame(b"beta") + frame(b"gam")[:5]
    early = reader.feed(first_chunk)
    assert all(isinstance(f, memoryview) for f in early)
    later = reader.feed(b"am" + frame(b"delta"))
    more = reader.feed(frame(b"x" * 50)[:20])
    more += reader.feed(frame(b"x" * 50)[20:])
    # Earlier views are not disturbed by anything the reader did since.
    assert [bytes(f) for f in early] == [b"alpha", b"beta"]
    assert [bytes(f) for f in later] == [b"gam", b"delta"]
    assert [bytes(f) for f in more] == [b"x" * 50]
    # Frames assembled across chunks are independent buffers.
    assert isinstance(more[0], bytes)


def test_split_frames_do_not_share_buffers():
    reader = FrameReader(MAX)
    data = frame(b"A" * 10) + frame(b"B" * 10)
    out = []
    for i in range(0, len(data), 3):
        out.extend(reader.feed(data[i : i + 3]))
    assert [bytes(f) for f in out] == [b"A" * 10, b"B" * 10]
    # Joined frames are immutable bytes of their own: later feeds cannot change them.
    assert all(type(f) is bytes for f in out)
    reader.feed(frame(b"C" * 10)[:7])
    assert out == [b"A" * 10, b"B" * 10]


def test_zero_length_frames():
    reader = FrameReader(MAX)
    assert [bytes(f) for f in reader.feed(frame(b"") * 3)] == [b"", b"", b""]
    out = []
    for b in frame(b"") + frame(b"q"):
        out.extend(bytes(f) for f in reader.feed(bytes([b])))
    assert out == [b"", b"q"]


@settings(max_examples=200, deadline=None)
@given(payloads=payloads_st, data=st.data())
def test_idle_is_true_exactly_when_nothing_is_buffered(payloads, data):
    stream = _stream(payloads)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=8))
    reader = FrameReader(MAX)
    assert reader.idle
    start = 0
    for cut in [*sorted(set(cuts)), len(stream)]:
        reader.feed(stream[start:cut])
        assert reader.idle == (reader.buffered_bytes == 0)
        start = cut
    assert reader.idle


def test_a_chunk_of_exactly_one_frame_is_that_frame_without_a_copy():
    chunk = frame(b"hello")
    (f,) = FrameReader(MAX).feed(chunk)
    assert isinstance(f, memoryview) and f.obj is chunk and bytes(f) == b"hello"


def test_a_whole_frame_after_a_partial_one_is_not_mistaken_for_a_single_frame():
    reader = FrameReader(MAX)
    assert reader.feed(frame(b"abcdef")[:3]) == []
    assert not reader.idle
    rest = frame(b"abcdef")[3:] + frame(b"xy")
    assert [bytes(f) for f in reader.feed(rest)] == [b"abcdef", b"xy"]
    assert reader.idle


def test_an_announced_size_allocates_nothing_until_the_bytes_arrive():
    """A peer that announces 100 MB and sends a byte costs that byte, not 100 MB."""
    import tracemalloc

    reader = FrameReader(100 * 1024 * 1024)
    tracemalloc.start()
    try:
        assert reader.feed(struct.pack(">i", 100_000_000) + b"x") == []
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024
    assert reader.buffered_bytes == 5 and not reader.idle and reader.frames_started == 1


def test_a_long_frame_holds_only_what_arrived_and_counts_as_one_started_frame():
    reader = FrameReader(MAX)
    payload = bytes(range(256)) * 40
    data = frame(payload)
    got = []
    for i in range(0, len(data), 1000):
        got += reader.feed(data[i : i + 1000])
        assert reader.buffered_bytes == (0 if got else min(i + 1000, len(data)))
    assert [bytes(f) for f in got] == [payload]
    assert reader.frames_started == 1 and reader.idle


def test_a_frame_is_started_once_whether_or_not_its_size_prefix_was_cut():
    reader = FrameReader(MAX)
    data = frame(b"y" * 100)
    reader.feed(data[:2])
    assert reader.frames_started == 1 and reader.missing_bytes > 0
    reader.feed(data[2:50])
    assert reader.frames_started == 1 and reader.missing_bytes == len(data) - 50
    reader.feed(data[50:])
    assert reader.frames_started == 1 and reader.missing_bytes == 0 and reader.idle


# -- large frames: one buffer of their size once a quarter has arrived, filled or fed ----------

def _large(n: int) -> bytes:
    return (bytes(range(256)) * (n // 256 + 1))[:n]


large_payloads_st = st.lists(
    st.one_of(st.binary(max_size=300),
              st.integers(CONTIGUOUS_MIN_BYTES - 2, 3 * CONTIGUOUS_MIN_BYTES).map(_large)),
    max_size=6)


@settings(max_examples=150, deadline=None)
@given(payloads=large_payloads_st, data=st.data())
def test_large_frames_come_out_the_same_fed_or_filled(payloads, data):
    """The rest of a large frame may be fed, or read into fill_buffer in pieces of any size (as
    proxy.dataplane.fill does): the frames are the same; a frame with a buffer holds at most
    four times what arrived of it, and the buffer takes exactly what is missing."""
    stream = _stream(payloads)
    reader = FrameReader(MAX)
    out: list[bytes] = []
    pos = 0
    while pos < len(stream):
        view = reader.fill_buffer()
        if view is not None:
            assert len(view) == reader.missing_bytes
            size = reader.buffered_bytes - 4
            assert size >= CONTIGUOUS_MIN_BYTES and size <= 4 * (size - reader.missing_bytes)
        if view is not None and data.draw(st.booleans()):
            n = data.draw(st.integers(1, len(view)))
            view[:n] = stream[pos : pos + n]
            done = reader.filled(n)
            if done is not None:
                out.append(bytes(done))
        else:
            n = data.draw(st.integers(1, 2 * CONTIGUOUS_MIN_BYTES))
            out.extend(bytes(f) for f in reader.feed(stream[pos : pos + n]))
        pos += n
    assert out == payloads
    assert reader.idle and reader.buffered_bytes == 0 and reader.fill_buffer() is None


def test_a_large_frame_gets_its_buffer_only_once_a_quarter_arrived():
    size = 1 << 20
    stream = frame(_large(size))
    reader = FrameReader(2 * size)
    reader.feed(stream[:1004])
    assert reader.buffered_bytes == 1004 and reader.fill_buffer() is None  # what arrived, no more
    reader.feed(stream[1004 : 4 + size // 4 - 1])
    assert reader.fill_buffer() is None
    reader.feed(stream[4 + size // 4 - 1 : 4 + size // 4])
    view = reader.fill_buffer()
    assert view is not None and len(view) == size - size // 4
    assert reader.buffered_bytes == size + 4
    view[:] = stream[4 + size // 4 :]
    assert bytes(reader.filled(len(view))) == stream[4:]
    assert reader.idle


def test_a_frame_begun_in_a_reused_buffer_is_not_changed_by_its_reuse():
    """A chunk that is not immutable bytes is copied, never kept: the caller may reuse it."""
    payload = _large(3 * CONTIGUOUS_MIN_BYTES)
    stream = frame(payload)
    for cut in (100, len(stream) // 2):  # kept as parts, or copied into the frame's buffer
        reader = FrameReader(MAX)
        chunk = bytearray(stream[:cut])
        reader.feed(chunk)
        chunk[:] = b"\xee" * len(chunk)
        assert [bytes(f) for f in reader.feed(stream[cut:])] == [payload]
