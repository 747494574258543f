"""One client connection and the upstream connection it owns.

Guarantees:
- responses reach the client in request order, whether the broker or the proxy produced them;
- a Produce with acks=0 registers nothing and is never answered;
- a frame that cannot be framed or parsed closes this connection only, with a log line;
- while muted, nothing is read from the client, but responses still flow to it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import deque
from functools import lru_cache
from struct import Struct
from struct import error as struct_error
from typing import TYPE_CHECKING

from protocol.apis import FIRST_FLEXIBLE_VERSION, ApiKey, api_name
from protocol.errors import ProtocolError
from protocol.frames import FrameError, FrameReader
from protocol.headers import HeaderError, parse_request_header, response_correlation_id
from protocol.produce import produce_acks
from protocol.throttle import with_throttle

from .filters.base import (
    UNFILTERED,
    UNROUTED,
    Answer,
    Close,
    Defer,
    FilterContractError,
    Forward,
    Hold,
    StreamRoute,
)
from .flow import ReadGate
from .guard import proxy_paused
from .principal import ANONYMOUS, SaslError, principal_from_client_token, scram_exchange_complete
from .stats import SLOT_KEYS, SLOT_VERSIONS

if TYPE_CHECKING:
    from .server import ProxyServer

log = logging.getLogger(__name__)

_INT32 = Struct(">i")
_INT16 = Struct(">h")
_RESPONSE_HEAD = Struct(">ii")  # size, correlation id
_PRODUCE = int(ApiKey.PRODUCE)
_PRODUCE_FIRST_FLEXIBLE = FIRST_FLEXIBLE_VERSION[ApiKey.PRODUCE]
_JOIN_MAX_BYTES = 64 * 1024
_WRITE_HIGH_BYTES = 1 << 20
_WRITE_LOW_BYTES = 1 << 18
_RAW_SASL_ROUND_TRIPS = {"PLAIN": 1, "SCRAM-SHA-256": 2, "SCRAM-SHA-512": 2}


class Session:
    """Who is on the other end of a client connection."""

    __slots__ = ("principal", "client_id", "sasl_mechanism", "claimed_principal", "authenticated")

    def __init__(self) -> None:
        self.principal = ANONYMOUS
        self.client_id: str | None = None
        self.sasl_mechanism: str | None = None
        self.claimed_principal: str | None = None
        self.authenticated = False

    def authenticate(self, principal: str) -> None:
        self.principal = principal
        self.authenticated = True


class InFlight:
    """A request awaiting its response. ``response`` is set once the bytes to send are known.

    Every request sets the slots. The other fields are class defaults that a filter overrides
    for its own entry (kept in an instance dict, made only then), so forwarding a request
    costs nine stores rather than twenty-two."""

    __slots__ = (
        "correlation_id", "api_key", "api_version", "received_at", "request_bytes", "response",
        "route", "forwarded_at", "upstream_ms", "__dict__",
    )

    raw = False  # a raw SASL token (SaslHandshake v0): no header, no correlation id
    throttle_ms = 0  # the longest throttle the proxy's quotas asked for
    fetch_session: tuple[int, int] | None = None  # Fetch v7+: (session id, epoch)
    on_response = None  # a request filter's own rewrite of this request's response
    note = None  # what a request filter wants to remember for the response
    produce = None  # a Produce request's ProduceScan, once a filter has needed it
    scan = None  # a Produce / Fetch response's ResponseScan, for the filters after
    # For the usage log: what a filter counted (records and batches of a Produce request or a
    # Fetch response, None: not counted), the partitions a controller mutation asked for, new
    # producer ids, a quota rejection.
    records: int | None = None
    batches = 0
    mutations = 0
    new_producer_ids = 0
    rejected = False
    # Its request was given a throttle: the connection's later requests wait until the response
    # is sent and the mute that follows it ends (see ClientConnection._hold_for_throttle).
    holds = False

    def __init__(self, correlation_id: int, api_key: int, api_version: int, received_at: float,
                 request_bytes: int = 0) -> None:
        self.correlation_id = correlation_id
        self.api_key = api_key
        self.api_version = api_version
        self.received_at = received_at
        self.request_bytes = request_bytes
        self.response: bytes | bytearray | memoryview | None = None
        # How the broker's response goes back, decided when the request is forwarded (and
        # undone by a reload, see chain_changed): AS_READ (no response filter looks at this
        # version, no request filter rewrote or throttled it), the response's one filter run on
        # the chunk it came in, or None: through the response filters.
        self.route = None
        # For the usage log: when it went to the broker (0: not sent) and how long the broker took.
        self.forwarded_at = 0.0
        self.upstream_ms = 0.0


AS_READ = object()  # InFlight.route: the broker's response goes back as it came
_FRAME_TYPES = (bytes, bytearray, memoryview)  # what a response filter returns (or Hold)
_new_in_flight = object.__new__  # an InFlight without running __init__ (the hot path sets its slots)


@lru_cache(maxsize=256)
def _request_head(client_id_field_bytes: int) -> Struct:
    """Size, api key, api version, correlation id, and a client id field this long (int16
    length and bytes: the request header v1 and v2 both start so)."""
    return Struct(f">ihhi{client_id_field_bytes}s")


def _acks_not_zero(data: bytes, pos: int, version: int) -> bool:
    """Whether a Produce frame (with its size prefix; its first chunk is enough), whose request
    header ends at the client id at ``pos``, has an acks other than 0. False too when it cannot
    tell (header tagged fields, cut short): the general path then reads it, or rejects it."""
    try:
        if version >= _PRODUCE_FIRST_FLEXIBLE:
            if data[pos] != 0:
                return False  # the header has tagged fields
            pos += 1  # no header tagged fields: the body follows
            if data[pos] != 0:  # a transactional id (a compact string; 0: null)
                return produce_acks(data, pos, version) != 0
            pos += 1
        elif version >= 3:
            if data[pos] != 0xFF or data[pos + 1] != 0xFF:  # a transactional id (-1: null)
                return produce_acks(data, pos, version) != 0
            pos += 2
        return data[pos] != 0 or data[pos + 1] != 0  # acks, an int16
    except (IndexError, struct_error, ProtocolError):  # cut short, or a bad varint: the general path rejects it
        return False


def _tune(transport: asyncio.Transport) -> None:
    """Small requests go out at once; a whole large fetch response may sit in the write buffer
    before the other side is paused (the default 64 KiB high-water mark would pause and resume
    the broker side for every large response)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
    transport.set_write_buffer_limits(high=_WRITE_HIGH_BYTES, low=_WRITE_LOW_BYTES)


