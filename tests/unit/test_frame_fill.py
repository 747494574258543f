"""Large frames read straight into their buffers (proxy.dataplane.fill), over real sockets.

An owner protocol frames what a client sends, lending its transport to a FrameFill whenever a
large frame has its own buffer, as ClientConnection and UpstreamConnection do. Whatever the
sizes, the chunking and the pauses of the sender, the owner gets exactly the frames sent, in
order; with uvloop's loop and asyncio's, over TCP and over TLS (certificates made here).
"""

from __future__ import annotations

import asyncio
import random
import ssl
import struct

import pytest
import uvloop

from protocol.frames import CONTIGUOUS_MIN_BYTES, FrameReader, frame
from proxy.dataplane.fill import FrameFill, lend_for_fill
from tests.support.certs import TestPki


class Owner(asyncio.Protocol):
    """Frames what arrives; counts the frames that were filled and the bytes each way came."""

    def __init__(self) -> None:
        self.reader = FrameReader(64 << 20)
        self.transport: asyncio.Transport | None = None
        self.frames: list[bytes] = []
        self.filled_frames = 0
        self.bytes_read = 0
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.bytes_read += len(data)
        self.frames.extend(bytes(f) for f in self.reader.feed(data))
        lend_for_fill(self.transport, self, self.reader)

    def filled(self, nbytes: int, frame_: memoryview | None) -> None:
        self.bytes_read += nbytes
        if frame_ is not None:
            assert not isinstance(self.transport.get_protocol(), FrameFill)  # given back first
            self.filled_frames += 1
            self.frames.append(bytes(frame_))

    def connection_lost(self, exc) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


def _payloads(rng: random.Random) -> list[bytes]:
    sizes = [0, 10, CONTIGUOUS_MIN_BYTES - 1, CONTIGUOUS_MIN_BYTES, 300_000, 1_000_003, 5, 2_500_000, 70_000]
    rng.shuffle(sizes)
    return [rng.randbytes(n) for n in sizes]


async def _exchange(tls: bool, tmp_path, seed: int) -> tuple[Owner, list[bytes]]:
    loop = asyncio.get_running_loop()
    owners: list[Owner] = []
    server_ctx = client_ctx = None
    if tls:
        pki = TestPki(tmp_path)
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ctx.load_cert_chain(pki.server.cert, pki.server.key)
        client_ctx = ssl.create_default_context(cafile=pki.ca_file)

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
def test_filled_frames_are_the_frames_sent(loop_kind, tls, seed, tmp_path):
    runner = uvloop.run if loop_kind == "uvloop" else asyncio.run
    owner, payloads = runner(_exchange(tls, tmp_path, seed))
    assert [len(f) for f in owner.frames] == [len(p) for p in payloads]
    assert owner.frames == payloads
    assert owner.filled_frames >= 1  # the large frames were read into their buffers
    assert owner.bytes_read == sum(4 + len(p) for p in payloads)
    assert owner.reader.idle


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_connection_lost_while_lent_reaches_the_owner(loop_kind):
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
                if owners and owners[0].transport is not None and isinstance(
                        owners[0].transport.get_protocol(), FrameFill):
                    break
                await asyncio.sleep(0.005)
            assert isinstance(owners[0].transport.get_protocol(), FrameFill)
            writer.close()
            await asyncio.wait_for(owners[0].lost, 5)
            return owners[0]
        finally:
            server.close()

    owner = (uvloop.run if loop_kind == "uvloop" else asyncio.run)(scenario())
    assert owner.frames == []
    assert owner.reader.missing_bytes == 600_000  # every byte sent before the close was read
