"""Decisions, filter interfaces and the per-API chain.

A request filter sees the parsed header, the raw frame and the request's in-flight entry (where
it may note a throttle) and returns ``None`` (pass on to the next filter, then forward), :class:`Forward` with rewritten bytes, :class:`Answer` (the proxy
responds itself) or :class:`Close`. A response filter returns the frame to send on (the same
object when it changed nothing), or :class:`Hold`. Frames here never include the 4-byte size prefix.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

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


class FilterChain:
    """Filters indexed by API key, so an API nobody filters costs one dict miss."""

    def __init__(self, request_filters: Iterable[RequestFilter], response_filters: Iterable[ResponseFilter]):
        self.request: dict[int, tuple[RequestFilter, ...]] = {}
        self.request_all: tuple[RequestFilter, ...] = ()
        self.response: dict[int, tuple[ResponseFilter, ...]] = {}
        for f in request_filters:
            if f.api_keys is None:
                self.request_all += (f,)
                for key in self.request:
                    self.request[key] += (f,)
            else:
                for key in f.api_keys:
                    self.request[key] = self.request.get(key, self.request_all) + (f,)
        for f in response_filters:
            for key in getattr(f, "response_api_keys", f.api_keys):
                self.response[key] = self.response.get(key, ()) + (f,)

    def request_filters(self, api_key: int) -> tuple[RequestFilter, ...]:
        return self.request.get(api_key, self.request_all)
