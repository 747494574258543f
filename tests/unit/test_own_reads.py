"""Sockets read into the proxy's own buffers (proxy.dataplane.reads), over real sockets.

An owner protocol frames what a client sends as ClientConnection and UpstreamConnection do: it
reads into the proxy's read buffer, or into a large frame's own buffer once it has one.
Whatever the sizes, the chunking and the pauses of the sender, the owner gets exactly the frames
sent, in order, and what it kept by reference is never written to again; with uvloop's loop and
asyncio's, over TCP and over TLS (certificates made here).
"""

from __future__ import annotations

import asyncio
import random
import ssl
import struct

import pytest
import uvloop

from protocol.frames import CONTIGUOUS_MIN_BYTES, FrameReader, frame
from proxy.dataplane.reads import (
    KEPT_READ_BYTES,
    OWN_READS_FROM_BYTES,
    PLAIN_AFTER_SHORT_READS,
    READ_BUFFER_BYTES,
    OwnBuffers,
    OwnReads,
    ReadBuffer,
)
from tests.support.certs import TestPki


class Owner(OwnReads):
    """Frames what arrives, keeping the frames as the reader gives them (views of the chunks
    and buffers read into); counts the frames that were filled and the bytes each way came."""

    def __init__(self) -> None:
        self._reader = FrameReader(64 << 20)
        self._reads = ReadBuffer()
        self._own, self._short_reads = False, 0
        self.transport: asyncio.Transport | None = None
        self.frames: list = []
        self.filled_frames = 0
        self.bytes_read = 0
        self.switches = 0  # read_own calls that switched the transport to OwnBuffers
        self.lost = asyncio.get_running_loop().create_future()

    @property
    def reader(self) -> FrameReader:
        return self._reader

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data) -> None:
        if not self._own and (len(data) >= OWN_READS_FROM_BYTES or self._reader.filling):
            self.switches += 1
            self.read_own()
        self.bytes_read += len(data)
        self.frames.extend(self._reader.feed(data))

    def filled(self, nbytes: int, frame_: memoryview | None) -> None:
        self.bytes_read += nbytes
        if frame_ is not None:
            self.filled_frames += 1
            self.frames.append(frame_)

    def connection_lost(self, exc) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


def _payloads(rng: random.Random) -> list[bytes]:
    sizes = [0, 10, CONTIGUOUS_MIN_BYTES - 1, CONTIGUOUS_MIN_BYTES, 300_000, 1_000_003, 5, 2_500_000, 70_000]
    rng.shuffle(sizes)
    return [rng.randbytes(n) for n in sizes]