def _write(transport: asyncio.Transport, buffers) -> None:
    """One write per batch: small batches are joined (one copy, one send), large ones are
    handed over as they are (no copy of a big record set)."""
    if len(buffers) == 1:
        transport.write(buffers[0])
    elif sum(map(len, buffers)) <= _JOIN_MAX_BYTES:
        transport.write(b"".join(buffers))
    else:
        transport.writelines(buffers)


class ClientConnection(asyncio.Protocol):
    __slots__ = (
        "server", "cluster", "stats", "chain", "node_id", "session", "label", "transport",
        "upstream", "_reader", "_pending", "_awaiting_upstream", "_unsent", "_closed",
        "_raw_sasl_frames", "_close_when_drained", "gate", "_connect_task", "_muted_until", "_unmute",
        "_deferred", "_held", "_held_error", "_acks0", "_uplift", "_requests", "_holding", "usage",
        "_client_id_field", "_hot_head", "_through", "_throttle_hold",
        "_ip", "_active", "_idle_since", "_partial_since", "_partial_token", "_pool_bytes",
    )

    def __init__(self, server: ProxyServer, node_id: int | None) -> None:
        self.server = server
        self.cluster = server.cluster
        self.stats = server.stats
        self.chain = server.chain
        self.node_id = node_id  # None: the bootstrap listener
        self.session = Session()
        self.label = "client"
        self.transport: asyncio.Transport | None = None
        self.upstream: UpstreamConnection | None = None
        self._reader = FrameReader(server.config.listen.max_frame_bytes)
        self._pending: deque[InFlight] = deque()  # every answered request, in client order
        self._awaiting_upstream: deque[InFlight] = deque()  # forwarded, in upstream order
        self._unsent: list = []  # frames for upstream before it is connected
        self._closed = False
        self._raw_sasl_frames = 0
        self._close_when_drained = False
        self._muted_until = 0.0
        self._deferred: asyncio.Task | None = None
        self._held: list[bytes] = []  # frames read while a request was deferred or throttled
        self._held_error: FrameError | None = None
        # Kafka's per-connection discipline for throttled work (SocketServer reads one request
        # per connection at a time; ClientQuotaManager keeps a throttled channel muted): once a
        # request is given a throttle, later requests are held, neither charged nor forwarded,
        # until its response is sent (its entry, marked InFlight.holds, leaves _pending) and the
        # mute after it ends.
        self._throttle_hold = False
        self._acks0: deque[int] = deque(maxlen=256)  # correlation ids of recent acks=0 Produces
        self._unmute: asyncio.TimerHandle | None = None
        self.gate: ReadGate | None = None
        self._connect_task: asyncio.Task | None = None
        # KIP-951 uplift: api key -> the version this broker has, for requests the client
        # sends one version higher (set from the broker's ApiVersions answer).
        self._uplift: dict[int, int] | None = None
        self._requests = self.chain.request_without_uplift  # see the uplift property
        self._holding: set[asyncio.Task] = set()  # responses a filter is holding (Hold)
        self.usage = server.usage  # proxy.usage_log.UsageLog, or None when off
        # The session's client_id as it is on the wire (int16 length, -1 for null; the bytes),
        # set by _remember_client_id: a request that repeats it at byte 12 of its frame needs no
        # header parse to know who sent it.
        self._client_id_field: bytes | None = None
        # While the hot path may run (see _arm), the request head that ends with a client id
        # field as long as that one: size, api key, api version, correlation id, client id
        # field; else None.
        self._hot_head: Struct | None = None
        # Bytes of a hot-path request longer than the chunk it started in that are still to
        # come: they go to the broker as they arrive, never assembled into a frame.
        self._through = 0
        # For the connection guard (proxy.guard): the client's IP, whether bytes came since
        # the last sweep and since when none did, the unfinished frame the sweep last saw and
        # since when, the bytes this connection holds in the memory pool.
        self._ip = ""
        self._active = False
        self._idle_since = 0.0
        self._partial_since = 0.0
        self._partial_token = None
        self._pool_bytes = 0

    # -- client side ------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self._ip = peer[0] if peer else ""
        self.label = f"{peer[0]}:{peer[1]}" if peer else "client"
        admission = self.server.guard.admit(self._ip)
        loop = asyncio.get_running_loop()
        if not admission.accepted:
            # Never served: no broker connection, not counted open; an IP over its creation
            # rate is closed after the throttle (ConnectionQuotas, Acceptor's DelayedCloseSocket).
            self._closed = True
            transport.pause_reading()
            if admission.delay_ms:
                loop.call_later(admission.delay_ms / 1000, transport.close)
            else:
                transport.close()
            return
        _tune(transport)
        self.gate = ReadGate(transport, self.stats)
        self.stats.open_connections += 1
        self.server.connections.add(self)
        self._idle_since = time.monotonic()
        if admission.delay_ms:
            # max_connection_creation_rate: accepted later, as Kafka's Acceptor waits.
            self.gate.pause("accept")
            self._unmute = loop.call_later(admission.delay_ms / 1000, self.gate.resume, "accept")
        # The broker connection is opened when the first request is forwarded (_send_upstream):
        # an idle or half-open client costs the brokers nothing.

    def data_received(self, data: bytes) -> None:
        self._active = True
        n = len(data)
        through = self._through
        if through:
            # The rest of a request the hot path started: to the broker as it comes.
            if self._closed:
                return
            if n <= through:
                self.upstream.transport.write(data)
                self.stats.bytes_client_to_upstream += n
                self._through = through - n
                return
            self.upstream.transport.write(data[:through])
            self.stats.bytes_client_to_upstream += through
            self._through = 0
            data = data[through:]  # the next request(s) begin in this chunk
            n = len(data)
        head = self._hot_head  # None unless armed (see _arm)
        if head is not None and n >= head.size and type(data) is bytes:
            # The hot path: one request (whole in this chunk, or starting it and no more), of a
            # known API, from the client id of the last request parsed in full, at a version no
            # filter looks at, and not an acks=0 Produce. The very bytes that came in go
            # upstream first; the bookkeeping follows, and the rest of a longer request goes
            # upstream as it arrives (see _through).
            size, key, version, correlation_id, client_id = head.unpack_from(data)
            known = self._requests.get(key)  # None: an unknown API, counted on the general path
            if (client_id == self._client_id_field and size >= n - 4 and known is not None
                    and 0 <= version < known[0] and version < SLOT_VERSIONS
                    and size <= self._reader.max_frame_bytes
                    and (key != _PRODUCE or _acks_not_zero(data, head.size, version))):
                received_at = time.monotonic()
                self.upstream.transport.write(data)
                self._through = size + 4 - n
                # InFlight(correlation_id, key, version, received_at, size) and _route(entry),
                # without the two calls (a call is a frame of cold cache lines per request).
                entry = _new_in_flight(InFlight)
                entry.correlation_id = correlation_id
                entry.api_key = key
                entry.api_version = version
                entry.received_at = received_at
                entry.request_bytes = size
                entry.response = None
                since, chunk_filter = self.chain.response_route.get(key, UNROUTED)
                entry.route = AS_READ if version < since else chunk_filter
                entry.forwarded_at = received_at if self.usage is not None else 0.0
                entry.upstream_ms = 0.0
                self._pending.append(entry)
                self._awaiting_upstream.append(entry)
                stats = self.stats
                stats.bytes_client_to_upstream += n
                stats.requests.slots[key * SLOT_VERSIONS + version] += 1  # known: key < SLOT_KEYS
                return
        self.stats.bytes_client_to_upstream += n
        bad_frame: FrameError | None = None
        try:
            frames = self._reader.feed(data)
        except FrameError as exc:
            frames, bad_frame = exc.frames, exc
        if self._requests_wait():
            # A deferred request is being decided, or a throttle holds the connection: later
            # frames wait their turn.
            self._held.extend(bytes(f) for f in frames)
            if bad_frame is not None:
                self._held_error = bad_frame
        else:
            self._process(frames, bad_frame)
            self._arm()
        self._account()

    def _requests_wait(self) -> bool:
        """Whether requests read now must wait their turn (held, in order): a deferred decision
        is being made, or a throttle holds the connection."""
        return self._deferred is not None or self._throttle_hold

    def _account(self) -> None:
        """Tells the memory pool what this connection holds: a partial frame, held requests,
        requests waiting for the broker connection."""
        held = self._reader.buffered_bytes
        if self._held:
            held += sum(map(len, self._held))
        if self._unsent:
            held += sum(map(len, self._unsent))
        if held or self._pool_bytes:
            self._pool_bytes = held
            if not self._closed:
                self.server.guard.pool.update(self, held)

    def bytes_to_finish(self) -> int:
        """Bytes still to come of the frame being read (0: none is being read)."""
        return self._reader.missing_bytes

    def deadline_passed(self, now_s: float, idle_s: float, partial_s: float) -> str | None:
        """Whether this connection has been idle (nothing read, nothing awaited) for ``idle_s``
        or has left one frame unfinished for ``partial_s``, not counting time in which the proxy
        itself did not read it: "idle", "partial_request" or None. Called by the guard's sweep."""
        if self._closed:
            return None
        paused_by_proxy = proxy_paused(self.gate.reasons)
        if self._active or self._pending or paused_by_proxy:
            self._active = False
            self._idle_since = now_s
        elif now_s - self._idle_since >= idle_s:
            return "idle"
        if self._reader.idle and not self._through:
            self._partial_token = None
            return None
        # The frame being read: a frame the reader started, or a hot-path request still coming.
        token = (self._reader.frames_started, self._pending[-1] if self._through and self._pending else None)
        if paused_by_proxy or token != self._partial_token:
            self._partial_token = token
            self._partial_since = now_s
        elif now_s - self._partial_since >= partial_s:
            return "partial_request"
        return None

    def close_for(self, reason: str) -> None:
        """Closes this connection for a limit of the guard's (counted and logged by reason)."""
        self._close_counted(reason, reason.replace("_", " "))

    def _arm(self) -> None:
        """Lets the hot path run while nothing else must see a request first: a frame reader
        between frames, no deferred decision, no raw SASL token due, a broker connection up, a
        client id seen, the connection open. Called where one of these may have become true;
        where one becomes false (all but a close happen on the general path), before the next
        chunk is read."""
        up = self.upstream
        field = self._client_id_field
        self._hot_head = _request_head(len(field)) if (
            field is not None and self._reader.idle and not self._requests_wait()
            and not self._raw_sasl_frames and up is not None and up.transport is not None
            and not self._closed
        ) else None

    def _process(self, frames, bad_frame) -> None:
        out: list = []
        for i, frame in enumerate(frames):
            if self._closed:
                return
            if self._requests_wait():
                self._held.extend(bytes(f) for f in frames[i:])
                self._held_error = bad_frame
                break
            if self._raw_sasl_frames:
                self._forward_raw_sasl(frame, out)
                continue
            if not self._guarded(self._on_request, frame, out):
                return
        if out:
            self._send_upstream(out)
        if bad_frame is not None:
            if self._requests_wait():
                self._held_error = bad_frame  # after the held frames, in order
            else:
                self._reject("bad_frame", str(bad_frame), drain=True)

    def _on_request(self, frame, out: list) -> None:
        header = parse_request_header(frame)
        key = header.api_key
        stats = self.stats
        stats.requests.add(key, header.api_version)
        if header.body_offset < 0:
            stats.unknown_api_requests += 1
        if self._client_id_field is None or header.client_id != self.session.client_id:
            self._remember_client_id(header.client_id)
        self.session.client_id = header.client_id
        entry = InFlight(header.correlation_id, key, header.api_version, time.monotonic(), len(frame))
        since, filters = self._requests.get(key, self.chain.request_all)
        if header.api_version >= since:
            self._apply_filters(header, frame, entry, filters, out)
        else:
            self._forward(header, frame, entry, out)

    def _remember_client_id(self, client_id: str | None) -> None:
        """Lets the hot path recognise requests from ``client_id`` without parsing them."""
        if client_id is None:
            self._client_id_field = _INT16.pack(-1)
        else:
            raw = client_id.encode()
            self._client_id_field = _INT16.pack(len(raw)) + raw

    def _request_failed(self, exc: Exception) -> None:
        """A request-side step raised: this connection is closed, with the reason counted."""
        if isinstance(exc, HeaderError):
            self._reject("bad_header", str(exc))
        elif isinstance(exc, FilterContractError):
            self._reject("filter_error", str(exc))
        elif isinstance(exc, ProtocolError):
            self.stats.decode_failures += 1
            self._reject("undecodable", str(exc))
        else:
            log.error("request filter failed on %s; closing it", self.label, exc_info=exc)
            self._reject("filter_error", "filter raised")

    def _guarded(self, call, *args) -> bool:
        """Runs a request-side step; a failure closes this connection only. False if it closed."""
        try:
            call(*args)
        except Exception as exc:
            self._request_failed(exc)
            return False
        return True

    def _apply_filters(self, header, frame, entry: InFlight, filters, out: list) -> None:
        for i, f in enumerate(filters):
            decision = f.on_request(self, header, frame, entry)
            if isinstance(decision, Forward):
                frame = decision.frame
            elif decision is not None:
                self._act(decision, header, frame, entry, filters[i + 1 :])
                return
        self._forward(header, frame, entry, out)

    def _act(self, decision, header, frame, entry: InFlight, rest) -> None:
        """Carries out a decision other than forwarding."""
        if isinstance(decision, Defer):
            self._defer(decision, header, frame, entry, rest)
        elif isinstance(decision, Answer):
            self._pending.append(entry)
            self.stats.local_responses[header.api_key] += 1
            if entry.throttle_ms:
                self._hold_for_throttle(entry)
            self._complete(entry, decision.frame)
        elif isinstance(decision, Close):
            self._reject("filter_close", decision.reason)
        else:
            raise FilterContractError(f"a request filter decided {type(decision).__name__} on "
                                      f"{api_name(header.api_key)} "
                                      f"(expected Forward, Answer, Close, Defer or None)")

    def _forward(self, header, frame, entry: InFlight, out: list) -> None:
        key = header.api_key
        if key == ApiKey.PRODUCE and header.body_offset >= 0 and (
            produce_acks(frame, header.body_offset, header.api_version) == 0
        ):
            # acks=0: the broker sends nothing back, so nothing may wait for or invent a reply;
            # a throttle can only be enforced by muting (KIP-219).
            self._acks0.append(header.correlation_id)
            if entry.throttle_ms:
                self._hold_for_throttle(None)
                self.mute(entry.throttle_ms)
            if self.usage is not None:
                self._count_usage(entry, 0)
        else:
            if entry.throttle_ms:
                self._hold_for_throttle(entry)
            elif entry.on_response is None:
                self._route(entry)
            self._pending.append(entry)
            self._awaiting_upstream.append(entry)
            if self.usage is not None:
                entry.forwarded_at = time.monotonic()
        out.append(_INT32.pack(len(frame)))
        out.append(frame)

    def _defer(self, decision: Defer, header, frame, entry: InFlight, rest) -> None:
        self.gate.pause("deferred")
        self._deferred = asyncio.get_running_loop().create_task(decision.decision)
        frame = bytes(frame)  # the chunk it came in is not ours to keep
        self._deferred.add_done_callback(lambda task: self._resume_deferred(task, header, frame, entry, rest))

    def _resume_deferred(self, task: asyncio.Task, header, frame, entry: InFlight, rest) -> None:
        self._deferred = None
        if self._closed or task.cancelled():
            return
        if task.exception() is not None:
            log.error("deferred filter failed on %s: %r; closing it", self.label, task.exception())
            self._reject("filter_error", "deferred filter raised")
            return
        out: list = []
        decision = task.result()
        if isinstance(decision, Forward):
            frame, decision = decision.frame, None
        if decision is None:
            ok = self._guarded(self._apply_filters, header, frame, entry, rest, out)
        else:
            ok = self._guarded(self._act, decision, header, frame, entry, rest)
        if not ok:
            return
        if out:
            self._send_upstream(out)
        if self._deferred is None:
            self.gate.resume("deferred")
        self._process_held()

    def _process_held(self) -> None:
        """Processes the frames held while a request was deferred or throttled, unless one of
        these holds again (then they stay held)."""
        if self._requests_wait() or self._closed:
            return
        held, self._held = self._held, []
        error, self._held_error = self._held_error, None
        self._process(held, error)
        self._arm()
        self._account()

    def _hold_for_throttle(self, entry: InFlight | None) -> None:
        """``entry``'s request was given a throttle (None: an acks=0 Produce, muted at once):
        from now on the connection's requests are held and it is not read (Kafka's Processor
        does not read a channel with a request in progress, and a throttled one stays muted),
        until the response is sent and the mute after it ends (_end_mute)."""
        if entry is not None:
            entry.holds = True
        self._throttle_hold = True
        self._hot_head = None
        self.gate.pause("throttled")

    def _release_throttle_hold(self) -> None:
        """The mute ended: unless a throttled response is still to be sent, the held requests
        are processed, each charged now (as Kafka charges a request when it reads it)."""
        if not self._throttle_hold or self._closed or any(e.holds for e in self._pending):
            return
        self._throttle_hold = False
        self.gate.resume("throttled")
        self._process_held()

    def _forward_raw_sasl(self, frame, out: list) -> None:
        session = self.session
        if session.claimed_principal is None:
            try:
                session.claimed_principal = principal_from_client_token(session.sasl_mechanism or "", bytes(frame))
            except (SaslError, UnicodeDecodeError) as exc:
                self.server.guard.log("sasl_token", logging.WARNING,
                                      "cannot read principal from raw SASL token on %s: %s",
                                      self.label, exc, logger=log)
        entry = InFlight(-1, ApiKey.SASL_AUTHENTICATE, -1, time.monotonic())
        entry.raw = True
        self._pending.append(entry)
        self._awaiting_upstream.append(entry)
        self._raw_sasl_frames -= 1
        out.append(_INT32.pack(len(frame)))
        out.append(frame)

    def mute(self, throttle_ms: int) -> None:
        """Stops reading from the client for ``throttle_ms`` (extends, never shortens, a mute)."""
        if self._closed or throttle_ms <= 0:
            return
        loop = asyncio.get_running_loop()
        until = loop.time() + throttle_ms / 1000
        if until <= self._muted_until:
            return
        self._muted_until = until
        self.gate.pause("mute")
        if self._unmute is not None:
            self._unmute.cancel()
        self._unmute = loop.call_at(until, self._end_mute)

    def _end_mute(self) -> None:
        self._unmute = None
        self._muted_until = 0.0
        self.gate.resume("mute")
        self._release_throttle_hold()

    def _on_raw_sasl_response(self, frame) -> None:
        # SaslHandshake v0 has no error field for the tokens: a broker that rejects closes.
        session = self.session
        if any(e.raw for e in self._awaiting_upstream) or self._raw_sasl_frames:
            return
        mechanism = session.sasl_mechanism or ""
        if mechanism.startswith("SCRAM-") and not scram_exchange_complete(bytes(frame)):
            return
        if session.claimed_principal is not None:
            session.authenticate(session.claimed_principal)
            log.info("authenticated %s as %s via %s (SaslHandshake v0)", self.label, session.principal, mechanism)

    def start_raw_sasl(self, mechanism: str | None) -> None:
        """SaslHandshake v0 succeeded: the next client frames are raw SASL tokens."""
        rounds = _RAW_SASL_ROUND_TRIPS.get(mechanism or "")
        if rounds is None:
            self._reject("unsupported_sasl", f"SaslHandshake v0 with {mechanism} is not supported")
            return
        self._raw_sasl_frames = rounds
        self._arm()  # the next frames are raw tokens: not for the hot path

    def _route(self, entry: InFlight) -> None:
        """For a request no request filter rewrote or throttled: how its response goes back
        (InFlight.route)."""
        since, chunk_filter = self.chain.response_route.get(entry.api_key, UNROUTED)
        entry.route = AS_READ if entry.api_version < since else chunk_filter

    @property
    def uplift(self) -> dict[int, int] | None:
        """KIP-951 uplift for this connection, from the broker's ApiVersions answer: {api key:
        the broker's highest version} for the APIs a client may send one version higher."""
        return self._uplift

    @uplift.setter
    def uplift(self, uplift: dict[int, int] | None) -> None:
        self._uplift = uplift
        # Without an uplift, the filters that only act on one are not asked about requests.
        self._requests = self.chain.request if uplift else self.chain.request_without_uplift

    def chain_changed(self) -> None:
        """The filters changed (a reload): requests are looked up in the new chain, and
        responses still awaited take the general path, which runs the filters in force when
        they arrive (as Kafka's ClientQuotaManager records a response under the quota in force
        when it is sent). A response already being streamed to the client (see
        UpstreamConnection._stream) is being sent: it goes on as it started."""
        self.uplift = self._uplift
        for entry in self._awaiting_upstream:
            entry.route = None

    def _send_upstream(self, out: list) -> None:
        up = self.upstream
        if up is None or up.transport is None:
            self._unsent.extend(bytes(b) for b in out)  # the chunk's memory is not ours to keep
            if self._connect_task is None and not self._closed:
                # The first request to forward: now the broker connection is opened; the
                # client is not read meanwhile, so what waits for it stays small.
                self.gate.pause("connecting")
                self._connect_task = asyncio.get_running_loop().create_task(self._connect_upstream())
            return
        _write(up.transport, out)

    def pause_writing(self) -> None:  # the client reads slower than the broker answers
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.resume_reading()

    def connection_lost(self, exc) -> None:
        if self._pending and not self._closed:
            self.server.guard.log("client_gone", logging.INFO, "client %s disconnected with %d requests in flight",
                                  self.label, len(self._pending), logger=log)
        self._teardown()

    # -- upstream side ----------------------------------------------------------------------

    async def _connect_upstream(self) -> None:
        cfg = self.server.config.upstream
        loop = asyncio.get_running_loop()
        for attempt in range(cfg.connect_attempts):
            address = self.cluster.upstream_address(self.node_id, attempt)
            try:
                _, protocol = await asyncio.wait_for(
                    loop.create_connection(lambda: UpstreamConnection(self), *address),
                    cfg.connect_timeout_s,
                )
            except (OSError, asyncio.TimeoutError) as exc:
                self.stats.upstream_connect_failures += 1
                self.server.guard.log(
                    "broker_unreachable", logging.WARNING, "cannot reach broker %s:%s for %s (attempt %d/%d): %s",
                    *address, self.label, attempt + 1, cfg.connect_attempts, exc or "timeout", logger=log,
                )
                if self._closed:
                    return
                await asyncio.sleep(min(0.1 * 2**attempt, 2.0))
                continue
            if self._closed:
                protocol.transport.close()
                return
            self.upstream = protocol
            if self._unsent:
                protocol.transport.writelines(self._unsent)
                self._unsent = []
            self.gate.resume("connecting")
            self._arm()
            self._account()
            return
        self.server.guard.log("broker_unreachable_final", logging.ERROR,
                              "giving up on %s: no broker reachable after %d "
                              "attempts", self.label, cfg.connect_attempts, logger=log)
        self._close()

    def on_upstream_frame(self, frame) -> None:
        """A response frame from the broker (UpstreamConnection.data_received sends a chunk that
        is exactly the oldest answer due back itself, when no filter or only a chunk filter
        needs to see it)."""
        awaiting = self._awaiting_upstream
        if self._acks0 and len(frame) >= 4:
            # Kafka never answers acks=0, but some brokers (Tansu 0.6) do: the client expects
            # nothing, so the answer is dropped rather than taken for another request's.
            corr = response_correlation_id(frame)
            if corr in self._acks0 and (not awaiting or awaiting[0].correlation_id != corr):
                self._acks0.remove(corr)
                return
        if not awaiting:
            self._upstream_failed(f"unsolicited response of {len(frame)} bytes")
            return
        entry = awaiting.popleft()
        if entry.forwarded_at:
            entry.upstream_ms = (time.monotonic() - entry.forwarded_at) * 1000
        if entry.raw:
            self._on_raw_sasl_response(frame)
            self._complete(entry, frame)
            return
        corr = response_correlation_id(frame)
        if corr != entry.correlation_id:
            self._upstream_failed(f"correlation id {corr}, expected {entry.correlation_id}")
            return
        if entry.route is AS_READ:
            self._complete(entry, frame)
        else:
            self._respond(entry, frame, self.chain.response.get(entry.api_key, UNFILTERED)[1])

    def _respond(self, entry: InFlight, frame, filters) -> None:
        """Runs the response filters, then completes the entry; a filter may hold it (Hold)."""
        for i, f in enumerate(filters):
            frame = f.on_response(self, entry, frame)
            if not isinstance(frame, _FRAME_TYPES):
                if isinstance(frame, Hold):
                    task = asyncio.get_running_loop().create_task(frame.frame)
                    self._holding.add(task)
                    rest = filters[i + 1 :]
                    task.add_done_callback(lambda t, rest=rest: self._resume_response(t, entry, rest))
                    return
                # A None would leave the answer unknown and every later one waiting behind it.
                raise FilterContractError(f"{type(f).__name__}.on_response returned {type(frame).__name__} for "
                                          f"{api_name(entry.api_key)} (expected a frame or Hold)")
        if entry.on_response is not None:
            frame = entry.on_response(frame)
        if entry.throttle_ms:
            # KIP-219: throttle_time_ms = max(the broker's, every quota the proxy applied).
            frame = with_throttle(entry.api_key, entry.api_version, frame, entry.throttle_ms)
        self._complete(entry, frame)

    def _resume_response(self, task: asyncio.Task, entry: InFlight, rest) -> None:
        self._holding.discard(task)
        if self._closed or task.cancelled():
            return
        try:
            self._respond(entry, task.result(), rest)
        except ProtocolError as exc:
            self._upstream_failed(f"undecodable response: {exc}")  # counts the decode failure
        except FilterContractError as exc:
            self._reject("filter_error", str(exc))
        except Exception:
            log.exception("response filter failed for %s; closing it", self.label)
            self._close()

    def _complete(self, entry: InFlight, frame) -> None:
        """Answers ``entry`` with ``frame`` and sends every answer now due, in request order."""
        entry.response = frame
        self._send_due()

    def _send_due(self) -> None:
        """Sends the answers at the head of the queue that are known, in request order."""
        pending = self._pending
        transport = self.transport
        while pending and pending[0].response is not None:
            done = pending.popleft()
            data = done.response
            done.response = None
            size = len(data)
            if transport is not None and not self._closed:
                _write(transport, (_INT32.pack(size), data))
                if done.throttle_ms:
                    self.mute(done.throttle_ms)  # KIP-219: answer at once, then stop reading
            self._sent(done, size)
        if self._close_when_drained and not pending:
            self._close()

    def _head_written(self, size: int) -> None:
        """The broker side wrote the oldest answer due (``size`` bytes without its size prefix)
        straight to the client: it leaves both queues, is counted, and the answers that waited
        behind it go."""
        self._awaiting_upstream.popleft()
        done = self._pending.popleft()
        self._sent(done, size)
        pending = self._pending
        if self._close_when_drained or (pending and pending[0].response is not None):
            self._send_due()

    def _sent(self, done: InFlight, size: int) -> None:
        """Counts a response of ``size`` bytes (without its size prefix) once it is written:
        after the write, so the client need not wait for the counting."""
        stats = self.stats
        stats.bytes_upstream_to_client += size + 4
        key = done.api_key
        version = done.api_version
        if 0 <= key < SLOT_KEYS and 0 <= version < SLOT_VERSIONS:
            stats.responses.slots[key * SLOT_VERSIONS + version] += 1
            stats.latency.slots[key].observe(time.monotonic() - done.received_at)
        else:  # an API the proxy does not know, or a version past the count slots
            stats.responses.add(key, version)
            stats.latency.histogram(key).observe(time.monotonic() - done.received_at)
        if self.usage is not None and not done.raw:
            self._count_usage(done, size)

    def _count_usage(self, entry: InFlight, response_bytes: int) -> None:
        session = self.session
        self.usage.add(
            session.principal, session.client_id or "", entry.api_key,
            request_bytes=entry.request_bytes, response_bytes=response_bytes, records=entry.records or 0,
            batches=entry.batches, mutations=entry.mutations, new_producer_ids=entry.new_producer_ids,
            throttle_ms=entry.throttle_ms, rejected=entry.rejected, upstream_ms=entry.upstream_ms,
        )

    def _upstream_failed(self, reason: str) -> None:
        # A client can make a broker's answer undecodable (an unknown version), so rate-limited.
        self.server.guard.log("upstream_failed", logging.ERROR, "broker connection for %s failed: %s; closing client",
                              self.label, reason, logger=log)
        self.stats.decode_failures += 1
        self._close()

    def on_upstream_lost(self, exc) -> None:
        if self._closed:
            return
        if self._pending:
            self.server.guard.log(
                "broker_closed", logging.WARNING, "broker closed the connection of %s with %d requests in flight%s",
                self.label, len(self._pending), f": {exc}" if exc else "", logger=log,
            )
        self._close()

    # -- closing ----------------------------------------------------------------------------

    def _reject(self, reason: str, detail: str, drain: bool = False) -> None:
        """Closes this connection for what the client sent; with ``drain``, only after the
        responses owed are sent."""
        self.stats.frames_rejected[reason] += 1
        self._close_counted(reason, detail, drain)

    def _close_counted(self, reason: str, detail: str, drain: bool = False) -> None:
        """Closes this connection, counted in kqp_connections_closed_total{reason} and logged
        (rate-limited per reason)."""
        self.server.guard.closed[reason] += 1
        self.server.guard.log(reason, logging.WARNING, "closing %s (client_id=%s): %s", self.label,
                              self.session.client_id, detail, logger=log)
        if drain and self._pending:
            self._close_when_drained = True
            self.gate.pause("closing")
            return
        self._close()

    def _close(self) -> None:
        if self._closed:
            return
        if self.transport is not None:
            self.transport.close()
        self._teardown()

    def _teardown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._arm()
        self.stats.open_connections -= 1
        self.server.guard.release(self._ip)
        if self._pool_bytes:
            self.server.guard.pool.release(self)
        if self._unmute is not None:
            self._unmute.cancel()
        if self.gate is not None:
            self.gate.release()
        self.server.connections.discard(self)
        if self._connect_task is not None and not self._connect_task.done():
            self._connect_task.cancel()
        if self._deferred is not None:
            self._deferred.cancel()
        for task in self._holding:
            task.cancel()
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.close()
        self._pending.clear()
        self._awaiting_upstream.clear()


