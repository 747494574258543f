"""Decisions, filter interfaces and the per-API chain.

A request filter sees the parsed header, the raw frame and the request's in-flight entry (where
it may note a throttle) and returns ``None`` (pass on to the next filter, then forward), :class:`Forward` with rewritten bytes, :class:`Answer` (the proxy
responds itself) or :class:`Close`. A response filter returns the frame to send on (the same
object when it changed nothing), or :class:`Hold`. Frames here never include the 4-byte size
prefix; only ``on_response_chunk`` (below) sees and returns whole chunks, prefix included.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from protocol.apis import SPECS
from protocol.headers import RequestHeader

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
        self.response_route = {
            key: (self.response[key][0], getattr(fs[0][1], "on_response_chunk", None) if len(fs) == 1 else None)
            for key, fs in response.items()
        }

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


def _entry(filters: list[tuple[int, object]]) -> tuple[int, tuple]:
    return (min(since for since, _ in filters), tuple(f for _, f in filters)) if filters else UNFILTERED
