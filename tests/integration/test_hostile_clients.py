"""Hostile clients against the connection guard (proxy/guard.py, quotas/connections.py): the
real proxy process in front of a real Tansu, and raw sockets on 127.0.0.1 that announce huge
frames, leave a frame unfinished, send nothing at all, or connect too often or too many.

Every assertion here fails without the guard. Before it (89f1f6e for the frame reader, 4fb6824
for the rest) 8 connections announcing 100 MB and sending 1 byte grew the proxy by 763 MB; 16
connections pushing 4 MiB each of a huge frame grew it by 64 MB (every byte sent was held);
2,000 slowloris and 2,000 silent connections were all still open after 76 s and had opened
4,000 broker connections before sending a byte; no connection was ever refused.

The sweep that enforces the timeouts runs every quarter of the shorter timeout (at most 1 s),
so on a quiet machine a deadline of T is met between T and T + T/4 after the state began. The
tests assert what holds on any machine: never before T (less 50 ms: the client's clock starts
when its connect returns), for the right reason (the counter of that reason), and eventually
(within WATCH_S more, the watches ending as soon as every socket is closed); how much after T
depends on how busy the machine is.
"""

from __future__ import annotations

import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from kafka.protocol.metadata import ApiVersionsRequest

from tests.support import hostile
from tests.support.proxy_process import sum_samples
from tests.support.raw_broker import RawBroker, echo_correlation
from tests.support.wire import api_versions, is_closed, read_frame, request_bytes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MiB = 1 << 20
HUGE_SIZE_PREFIX = struct.pack(">i", 100_000_000)
WATCH_S = 10.0  # on top of a deadline: how long a watch waits for a closure before giving up


def _config(**connections) -> dict:
    # No periodic metadata refresh during a test: broker connections seen are the clients'.
    return {"connections": connections, "upstream": {"metadata_refresh_interval_s": 600}}


def _closed(p, reason: str) -> float:
    return p.metric_sum("kqp_connections_closed_total", reason=reason)


def _bystander_ok(p) -> None:
    resp = api_versions(p.address)
    assert resp.error_code == 0 and resp.api_keys


def _log_lines(p, fragment: str) -> list[str]:
    return [line for line in p.log_text().splitlines() if fragment in line]


def _wait_for_metric(p, name: str, value: float, timeout_s: float = 5.0) -> float:
    deadline = time.monotonic() + timeout_s
    seen = p.metric_sum(name)
    while seen != value and time.monotonic() < deadline:
        time.sleep(0.05)
        seen = p.metric_sum(name)
    return seen


def _served(address, source_ip: str | None = None) -> socket.socket:
    """A connection that the proxy serves: its ApiVersions request is answered. Left open."""
    s = socket.socket()
    try:
        if source_ip is not None:
            s.bind((source_ip, 0))
        s.settimeout(5)
        s.connect(address)
        s.sendall(request_bytes(ApiVersionsRequest[0](), 11))
        frame = read_frame(s)
    except BaseException:
        s.close()
        raise
    assert frame is not None and struct.unpack(">i", frame[:4])[0] == 11, "a connection under the limits was not served"
    return s


def _assert_refused_at_once(address, source_ip: str | None = None) -> None:
    """A new connection is closed by the proxy before sending it a byte: nothing but the refusal
    closes one here (no partial or idle timeout shorter than the 10 min default, no throttle),
    so closed at all is closed by it; the caller checks the reason's counter."""
    socks = hostile.connect_many(address, 1, source_ip=source_ip)
    try:
        (seen,) = hostile.watch_eof(socks, WATCH_S).values()
    finally:
        hostile.close_all(socks)
    assert seen.eof_at is not None, "a connection over the limit was kept open"
    assert not seen.received, (seen.lived_s, bytes(seen.received))


# -- memory -------------------------------------------------------------------------------


