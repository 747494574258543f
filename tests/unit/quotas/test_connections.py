"""ConnectionQuotas: counts per IP and in all, creation rates (KIP-612), on synthetic instants."""

from __future__ import annotations

from quotas.connections import (
    ACCEPT,
    CONNECTION_RATE,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_IP,
    ConnectionLimits,
    ConnectionQuotas,
)


def test_no_limits_accept_everything_at_once():
    q = ConnectionQuotas(ConnectionLimits())
    assert all(q.admit_at("10.0.0.1", t) == (ACCEPT, 0) for t in range(1000))
    assert q.open_total == 1000 and q.open_per_ip == {"10.0.0.1": 1000}


def test_max_connections_per_ip_with_an_override_and_release():
    q = ConnectionQuotas(ConnectionLimits(max_connections_per_ip=2, max_connections_per_ip_overrides={"10.0.0.9": 3}))
    assert [q.admit_at("10.0.0.1", 0).verdict for _ in range(3)] == [ACCEPT, ACCEPT, MAX_CONNECTIONS_PER_IP]
    assert [q.admit_at("10.0.0.9", 0).verdict for _ in range(4)] == [ACCEPT] * 3 + [MAX_CONNECTIONS_PER_IP]
    assert q.admit_at("10.0.0.2", 0).accepted  # another IP is not affected
    q.release("10.0.0.1")
    assert q.admit_at("10.0.0.1", 0).accepted
    assert q.open_per_ip["10.0.0.1"] == 2 and q.open_total == 6


def test_max_connections_counts_every_ip():
    q = ConnectionQuotas(ConnectionLimits(max_connections=3))
    assert [q.admit_at(f"10.0.0.{i}", 0).verdict for i in range(4)] == [ACCEPT] * 3 + [MAX_CONNECTIONS]
    q.release("10.0.0.0")
    assert q.admit_at("10.0.0.3", 0).accepted
    assert q.open_total == 3


def test_ip_creation_rate_closes_after_the_throttle_and_does_not_count_the_refused():
    # 2 connections/s over 2 × 1 s windows: the window is at least 1 s, so 2 are admitted at
    # once and the third would make 3/s.
    q = ConnectionQuotas(ConnectionLimits(connection_creation_rate=2, window_num=2, window_size_ms=1000))
    assert q.admit_at("10.0.0.1", 0).accepted and q.admit_at("10.0.0.1", 0).accepted
    refused = q.admit_at("10.0.0.1", 0)
    assert refused.verdict == CONNECTION_RATE
    # QuotaUtils.throttleTime: (3 - 2) / 2 × 1000 ms, capped at one window.
    assert refused.delay_ms == 500
    assert q.open_per_ip == {"10.0.0.1": 2}
    # Refused connections were un-recorded: hammering does not push the next admission away.
    for _ in range(100):
        assert not q.admit_at("10.0.0.1", 10).accepted
    assert q.admit_at("10.0.0.1", 1500).accepted
    assert q.admit_at("10.0.0.2", 10).accepted  # other IPs have their own rate


def test_ip_creation_rate_override_and_no_quota_for_others():
    q = ConnectionQuotas(ConnectionLimits(connection_creation_rate_overrides={"10.0.0.1": 1}, window_num=2))
    assert q.admit_at("10.0.0.1", 0).accepted
    assert q.admit_at("10.0.0.1", 0).verdict == CONNECTION_RATE
    assert all(q.admit_at("10.0.0.2", 0).accepted for _ in range(50))


def test_creation_rate_of_all_listeners_delays_but_accepts():
    q = ConnectionQuotas(ConnectionLimits(max_connection_creation_rate=2, window_num=2, window_size_ms=1000))
    admissions = [q.admit_at(f"10.0.0.{i}", 0) for i in range(5)]
    assert all(a.accepted for a in admissions)
    assert [a.delay_ms for a in admissions][:2] == [0, 0]
    delays = [a.delay_ms for a in admissions][2:]
    assert delays == sorted(delays) and 0 < delays[0] <= delays[-1] <= 1000  # capped at a window
    assert q.open_total == 5


def test_ip_throttle_un_records_the_connection_in_all_too():
    q = ConnectionQuotas(ConnectionLimits(max_connection_creation_rate=3, connection_creation_rate=1, window_num=2))
    assert q.admit_at("10.0.0.1", 0) == (ACCEPT, 0)
    for _ in range(20):
        assert q.admit_at("10.0.0.1", 0).verdict == CONNECTION_RATE
    # Only the admitted one counts towards the rate of all: two more get in without delay.
    assert q.admit_at("10.0.0.2", 0) == (ACCEPT, 0)
    assert q.admit_at("10.0.0.3", 0) == (ACCEPT, 0)


def test_expire_forgets_ips_whose_window_emptied():
    q = ConnectionQuotas(ConnectionLimits(connection_creation_rate=100, window_num=2, window_size_ms=1000))
    for i in range(1000):
        q.admit_at(f"10.1.{i // 256}.{i % 256}", 0)
        q.release(f"10.1.{i // 256}.{i % 256}")
    assert q.tracked_ips == 1000
    assert q.expire_at(500) == 0
    assert q.expire_at(2000) == 1000 and q.tracked_ips == 0
