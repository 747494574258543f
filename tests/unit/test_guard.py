"""The connection guard in process: the memory pool, deadlines, admission, lazy broker
connections and rate-limited log lines. Clients are played by the test (see
test_connection_paths); the sweep is called with chosen instants."""

from __future__ import annotations

import asyncio
import logging
import struct

from config import parse_config
from proxy.app.server import ProxyServer
from proxy.dataplane.connection import ClientConnection
from proxy.dataplane.guard import MemoryPool
from proxy.observability.logs import LogLimiter

from .test_connection_paths import BASE, Pair, Wire, list_offsets


class Holder:
    """A connection as the memory pool sees it."""

    def __init__(self, to_finish: int) -> None:
        self.to_finish = to_finish
        self.reasons: set[str] = set()
        self.gate = self

    def pause(self, reason: str) -> None:
        self.reasons.add(reason)

    def resume(self, reason: str) -> None:
        self.reasons.discard(reason)

    def bytes_to_finish(self) -> int:
        return self.to_finish


def test_memory_pool_pauses_every_holder_but_the_nearest_to_finishing_then_resumes():
    pool = MemoryPool(1000)
    big, small, near = Holder(10_000), Holder(5_000), Holder(10)
    pool.update(big, 600)
    pool.update(small, 300)
    assert not big.reasons and not small.reasons  # within the budget
    pool.update(near, 200)  # 1,100 > 1,000
    assert big.reasons == {"memory"} and small.reasons == {"memory"} and not near.reasons
    assert pool.paused == {big, small} and pool.pauses_total == 2
    pool.update(near, 0)  # its frame finished and went on: 900 held, within the budget
    assert not big.reasons and not small.reasons and not pool.paused
    assert pool.held_bytes == 900


def test_memory_pool_lets_another_read_when_the_one_reading_closes():
    pool = MemoryPool(100)
    a, b = Holder(50), Holder(60)
    pool.update(a, 80)
    pool.update(b, 80)
    assert b.reasons == {"memory"} and not a.reasons
    pool.release(a)  # closed (say, by the partial-request timeout): b is alone and under budget
    assert not b.reasons and pool.held_bytes == 80


def test_memory_pool_never_keeps_a_holder_of_nothing_paused_and_chooses_a_reader_when_one_leaves():
    pool = MemoryPool(100)
    a, b, c = Holder(1), Holder(500), Holder(600)
    pool.update(b, 90)
    pool.update(c, 90)  # over: b is nearest to finishing, it reads
    assert pool.reader is b and c.reasons and not b.reasons
    pool.update(a, 10)  # a newcomer while over the budget waits (O(1), no new choice)
    assert a.reasons == {"memory"} and pool.reader is b
    pool.update(b, 0)  # b's frame finished and went on: 100 held, within the budget, all read
    assert not b.reasons and b not in pool.paused
    pool.update(c, 95)  # over again (105): the nearest of a and c reads
    assert pool.reader is a and not a.reasons and c.reasons == {"memory"}


def test_memory_pool_under_attack_costs_o1_per_update():
    pool = MemoryPool(1000)
    calls = [0]

    class Counting(Holder):
        def bytes_to_finish(self) -> int:
            calls[0] += 1
            return self.to_finish

    holders = [Counting(10 + i) for i in range(2000)]
    for h in holders:
        pool.update(h, 100)
    reader = pool.reader
    before = calls[0]
    for _ in range(10):
        for h in holders[100:]:
            pool.update(h, 101)  # paused holders' bytes change (held requests processed, say)
    assert calls[0] == before and pool.reader is reader


