"""Pausing a client's reads for any number of reasons at once (backpressure, a throttle mute)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.dataplane.inflight import InFlight
    from proxy.observability.stats import ProxyStats


class ReadGate:
    """Reading is paused while at least one reason holds. ``pause``/``resume`` are idempotent."""

    __slots__ = ("_transport", "_stats", "_reasons")

    def __init__(self, transport: asyncio.Transport, stats: ProxyStats) -> None:
        self._transport = transport
        self._stats = stats
        self._reasons: set[str] = set()

    @property
    def paused(self) -> bool:
        return bool(self._reasons)

    @property
    def reasons(self) -> frozenset[str]:
        """Why reading is paused now (empty: it is not)."""
        return frozenset(self._reasons)

    def pause(self, reason: str) -> None:
        if reason in self._reasons:
            return
        if not self._reasons:
            self._transport.pause_reading()
        self._reasons.add(reason)
        if reason == "mute":
            self._stats.muted_connections += 1
            self._stats.mutes_total += 1

    def resume(self, reason: str) -> None:
        if reason not in self._reasons:
            return
        self._reasons.discard(reason)
        if reason == "mute":
            self._stats.muted_connections -= 1
        if not self._reasons and not self._transport.is_closing():
            self._transport.resume_reading()

    def release(self) -> None:
        """Forgets every reason (the connection is closing)."""
        if "mute" in self._reasons:
            self._stats.muted_connections -= 1
        self._reasons.clear()


class ChannelMute:
    """The mute of a throttled client connection and the hold on its requests, after Kafka's
    ``KafkaChannel.ChannelMuteState`` (SocketServer reads one request per connection at a time;
    ``ClientQuotaManager`` keeps a throttled channel muted until its throttle ends).

    :meth:`mute` stops reading for a throttle (extends, never shortens, a mute). :meth:`hold`
    marks that a request was given a throttle: from then on the connection is not read and its
    later requests are held, neither charged nor forwarded, until the connection calls
    :meth:`release` (its throttled responses are sent and the mute after them ended).
    ``on_end`` runs whenever a mute ends."""

    __slots__ = ("_gate", "_until", "timer", "holding", "_on_end")

    def __init__(self, gate: ReadGate, on_end: Callable[[], None]) -> None:
        self._gate = gate
        self._until = 0.0
        self.timer: asyncio.TimerHandle | None = None  # set while muted
        self.holding = False
        self._on_end = on_end

    def mute(self, throttle_ms: int) -> None:
        if throttle_ms <= 0:
            return
        loop = asyncio.get_running_loop()
        until = loop.time() + throttle_ms / 1000
        if until <= self._until:
            return
        self._until = until
        self._gate.pause("mute")
        if self.timer is not None:
            self.timer.cancel()
        self.timer = loop.call_at(until, self.end)

    def end(self) -> None:
        """The mute ended (its timer fired)."""
        self.timer = None
        self._until = 0.0
        self._gate.resume("mute")
        self._on_end()

    def hold(self, entry: InFlight | None) -> None:
        """``entry``'s request was given a throttle (None: an acks=0 Produce, muted at once)."""
        if entry is not None:
            entry.holds = True
        self.holding = True
        self._gate.pause("throttled")

    def release(self) -> None:
        self.holding = False
        self._gate.resume("throttled")

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
