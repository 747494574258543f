"""How a broker's response travels back to the client: the one route planner.

A route is decided once per forwarded request, by :func:`plan_route`, and kept on its in-flight
entry (``InFlight.route``):

- ``AS_READ``: the response goes back as it came, written from the very chunk it arrived in,
  or streamed as it arrives when it is longer than that chunk;
- a chunk route (its API's only response filter's ``on_response_chunk``, or a
  :class:`ChunkChain` of them all when every one has the chunk role): run on the chunk the
  response came in when that chunk is exactly the response, else the response is assembled;
- a :class:`StreamRoute` (Fetch whose every response filter has the stream role): streamed, its
  tail held back until the filters accept it unchanged; a response that is one whole chunk is
  assembled;
- ``ASSEMBLED`` (None): framed and run through the response filters (``on_response``), the
  request filter's own rewrite and the throttle, then sent in request order.

The invariant, relied on by every fast route (the three above ASSEMBLED), which never runs
``on_response``, never rewrites throttle_time_ms and never mutes: **a fast route never carries a
throttle, a mute or a response filter that must see the response whole.** :func:`plan_route`
returns ASSEMBLED for any entry with a throttle or a request filter's rewrite of its response,
and a fast route only for the versions its API's response filters declared they need not see
whole. A reload sends every awaited response the ASSEMBLED way (see
``ClientConnection.chain_changed``), so a route never outlives the filters it was planned for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from protocol.apis import ApiKey
from protocol.frames import Buffer
from protocol.headers import response_body_offset
from protocol.scan import scan_fetch_head, scan_fetch_tail

if TYPE_CHECKING:
    from proxy.dataplane.filters.api import ChunkFilter, FilterContext, Frame, StreamFilter
    from proxy.dataplane.inflight import InFlight

AS_READ: Any = object()  # the response goes back as it came
ASSEMBLED = None  # framed, through the response filters, the rewrite and the throttle

_NEVER = 2**15  # above any int16 version
UNROUTED = (_NEVER, ASSEMBLED)  # a route table entry: every version goes back as it came

# API key -> the scanners of a response's head and tail, for the APIs whose responses may
# stream through their filters: Fetch, whose responses are the large ones.
STREAM_SCANS: dict[int, tuple[Callable[..., Any], Callable[..., Any]]] = {
    ApiKey.FETCH: (scan_fetch_head, scan_fetch_tail),
}


def plan_route(table: dict[int, tuple[int, Any]], entry: InFlight) -> Any:
    """How ``entry``'s response travels back, decided when its request is forwarded. ``table``
    is the chain's ``response_route`` ({api key: (first version its response filters see, the
    fast route for those versions)}). Here, and only here, the invariant holds: an entry with a
    throttle or with a request filter's own rewrite of its response is ASSEMBLED."""
    if entry.throttle_ms or entry.on_response is not None:
        return ASSEMBLED
    since, route = table.get(entry.api_key, UNROUTED)
    return AS_READ if entry.api_version < since else route


def fast_route(key: int, filters: Sequence[Any], chunk: Sequence[bool], stream: Sequence[bool]) -> Any:
    """The route of a response of ``key`` at or above its filters' first version, by the roles
    they declared (``chunk`` / ``stream``, one flag per filter): a StreamRoute (Fetch, every
    filter streams), its filters' chunk roles (every filter has one), or ASSEMBLED."""
    if key in STREAM_SCANS and filters and all(stream):
        return StreamRoute(tuple(filters), STREAM_SCANS[key])
    if filters and all(chunk):
        return filters[0].on_response_chunk if len(filters) == 1 else ChunkChain(filters)
    return ASSEMBLED


class ChunkChain:
    """The route of a response whose every filter has the chunk role: each filter's
    ``on_response_chunk`` in the chain's order, each on what the one before returned. None as
    soon as one declines: the response is then assembled and every filter's ``on_response``
    runs (a chunk role changes nothing but what it returns, so running both is safe)."""

    __slots__ = ("chunks",)

    def __init__(self, filters: Sequence[ChunkFilter]) -> None:
        self.chunks: tuple[Callable[[FilterContext, InFlight, Any], Frame | None], ...] = tuple(
            f.on_response_chunk for f in filters)

    def __call__(self, ctx: FilterContext, entry: InFlight, chunk: bytes) -> Frame | None:
        out: Frame | None = chunk
        for on_chunk in self.chunks:
            out = on_chunk(ctx, entry, out)
            if out is None:
                return None
        return out


class StreamRoute:
    """The route of a Fetch response whose filters all have the stream role. A response that is
    one whole chunk goes through the filters (``__call__`` gives None, as a chunk filter that
    declines)."""

    __slots__ = ("filters", "scan_head", "scan_tail")

    def __init__(self, filters: tuple[StreamFilter, ...], scans: tuple[Callable[..., Any], Callable[..., Any]]) -> None:
        self.filters = filters
        self.scan_head, self.scan_tail = scans

    def __call__(self, ctx: FilterContext, entry: InFlight, chunk: bytes) -> None:
        return None

    def hold_from(self, ctx: FilterContext, entry: InFlight, chunk: Buffer, size: int) -> int | None:
        """For the first ``chunk`` of a response of ``size`` bytes (size prefix excluded; the
        chunk has it): the offset, counted from the chunk's first byte, where the tail the
        filters must see before it is sent starts; None: the response is assembled instead."""
        frame = memoryview(chunk)[4:]
        offset = response_body_offset(frame, entry.api_key, entry.api_version)
        head = self.scan_head(frame[offset:], entry.api_version)
        if head is None:
            return None
        start = 4 + offset + int(head.tail_offset)
        # The tail holds three tagged-field sections (a byte each at least), inside the frame.
        if start + 3 > size + 4 or not all(f.on_stream_head(ctx, entry, head) for f in self.filters):
            return None
        return start

    def tail_unchanged(self, ctx: FilterContext, entry: InFlight, tail: bytes) -> bool:
        """Whether every filter leaves ``tail`` as it is (raises ScanError if malformed)."""
        endpoints = self.scan_tail(tail)
        # Every filter sees the tail, even after one refused it (it may stop streaming for good).
        return all([f.on_stream_tail(ctx, entry, endpoints) for f in self.filters])
