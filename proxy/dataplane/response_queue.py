"""The in-order response queue of one client connection.

Guarantees:
- answers reach the client in request order, whichever made them: the broker (as read, rewritten
  on the chunk, streamed, or assembled through the response filters), or the proxy (a filter's
  Answer); a response a filter holds (Hold) keeps its place;
- every answer is counted once, after it is written (bytes, responses per version, latency,
  the usage log);
- a throttled answer mutes the connection once it is written (KIP-219);
- a broker answer that does not match the oldest request it was sent is refused, never taken
  for another request's.

Both sides call it: the client side registers what it owes (:meth:`expect`,
:meth:`expect_from_broker`) and answers itself (:meth:`answer`); the broker side takes each
response's entry (:meth:`take`), then either runs it through the filters (:meth:`respond`) or,
on a fast route, writes it itself and says so (:meth:`head_written`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from struct import Struct
from typing import TYPE_CHECKING, Any, Protocol

from protocol.apis import api_name
from protocol.headers import response_correlation_id
from protocol.throttle import with_throttle
from proxy.dataplane.filters.api import FilterContractError, Forward, Hold
from proxy.dataplane.inflight import Frame, InFlight
from proxy.observability.stats import SLOT_KEYS, SLOT_VERSIONS

if TYPE_CHECKING:
    from proxy.dataplane.filters.api import FilterContext

_INT32 = Struct(">i")
_JOIN_MAX_BYTES = 64 * 1024
_FRAME_TYPES = (bytes, bytearray, memoryview)


def write(transport: asyncio.Transport, buffers: Sequence[Frame]) -> None:
    """One write per batch: small batches are joined (one copy, one send), large ones are
    handed over as they are (no copy of a big record set)."""
    if len(buffers) == 1:
        transport.write(buffers[0])
    elif sum(map(len, buffers)) <= _JOIN_MAX_BYTES:
        transport.write(b"".join(buffers))
    else:
        transport.writelines(buffers)


def finish(entry: InFlight, frame: Frame) -> Frame:
    """The last steps of every answer the filters made or passed on: the request filters' own
    rewrites of it (Forward.on_response), then the throttle."""
    if entry.on_response is not None:
        frame = entry.on_response(frame)
    if entry.throttle_ms:
        # KIP-219: throttle_time_ms = max(the broker's or the filter's, every quota the proxy applied).
        frame = with_throttle(entry.api_key, entry.api_version, frame, entry.throttle_ms)
    return frame


class QueueOwner(Protocol):
    """What a response queue asks of its connection: closing it once drained, closing it when a
    held response's filters raise."""

    def close(self) -> None: ...

    def response_failed(self, exc: Exception) -> None: ...


class UnexpectedResponse(Exception):
    """A broker frame that answers no request awaited, or not the oldest one."""


