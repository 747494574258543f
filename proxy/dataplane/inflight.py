"""The in-flight entry: one request of a client connection, from when it is read until its
response is written to the client. Filters read and note on it (the usage counters, what they
want back with the response, through a :class:`NoteKey` of their own); the connection and the
response queue own its other fields."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

if TYPE_CHECKING:
    from protocol.records import ProduceScan
    from protocol.scan import ResponseScan

Frame = bytes | bytearray | memoryview
_T = TypeVar("_T")


class NoteKey(Generic[_T]):
    """A filter's own note on a request, for when its response comes: a typed key, made once at
    module level (``_CHARGES: NoteKey[Charges] = NoteKey("controller_mutation")``) and used as
    ``_CHARGES.set(entry, charges)`` / ``_CHARGES.get(entry)`` (None: nothing noted). mypy checks
    what is noted and what comes back, and every key is a note of its own (two keys of the same
    name included): no filter reads or overwrites what another one noted.

    A note lives in the entry's instance dict, made only for an entry something is noted on (as
    for any field a filter sets): a request no filter notes on costs nothing more."""

    __slots__ = ("name", "_attr")
    _made = itertools.count()

    def __init__(self, name: str) -> None:
        self.name = name  # for people: the note's owner
        # Not an identifier, so never one of InFlight's own fields; numbered, so never another key's.
        self._attr = f"note:{name}:{next(NoteKey._made)}"

    def set(self, entry: InFlight, value: _T) -> None:
        """Notes ``value`` on ``entry`` (replacing what this key noted there before)."""
        setattr(entry, self._attr, value)

    def get(self, entry: InFlight) -> _T | None:
        """What this key noted on ``entry``; None when nothing was."""
        value: _T | None = getattr(entry, self._attr, None)
        return value

    def __repr__(self) -> str:
        return f"NoteKey({self.name!r})"


class InFlight:
    """A request awaiting its response. ``response`` is set once the bytes to send are known.

    Every request sets the slots. The other fields are class defaults that a filter or the
    connection overrides for its own entry (kept in an instance dict, made only then), so
    forwarding a request costs nine stores rather than twenty-three."""

    __slots__ = (
        "correlation_id", "api_key", "api_version", "received_at", "request_bytes", "response",
        "route", "forwarded_at", "upstream_ms", "__dict__",
    )

    raw = False  # a raw SASL token (SaslHandshake v0): no header, no correlation id
    # The longest throttle the proxy's quotas asked for (the decisions' throttle_ms): the
    # response's throttle_time_ms, and the mute after it is sent (KIP-219).
    throttle_ms = 0
    fetch_session: tuple[int, int] | None = None  # Fetch v7+: (session id, epoch)
    on_response: Callable[[Frame], Frame] | None = None  # a request filter's own rewrite of the response
    # A Produce request's scan, once a filter has needed it (False: unreadable); see
    # proxy.dataplane.filters.records.produce_scan. What a filter notes for itself: a NoteKey.
    produce: ProduceScan | Literal[False] | None = None
    scan: ResponseScan | None = None  # a Produce / Fetch response's scan, for the filters after
    # For the usage log: what a filter counted (records and batches of a Produce request or a
    # Fetch response, None: not counted), the partitions a controller mutation asked for, new
    # producer ids, a quota rejection.
    records: int | None = None
    records_unreadable = False  # a Fetch response whose batches could not be counted
    batches = 0
    mutations = 0
    new_producer_ids = 0
    rejected = False
    # What the quotas in shadow mode would have done to it: their longest throttle, a refusal.
    shadow_throttle_ms = 0
    shadow_rejected = False
    # Its request was given a throttle: the connection's later requests wait until the response
    # is sent and the mute that follows it ends (see proxy.mute.ChannelMute).
    holds = False

    def __init__(self, correlation_id: int, api_key: int, api_version: int, received_at: float,
                 request_bytes: int = 0) -> None:
        self.correlation_id = correlation_id
        self.api_key = api_key
        self.api_version = api_version
        self.received_at = received_at
        self.request_bytes = request_bytes
        self.response: Frame | None = None
        # How the broker's response goes back (proxy.dataplane.routes.plan_route), decided when the
        # request is forwarded; None (ASSEMBLED) until then.
        self.route: Any = None
        # When it went to the broker (0: not sent) and how long the broker took: for the usage
        # log, and the latency the proxy added (kqp_request_upstream_seconds_total).
        self.forwarded_at = 0.0
        self.upstream_ms = 0.0

    def answered(self) -> None:
        """The broker's response arrived: how long the broker took. Called only for a request
        that went to the broker (``forwarded_at`` set)."""
        self.upstream_ms = (time.monotonic() - self.forwarded_at) * 1000

    def throttle(self, throttle_ms: int) -> None:
        """Applies a decision's throttle: the longest one asked for wins."""
        if throttle_ms > self.throttle_ms:
            self.throttle_ms = throttle_ms

    def shadow_throttle(self, throttle_ms: int) -> None:
        """Notes a shadow-mode decision's throttle (counted, never applied): the longest wins."""
        if throttle_ms > self.shadow_throttle_ms:
            self.shadow_throttle_ms = throttle_ms
