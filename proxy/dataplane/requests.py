"""The request side of one client connection: every request it reads, in order, through the
request filters, and their decisions carried out.

Guarantees:
- requests are decided one at a time in the order they were read: while a decision is
  deferred (Defer) or a throttle holds the connection (Kafka's channel mute, proxy.dataplane.flow), the
  frames read after it are held, neither charged nor forwarded, then processed in order;
- every forwarded request's response route comes from the one planner (proxy.dataplane.routes);
- a Produce with acks=0 registers nothing to answer; its throttle can only mute (KIP-219);
- a request-side failure (a bad header, an undecodable body, a filter that raises or decides
  outside the contract) closes this connection only, counted by reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from struct import Struct
from typing import TYPE_CHECKING, Any, Protocol

from protocol.apis import ApiKey, api_name
from protocol.errors import ProtocolError
from protocol.frames import FrameError, held_bytes
from protocol.headers import HeaderError, RequestHeader, parse_request_header
from protocol.produce import produce_acks
from proxy.dataplane.filters.api import Answer, Close, Defer, FilterContractError, Forward
from proxy.dataplane.inflight import Frame, InFlight
from proxy.dataplane.response_queue import finish
from proxy.dataplane.routes import plan_route

if TYPE_CHECKING:
    from proxy.dataplane.filters.chain import FilterChain
    from proxy.dataplane.flow import ChannelMute, ReadGate
    from proxy.dataplane.raw_sasl import RawSasl
    from proxy.dataplane.response_queue import ResponseQueue

log = logging.getLogger(__name__)

_INT32 = Struct(">i")
_INT16 = Struct(">h")


class RequestOwner(Protocol):
    """What a RequestSide asks of its connection (a closed connection's stand-in answers too:
    closed, and every action a no-op)."""

    @property
    def closed(self) -> bool: ...

    @property
    def channel_mute(self) -> ChannelMute | None: ...

    @property
    def raw_sasl(self) -> RawSasl | None: ...

    @property
    def gate(self) -> ReadGate | None: ...

    def send_upstream(self, out: list[Frame]) -> None: ...

    def reject(self, reason: str, detail: str, drain: bool = False) -> None: ...

    def hold_for_throttle(self, entry: InFlight | None) -> None: ...

    def mute(self, throttle_ms: int) -> None: ...

    def requests_done(self) -> None: ...


class RequestSide:
    """Decides the requests of ``conn``. ``table``: the chain's per-API request filters for this
    connection (with or without the uplift filters); ``client_id_field``: the last client id
    parsed, as on the wire (int16 length, -1 for null; the bytes), for the hot path."""

    __slots__ = ("conn", "ctx", "queue", "stats", "usage", "chain", "table", "client_id_field", "deferred",
                 "held", "held_error")

    def __init__(self, conn: RequestOwner, queue: ResponseQueue, chain: FilterChain) -> None:
        self.conn = conn
        self.ctx = queue.ctx
        self.queue = queue
        self.stats = queue.stats
        self.usage = queue.usage  # proxy.observability.usage_log.UsageLog, or None when off
        self.chain = chain
        self.table = self.chain.request_without_uplift
        self.client_id_field: bytes | None = None
        self.deferred: asyncio.Future[Any] | None = None
        self.held: list[Frame] = []  # frames read while a request was deferred or throttled
        self.held_error: FrameError | None = None

    def close(self, stand_in: RequestOwner) -> None:
        """The connection closed: a decision being deferred is cancelled, and this side reaches
        ``stand_in`` instead of the connection (which it no longer keeps alive)."""
        if self.deferred is not None:
            self.deferred.cancel()
        self.conn = stand_in

    def wait(self) -> bool:
        """Whether requests read now must wait their turn (held, in order): a deferred decision
        is being made, or a throttle holds the connection."""
        mute = self.conn.channel_mute
        return self.deferred is not None or (mute is not None and mute.holding)

    def hold(self, frames: Sequence[Frame], bad_frame: FrameError | None) -> None:
        self.held.extend(map(_kept, frames))
        if bad_frame is not None:
            self.held_error = bad_frame

    def held_bytes(self) -> int:
        return sum(map(len, self.held)) if self.held else 0

    def process(self, frames: Sequence[Frame], bad_frame: FrameError | None) -> None:
        """Decides ``frames`` in order; a frame that could not be framed (``bad_frame``) closes
        the connection after the answers owed for those before it."""
        conn = self.conn
        out: list[Frame] = []
        for i, frame in enumerate(frames):
            if conn.closed:
                return
            if self.wait():
                self.hold(frames[i:], None)
                self.held_error = bad_frame
                break
            raw_sasl = conn.raw_sasl
            if raw_sasl is not None and raw_sasl.frames_due:
                raw_sasl.forward(frame, out)
                continue
            if not self._guarded(self._on_request, frame, out):
                return
        if out:
            conn.send_upstream(out)
        if bad_frame is not None:
            if self.wait():
                self.held_error = bad_frame  # after the held frames, in order
            else:
                conn.reject("bad_frame", str(bad_frame), drain=True)

    def process_held(self) -> None:
        """Processes the frames held while a request was deferred or throttled, unless one of
        these holds again (then they stay held)."""
        if self.wait() or self.conn.closed:
            return
        held, self.held = self.held, []
        error, self.held_error = self.held_error, None
        self.process(held, error)
        self.conn.requests_done()

    def _on_request(self, frame: Frame, out: list[Frame]) -> None:
        header = parse_request_header(frame)
        key = header.api_key
        stats = self.stats
        stats.requests.add(key, header.api_version)
        if header.body_offset < 0:
            stats.unknown_api_requests += 1
        session = self.ctx.session
        if self.client_id_field is None or header.client_id != session.client_id:
            client_id = header.client_id
            raw = b"" if client_id is None else client_id.encode()
            self.client_id_field = _INT16.pack(-1 if client_id is None else len(raw)) + raw
        session.client_id = header.client_id
        entry = InFlight(header.correlation_id, key, header.api_version, time.monotonic(), len(frame))
        since, filters = self.table.get(key, self.chain.request_all)
        if header.api_version >= since:
            self._apply_filters(header, frame, entry, filters, out)
        else:
            self._forward(header, frame, entry, out)

    def _guarded(self, call: Any, *args: Any) -> bool:
        """Runs a request-side step; a failure closes this connection only. False if it closed."""
        reject = self.conn.reject
        try:
            call(*args)
        except HeaderError as exc:
            reject("bad_header", str(exc))
        except FilterContractError as exc:
            reject("filter_error", str(exc))
        except ProtocolError as exc:
            self.stats.decode_failures += 1
            reject("undecodable", str(exc))
        except Exception as exc:
            log.error("request filter failed on %s; closing it", self.ctx.label, exc_info=exc)
            reject("filter_error", "filter raised")
        else:
            return True
        return False

    def _apply_filters(self, header: RequestHeader, frame: Frame, entry: InFlight, filters: tuple[Any, ...],
                       out: list[Frame]) -> None:
        ctx = self.ctx
        for i, f in enumerate(filters):
            decision = f.on_request(ctx, header, frame, entry)
            if decision is None:
                continue
            if type(decision) is Forward:
                frame = _take_forward(decision, entry, frame)
            else:
                self._act(decision, header, frame, entry, filters[i + 1 :])
                return
        self._forward(header, frame, entry, out)

    def _act(self, decision: Any, header: RequestHeader, frame: Frame, entry: InFlight,
             rest: tuple[Any, ...]) -> None:
        """Carries out a decision other than passing on or forwarding."""
        if type(decision) is Defer:
            self._defer(decision, header, frame, entry, rest)
        elif type(decision) is Answer:
            entry.throttle(decision.throttle_ms)
            frame = finish(entry, decision.frame)  # an earlier filter's rewrite and the throttle too
            self.queue.expect(entry)
            self.stats.local_responses[header.api_key] += 1
            if entry.throttle_ms:
                self.conn.hold_for_throttle(entry)
            self.queue.answer(entry, frame)
        elif type(decision) is Close:
            self.conn.reject("filter_close", decision.reason)
        else:
            raise FilterContractError(f"a request filter decided {type(decision).__name__} on "
                                      f"{api_name(header.api_key)} (expected None, Forward, Answer, Close or Defer)")

    def _forward(self, header: RequestHeader, frame: Frame, entry: InFlight, out: list[Frame]) -> None:
        if header.api_key == ApiKey.PRODUCE and header.body_offset >= 0 and (
            produce_acks(frame, header.body_offset, header.api_version) == 0  # the frame sent (not the scan's)
        ):
            # acks=0: the broker sends nothing back, so nothing may wait for or invent a reply;
            # a throttle can only be enforced by muting (KIP-219).
            self.queue.forwarded_acks0(header.correlation_id)
            if entry.throttle_ms:
                self.conn.hold_for_throttle(None)
                self.conn.mute(entry.throttle_ms)
            if self.usage is not None:
                self.queue.count_usage(entry, 0)
        else:
            entry.route = plan_route(self.chain.response_route, entry)
            if entry.throttle_ms:
                self.conn.hold_for_throttle(entry)
            self.queue.expect_from_broker(entry)
            entry.forwarded_at = time.monotonic()
        out.append(_INT32.pack(len(frame)))
        out.append(frame)

    def _defer(self, decision: Defer, header: RequestHeader, frame: Frame, entry: InFlight,
               rest: tuple[Any, ...]) -> None:
        gate = self.conn.gate  # set once served: requests are only read then
        if gate is not None:
            gate.pause("deferred")
        self.deferred = deferred = asyncio.ensure_future(decision.decision)
        frame = _kept(frame)
        deferred.add_done_callback(lambda task: self._resume_deferred(task, header, frame, entry, rest))

    def _resume_deferred(self, task: asyncio.Future[Any], header: RequestHeader, frame: Frame, entry: InFlight,
                         rest: tuple[Any, ...]) -> None:
        self.deferred = None
        conn = self.conn
        if conn.closed or task.cancelled():
            return
        if task.exception() is not None:
            log.error("deferred filter failed on %s: %r; closing it", self.ctx.label, task.exception())
            conn.reject("filter_error", "deferred filter raised")
            return
        out: list[Frame] = []
        decision = task.result()
        if type(decision) is Forward:
            frame = _take_forward(decision, entry, frame)
            decision = None
        if decision is None:
            ok = self._guarded(self._apply_filters, header, frame, entry, rest, out)
        else:
            ok = self._guarded(self._act, decision, header, frame, entry, rest)
        if not ok:
            return
        if out:
            conn.send_upstream(out)
        gate = conn.gate
        if self.deferred is None and gate is not None:
            gate.resume("deferred")
        self.process_held()


def _kept(frame: Frame) -> Frame:
    """``frame``, to keep past the callback it came in: as it is when it is immutable bytes or a
    view of them, or of a buffer of the proxy's own (a large frame's or a read's, never
    reused) that it is a quarter of at least; else a copy (a 100 MB copy holds the loop tens
    of ms, and a small frame need not keep a read of a megabyte alive)."""
    if type(frame) is bytes or (
        type(frame) is memoryview and type(frame.obj) in (bytes, bytearray) and len(frame) * 4 >= held_bytes(frame)
    ):
        return frame
    return bytes(frame)


def _take_forward(decision: Forward, entry: InFlight, frame: Frame) -> Frame:
    """Applies a Forward's throttle and response rewrite to ``entry``; the frame to send on.
    Rewrites compose: the response to a request two filters rewrote is rewritten by the later
    filter first (it answers the request as that filter sent it), then by the earlier."""
    entry.throttle(decision.throttle_ms)
    later = decision.on_response
    if later is not None:
        earlier = entry.on_response
        entry.on_response = later if earlier is None else (lambda response: earlier(later(response)))
    return frame if decision.frame is None else decision.frame
