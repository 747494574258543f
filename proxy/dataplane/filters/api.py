"""The filter API: what a filter declares, what it is given, and the decisions it returns.

A filter is an object with a :class:`FilterSpec` (its ``spec`` attribute, read whenever the
chain is rebuilt: at start and on every reload) and the methods of the roles that spec declares:

- request role (``spec.request_keys``): ``on_request(ctx, header, frame, entry)`` returns
  ``None`` (pass on to the next filter, then forward), :class:`Forward`, :class:`Answer`,
  :class:`Close` or :class:`Defer`;
- response role (``spec.response_keys``): ``on_response(ctx, entry, frame)`` returns the frame
  to pass on (the same object when it changed nothing), :class:`Forward` (a frame and a
  throttle) or :class:`Hold`;
- chunk role (``spec.chunk``): ``on_response_chunk(ctx, entry, chunk)`` does what
  ``on_response`` does, on a chunk that is exactly one response with its size prefix, and
  returns the chunk to send, or ``None`` to have ``on_response`` run instead; used when every
  response filter of its API has this role (each on what the one before returned; when one
  declines, every filter's ``on_response`` runs, so a chunk run may note on the entry what
  ``on_response`` would, and change nothing else), except a Fetch that streams;
- stream role (``spec.stream``, Fetch only): ``on_stream_head(ctx, entry, head)`` says whether
  the filter leaves a response with this head (a :class:`protocol.scan.FetchHead`) unchanged,
  and ``on_stream_tail(ctx, entry, node_endpoints)`` whether it leaves its tail unchanged. When
  every response filter of Fetch has this role, a response longer than its first chunk goes
  back as it arrives and only its tail (tagged fields) is held back for them.

Frames never include the 4-byte size prefix; only the chunk role sees and returns whole chunks.
What a filter wants back with a request's response it notes under a key of its own
(:class:`proxy.dataplane.inflight.NoteKey`); a quota it applies goes through
``proxy.dataplane.filters.shadow`` (shadow mode). Filters of the operator's own are named under
``filters:`` in the configuration and built by ``proxy.dataplane.filters.plugins``.
A filter never touches a socket: the connection carries out its decisions. A decision other
than these, or a response filter's ``None``, closes that one connection with a log line and a
counter (``filter_error``), never a hang. A body a filter cannot read ends as a
:class:`protocol.errors.ProtocolError` (the connection closes, with one line and a counter); a
line a client can trigger at will goes through a :class:`proxy.observability.logs.LogLimiter`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeGuard

from protocol.headers import RequestHeader

if TYPE_CHECKING:
    from protocol.scan import FetchHead
    from proxy.cluster.brokers import Cluster
    from proxy.cluster.leaders import LeaderCache
    from proxy.cluster.topics import TopicCache
    from proxy.dataplane.inflight import InFlight
    from proxy.identity.principal import Session
    from proxy.observability.stats import ProxyStats

Frame = bytes | bytearray | memoryview

_NO_VERSIONS: Mapping[int, int] = {}


@dataclass(frozen=True, slots=True)
class FilterSpec:
    """What a filter looks at, declared once per configuration (the chain reads it at start and
    after every reload, never per request).

    ``request_keys``: the APIs whose requests it sees (``None``: every API). ``response_keys``:
    the APIs whose responses it sees. ``request_since`` / ``response_since``: {api key: first
    version}, a promise to do nothing for lower versions, which then skip the filter (and may
    take the hot path). ``needs_uplift``: it acts only on a connection whose broker asked for a
    KIP-951 uplift (every other connection skips it). ``idle``: nothing to do under the
    configuration in force (no quota, no limiter), so it is left out of the chain. ``chunk`` and
    ``stream``: it has the chunk or the stream role (see the module docstring)."""

    request_keys: frozenset[int] | None = frozenset()
    response_keys: frozenset[int] = frozenset()
    request_since: Mapping[int, int] = field(default_factory=lambda: _NO_VERSIONS)
    response_since: Mapping[int, int] = field(default_factory=lambda: _NO_VERSIONS)
    needs_uplift: bool = False
    idle: bool = False
    chunk: bool = False
    stream: bool = False


# -- decisions ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Forward:
    """Send on. A request filter: the request goes to the broker (``frame`` rewritten, or
    ``None``: as it is), and its response gets ``throttle_ms`` (KIP-219: answered at once with
    throttle_time_ms = the longest throttle any quota asked for, then the connection is muted
    for it) and, with ``on_response``, the filter's own rewrite of that response. A response
    filter: ``frame`` goes on to the next filter, with ``throttle_ms`` for this response."""

    frame: Frame | None = None
    throttle_ms: int = 0
    on_response: Callable[[Frame], Frame] | None = None


@dataclass(frozen=True, slots=True)
class Answer:
    """The proxy answers itself with ``frame`` (a complete response: header and body, its
    throttle_time_ms already ``throttle_ms``); the connection is muted for ``throttle_ms`` after
    it is sent. The request never reaches the broker."""

    frame: Frame
    throttle_ms: int = 0


@dataclass(frozen=True, slots=True)
class Close:
    """Close this client connection (counted as ``filter_close``, logged with ``reason``)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Defer:
    """The decision needs I/O or time first (a topic's partition count, a quota's tokens): the
    connection stops reading, awaits ``decision`` and applies the decision it resolves to,
    keeping request order; later requests wait their turn."""

    decision: Awaitable[RequestDecision]


@dataclass(frozen=True, slots=True)
class Hold:
    """A response filter that must wait first (e.g. for a metadata refresh): ``frame`` resolves
    to what the filter would have returned. The response keeps its place in order."""

    frame: Awaitable[Frame | Forward]


