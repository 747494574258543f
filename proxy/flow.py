"""Pausing a client's reads for any number of reasons at once (backpressure, a throttle mute)."""

from __future__ import annotations

import asyncio


class ReadGate:
    """Reading is paused while at least one reason holds. ``pause``/``resume`` are idempotent."""

    __slots__ = ("_transport", "_stats", "_reasons")

    def __init__(self, transport: asyncio.Transport, stats) -> None:
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
