"""One client connection: reading its requests, running the request filters, carrying out
their decisions, and forwarding to the broker connection it owns.

Guarantees:
- every request is answered once, in order (by the broker or by the proxy, see
  proxy.dataplane.response_queue), except a Produce with acks=0, which registers nothing;
- a request is read, charged and decided one at a time in order: while a decision is deferred
  or a throttle holds the connection, later requests wait, neither charged nor forwarded;
- a frame that cannot be framed or parsed, a filter that raises or breaks its contract, closes
  this connection only, with one log line (rate-limited) and a counter;
- while muted or held, nothing is read from the client, but responses still flow to it;
- the hot path (a request no filter looks at) forwards the very bytes that came in and takes
  its route from the one planner (proxy.dataplane.routes.plan_route), as every other request does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from struct import Struct
from typing import cast

from protocol.apis import ApiKey
from protocol.frames import Buffer, FrameError, FrameReader
from protocol.headers import request_head
from protocol.produce import framed_acks_not_zero
from proxy.dataplane.closed import CLOSED
from proxy.dataplane.environment import ConnectionEnv
from proxy.dataplane.filters.api import FilterContext
from proxy.dataplane.flow import ChannelMute, ReadGate
from proxy.dataplane.guard import Deadlines
from proxy.dataplane.inflight import Frame, InFlight
from proxy.dataplane.raw_sasl import RawSasl
from proxy.dataplane.reads import OWN_READS_FROM_BYTES, OwnReads
from proxy.dataplane.requests import RequestSide
from proxy.dataplane.response_queue import ResponseQueue, write
from proxy.dataplane.routes import ASSEMBLED, plan_route
from proxy.dataplane.upstream import UpstreamConnection, open_upstream, response_failed, tune
from proxy.identity.principal import Session
from proxy.identity.tls import EarlyBytes, HandshakeFailure, ServerTls, handshake
from proxy.observability.stats import SLOT_VERSIONS
from quotas.connections import Admission

__all__ = ["ClientConnection", "UpstreamConnection"]

log = logging.getLogger(__name__)

_PRODUCE = int(ApiKey.PRODUCE)


class ClientConnection(OwnReads):
    """The client side of a proxied connection (see the module docstring): its transport, the
    hot path, the broker connection it opens with the first request forwarded (``upstream``),
    the guard's deadlines, and closing. ``ctx`` is what its filters see of it; ``requests``
    decides its requests (proxy.dataplane.requests); ``queue`` sends its answers in order
    (proxy.dataplane.response_queue)."""

    __slots__ = (
        "env", "chain", "stats", "ctx", "queue", "raw_sasl", "requests", "transport", "gate",
        "channel_mute", "upstream", "closed", "_reader", "_unsent", "_connect_task", "_hot_head", "_through",
        "_accept_timer", "_ip", "_active", "deadlines", "_pool_bytes", "_admitted_by", "_reads",
    )

    def __init__(self, env: ConnectionEnv, node_id: int | None) -> None:
        self.env = env
        self.chain = env.chain
        self.stats = env.stats
        self.ctx = FilterContext(Session(), node_id, env.cluster, env.topics, env.leaders, env.stats, self)
        self.queue = ResponseQueue(self.ctx, env.usage, self)
        self.raw_sasl: RawSasl | None = None  # made by the first SaslHandshake v0
        self.requests = RequestSide(self, self.queue, self.chain)
        self.transport: asyncio.Transport | None = None
        self.gate: ReadGate | None = None
        self.channel_mute: ChannelMute | None = None  # made by the first throttle or mute
        self.upstream: UpstreamConnection | None = None
        self.closed = False
        self._reader = FrameReader(env.max_frame_bytes)
        self._reads = env.reads
        self._own, self._short_reads = False, 0  # read by the loop until a long read (OwnReads)
        self._unsent: list[bytes] = []  # frames for the broker before its connection is up
        self._connect_task: asyncio.Task[None] | None = None
        # While the hot path may run (see _arm): the request head that ends with the last client
        # id seen (a request that repeats it at byte 12 of its frame needs no header parse to
        # know who sent it); else None.
        self._hot_head: Struct | None = None
        # Bytes of a hot-path request longer than the chunk it started in that are still to
        # come: they go to the broker as they arrive, never assembled into a frame.
        self._through = 0
        self._accept_timer: asyncio.TimerHandle | None = None
        # For the connection guard (proxy.dataplane.guard): the client's IP, whether bytes came since the
        # last sweep, its deadlines (set once served), the bytes it holds in the memory pool.
        self._ip = ""
        self._admitted_by: str | None = None  # "proxy" or "host" once counted open by the guard
        self._active = False
        self.deadlines: Deadlines | None = None
        self._pool_bytes = 0

    # -- the client's transport -------------------------------------------------------------

    def connection_made(self, raw: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, raw)  # a TCP connection's (uvloop's or asyncio's)
        peer = transport.get_extra_info("peername")
        self._ip = peer[0] if peer else ""
        self.ctx.label = f"{peer[0]}:{peer[1]}" if peer else "client"
        if self.env.guard.host is not None:
            # Workers: the host's admission answers (a round trip to the supervisor); what the
            # client sends meanwhile is kept (uvloop may read it even with reading paused).
            early = EarlyBytes()
            transport.set_protocol(early)
            transport.pause_reading()
            self._connect_task = asyncio.get_running_loop().create_task(self._admit_by_host(transport, early))
            return
        self._admitted(transport, self.env.guard.admit(self._ip), "proxy")

    async def _admit_by_host(self, transport: asyncio.Transport, early: EarlyBytes) -> None:
        admission = await self.env.guard.admit_by_host(self._ip)
        self._connect_task = None
        if early.lost:  # the client left while the host decided
            self.closed = True
            if admission.accepted:
                self.env.guard.release(self._ip, by_host=True)
            return
        self._admitted(transport, admission, "host", early)
        if self.gate is None:
            return  # refused, or a TLS handshake took the early bytes
        transport.set_protocol(self)
        if early.data:
            self.data_received(bytes(early.data))
        if not self.gate.paused and not self.closed:
            transport.resume_reading()

    def _admitted(self, transport: asyncio.Transport, admission: Admission, by: str,
                  early: EarlyBytes | None = None) -> None:
        loop = asyncio.get_running_loop()
        if not admission.accepted:
            # Never served: no broker connection, not counted open; an IP over its creation
            # rate is closed after the throttle (ConnectionQuotas, Acceptor's DelayedCloseSocket).
            self.closed = True
            transport.pause_reading()
            if admission.delay_ms:
                loop.call_later(admission.delay_ms / 1000, transport.close)
            else:
                transport.close()
            return
        self._admitted_by = by
        tls = self.env.listener_tls()
        if tls is not None:
            # Until the TLS layer takes the transport, what it reads is kept for that layer.
            early = early or EarlyBytes()
            transport.set_protocol(early)
            transport.pause_reading()
            self._connect_task = loop.create_task(self._start_tls(transport, early, tls, admission.delay_ms))
            return
        self._serve(transport, admission.delay_ms)

    async def _start_tls(self, raw: asyncio.Transport, early: EarlyBytes, tls: ServerTls, delay_ms: int) -> None:
        done = await handshake(raw, early, tls)
        self._connect_task = None  # held until now: a task nothing refers to may be collected
        if isinstance(done, HandshakeFailure):
            self.closed = True  # never served: counted here, not open
            guard = self.env.guard
            self.stats.tls_handshake_failures[done.reason] += 1
            guard.closed["tls_handshake"] += 1
            guard.log(f"tls_{done.reason}", logging.WARNING, "TLS handshake with %s failed (%s): %s",
                      self.ctx.label, done.reason, done.detail, logger=log)
            guard.release(self._ip, by_host=self._admitted_by == "host")
            self._admitted_by = None
            return
        transport, principal, after = done
        if principal is not None:
            self.ctx.session.principal = principal  # a SASL exchange that succeeds overrides it
        transport.set_protocol(self)
        self._serve(transport, delay_ms)
        if after.data:
            self.data_received(bytes(after.data))  # sent with or right after the handshake
        if after.lost:
            self.connection_lost(None)  # gone before it was served: it must not stay counted open

    def _serve(self, transport: asyncio.Transport, delay_ms: int) -> None:
        """The connection is accepted (and its handshake done): it is read from now on."""
        loop = asyncio.get_running_loop()
        self.transport = transport
        tune(transport)
        self.queue.transport = transport
        self.gate = ReadGate(transport, self.stats)
        self.stats.open_connections += 1
        self.env.connections.add(self)
        self.deadlines = Deadlines(time.monotonic())
        if delay_ms:
            # max_connection_creation_rate: accepted later, as Kafka's Acceptor waits.
            self.gate.pause("accept")
            self._accept_timer = loop.call_later(delay_ms / 1000, self.gate.resume, "accept")
        # The broker connection is opened when the first request is forwarded (send_upstream):
        # an idle or half-open client costs the brokers nothing.

    def data_received(self, data: Buffer) -> None:
        self._active = True
        n = len(data)
        if not self._own and (n >= OWN_READS_FROM_BYTES or self._reader.filling):
            self.read_own()  # from the next read on
        through = self._through
        if through:
            # The rest of a request the hot path started: to the broker as it comes.
            if self.closed:
                return
            # The upstream is up while a request goes through (typed Optional for before it is).
            if n <= through:
                self.upstream.transport.write(data)  # type: ignore[union-attr]
                self.stats.bytes_client_to_upstream += n
                self._through = through - n
                return
            self.upstream.transport.write(data[:through])  # type: ignore[union-attr]
            self.stats.bytes_client_to_upstream += through
            self._through = 0
            data = data[through:]  # the next request(s) begin in this chunk
            n = len(data)
        head = self._hot_head  # None unless armed (see _arm)
        if head is not None and n >= head.size and type(data) is not bytearray:
            # The hot path: one request (whole in this chunk, or starting it and no more), of a
            # known API, from the client id of the last request parsed in full, at a version no
            # request filter looks at, and not an acks=0 Produce. The very bytes that came in go
            # upstream first; the bookkeeping follows, and the rest of a longer request goes
            # upstream as it arrives (see _through).
            size, key, version, correlation_id, client_id = head.unpack_from(data)
            requests = self.requests
            known = requests.table.get(key)  # None: an unknown API, counted on the general path
            if (client_id == requests.client_id_field and size >= n - 4 and known is not None
                    and 0 <= version < known[0] and version < SLOT_VERSIONS
                    and size <= self._reader.max_frame_bytes
                    and (key != _PRODUCE or framed_acks_not_zero(data, head.size, version))):
                received_at = time.monotonic()
                self.upstream.transport.write(data)  # type: ignore[union-attr]  # armed: it is up
                self._through = size + 4 - n
                entry = InFlight(correlation_id, key, version, received_at, size)
                entry.route = plan_route(self.chain.response_route, entry)
                entry.forwarded_at = received_at
                self.queue.expect_from_broker(entry)
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
        self._take(frames, bad_frame)

    def filled(self, nbytes: int, frame: memoryview | None) -> None:
        """``nbytes`` of a large request were read into its buffer (proxy.dataplane.reads),
        completing it when ``frame`` is given."""
        self._active = True
        self.stats.bytes_client_to_upstream += nbytes
        if frame is not None and not self.closed:
            self._take([frame], None)  # what it holds changes only now

    def _take(self, frames: Sequence[Frame], bad_frame: FrameError | None) -> None:
        if self.requests.wait():
            # A deferred request is being decided, or a throttle holds the connection: later
            # frames wait their turn.
            self.requests.hold(frames, bad_frame)
        else:
            self.requests.process(frames, bad_frame)
            self._arm()
        self._account()

    def pause_writing(self) -> None:  # the client reads slower than the broker answers
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.queue.pending and not self.closed:
            self.env.guard.log("client_gone", logging.INFO, "client %s disconnected with %d requests in flight",
                               self.ctx.label, len(self.queue.pending), logger=log)
        self._teardown()

    # -- for the connection guard -----------------------------------------------------------

    def _account(self) -> None:
        """Tells the memory pool what this connection holds: a partial frame, held requests,
        requests waiting for the broker connection."""
        held = self._reader.buffered_bytes + self.requests.held_bytes()
        if self._unsent:
            held += sum(map(len, self._unsent))
        if held or self._pool_bytes:
            self._pool_bytes = held
            if not self.closed:
                self.env.guard.pool.update(self, held)

    def bytes_to_finish(self) -> int:
        """Bytes still to come of the frame being read (0: none is being read)."""
        return self._reader.missing_bytes

    def deadline_passed(self, now_s: float, idle_s: float, partial_s: float) -> str | None:
        """Whether this connection has been idle (nothing read, nothing awaited) for ``idle_s``
        or has left one frame unfinished for ``partial_s`` (see proxy.dataplane.guard.Deadlines): "idle",
        "partial_request" or None. Called by the guard's sweep."""
        deadlines, gate = self.deadlines, self.gate  # both set once served, before it is swept
        if self.closed or deadlines is None or gate is None:
            return None
        pending = self.queue.pending
        busy, self._active = self._active or bool(pending), False
        # The frame being read: a frame the reader started, or a hot-path request still coming.
        frame = None if self._reader.idle and not self._through else (
            self._reader.frames_started, pending[-1] if self._through and pending else None)
        return deadlines.passed(now_s, idle_s, partial_s, busy, gate.reasons, frame)

    def close_for(self, reason: str) -> None:
        """Closes this connection for a limit of the guard's (counted and logged by reason)."""
        self._close_counted(reason, reason.replace("_", " "))

    # -- the hot path ------------------------------------------------------------------------

    def requests_done(self) -> None:
        """The request side processed what it held: the hot path may run again."""
        self._arm()
        self._account()

    def _arm(self) -> None:
        """Lets the hot path run while nothing else must see a request first: a frame reader
        between frames, no deferred decision, no raw SASL token due, a broker connection up, a
        client id seen, the connection open. Called where one of these may have become true;
        where one becomes false (all but a close happen on the general path), before the next
        chunk is read."""
        up = self.upstream
        field = self.requests.client_id_field
        self._hot_head = request_head(len(field)) if (
            field is not None and self._reader.idle and not self.requests.wait()
            and (self.raw_sasl is None or not self.raw_sasl.frames_due)
            and up is not None and up.transport is not None and not self.closed
        ) else None

    # -- throttles and mutes (Kafka's ChannelMuteState, see proxy.dataplane.flow.ChannelMute) -----------

    def hold_for_throttle(self, entry: InFlight | None) -> None:
        """``entry``'s request was given a throttle (None: an acks=0 Produce, muted at once):
        the connection's requests are held and it is not read until the response is sent and
        the mute after it ends (_mute_ended)."""
        self._channel_mute().hold(entry)
        self._hot_head = None

    def _mute_ended(self) -> None:
        """Unless a throttled response is still to be sent, the held requests are processed,
        each charged now (as Kafka charges a request when it reads it)."""
        mute = self.channel_mute
        if mute is None or not mute.holding or self.closed or self.queue.owes_throttled():
            return
        mute.release()
        self.requests.process_held()

    def mute(self, throttle_ms: int) -> None:
        """Stops reading from the client for ``throttle_ms`` (extends, never shortens, a mute)."""
        if not self.closed:
            self._channel_mute().mute(throttle_ms)

    def _channel_mute(self) -> ChannelMute:
        mute = self.channel_mute
        if mute is None:
            gate = self.gate
            assert gate is not None  # throttles come of requests, read once served
            mute = self.channel_mute = ChannelMute(gate, self._mute_ended)
        return mute

    # -- what filters may change (through their FilterContext) ------------------------------

    def start_raw_sasl(self, mechanism: str | None) -> None:
        """SaslHandshake v0 succeeded: the next client frames are raw SASL tokens."""
        if self.raw_sasl is None:
            self.raw_sasl = RawSasl(self.ctx, self.queue, self.env.guard.log)
        if not self.raw_sasl.start(mechanism):
            self.reject("unsupported_sasl", f"SaslHandshake v0 with {mechanism} is not supported")
            return
        self._arm()  # the next frames are raw tokens: not for the hot path

    def uplift_changed(self, uplift: dict[int, int] | None) -> None:
        # Without an uplift, the filters that only act on one are not asked about requests.
        self.requests.table = self.chain.request if uplift else self.chain.request_without_uplift

    def chain_changed(self) -> None:
        """The filters changed (a reload): requests are looked up in the new chain, and
        responses still awaited are ASSEMBLED, through the filters in force when they arrive
        (as Kafka's ClientQuotaManager records a response under the quota in force when it is
        sent). A response already being streamed to the client is being sent: it goes on."""
        self.requests.chain = self.chain
        self.uplift_changed(self.ctx.uplift)
        for entry in self.queue.awaiting:
            entry.route = ASSEMBLED

    # -- the broker connection --------------------------------------------------------------

    def send_upstream(self, out: list[Frame]) -> None:
        up = self.upstream
        if up is None or up.transport is None:
            self._unsent.extend(bytes(b) for b in out)  # the chunk's memory is not ours to keep
            gate = self.gate  # set once served: requests are read from then on
            if self._connect_task is None and not self.closed and gate is not None:
                # The first request to forward: now the broker connection is opened; the
                # client is not read meanwhile, so what waits for it stays small.
                gate.pause("connecting")
                self._connect_task = asyncio.get_running_loop().create_task(self._connect_upstream())
            return
        write(up.transport, out)

    async def _connect_upstream(self) -> None:
        protocol = await open_upstream(self)
        if protocol is None:
            self.close()
            return
        self.upstream = protocol
        if self._unsent and protocol.transport is not None:
            protocol.transport.writelines(self._unsent)
            self._unsent = []
        if self.gate is not None:
            self.gate.resume("connecting")
        self._arm()
        self._account()

    def response_failed(self, exc: Exception) -> None:
        """A response's filters raised (see proxy.dataplane.upstream.response_failed)."""
        response_failed(self, exc)

    # -- closing ----------------------------------------------------------------------------

    def reject(self, reason: str, detail: str, drain: bool = False) -> None:
        """Closes this connection for what the client sent; with ``drain``, only after the
        responses owed are sent."""
        self.stats.frames_rejected[reason] += 1
        self._close_counted(reason, detail, drain)

    def _close_counted(self, reason: str, detail: str, drain: bool = False) -> None:
        """Closes this connection, counted in kqp_connections_closed_total{reason} and logged
        (rate-limited per reason)."""
        self.env.guard.closed[reason] += 1
        self.env.guard.log(reason, logging.WARNING, "closing %s (client_id=%s): %s", self.ctx.label,
                           self.ctx.session.client_id, detail, logger=log)
        if drain and self.queue.pending and self.gate is not None:
            self.queue.close_when_drained = True
            self.gate.pause("closing")
            return
        self.close()

    def drain(self) -> None:
        """A graceful stop: nothing more is read; the connection closes once the responses owed
        to the client are sent (at once when none are)."""
        if self.closed:
            return
        if self.queue.pending and self.gate is not None:
            self.queue.close_when_drained = True
            self.gate.pause("closing")
            return
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        if self.transport is not None:
            self.transport.close()
        self._teardown()

    def _teardown(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._arm()
        if self.gate is not None:  # served (a TLS connection is, once its handshake is done)
            self.stats.open_connections -= 1
        if self._admitted_by is not None:
            self.env.guard.release(self._ip, by_host=self._admitted_by == "host")
        if self._pool_bytes:
            self.env.guard.pool.release(self)
        if self.channel_mute is not None:
            self.channel_mute.cancel()
            self.channel_mute = None
        if self._accept_timer is not None:
            self._accept_timer.cancel()
        if self.gate is not None:
            self.gate.release()
        self.env.connections.discard(self)
        if self._connect_task is not None and not self._connect_task.done():
            self._connect_task.cancel()
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.close()
        # The parts no longer reach this connection (a closed connection's parts may only ask it
        # for nothing): without a cycle, its memory is freed now, not at the next full collection.
        self.requests.close(CLOSED)
        self.queue.close(CLOSED)
        self.ctx.detach(CLOSED)
        self.upstream = None