def test_a_100_mb_size_prefix_costs_the_bytes_sent(tansu, proxy):
    p = proxy(tansu.bootstrap, extra_config=_config(partial_request_timeout_ms=1000))
    _bystander_ok(p)  # the proxy's first-use allocations happen before the baseline
    rss_before = hostile.settled_rss(p.pid)
    opened: dict = {}
    attackers = hostile.connect_many(p.address, 8, HUGE_SIZE_PREFIX + b"x", opened_at=opened)
    try:
        held = _wait_for_metric(p, "kqp_memory_held_bytes", 8 * 5)  # every byte sent read
        grown = hostile.rss_bytes(p.pid) - rss_before
        # Before growth-by-arrival: 95 MB per connection (763 MB for these 8).
        assert grown <= 4 * MiB, f"RSS grew {grown / MiB:.1f} MiB for 40 bytes sent"
        assert held == 8 * 5  # the size prefix and 1 byte each
        assert p.metric_sum("kqp_open_connections") == 8
        # Not one complete request: not one broker connection.
        assert hostile.sockets_to_port(p.pid, tansu.port) == 0
        _bystander_ok(p)
        seen = hostile.watch_eof(attackers, 1.0 + WATCH_S, opened_at=opened)
    finally:
        hostile.close_all(attackers)
    lived = sorted(w.lived_s for w in seen.values() if w.eof_at is not None)
    assert len(lived) == 8, f"only {len(lived)} of 8 unfinished frames were closed"
    assert 0.95 <= lived[0], lived
    assert not any(w.received for w in seen.values())
    assert _closed(p, "partial_request") == 8
    assert _wait_for_metric(p, "kqp_open_connections", 0) == 0
    assert p.metric_sum("kqp_memory_held_bytes") == 0


def test_huge_frames_really_sent_are_held_to_the_memory_budget(tansu, proxy):
    budget, per_connection, n = 8 * MiB, 4 * MiB, 16
    p = proxy(tansu.bootstrap, extra_config=_config(queued_max_request_bytes=budget, partial_request_timeout_ms=4000))
    _bystander_ok(p)
    rss_before = hostile.settled_rss(p.pid)
    opened: dict = {}
    attackers = hostile.connect_many(p.address, n, HUGE_SIZE_PREFIX, opened_at=opened)
    try:
        sent = hostile.push(attackers, per_connection, timeout_s=1.0)
        metrics = p.metrics()
        held = sum_samples(metrics, "kqp_memory_held_bytes")
        paused = sum_samples(metrics, "kqp_memory_paused_connections")
        grown = hostile.rss_bytes(p.pid) - rss_before
        _bystander_ok(p)  # whole requests in one chunk hold nothing: served while the budget is spent
        # Only the reader's clock runs (time paused for memory does not count): it stalls, is
        # closed as unfinished, and the next nearest reads in its place; the others wait.
        seen = hostile.watch_eof(attackers, 2 * 4.0 + 2.5, opened_at=opened)
        after = p.metrics()
    finally:
        hostile.close_all(attackers)
    # The attackers pushed several times the budget; the proxy read about the budget, plus what
    # the one connection still read (the one nearest to finishing its frame) had been sent.
    assert sum(sent.values()) >= 4 * budget, f"the attack pushed only {sum(sent.values()) / MiB:.1f} MiB"
    assert budget < held <= budget + per_connection + MiB, f"held {held / MiB:.2f} MiB, budget {budget / MiB} MiB"
    assert paused == n - 1, "every holder but the one nearest to finishing its frame waits"
    assert grown <= budget + per_connection + 8 * MiB, f"RSS grew {grown / MiB:.1f} MiB"
    lived = sorted(w.lived_s for w in seen.values() if w.eof_at is not None)
    assert 1 <= len(lived) <= 3 and 4.0 - 0.05 <= lived[0], lived  # one reader at a time, each timed
    assert sum_samples(after, "kqp_connections_closed_total", reason="partial_request") == len(lived)
    assert sum_samples(after, "kqp_memory_paused_connections") == n - 1 - len(lived)
    assert sum_samples(after, "kqp_memory_held_bytes") <= budget + 2 * per_connection + MiB
    # The attackers leave: every byte they held is free, nobody waits.
    assert _wait_for_metric(p, "kqp_open_connections", 0) == 0
    assert p.metric_sum("kqp_memory_held_bytes") == 0
    assert p.metric_sum("kqp_memory_paused_connections") == 0


