"""The supervisor's hub and a worker's link, over real Unix socket pairs: framing, the host's
connection admission, usage passed to the other workers and replayed to a new one, quotas set
through the Admin API kept for workers that start later, and broker ports held for every worker."""

from __future__ import annotations

import asyncio
import socket

import pytest

from config.loader import parse_config
from proxy.control.worker_channel import MAX_MESSAGE_BYTES, Channel, ChannelError, decode, encode
from proxy.control.worker_hub import WorkerHub
from proxy.control.worker_link import WorkerLink, changes_from_json, changes_to_json
from quotas.client_quota_admin import QuotaChange, QuotaEntity
from quotas.connections import MAX_CONNECTIONS


def config(**connections):
    return parse_config({"upstream": {"bootstrap_servers": ["127.0.0.1:9"]}, "connections": connections})


class Clock:
    def __init__(self) -> None:
        self.ms = 1_000_000

    def __call__(self) -> int:
        return self.ms


async def pair() -> tuple[Channel, Channel]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return await Channel.over(a), await Channel.over(b)


async def serve(hub: WorkerHub, worker_id: int) -> tuple[Channel, asyncio.Task[None]]:
    """A worker's end of a channel the hub serves (as the supervisor does)."""
    hub_end, worker_end = await pair()
    state = hub.joined(worker_id, hub_end)

    async def loop() -> None:
        while (message := await hub_end.receive()) is not None:
            hub.handle(state, message)

    return worker_end, asyncio.get_running_loop().create_task(loop())


async def next_of(channel: Channel, kind: str) -> dict:
    async with asyncio.timeout(5):
        while True:
            message = await channel.receive()
            assert message is not None
            if message["t"] == kind:
                return message


def test_messages_are_framed_and_anything_else_is_refused():
    assert decode(encode({"t": "beat", "n": [1, None]})[4:]) == {"t": "beat", "n": [1, None]}
    for body in (b"[1]", b'{"n": 1}', b'{"t": 3}', b"\xff", b"{"):
        with pytest.raises(ChannelError):
            decode(body)

    async def oversized() -> None:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        reader = await Channel.over(b)
        a.sendall((MAX_MESSAGE_BYTES + 1).to_bytes(4, "big"))
        with pytest.raises(ChannelError, match="bytes"):
            await reader.receive()
        a.close()

    asyncio.run(oversized())


def test_max_connections_holds_for_the_host_and_a_dead_workers_connections_are_released():
    async def run() -> None:
        hub = WorkerHub(config(max_connections=3), 11_000, Clock())
        w0, t0 = await serve(hub, 0)
        w1, t1 = await serve(hub, 1)
        verdicts = []
        for i, channel in enumerate([w0, w1, w0, w1]):
            channel.send({"t": "admit", "id": i, "ip": "10.0.0.1"})
            verdicts.append((await next_of(channel, "admitted"))["verdict"])
        assert verdicts == ["accept", "accept", "accept", MAX_CONNECTIONS]
        w1.send({"t": "release", "ip": "10.0.0.1"})
        w1.send({"t": "release", "ip": "10.0.0.9"})  # never admitted: changes nothing
        w1.send({"t": "admit", "id": 9, "ip": "10.0.0.2"})
        assert (await next_of(w1, "admitted"))["verdict"] == "accept"
        assert hub.admission.open_total == 3
        hub.gone(0)  # its two connections died with it
        assert hub.admission.open_total == 1
        t0.cancel()
        t1.cancel()

    asyncio.run(run())


def test_usage_goes_to_the_other_workers_and_a_new_worker_gets_the_window():
    async def run() -> None:
        clock = Clock()
        hub = WorkerHub(config(), 11_000, clock)
        w0, _ = await serve(hub, 0)
        w1, _ = await serve(hub, 1)
        assert (await next_of(w0, "members"))["members"] in (1, 2)
        w0.send({"t": "usage", "entries": [["producer_byte_rate", None, "c1", 1000.0]]})
        got = await next_of(w1, "usage")
        assert got["entries"] == [["producer_byte_rate", None, "c1", 1000.0]] and got["members"] == 2
        clock.ms += 5_000
        w1.send({"t": "usage", "entries": [["request_rate", "u", None, 2.0]]})
        await next_of(w0, "usage")
        clock.ms += 7_000  # the first report has left the 11 s window, the second has not
        w2, _ = await serve(hub, 2)
        assert (await next_of(w2, "usage"))["entries"] == [["request_rate", "u", None, 2.0]]

    asyncio.run(run())


def test_quotas_set_on_one_worker_reach_the_others_and_later_ones():
    async def run() -> None:
        hub = WorkerHub(config(), 11_000, Clock())
        w0, _ = await serve(hub, 0)
        w1, _ = await serve(hub, 1)
        change = QuotaChange(QuotaEntity((("user", "alice"),)), "producer_byte_rate", None, 2048.0)
        w0.send({"t": "quotas", "changes": changes_to_json([change])})
        assert changes_from_json((await next_of(w1, "quotas"))["changes"]) == [change]
        w2, _ = await serve(hub, 2)
        assert changes_from_json((await next_of(w2, "quotas"))["changes"]) == [change]

    asyncio.run(run())


def test_a_broker_is_served_on_one_port_held_by_the_supervisor():
    hub = WorkerHub(config(), 11_000, Clock())
    try:
        first = hub.port(7, 0)["port"]
        assert hub.port(7, 0)["port"] == first  # every worker asks: the same port
        assert hub.port(8, 0)["port"] != first
        # A worker binds it too (SO_REUSEPORT) and listens.
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", first))
        sock.listen()
        sock.close()
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        assert "error" in hub.port(9, taken.getsockname()[1])  # bound without SO_REUSEPORT elsewhere
        taken.close()
    finally:
        hub.close()


def test_a_link_admits_through_the_hub_and_releases_an_answer_it_gave_up_on():
    async def run() -> None:
        hub = WorkerHub(config(max_connections=1), 11_000, Clock())
        hub_end, worker_end = await pair()
        state = hub.joined(0, hub_end)

        async def loop() -> None:
            while (message := await hub_end.receive()) is not None:
                hub.handle(state, message)

        task = asyncio.get_running_loop().create_task(loop())
        link = WorkerLink(0, worker_end, None, 100, Clock())
        link.start()
        assert (await link.admit("10.0.0.1")).accepted
        assert not (await link.admit("10.0.0.1")).accepted
        link.release("10.0.0.1")
        await asyncio.sleep(0.05)
        assert hub.admission.open_total == 0
        # A request the link no longer waits for (timed out, or its client left): admitted by
        # the hub, then released by the link when the answer finds no one waiting.
        worker_end.send({"t": "admit", "id": 999, "ip": "10.0.0.3"})
        await asyncio.sleep(0.2)
        assert (await link.admit("10.0.0.4")).accepted  # max_connections 1: the 999th was released
        assert hub.admission.open_per_ip == {"10.0.0.4": 1}
        await link.stop()
        task.cancel()

    asyncio.run(run())