class UpstreamConnection(asyncio.Protocol):
    """The broker side of one client connection: frames responses back to it."""

    __slots__ = ("client", "transport", "_reader", "_through", "_streaming_size", "_tail", "_tail_route",
                 "_unheld")

    def __init__(self, client: ClientConnection) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        # Responses are bounded by what the client asked for; the client limit applies too.
        self._reader = FrameReader(2**31 - 1)
        # A response longer than the chunk it started in that goes back as it came is streamed
        # (see _stream): the bytes of it still to come, and its size without the size prefix.
        self._through = 0
        self._streaming_size = 0
        # A streamed response whose filters must see its tail first (a StreamRoute): the tail
        # received so far (None: no such response), its route, and the bytes still to send
        # before the tail starts.
        self._tail: bytearray | None = None
        self._tail_route: StreamRoute | None = None
        self._unheld = 0

    def connection_made(self, transport) -> None:
        self.transport = transport
        _tune(transport)

    def data_received(self, data: bytes) -> None:
        client = self.client
        if self._through:
            data = self._stream(data)
            if data is None:
                return
        awaiting = client._awaiting_upstream
        n = len(data)
        if n >= 8 and awaiting and self._reader.idle and type(data) is bytes:
            size, correlation_id = _RESPONSE_HEAD.unpack_from(data)
            entry = awaiting[0]
            pending = client._pending
            transport = client.transport
            if (correlation_id == entry.correlation_id and pending[0] is entry
                    and transport is not None and not client._closed):
                # The hot paths: the oldest answer due (what _complete would send first).
                try:
                    route = entry.route
                    if size != n - 4:
                        if size > n - 4:
                            # It starts this chunk and goes on past it. If nothing changes it,
                            # or its filters can tell from its head that they will not, it
                            # goes back as it comes (see _stream).
                            if route is AS_READ:
                                self._start_stream(entry, data, size)
                                return
                            if type(route) is StreamRoute:
                                hold_from = route.hold_from(client, entry, data, size)
                                if hold_from is not None:
                                    self._start_stream(entry, data, size, route, hold_from)
                                    return
                        out = None  # several responses, or a long one its filters see whole
                    elif route is AS_READ:
                        # Exactly one response, which nothing changes or whose one filter
                        # rewrites it as a chunk: it goes back at once, the bookkeeping follows.
                        out = data
                    elif route is not None:
                        out = route(client, entry, data)  # a chunk filter; None: the general path
                    else:
                        out = None
                    if out is not None:
                        if entry.forwarded_at:
                            entry.upstream_ms = (time.monotonic() - entry.forwarded_at) * 1000
                        transport.write(out)
                        client._head_written(len(out) - 4)
                        return
                except Exception as exc:  # as the general path: this connection only
                    self._response_failed(exc)
                    return
        try:
            frames = self._reader.feed(data)
        except FrameError as exc:
            client._upstream_failed(str(exc))
            return
        for frame in frames:
            if client._closed:
                return
            try:
                client.on_upstream_frame(frame)
            except Exception as exc:
                self._response_failed(exc)
                return

    def _start_stream(self, entry: InFlight, data: bytes, size: int, route: StreamRoute | None = None,
                      hold_from: int = 0) -> None:
        """Writes the first chunk of a response that goes back as it came and is longer than
        the chunk: the rest follows as it arrives, never assembled into a frame. Its entry
        stays at the head of the queues until its last byte is written, so nothing is written
        in between (an answer the proxy made itself waits behind it, see _send_due). With a
        ``route``, the bytes from ``hold_from`` on (the response's tail) are held back until
        its filters have seen them."""
        if entry.forwarded_at:
            entry.upstream_ms = (time.monotonic() - entry.forwarded_at) * 1000
        n = len(data)
        self.client.stats.responses_streamed[entry.api_key] += 1
        if route is None:
            self.client.transport.write(data)
        else:
            self._tail_route = route
            self._tail = bytearray(data[hold_from:])  # empty when the tail starts in a later chunk
            self._unheld = max(hold_from - n, 0)
            self.client.transport.write(data[:hold_from])  # the very chunk when it all goes
        self._through = size + 4 - n
        self._streaming_size = size

    def _stream(self, data: bytes) -> bytes | None:
        """Writes the part of ``data`` that belongs to the response being streamed. Returns
        what follows it (the next responses), or None when nothing does."""
        client = self.client
        through = self._through
        n = len(data)
        if client._closed:
            return None  # and whatever follows: nothing from this broker is read as a frame
        if type(data) is not bytes:
            data = bytes(data)  # a chunk that is not ours to keep
        try:
            self._through = max(through - n, 0)
            part = data if n <= through else data[:through]
            if self._tail is not None:
                self._stream_held(part, n >= through)
            else:
                client.transport.write(part)
                if n >= through:
                    client._head_written(self._streaming_size)  # its last byte is out
        except Exception as exc:  # as the general path: this connection only
            self._through = 0
            self._tail = self._tail_route = None
            self._response_failed(exc)
            return None
        return data[through:] if n > through and not client._closed else None

    def _stream_held(self, part: bytes, last: bool) -> None:
        """The next ``part`` of a streamed response whose tail is held back (see
        _start_stream); ``last``: it ends the response. The tail goes once every filter
        accepts it unchanged; otherwise the client's connection is closed (the response's size
        went first, so it cannot be changed), with a log line."""
        client = self.client
        unheld = self._unheld
        if unheld >= len(part) and not last:
            client.transport.write(part)
            self._unheld = unheld - len(part)
            return
        self._unheld = 0
        self._tail += part[unheld:] if unheld else part
        if not last:
            if unheld:
                client.transport.write(part[:unheld])
            return
        tail = bytes(self._tail)
        route = self._tail_route
        self._tail = self._tail_route = None
        entry = client._pending[0]
        if not route.tail_unchanged(client, entry, tail):
            log.error("%s v%d response to %s: a filter would change its end after it began streaming "
                      "(NodeEndpoints without a moved partition); closing the connection, the client asks again",
                      api_name(entry.api_key), entry.api_version, client.label)
            client._close()
            return
        client.transport.write(part[:unheld] + tail if unheld else tail)
        client._head_written(self._streaming_size)  # its last byte is out

    def _response_failed(self, exc: Exception) -> None:
        """A response filter or a write to the client raised: the client's connection is
        closed, with the reason counted."""
        client = self.client
        if isinstance(exc, ProtocolError):
            client._upstream_failed(f"undecodable response: {exc}")  # counts the decode failure
        elif isinstance(exc, FilterContractError):
            client._reject("filter_error", str(exc))
        else:
            log.error("response filter failed for %s; closing it", client.label, exc_info=exc)
            client._close()

    def pause_writing(self) -> None:  # the broker reads slower than the client sends
        self.client.gate.pause("backpressure")

    def resume_writing(self) -> None:
        self.client.gate.resume("backpressure")

    def connection_lost(self, exc) -> None:
        self.client.on_upstream_lost(exc)