def test_a_client_whose_request_waits_behind_the_memory_budget_is_served_not_cut(tansu, proxy):
    """A whole request that the proxy does not read because the budget is spent is not timed out
    for the proxy's delay: once the attackers' frames go (closed one by one as each stalls), it
    is read and answered."""
    budget, per_connection, n = 1 * MiB, 1 * MiB, 3
    p = proxy(tansu.bootstrap, extra_config=_config(queued_max_request_bytes=budget, partial_request_timeout_ms=1500))
    opened: dict = {}
    attackers = hostile.connect_many(p.address, n, HUGE_SIZE_PREFIX, opened_at=opened)
    try:
        hostile.push(attackers, per_connection, timeout_s=1.0)
        # The proxy reads what was pushed: past the budget, all but one attacker wait.
        assert _wait_for_metric(p, "kqp_memory_paused_connections", n - 1) == n - 1
        with socket.create_connection(p.address, timeout=30) as legit:
            # A 3 MiB request in flight: past the budget, so it waits its turn.
            legit.sendall(_big_produce_request(3 * MiB))
            legit.settimeout(30)
            frame = read_frame(legit)
        assert frame is not None and struct.unpack_from(">i", frame)[0] == 42
    finally:
        hostile.close_all(attackers)
    assert sum_samples(p.metrics(), "kqp_connections_closed_total", reason="partial_request") <= n


def _big_produce_request(size: int) -> bytes:
    """A Produce v8 request (acks=1, correlation id 42) of one record of ``size`` bytes to a
    topic the broker need not know: whatever the broker answers, it answers."""
    from kafka.protocol.producer import ProduceRequest
    from kafka.record.memory_records import MemoryRecordsBuilder

    builder = MemoryRecordsBuilder(magic=2, compression_type=0, batch_size=size + 1024)
    builder.append(timestamp=None, key=None, value=b"v" * size, headers=[])
    builder.close()
    T = ProduceRequest[8].TopicProduceData
    request = ProduceRequest[8](transactional_id=None, acks=1, timeout_ms=30_000, topic_data=[
        T(name="hostile-big", partition_data=[T.PartitionProduceData(index=0, records=bytes(builder.buffer()))])])
    return request_bytes(request, 42, "legit")


# -- time ---------------------------------------------------------------------------------