class ResponseQueue:
    """Every answer one client connection owes, in request order. ``pending``: every request
    to answer, in client order; ``awaiting``: those forwarded, in broker order. ``transport`` is
    the client's (None once the connection closed: nothing is written any more)."""

    __slots__ = ("pending", "awaiting", "transport", "ctx", "stats", "usage", "close_when_drained", "_acks0",
                 "_holding", "_conn")

    def __init__(self, ctx: FilterContext, usage: Any, conn: QueueOwner) -> None:
        self.pending: deque[InFlight] = deque()
        self.awaiting: deque[InFlight] = deque()
        self.transport: asyncio.Transport | None = None
        self.ctx = ctx
        self.stats = ctx.stats
        self.usage = usage  # proxy.observability.usage_log.UsageLog, or None when off
        self.close_when_drained = False  # once the last answer owed is written, the connection closes
        # Made when first needed (most connections never need them): the correlation ids of
        # recent acks=0 Produces, the responses a filter is holding (Hold).
        self._acks0: deque[int] | None = None
        self._holding: set[asyncio.Task[Any]] | None = None
        # The client connection: closed when drained, told when a held response's filters raise.
        self._conn = conn

    # -- the client side --------------------------------------------------------------------

    def expect(self, entry: InFlight) -> None:
        """``entry`` will be answered by the proxy (see :meth:`answer`)."""
        self.pending.append(entry)

    def expect_from_broker(self, entry: InFlight) -> None:
        """``entry``'s request was forwarded: the broker answers it."""
        self.pending.append(entry)
        self.awaiting.append(entry)

    def forwarded_acks0(self, correlation_id: int) -> None:
        """An acks=0 Produce was forwarded: Kafka never answers it, but some brokers (Tansu 0.6)
        do, and such an answer is dropped (see :meth:`take`)."""
        if self._acks0 is None:
            self._acks0 = deque(maxlen=256)
        self._acks0.append(correlation_id)

    def owes_throttled(self) -> bool:
        """Whether an answer given a throttle (InFlight.holds) is still to be written."""
        return any(e.holds for e in self.pending)

    def answer(self, entry: InFlight, frame: Frame) -> None:
        """Answers ``entry`` with ``frame`` and sends every answer now due, in request order."""
        entry.response = frame
        self.send_due()

    def send_due(self) -> None:
        """Sends the answers at the head of the queue that are known, in request order."""
        pending = self.pending
        while pending and (data := pending[0].response) is not None:
            done = pending.popleft()
            done.response = None
            size = len(data)
            if self.transport is not None:
                write(self.transport, (_INT32.pack(size), data))
                if done.throttle_ms:
                    self.ctx.mute(done.throttle_ms)  # KIP-219: answer at once, then stop reading
            self._sent(done, size)
        if self.close_when_drained and not pending:
            self._conn.close()

    # -- the broker side --------------------------------------------------------------------

    def take(self, frame: Frame) -> InFlight | None:
        """The entry the broker's response ``frame`` answers, removed from ``awaiting`` (None: an
        answer to an acks=0 Produce, dropped). Raises UnexpectedResponse when it answers none or
        not the oldest."""
        awaiting = self.awaiting
        if self._acks0 and len(frame) >= 4:
            corr = response_correlation_id(frame)
            if corr in self._acks0 and (not awaiting or awaiting[0].correlation_id != corr):
                self._acks0.remove(corr)
                return None
        if not awaiting:
            raise UnexpectedResponse(f"unsolicited response of {len(frame)} bytes")
        entry = awaiting.popleft()
        if entry.forwarded_at:
            entry.answered()
        if not entry.raw:
            corr = response_correlation_id(frame)
            if corr != entry.correlation_id:
                raise UnexpectedResponse(f"correlation id {corr}, expected {entry.correlation_id}")
        return entry

    def respond(self, entry: InFlight, frame: Frame, filters: tuple[Any, ...]) -> None:
        """Runs the response filters on ``frame``, then the request filter's rewrite and the
        throttle, and answers ``entry``; a filter may hold it (Hold). Raises what a filter
        raises (FilterContractError for a decision outside the contract)."""
        ctx = self.ctx
        for i, f in enumerate(filters):
            frame = f.on_response(ctx, entry, frame)
            if not isinstance(frame, _FRAME_TYPES):
                if type(frame) is Forward:
                    entry.throttle(frame.throttle_ms)
                    frame = frame.frame
                    if isinstance(frame, _FRAME_TYPES):
                        continue
                elif type(frame) is Hold:
                    self._hold(entry, frame, filters[i + 1 :])
                    return
                # A None would leave the answer unknown and every later one waiting behind it.
                raise FilterContractError(f"{type(f).__name__}.on_response returned {type(frame).__name__} for "
                                          f"{api_name(entry.api_key)} (expected a frame, Forward or Hold)")
        self.answer(entry, finish(entry, frame))

    def _hold(self, entry: InFlight, hold: Hold, rest: tuple[Any, ...]) -> None:
        task = asyncio.ensure_future(hold.frame)
        if self._holding is None:
            self._holding = set()
        self._holding.add(task)
        task.add_done_callback(lambda t: self._resume(t, entry, rest))

    def _resume(self, task: asyncio.Task[Any], entry: InFlight, rest: tuple[Any, ...]) -> None:
        if self._holding is not None:
            self._holding.discard(task)
        if self.transport is None or task.cancelled():
            return
        try:
            result = task.result()
            if type(result) is Forward:
                entry.throttle(result.throttle_ms)
                result = result.frame
            self.respond(entry, result, rest)
        except Exception as exc:
            self._conn.response_failed(exc)

    def head_written(self, size: int) -> None:
        """A fast route wrote the oldest answer due (``size`` bytes without its size prefix)
        straight to the client: it leaves both queues, is counted, and the answers that waited
        behind it go."""
        self.awaiting.popleft()
        done = self.pending.popleft()
        self._sent(done, size)
        pending = self.pending
        if self.close_when_drained or (pending and pending[0].response is not None):
            self.send_due()

    # -- counting ---------------------------------------------------------------------------

    def _sent(self, done: InFlight, size: int) -> None:
        """Counts a response of ``size`` bytes (without its size prefix) once it is written:
        after the write, so the client need not wait for the counting."""
        stats = self.stats
        stats.bytes_upstream_to_client += size + 4
        key = done.api_key
        version = done.api_version
        if 0 <= key < SLOT_KEYS and 0 <= version < SLOT_VERSIONS:
            stats.responses.slots[key * SLOT_VERSIONS + version] += 1
            latency = stats.latency.slots[key]
        else:  # an API the proxy does not know, or a version past the count slots
            stats.responses.add(key, version)
            latency = stats.latency.histogram(key)
        latency.observe(time.monotonic() - done.received_at)
        latency.upstream_ms += done.upstream_ms
        if self.usage is not None and not done.raw:
            self.count_usage(done, size)

    def count_usage(self, entry: InFlight, response_bytes: int) -> None:
        session = self.ctx.session
        self.usage.add(
            session.principal, session.client_id or "", entry.api_key,
            request_bytes=entry.request_bytes, response_bytes=response_bytes, records=entry.records or 0,
            batches=entry.batches, mutations=entry.mutations, new_producer_ids=entry.new_producer_ids,
            throttle_ms=entry.throttle_ms, rejected=entry.rejected, upstream_ms=entry.upstream_ms,
            shadow_throttle_ms=entry.shadow_throttle_ms, shadow_rejected=entry.shadow_rejected,
        )

    def close(self, stand_in: QueueOwner) -> None:
        """The connection closed: nothing more is written, held responses are dropped, and the
        queue reaches ``stand_in`` instead of the connection (which it no longer keeps alive)."""
        self._conn = stand_in
        self.transport = None
        for task in self._holding or ():
            task.cancel()
        self.pending.clear()
        self.awaiting.clear()
