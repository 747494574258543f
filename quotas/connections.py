"""Connection counts and creation rates per IP and in all, as Kafka's ``ConnectionQuotas``.

Pure: every decision takes ``now_ms``; nothing reads a clock or touches a socket. The proxy asks
:meth:`ConnectionQuotas.admit_at` for every new client connection and calls
:meth:`ConnectionQuotas.release` when an admitted one closes.

What Kafka does, and so this (``ConnectionQuotas.inc``, ``Acceptor.accept``):

* the connection creation rate of all listeners (``max.connection.creation.rate``) over its
  bound delays the acceptor: the connection is accepted later, after the throttle;
* the per-IP ``connection_creation_rate`` quota (KIP-612) over its bound un-records the
  connection and closes it after the throttle (``DelayedCloseSocket``), so a client that
  reconnects at once does not get a faster answer by it;
* ``max.connections.per.ip`` (and its overrides) reached closes the new connection at once
  (``TooManyConnectionsException``). Kafka's acceptor waits for a slot when ``max.connections``
  is reached; a proxy cannot leave a connection in the listen backlog, so it closes it at once.

Rates are Kafka's windowed ``Rate`` over the quota windows; a throttle is capped at one window
(``ConnectionQuotas.maxThrottleTimeMs``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from .rate import WindowedRate

ACCEPT = "accept"
MAX_CONNECTIONS = "max_connections"
MAX_CONNECTIONS_PER_IP = "max_connections_per_ip"
CONNECTION_RATE = "connection_creation_rate"


class Admission(NamedTuple):
    """``verdict`` ACCEPT (serve it after ``delay_ms``) or the limit that refuses it (close it
    after ``delay_ms``)."""

    verdict: str
    delay_ms: int = 0

    @property
    def accepted(self) -> bool:
        return self.verdict == ACCEPT


@dataclass(frozen=True)
class ConnectionLimits:
    """The limits in force (None: no limit); rates in connections per second."""

    max_connections: int | None = None
    max_connections_per_ip: int | None = None
    max_connections_per_ip_overrides: Mapping[str, int] = field(default_factory=dict)
    max_connection_creation_rate: float | None = None
    connection_creation_rate: float | None = None
    connection_creation_rate_overrides: Mapping[str, float] = field(default_factory=dict)
    window_num: int = 11
    window_size_ms: int = 1000


class ConnectionQuotas:
    """Counts open connections per IP and in all, and rates their creation.

    Guarantees: an IP never has more admitted connections open than its limit, nor all IPs
    together more than ``max_connections``; memory grows with the IPs that have connections
    open or a creation rate still in its window, and :meth:`expire_at` forgets the others.
    """

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.open_total = 0
        self.open_per_ip: dict[str, int] = {}
        self._ip_rates: dict[str, WindowedRate] = {}
        self._all_rate = WindowedRate(limits.window_num, limits.window_size_ms)

    def admit_at(self, ip: str, now_ms: int) -> Admission:
        """Whether a new connection from ``ip`` is served; an accepted one is counted open."""
        limits = self.limits
        if limits.max_connections is not None and self.open_total >= limits.max_connections:
            return Admission(MAX_CONNECTIONS)
        max_ms = limits.window_size_ms  # ConnectionQuotas caps a throttle at one quota window
        delay_ms = 0
        if limits.max_connection_creation_rate is not None:
            delay_ms = self._all_rate.record_and_throttle_at(1, limits.max_connection_creation_rate, now_ms, max_ms)
        ip_rate = limits.connection_creation_rate_overrides.get(ip, limits.connection_creation_rate)
        if ip_rate is not None:
            rate = self._ip_rates.get(ip)
            if rate is None:
                rate = self._ip_rates[ip] = WindowedRate(limits.window_num, limits.window_size_ms)
            throttle_ms = rate.record_and_throttle_at(1, ip_rate, now_ms, max_ms)
            if throttle_ms > 0:
                # recordIpConnectionMaybeThrottle: un-record it (here and in all), close it later.
                rate.unrecord_at(1, now_ms)
                if limits.max_connection_creation_rate is not None:
                    self._all_rate.unrecord_at(1, now_ms)
                return Admission(CONNECTION_RATE, throttle_ms)
        count = self.open_per_ip.get(ip, 0)
        max_per_ip = limits.max_connections_per_ip_overrides.get(ip, limits.max_connections_per_ip)
        if max_per_ip is not None and count >= max_per_ip:
            return Admission(MAX_CONNECTIONS_PER_IP)
        self.open_per_ip[ip] = count + 1
        self.open_total += 1
        return Admission(ACCEPT, delay_ms)

    def release(self, ip: str) -> None:
        """An admitted connection from ``ip`` closed."""
        count = self.open_per_ip.get(ip, 0)
        if count <= 1:
            self.open_per_ip.pop(ip, None)
        else:
            self.open_per_ip[ip] = count - 1
        if self.open_total > 0:
            self.open_total -= 1

    def expire_at(self, now_ms: int) -> int:
        """Forgets the creation rates of IPs with nothing left in their window; returns how many."""
        stale = [ip for ip, rate in self._ip_rates.items() if rate.total_at(now_ms) <= 0]
        for ip in stale:
            del self._ip_rates[ip]
        return len(stale)

    @property
    def tracked_ips(self) -> int:
        return len(self._ip_rates.keys() | self.open_per_ip.keys())
