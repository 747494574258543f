"""Decisions, filter interfaces and the per-API chain.

A request filter sees the parsed header, the raw frame and the request's in-flight entry (where
it may note a throttle) and returns ``None`` (pass on to the next filter, then forward),
:class:`Forward` with rewritten bytes, :class:`Answer` (the proxy
responds itself) or :class:`Close`. A response filter returns the frame to send on (the same
object when it changed nothing), or :class:`Hold`. Frames here never include the 4-byte size
prefix; only ``on_response_chunk`` (below) sees and returns whole chunks, prefix included.

A body a filter cannot read ends as a :class:`protocol.errors.ProtocolError` and nothing else
(the connection closes, with one line and a counter); a line a client can trigger at will goes
through a :class:`proxy.logs.LogLimiter`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from protocol.apis import SPECS, ApiKey
from protocol.headers import RequestHeader, response_body_offset
from protocol.scan import scan_fetch_head, scan_fetch_tail

if TYPE_CHECKING:
    from proxy.connection import ClientConnection, InFlight


@dataclass(frozen=True, slots=True)
class Forward:
    frame: bytes


@dataclass(frozen=True, slots=True)
class Answer:
    frame: bytes  # a complete response frame: header + body


@dataclass(frozen=True, slots=True)
class Close:
    reason: str


@dataclass(frozen=True, slots=True)
class Defer:
    """The decision needs I/O first (e.g. a topic's partition count): the connection stops
    reading, awaits ``decision`` and applies it, keeping request order."""

    decision: Awaitable


@dataclass(frozen=True, slots=True)
class Hold:
    """A response filter that must wait first (e.g. for a metadata refresh): ``frame`` resolves
    to the frame to pass on to the next filter. The response keeps its place in order."""

    frame: Awaitable


RequestDecision = Forward | Answer | Close | Defer | None


class FilterContractError(Exception):
    """A filter broke its contract: a request filter decided something other than a
    RequestDecision, or a response filter returned something other than a frame or Hold. The
    connection it happened on is closed, with a log line and a counter, rather than left
    waiting for an answer that will never come."""


class RequestFilter(Protocol):
    api_keys: frozenset[int] | None  # None = every API

    def on_request(
        self, conn: ClientConnection, header: RequestHeader, frame, entry: InFlight
    ) -> RequestDecision: ...


class ResponseFilter(Protocol):
    api_keys: frozenset[int]

    def on_response(self, conn: ClientConnection, entry: InFlight, frame): ...

    # Optional: ``on_response_chunk(conn, entry, chunk)`` does what ``on_response`` does, on a
    # chunk that is exactly one response with its size prefix, and returns the chunk to send,
    # or None to have ``on_response`` run instead. Used when it is the API's only filter.
    #
    # Optional, for the APIs in STREAM_SCANS: ``on_stream_head(conn, entry, head)`` and
    # ``on_stream_tail(conn, entry, node_endpoints)``. When every filter of the API has them,
    # a response longer than its first chunk may go back as it arrives: each filter is asked
    # about its head (e.g. protocol.scan.FetchHead) and returns whether it would leave the
    # response unchanged; if all do, everything before the head's tail offset is sent as it
    # comes, and the tail (tagged fields only) is held back until each filter accepts it
    # unchanged too. A filter that would change the tail must not say yes to the head: the
    # size prefix is already sent.


# API key -> the scanners of a response's head and tail, for the APIs whose responses may
# stream through their filters (see above): Fetch, whose responses are the large ones.
STREAM_SCANS = {ApiKey.FETCH: (scan_fetch_head, scan_fetch_tail)}


class StreamRoute:
    """InFlight.route of a response whose filters all offer the stream hooks above. A response
    that is one whole chunk goes through the filters (``__call__`` gives None)."""

    __slots__ = ("filters", "scan_head", "scan_tail")

    def __init__(self, filters: tuple, scans) -> None:
        self.filters = filters
        self.scan_head, self.scan_tail = scans

    def __call__(self, conn, entry, chunk):
        return None

    def hold_from(self, conn, entry, chunk, size: int) -> int | None:
        """For the first ``chunk`` of a response of ``size`` bytes (size prefix excluded; the
        chunk has it): the offset, counted from the chunk's first byte, where the tail the
        filters must see before it is sent starts; None: the response is assembled instead."""
        frame = memoryview(chunk)[4:]
        offset = response_body_offset(frame, entry.api_key, entry.api_version)
        head = self.scan_head(frame[offset:], entry.api_version)
        if head is None:
            return None
        start = 4 + offset + head.tail_offset
        # The tail holds three tagged-field sections (a byte each at least), inside the frame.
        if start + 3 > size + 4 or not all(f.on_stream_head(conn, entry, head) for f in self.filters):
            return None
        return start

    def tail_unchanged(self, conn, entry, tail: bytes) -> bool:
        """Whether every filter leaves ``tail`` as it is (raises ScanError if malformed)."""
        endpoints = self.scan_tail(tail)
        # Every filter sees the tail, even after one refused it (it may stop streaming for good).
        return all([f.on_stream_tail(conn, entry, endpoints) for f in self.filters])


_NEVER = 2**15  # above any int16 version
UNFILTERED = (_NEVER, ())  # a FilterChain entry: no filter looks at any version
UNROUTED = (_NEVER, None)  # a response_route entry: every version goes back as it came


class FilterChain:
    """Filters indexed by API key, so an API nobody filters costs one dict miss.

    ``request`` and ``response`` map an API key to ``(since, filters)``: a frame whose version
    is below ``since`` skips its filters. ``request`` has an entry for every API the proxy
    knows (``protocol.apis.SPECS``), so a miss there means an unknown API. A filter may declare ``request_since`` /
    ``response_since`` ({api key: first version}): it guarantees to do nothing for lower
    versions, which lets the connection forward them untouched. A filter whose ``idle``
    attribute is true has nothing to do under the configuration in force (no quota, no limiter)
    and is left out until :meth:`refresh` finds it busy: the proxy calls ``refresh`` whenever a
    reload changes what the filters enforce.
    """

    __slots__ = ("_request_filters", "_response_filters", "request", "request_all", "response", "response_route",
                 "request_without_uplift")

    def __init__(self, request_filters: Iterable[RequestFilter], response_filters: Iterable[ResponseFilter]):
        self._request_filters = tuple(request_filters)
        self._response_filters = tuple(response_filters)
        self.request: dict[int, tuple[int, tuple[RequestFilter, ...]]] = {}
        # The same without filters whose ``needs_uplift`` is true (they act only on a connection
        # whose ApiVersions answer asked for an uplift): what every other connection uses.
        self.request_without_uplift: dict[int, tuple[int, tuple[RequestFilter, ...]]] = {}
        self.request_all: tuple[int, tuple[RequestFilter, ...]] = UNFILTERED
        self.response: dict[int, tuple[int, tuple[ResponseFilter, ...]]] = {}
        # API key -> (since, chunk filter) for the APIs with response filters: a response below
        # ``since`` goes back as it came; at or above, through the API's one filter's
        # on_response_chunk if it has exactly one that offers it (else None: the filters).
        self.response_route: dict[int, tuple[int, object]] = {}
        self.refresh()

    def refresh(self) -> None:
        """Rebuilds the per-API entries from the filters that are not idle now."""
        self.request, self.request_all = self._requests(uplift=True)
        self.request_without_uplift, _ = self._requests(uplift=False)
        response: dict[int, list[tuple[int, ResponseFilter]]] = {}
        for f in self._response_filters:
            if getattr(f, "idle", False):
                continue
            since = getattr(f, "response_since", {})
            for key in getattr(f, "response_api_keys", f.api_keys):
                response.setdefault(key, []).append((since.get(key, 0), f))
        self.response = {key: _entry(fs) for key, fs in response.items()}
        self.response_route = {key: (self.response[key][0], _route(key, fs)) for key, fs in response.items()}

    def _requests(self, uplift: bool) -> tuple[dict, tuple]:
        every: list[RequestFilter] = []
        request: dict[int, list[tuple[int, RequestFilter]]] = {key: [] for key in SPECS}
        for f in self._request_filters:
            if getattr(f, "idle", False) or (not uplift and getattr(f, "needs_uplift", False)):
                continue
            if f.api_keys is None:
                every.append(f)
                for key in request:
                    request[key].append((0, f))
            else:
                since = getattr(f, "request_since", {})
                for key in f.api_keys:
                    request.setdefault(key, [(0, g) for g in every]).append((since.get(key, 0), f))
        # Every known API has an entry; request_all is for the others.
        return {key: _entry(fs) for key, fs in request.items()}, ((0, tuple(every)) if every else UNFILTERED)


def _route(key: int, filters: list[tuple[int, object]]):
    """How a response of ``key`` at or above its filters' first version goes back: the chunk
    filter of its only filter, a StreamRoute, or None (assembled, through the filters)."""
    chunk_filter = getattr(filters[0][1], "on_response_chunk", None) if len(filters) == 1 else None
    if chunk_filter is not None:
        return chunk_filter
    if key in STREAM_SCANS and all(hasattr(f, "on_stream_head") and hasattr(f, "on_stream_tail") for _, f in filters):
        return StreamRoute(tuple(f for _, f in filters), STREAM_SCANS[key])
    return None


def _entry(filters: list[tuple[int, object]]) -> tuple[int, tuple]:
    return (min(since for since, _ in filters), tuple(f for _, f in filters)) if filters else UNFILTERED