def _contexts(tls: bool, tmp_path) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """The server's and the client's TLS contexts (certificates made here), or none for TCP."""
    if not tls:
        return None, None
    pki = TestPki(tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(pki.server.cert, pki.server.key)
    return server_ctx, ssl.create_default_context(cafile=pki.ca_file)


async def _exchange(tls: bool, tmp_path, seed: int) -> tuple[Owner, list[bytes]]:
    loop = asyncio.get_running_loop()
    owners: list[Owner] = []
    server_ctx, client_ctx = _contexts(tls, tmp_path)

    def made() -> Owner:
        owners.append(Owner())
        return owners[-1]

    server = await loop.create_server(made, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    rng = random.Random(seed)
    payloads = _payloads(rng)
    stream = b"".join(frame(p) for p in payloads)
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx,
                                                  server_hostname="127.0.0.1" if tls else None)
        pos = 0
        while pos < len(stream):  # pieces of any size, some with a pause (the reader catches up)
            step = rng.choice((1, 3, 4, 100, 4096, 65536, 200_000, 1 << 20))
            writer.write(stream[pos : pos + step])
            pos += step
            if rng.random() < 0.3:
                await writer.drain()
                await asyncio.sleep(0.001)
        await writer.drain()
        owner = owners[0]
        for _ in range(2000):
            if len(owner.frames) == len(payloads):
                break
            await asyncio.sleep(0.005)
        writer.close()
        await owner.lost
        return owner, payloads
    finally:
        server.close()


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_frames_read_into_own_buffers_are_the_frames_sent(loop_kind, tls, seed, tmp_path):
    runner = uvloop.run if loop_kind == "uvloop" else asyncio.run
    owner, payloads = runner(_exchange(tls, tmp_path, seed))
    assert [len(f) for f in owner.frames] == [len(p) for p in payloads]
    assert [bytes(f) for f in owner.frames] == payloads  # views kept all along: nothing wrote over them
    assert owner.filled_frames >= 1  # the large frames were read into their buffers
    assert owner.bytes_read == sum(4 + len(p) for p in payloads)
    assert owner.reader.idle


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_connection_lost_while_a_frame_is_filled_reaches_the_owner(loop_kind):
    async def scenario() -> Owner:
        loop = asyncio.get_running_loop()
        owners: list[Owner] = []
        server = await loop.create_server(lambda: owners.append(Owner()) or owners[-1], "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(struct.pack(">i", 1_000_000) + b"x" * 400_000)  # 40 % of a frame, then gone
            await writer.drain()
            for _ in range(400):
                if owners and owners[0].reader.filling and owners[0].bytes_read == 400_004:
                    break
                await asyncio.sleep(0.005)
            assert owners[0].reader.filling
            writer.close()
            await asyncio.wait_for(owners[0].lost, 5)
            return owners[0]
        finally:
            server.close()

    owner = (uvloop.run if loop_kind == "uvloop" else asyncio.run)(scenario())
    assert owner.frames == []
    assert owner.reader.missing_bytes == 600_000  # every byte sent before the close was read


def _reads_own(owner: Owner) -> bool:
    """Whether the owner's transport reads into the proxy's buffers now."""
    assert owner.transport is not None
    protocol = owner.transport.get_protocol()
    assert protocol is owner or type(protocol) is OwnBuffers
    return type(protocol) is OwnBuffers


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_round_trips_stay_on_the_loops_reads_and_a_large_frame_reads_into_its_buffer(loop_kind, tls, tmp_path):
    """Small frames one at a time are read by the loop (one call into Python per read); a large
    frame switches the socket to the proxy's buffers, the frame is read into its own, and short
    reads after it hand the socket back to the loop. Every frame arrives as sent throughout."""

    async def scenario() -> tuple[Owner, list[bool], list[bytes]]:
        loop = asyncio.get_running_loop()
        owners: list[Owner] = []
        server_ctx, client_ctx = _contexts(tls, tmp_path)
        server = await loop.create_server(lambda: owners.append(Owner()) or owners[-1], "127.0.0.1", 0,
                                          ssl=server_ctx)
        port = server.sockets[0].getsockname()[1]
        sent: list[bytes] = []
        modes: list[bool] = []

        async def send(payload: bytes) -> None:
            sent.append(payload)
            writer.write(frame(payload))
            await writer.drain()
            for _ in range(2000):  # until the owner has it: the next frame is the next read
                if owners and len(owners[0].frames) == len(sent):
                    break
                await asyncio.sleep(0.002)
            modes.append(_reads_own(owners[0]))

        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx,
                                                      server_hostname="127.0.0.1" if tls else None)
            for i in range(20):
                await send(b"small %d" % i)
            await send(random.Random(7).randbytes(3 << 20))
            for i in range(PLAIN_AFTER_SHORT_READS + 2):
                await send(b"small again %d" % i)
            writer.close()
            await owners[0].lost
            return owners[0], modes, sent
        finally:
            server.close()

    owner, modes, sent = (uvloop.run if loop_kind == "uvloop" else asyncio.run)(scenario())
    assert [bytes(f) for f in owner.frames] == sent
    assert modes[:20] == [False] * 20  # round trips: never switched
    assert modes[20] and owner.filled_frames == 1  # the large frame: read into its buffer
    assert modes[-1] is False and owner.switches == 1  # handed back after short reads, once


def test_a_short_read_is_copied_and_a_long_one_takes_the_buffer():
    reads = ReadBuffer()
    first = reads.view
    assert len(first) == READ_BUFFER_BYTES
    first[:5] = b"short"
    short = reads.take(5)
    assert type(short) is bytes and short == b"short" and reads.view is first  # read into again
    n = KEPT_READ_BYTES
    first[:n] = b"L" * n
    long_ = reads.take(n)
    assert type(long_) is memoryview and long_.obj is first.obj and len(long_) == n
    assert reads.view.obj is not first.obj  # the next read never writes over it
    reads.view[:n] = b"N" * n
    assert bytes(long_) == b"L" * n
    assert long_.obj.__len__() <= 4 * n  # a kept read holds at most four times its bytes


def test_a_frame_started_in_a_long_read_keeps_a_slice_of_it_only_while_that_is_a_quarter_of_its_buffer():
    """The reader keeps slices of a read given to it (no copy) unless that would keep a buffer
    more than four times the bytes kept alive."""
    reads = ReadBuffer()
    reader = FrameReader(64 << 20)
    start = READ_BUFFER_BYTES - KEPT_READ_BYTES  # a frame announced in the last quarter of a long read
    view = reads.view
    view[:start] = frame(b"a" * (start - 4))
    view[start : start + 4] = struct.pack(">i", 10 * READ_BUFFER_BYTES)
    view[start + 4 : READ_BUFFER_BYTES] = b"b" * (KEPT_READ_BYTES - 4)
    chunk = reads.take(READ_BUFFER_BYTES)
    frames = reader.feed(chunk)
    assert [bytes(f) for f in frames] == [b"a" * (start - 4)]
    assert reader.buffered_bytes == KEPT_READ_BYTES  # arrived, size prefix included; under a quarter: no buffer
    parts = reader._parts
    assert parts is not None and len(parts) == 1 and type(parts[0]) is bytes  # copied: too little of the read
    reader2 = FrameReader(64 << 20)
    view = reads.view
    view[:4] = struct.pack(">i", 5 * READ_BUFFER_BYTES)  # under a quarter here: no buffer of its own yet
    view[4:READ_BUFFER_BYTES] = b"c" * (READ_BUFFER_BYTES - 4)
    chunk2 = reads.take(READ_BUFFER_BYTES)
    assert reader2.feed(chunk2) == []
    parts2 = reader2._parts
    assert parts2 is not None and type(parts2[0]) is memoryview and parts2[0].obj is chunk2.obj  # kept, not copied
    assert CONTIGUOUS_MIN_BYTES < KEPT_READ_BYTES


@pytest.mark.parametrize("offset", [0, 70_000])
def test_a_frame_that_fits_the_rest_of_a_long_read_is_read_into_that_reads_buffer(offset):
    """A large frame begun in a long read, that the read's buffer has room for, is finished in
    that buffer: what arrived is not copied, the rest is read after it, and the frame is a view
    of it; the frames before it in the read are untouched."""
    reads = ReadBuffer()
    reader = FrameReader(64 << 20)
    size = 600_000
    body = random.Random(offset).randbytes(size)
    before = frame(b"p" * (offset - 4)) if offset else b""
    arrived = 300_000
    view = reads.view
    view[: len(before)] = before
    view[len(before) : len(before) + 4] = struct.pack(">i", size)
    view[len(before) + 4 : len(before) + 4 + arrived] = body[:arrived]
    chunk = reads.take(len(before) + 4 + arrived)
    frames = reader.feed(chunk)
    assert [bytes(f) for f in frames] == ([b"p" * (offset - 4)] if offset else [])
    assert reader.filling and reader.buffered_bytes == READ_BUFFER_BYTES + 4  # the read's buffer, counted whole
    fill = reader.fill_buffer()
    assert fill is not None and fill.obj is chunk.obj and len(fill) == size - arrived
    fill[:] = body[arrived:]
    done = reader.filled(size - arrived)
    assert done is not None and done.obj is chunk.obj and bytes(done) == body
    assert [bytes(f) for f in frames] == ([b"p" * (offset - 4)] if offset else [])
    assert reader.idle and not reader.filling


def test_a_frame_too_long_for_its_reads_buffer_gets_one_of_its_own():
    reads = ReadBuffer()
    reader = FrameReader(64 << 20)
    size = READ_BUFFER_BYTES  # with its size prefix, one byte more than the read's buffer holds
    view = reads.view
    view[:4] = struct.pack(">i", size)
    view[4:] = b"a" * (READ_BUFFER_BYTES - 4)
    chunk = reads.take(READ_BUFFER_BYTES)
    assert reader.feed(chunk) == [] and reader.filling
    fill = reader.fill_buffer()
    assert fill is not None and fill.obj is not chunk.obj and len(fill) == 4
    fill[:] = b"bbbb"
    done = reader.filled(4)
    assert done is not None and bytes(done) == b"a" * (READ_BUFFER_BYTES - 4) + b"bbbb"


def test_a_long_reads_buffer_is_read_into_again_once_nothing_holds_it():
    """After a long read, the next read goes to the buffer the long read before took when no
    chunk of it is held any more, and to a new one while one is."""
    reads = ReadBuffer()
    first = id(reads.view.obj)
    chunk = reads.take(KEPT_READ_BYTES)  # takes the first buffer
    second = id(reads.view.obj)
    kept = reads.take(KEPT_READ_BYTES)  # takes the second; the first is held (chunk): a new one
    third = id(reads.view.obj)
    assert len({first, second, third}) == 3
    del chunk
    reads.take(KEPT_READ_BYTES)  # takes the third; the second is held (kept): a new one
    # (not the second or third, both alive; the first was freed, so its address may come back)
    assert id(reads.view.obj) not in (second, third)
    del kept
    reads.take(KEPT_READ_BYTES)  # the third is free now: read into again
    assert id(reads.view.obj) == third
    assert len(reads.take(10)) == 10 and id(reads.view.obj) == third  # a short read is copied out