def test_log_limiter_lets_a_few_lines_through_per_interval_and_counts_the_rest(caplog):
    now = [0.0]
    limiter = LogLimiter(logging.getLogger("test.limiter"), lines=3, interval_s=10, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.limiter"):
        sent = [limiter.log(logging.WARNING, "closing %d", i) for i in range(1000)]
        now[0] = 10.0
        limiter.log(logging.WARNING, "closing %d", 1000)
    assert sent.count(True) == 3
    assert [r.getMessage() for r in caplog.records] == [
        "closing 0", "closing 1", "closing 2", "closing 1000 (997 more like this not logged)"]


def test_an_announced_size_costs_the_pool_only_the_bytes_sent():
    async def go():
        pair = Pair()
        pair.conn.data_received(struct.pack(">i", 100_000_000) + b"x")
        assert pair.server.guard.pool.held_bytes == 5
        pair.conn._teardown()
        assert pair.server.guard.pool.held_bytes == 0

    asyncio.run(go())


def test_the_broker_connection_is_opened_by_the_first_request_not_by_the_accept():
    async def go():
        server = ProxyServer(parse_config(BASE))
        conn = ClientConnection(server.env, None)
        client = Wire()
        conn.connection_made(client)
        assert conn._connect_task is None and conn.upstream is None
        conn.data_received(list_offsets(1, "app")[:7])  # a partial request opens nothing either
        assert conn._connect_task is None
        conn.data_received(list_offsets(1, "app")[7:])
        assert conn._connect_task is not None and client.paused  # not read while it connects
        assert server.guard.pool.held_bytes == len(list_offsets(1, "app"))  # waiting for it
        conn._teardown()

    asyncio.run(go())


def _sweep(pair: Pair, now_s: float, idle_s: float = 10.0, partial_s: float = 3.0):
    return pair.conn.deadline_passed(now_s, idle_s, partial_s)


def test_an_idle_connection_passes_its_deadline_only_with_nothing_read_or_awaited():
    async def go():
        pair = Pair()
        start = pair.conn.deadlines.idle_since
        assert _sweep(pair, start + 9) is None
        assert _sweep(pair, start + 10) == "idle"
        pair.conn.data_received(list_offsets(1, "app"))  # read, and now awaited
        assert _sweep(pair, start + 11) is None
        assert _sweep(pair, start + 30) is None  # the broker has not answered: not idle
        pair.up.data_received(struct.pack(">ii", 8, 1) + b"\0\0\0\0")
        assert _sweep(pair, start + 31) is None  # idle since the sweep that last saw it awaited
        assert _sweep(pair, start + 39) is None
        assert _sweep(pair, start + 40) == "idle"
        pair.conn._teardown()

    asyncio.run(go())


def test_a_frame_left_unfinished_passes_its_deadline_a_stream_of_finished_frames_does_not():
    async def go():
        pair = Pair()
        request = list_offsets(1, "app")
        t = pair.conn.deadlines.idle_since
        pair.conn.data_received(request[:3])  # slowloris: part of a size prefix
        assert _sweep(pair, t) is None
        pair.conn.data_received(request[3:4])  # bytes keep coming, the frame does not finish
        assert _sweep(pair, t + 2) is None
        assert _sweep(pair, t + 3) == "partial_request"
        # A client whose frames each finish is never cut, though one is unfinished at each sweep.
        busy = Pair()
        t = busy.conn.deadlines.idle_since
        for i in range(10):
            busy.conn.data_received(request[4:] if i else request[:4])
            busy.conn.data_received(request[:4])
            assert _sweep(busy, t + 2 * i) is None
        pair.conn._teardown()
        busy.conn._teardown()

    asyncio.run(go())


def test_time_the_proxy_itself_does_not_read_a_client_does_not_count():
    async def go():
        pair = Pair()
        t = pair.conn.deadlines.idle_since
        pair.conn.data_received(list_offsets(1, "app")[:5])
        pair.conn.mute(60_000)
        assert _sweep(pair, t + 100) is None  # muted: neither idle nor late
        pair.conn.channel_mute.cancel()
        pair.conn.channel_mute.end()
        assert _sweep(pair, t + 101) is None
        assert _sweep(pair, t + 104) == "partial_request"
        pair.conn._teardown()

    asyncio.run(go())


def test_connections_over_the_per_ip_limit_are_refused_and_counted():
    async def go():
        server = ProxyServer(parse_config({**BASE, "connections": {"max_connections_per_ip": 2}}))
        conns = [ClientConnection(server.env, None) for _ in range(3)]
        wires = [Wire() for _ in conns]
        for conn, wire in zip(conns, wires):
            conn.connection_made(wire)
        assert [w.closed for w in wires] == [False, False, True]
        assert server.guard.closed["max_connections_per_ip"] == 1
        assert len(server.connections) == 2 and server.stats.open_connections == 2
        conns[0]._teardown()  # a slot is free again
        late = ClientConnection(server.env, None)
        late.connection_made(Wire())
        assert late in server.connections
        for conn in (conns[1], late):
            conn._teardown()
        assert server.guard.quotas.open_total == 0

    asyncio.run(go())


def test_close_for_counts_and_logs_each_reason_a_few_times_only(caplog):
    async def go():
        server = ProxyServer(parse_config(BASE))
        for _ in range(50):
            pair = Pair(server=server)
            pair.conn.close_for("idle")
        assert server.guard.closed["idle"] == 50

    with caplog.at_level(logging.WARNING, logger="proxy.dataplane.guard"):
        asyncio.run(go())
    assert len([r for r in caplog.records if "idle" in r.getMessage()]) == 10


def test_over_the_creation_rate_of_all_listeners_a_connection_is_accepted_later():
    async def go():
        server = ProxyServer(parse_config({**BASE, "connections": {"max_connection_creation_rate": 2},
                                           "quota_windows": {"quota_window_num": 2}}))
        wires = [Wire() for _ in range(3)]
        conns = [ClientConnection(server.env, None) for _ in wires]
        for conn, wire in zip(conns, wires):
            conn.connection_made(wire)
        # Served, not closed; the third is not read until its throttle has passed.
        assert not any(w.closed for w in wires) and len(server.connections) == 3
        assert [w.paused for w in wires] == [False, False, True]
        assert conns[2].gate.reasons == {"accept"} and server.guard.delayed_total == 1
        await asyncio.sleep(0.6)  # (3 - 2) / 2 x 1 s = 500 ms
        assert not wires[2].paused
        for conn in conns:
            conn._teardown()

    asyncio.run(go())