def test_slowloris_and_silent_connections_are_closed_and_cost_the_brokers_nothing(relay_tansu, proxy):
    n = 300  # of each kind
    hostile.raise_open_files_limit(4 * n + 256)
    partial_s, idle_s = 1.0, 2.0
    p = proxy(relay_tansu.bootstrap, extra_config=_config(
        partial_request_timeout_ms=int(partial_s * 1000), connections_max_idle_ms=int(idle_s * 1000)))
    relay = relay_tansu.relay
    relayed_before = len(relay.connections)  # the proxy's own metadata refresh at start
    opened: dict = {}
    slowloris = hostile.connect_many(p.address, n, HUGE_SIZE_PREFIX[:3], opened_at=opened)
    silent = hostile.connect_many(p.address, n, opened_at=opened)
    try:
        assert _wait_for_metric(p, "kqp_open_connections", 2 * n) == 2 * n
        assert hostile.sockets_to_port(p.pid, relay.port) == 0
        _bystander_ok(p)
        seen = hostile.watch_eof(slowloris + silent, idle_s + WATCH_S, opened_at=opened)
    finally:
        hostile.close_all(slowloris + silent)
    slow_lived = sorted(seen[s].lived_s for s in slowloris if seen[s].eof_at is not None)
    silent_lived = sorted(seen[s].lived_s for s in silent if seen[s].eof_at is not None)
    assert len(slow_lived) == n and len(silent_lived) == n, (len(slow_lived), len(silent_lived))
    assert partial_s - 0.05 <= slow_lived[0], slow_lived[::30]
    assert idle_s - 0.05 <= silent_lived[0], silent_lived[::30]
    print(f"\nclosed after {slow_lived[0]:.2f}-{slow_lived[-1]:.2f} s (partial, {partial_s} s), "
          f"{silent_lived[0]:.2f}-{silent_lived[-1]:.2f} s (idle, {idle_s} s)")
    assert not any(w.received for w in seen.values())
    assert _closed(p, "partial_request") == n
    assert _closed(p, "idle") == n
    # The broker saw one connection for all of this: the bystander's.
    assert len(relay.connections) == relayed_before + 1
    # Each reason logged, at most 10 lines per 10 s window, a window starting at its first line
    # (never before the first connection's timeout) and its last line before the last EOF seen.
    for fragment, group, timeout_s in (("): partial request", slowloris, partial_s), ("): idle", silent, idle_s)):
        first_possible = min(opened[s] for s in group) + timeout_s - 0.05
        windows = int((max(seen[s].eof_at for s in group) - first_possible) // 10) + 1
        lines = _log_lines(p, fragment)
        assert 1 <= len(lines) <= 10 * windows, (fragment, len(lines), windows)
    assert _wait_for_metric(p, "kqp_open_connections", 0) == 0


SLOW_CORRELATION_ID = 7777


def _unknown_api_request(correlation_id: int) -> bytes:
    body = struct.pack(">hhih", 999, 0, correlation_id, 2) + b"id"
    return struct.pack(">i", len(body)) + body


def _slow_for_one(frame: bytes) -> bytes:
    """RawBroker script: the request with SLOW_CORRELATION_ID is answered after 2.5 s."""
    if frame[4:8] == struct.pack(">i", SLOW_CORRELATION_ID):
        time.sleep(2.5)
    return echo_correlation(frame)


def _keep_alive(address, period_s: float, for_s: float) -> tuple[int, bool, float | None]:
    """A request every ``period_s`` for ``for_s``, then silence: (requests answered, whether
    the connection was closed before the last, seconds from sending the last request to EOF:
    the proxy's idle clock starts at the earliest when that request came)."""
    with socket.create_connection(address, timeout=5) as s:
        answered, end = 0, time.monotonic() + for_s
        while True:
            sent = time.monotonic()
            s.sendall(_unknown_api_request(answered + 1))
            if read_frame(s) is None:
                return answered, True, None
            answered += 1
            if time.monotonic() + period_s >= end:
                break
            time.sleep(period_s)
        return answered, False, (time.monotonic() - sent) if is_closed(s, timeout_s=WATCH_S) else None


def _slow_response(address) -> tuple[float | None, float | None]:
    """One request the broker answers after 2.5 s: (seconds to the answer, None: closed
    first; seconds from sending the request to EOF)."""
    with socket.create_connection(address, timeout=5) as s:
        start = time.monotonic()
        s.sendall(_unknown_api_request(SLOW_CORRELATION_ID))
        frame = read_frame(s)
        if frame is None:
            return None, None
        answered = time.monotonic()
        return answered - start, (time.monotonic() - start) if is_closed(s, timeout_s=WATCH_S) else None


def _drip(address, size: int, period_s: float, for_s: float) -> tuple[int, float, float | None]:
    """Announces a ``size``-byte frame, then sends one byte of it every ``period_s``: (bytes of
    it sent, the longest time between two sends, the prefix counting as one, seconds from
    sending the prefix to EOF or None)."""
    with socket.create_connection(address, timeout=5) as s:
        start = last = time.monotonic()
        s.sendall(struct.pack(">i", size))
        dripped, longest_gap_s = 0, 0.0
        s.settimeout(period_s)
        while time.monotonic() - start < for_s and dripped < size - 1:
            try:
                if s.recv(1) == b"":
                    return dripped, longest_gap_s, time.monotonic() - start
            except TimeoutError:
                pass
            except ConnectionResetError:
                return dripped, longest_gap_s, time.monotonic() - start
            now = time.monotonic()
            try:
                s.sendall(b"\x00")
            except OSError:
                return dripped, longest_gap_s, now - start
            longest_gap_s, last = max(longest_gap_s, now - last), now
            dripped += 1
        return dripped, longest_gap_s, None


def test_idle_and_unfinished_connections_are_closed_busy_ones_are_not(proxy):
    # A scripted broker: it can hold one answer back (Tansu has no cheap way to be slow).
    with RawBroker(_slow_for_one) as broker:
        p = proxy(broker.bootstrap, extra_config=_config(partial_request_timeout_ms=1000, connections_max_idle_ms=1000))
        opened: dict = {}
        silent = hostile.connect_many(p.address, 1, opened_at=opened)
        try:
            with ThreadPoolExecutor(3) as pool:
                keep_alive = pool.submit(_keep_alive, p.address, 0.3, 3.0)
                slow = pool.submit(_slow_response, p.address)
                drip = pool.submit(_drip, p.address, 100, 0.3, 1.0 + WATCH_S)
                (silent_seen,) = hostile.watch_eof(silent, 1.0 + WATCH_S, opened_at=opened).values()
                answered, closed_early, keep_alive_eof_s = keep_alive.result(timeout=30)
                slow_answer_s, slow_eof_s = slow.result(timeout=30)
                dripped, drip_gap_s, drip_eof_s = drip.result(timeout=30)
        finally:
            hostile.close_all(silent)
    assert silent_seen.eof_at is not None and 0.95 <= silent_seen.lived_s, silent_seen.lived_s
    # A request every 300 ms for 3 s: never idle for 1 s, so never closed; idle after the last.
    assert not closed_early and answered >= 8, answered
    assert keep_alive_eof_s is not None and 0.95 <= keep_alive_eof_s, keep_alive_eof_s
    # Waiting 2.5 s for the broker is not idling; the connection is idle once it is answered (the
    # broker answers 2.5 s after the request came, then 1 s idle), not at once.
    assert slow_answer_s is not None, "closed while waiting for a response"
    assert slow_answer_s >= 2.4
    # The sweep (every 250 ms here) restarts the idle clock when it finds a response awaited, so the
    # clock may start up to one sweep before the answer: idle 1 s, less a sweep, after the answer.
    assert slow_eof_s is not None and 1.0 - 0.25 - 0.05 <= slow_eof_s - slow_answer_s, (slow_answer_s, slow_eof_s)
    # A byte every 300 ms (never 1 s without one: never idle) past the 1 s idle timeout, but the
    # frame stays unfinished.
    assert drip_eof_s is not None and 0.95 <= drip_eof_s and dripped >= 1, (dripped, drip_eof_s)
    assert drip_gap_s < 1.0 <= drip_eof_s + 0.05, (drip_gap_s, drip_eof_s)
    assert _closed(p, "idle") == 3
    assert _closed(p, "partial_request") == 1


# -- connection counts and rates ----------------------------------------------------------


def test_connections_per_ip_are_limited_with_overrides(tansu, proxy):
    p = proxy(tansu.bootstrap, extra_config=_config(
        max_connections_per_ip=5, max_connections_per_ip_overrides={"127.0.0.1": 2}))
    # The default, for an IP without an override (all of 127/8 is loopback on Linux).
    default_ip = [_served(p.address, "127.0.0.2") for _ in range(5)]
    overridden = [_served(p.address, "127.0.0.1") for _ in range(2)]
    try:
        _assert_refused_at_once(p.address, "127.0.0.2")
        assert _closed(p, "max_connections_per_ip") == 1
        _assert_refused_at_once(p.address, "127.0.0.1")
        assert _closed(p, "max_connections_per_ip") == 2
        # The refused connections never reached the broker: one broker connection per served one.
        assert hostile.sockets_to_port(p.pid, tansu.port) == 7
        # A slot freed is a slot to use.
        overridden.pop().close()
        default_ip.pop().close()
        assert _wait_for_metric(p, "kqp_open_connections", 5) == 5
        overridden.append(_served(p.address, "127.0.0.1"))
        default_ip.append(_served(p.address, "127.0.0.2"))
        _assert_refused_at_once(p.address, "127.0.0.1")
        assert _closed(p, "max_connections_per_ip") == 3
    finally:
        hostile.close_all(default_ip + overridden)
    assert len(_log_lines(p, "max_connections_per_ip reached")) == 3


def test_connection_creation_rate_per_ip_closes_after_the_throttle(tansu, proxy):
    rate, n = 5, 50
    p = proxy(tansu.bootstrap, extra_config={
        **_config(connection_creation_rate=rate),
        "quota_windows": {"quota_window_num": 2, "quota_window_size_seconds": 1},
    })
    opened: dict = {}
    socks = hostile.connect_many(p.address, n, request_bytes(ApiVersionsRequest[0](), 3), opened_at=opened)
    try:
        burst_s = max(opened.values()) - min(opened.values())
        seen = hostile.watch_eof(socks, 2.5, opened_at=opened)
        # Neither answered nor closed yet (a busy machine): watched until closed, or for WATCH_S.
        pending = [s for s in socks if seen[s].eof_at is None and not seen[s].received]
        if pending:
            seen.update(hostile.watch_eof(pending, WATCH_S, opened_at=opened))
        served = [s for s in socks if seen[s].eof_at is None and seen[s].received]
        refused = [s for s in socks if seen[s].eof_at is not None]
        broker_connections = hostile.sockets_to_port(p.pid, tansu.port)
    finally:
        hostile.close_all(socks)
    assert len(served) + len(refused) == n
    # Kafka's Rate over 2 × 1 s windows admits `rate` at once, then `rate` per second.
    assert rate <= len(served) <= rate + rate * burst_s + 1, (len(served), burst_s)
    assert broker_connections == len(served)
    first = min(opened.values())
    for s in refused:
        w = seen[s]
        assert not w.received
        # Closed after the throttle, not at once: (6 − 5) / 5 × the 1 s window, less the time
        # since the window's first connection; capped at one window.
        throttle_s = 0.2 - (opened[s] - first)
        assert w.lived_s >= throttle_s - 0.01, (w.lived_s, throttle_s)
    longest_throttle_s = max(0.2 - (opened[s] - first) for s in refused)
    assert max(seen[s].lived_s for s in refused) >= min(0.1, longest_throttle_s - 0.01), \
        "refused connections were closed at once"
    assert _closed(p, "connection_creation_rate") == len(refused)
    assert 1 <= len(_log_lines(p, "connection_creation_rate reached")) <= 10


def test_max_connections_closes_the_one_over_at_once(tansu, proxy):
    p = proxy(tansu.bootstrap, extra_config=_config(max_connections=10))
    held = [_served(p.address) for _ in range(10)]
    try:
        _assert_refused_at_once(p.address)
        assert _closed(p, "max_connections") == 1
        held.pop().close()
        assert _wait_for_metric(p, "kqp_open_connections", 9) == 9
        held.append(_served(p.address))
        _assert_refused_at_once(p.address)
        assert _closed(p, "max_connections") == 2
    finally:
        hostile.close_all(held)