RequestDecision = Forward | Answer | Close | Defer | None
ResponseDecision = Frame | Forward | Hold


class FilterContractError(Exception):
    """A filter broke its contract: a request filter decided something other than a
    RequestDecision, or a response filter returned something other than a ResponseDecision. The
    connection it happened on is closed, with a log line and a counter, rather than left waiting
    for an answer that will never come."""


# -- what a filter is given ---------------------------------------------------------------------


class FilterContext:
    """What a filter may see and do of the client connection it runs for, one per connection:
    who is on the other end (``session``: principal, client id, SASL state), a ``label`` for
    log lines, the listener's ``node_id`` (None: bootstrap), the cluster view (``cluster``:
    brokers and their proxy addresses; ``topics``: partition counts; ``leaders``: the leader
    cache), the proxy's counters (``stats``) and the connection's KIP-951 ``uplift``; and three
    actions: :meth:`mute`, :meth:`set_uplift`, :meth:`start_raw_sasl`."""

    __slots__ = ("session", "label", "node_id", "cluster", "topics", "leaders", "stats", "uplift", "_conn")

    def __init__(self, session: Session, node_id: int | None, cluster: Cluster, topics: TopicCache,
                 leaders: LeaderCache, stats: ProxyStats, conn: ConnectionActions) -> None:
        self.session = session
        self.label = "client"
        self.node_id = node_id
        self.cluster = cluster
        self.topics = topics
        self.leaders = leaders
        self.stats = stats
        # {api key: the broker's highest version} for the APIs a client of this connection may
        # send one version higher (KIP-951), from the broker's ApiVersions answer; None: none.
        self.uplift: dict[int, int] | None = None
        self._conn = conn  # a reference, not three bound methods: one per connection is memory

    def detach(self, stand_in: ConnectionActions) -> None:
        """The connection closed: what a filter asks of it from now on goes to ``stand_in``."""
        self._conn = stand_in

    def mute(self, throttle_ms: int) -> None:
        """Stops reading from the client for ``throttle_ms`` (extends, never shortens, a mute)."""
        self._conn.mute(throttle_ms)

    def set_uplift(self, uplift: dict[int, int] | None) -> None:
        """Records the broker's uplift for this connection (see ``uplift``)."""
        self.uplift = uplift
        self._conn.uplift_changed(uplift)

    def start_raw_sasl(self, mechanism: str | None) -> None:
        """SaslHandshake v0 succeeded: the client's next frames are raw SASL tokens, not requests."""
        self._conn.start_raw_sasl(mechanism)


class ConnectionActions(Protocol):
    """What a FilterContext asks of its connection."""

    def mute(self, throttle_ms: int) -> None: ...

    def uplift_changed(self, uplift: dict[int, int] | None) -> None: ...

    def start_raw_sasl(self, mechanism: str | None) -> None: ...


# -- roles --------------------------------------------------------------------------------------


class Filter(Protocol):
    """A filter: its spec (a class attribute, or a property when it follows the configuration)
    and the methods of the roles it declares (below)."""

    @property
    def spec(self) -> FilterSpec: ...


class RequestFilter(Filter, Protocol):
    def on_request(self, ctx: FilterContext, header: RequestHeader, frame: Frame,
                   entry: InFlight) -> RequestDecision: ...


class ResponseFilter(Filter, Protocol):
    def on_response(self, ctx: FilterContext, entry: InFlight, frame: Frame) -> ResponseDecision: ...


class ChunkFilter(ResponseFilter, Protocol):
    def on_response_chunk(self, ctx: FilterContext, entry: InFlight, chunk: bytes) -> Frame | None: ...


class StreamFilter(ResponseFilter, Protocol):
    def on_stream_head(self, ctx: FilterContext, entry: InFlight, head: FetchHead) -> bool: ...

    def on_stream_tail(self, ctx: FilterContext, entry: InFlight, node_endpoints: int) -> bool: ...


# The methods each role must have: the chain checks a filter against its spec once, when built.
ROLE_METHODS: dict[str, tuple[str, ...]] = {
    "request": ("on_request",),
    "response": ("on_response",),
    "chunk": ("on_response", "on_response_chunk"),
    "stream": ("on_response", "on_stream_head", "on_stream_tail"),
}


def check_roles(f: object, spec: FilterSpec) -> None:
    """Raises TypeError, naming the filter and the method, when ``f`` lacks a method of a role
    its ``spec`` declares."""
    roles = [role for role, declared in (
        ("request", spec.request_keys is None or bool(spec.request_keys)),
        ("response", bool(spec.response_keys)),
        ("chunk", spec.chunk),
        ("stream", spec.stream),
    ) if declared]
    for role in roles:
        for method in ROLE_METHODS[role]:
            if not callable(getattr(f, method, None)):
                raise TypeError(f"{type(f).__name__} declares the {role} role but has no {method}()")


def checked_spec(f: object) -> FilterSpec:
    """``f``'s spec, once ``f`` is found to be a filter: its ``spec`` is a FilterSpec and it has
    the methods of every role that spec declares. Raises TypeError saying what is wrong."""
    spec = getattr(f, "spec", None)
    if not isinstance(spec, FilterSpec):
        raise TypeError(f"{type(f).__name__} has no FilterSpec (its spec attribute is {type(spec).__name__})")
    check_roles(f, spec)
    return spec


def is_request_filter(f: Filter) -> TypeGuard[RequestFilter]:
    """Whether ``f`` can have the request role (an ``on_request`` method)."""
    return callable(getattr(f, "on_request", None))


def is_response_filter(f: Filter) -> TypeGuard[ResponseFilter]:
    """Whether ``f`` can have the response role (an ``on_response`` method)."""
    return callable(getattr(f, "on_response", None))
