"""What client connections may cost the proxy: connections per IP and in all and their creation
rate (Kafka's ``ConnectionQuotas``), bytes held (Kafka's ``queued.max.request.bytes``), time
idle (``connections.max.idle.ms``) or spent on an unfinished frame.

Guarantees:
- a connection over a connection limit is never served and never opens a broker connection;
- the bytes all client connections hold in partial frames and in requests waiting their turn
  stay near ``queued_max_request_bytes``: past it, every connection holding bytes stops being
  read except the one nearest to finishing its frame; nothing is dropped;
- an idle connection, or one whose frame stays unfinished, is closed by the periodic sweep;
- each closure is counted by reason, and logged at most a few times per interval per reason.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from config.engines import connection_limits_for
from config.model import ConnectionsConfig, QuotaWindows
from proxy.observability.logs import ExcInfo, LogLimiter
from quotas.connections import Admission, ConnectionQuotas

if TYPE_CHECKING:
    from proxy.dataplane.flow import ReadGate

log = logging.getLogger(__name__)

# Gate reasons for which the proxy itself stops reading a client: time spent so does not count
# against the client's idle or partial-request time. Under the memory budget only one holder
# reads at a time (MemoryPool): its clock runs, and if it stalls it is closed, then the next.
_PROXY_PAUSES = frozenset({"mute", "throttled", "deferred", "backpressure", "connecting", "accept", "closing",
                           "memory"})


class PoolHolder(Protocol):
    """What the memory pool asks of a connection holding bytes."""

    @property
    def gate(self) -> ReadGate | None: ...

    def bytes_to_finish(self) -> int: ...


class Swept(Protocol):
    """What the guard's sweep asks of a served connection."""

    def deadline_passed(self, now_s: float, idle_s: float, partial_s: float) -> str | None: ...

    def close_for(self, reason: str) -> None: ...


def _now_ms() -> int:
    return time.monotonic_ns() // 1_000_000


class MemoryPool:
    """Bytes held by client connections, against one budget (Kafka's ``queued.max.request.bytes``,
    a ``MemoryPool`` that may overshoot by what one connection is reading).

    A holder is a client connection: ``gate`` (pause/resume by reason) and
    ``bytes_to_finish()`` (bytes still to come of its unfinished frame; 0 if it has none).

    Guarantees: while the bytes held are over the budget, exactly one holder reads, the one
    nearest to finishing its frame when it was chosen (finishing frees its bytes), and every
    other holder is paused; a holder that holds nothing is never paused; when the total falls
    back within the budget every paused holder is read again. Each update costs O(1), except
    crossing the budget and the reader leaving, which look at every holder once."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.held_bytes = 0
        self._held: dict[PoolHolder, int] = {}
        self.paused: set[PoolHolder] = set()
        self.reader: PoolHolder | None = None  # the one holder read while over the budget
        self._shedding = False  # over the budget, holders other than the reader paused
        self.pauses_total = 0

    def update(self, holder: PoolHolder, nbytes: int) -> None:
        """``holder`` now holds ``nbytes`` (0: nothing)."""
        old = self._held.pop(holder, 0)
        if nbytes > 0:
            self._held[holder] = nbytes
        else:
            self._resume(holder)  # nothing held: nothing to wait for
        self.held_bytes += nbytes - old
        if self.held_bytes <= self.budget_bytes:
            if self.paused:
                for h in list(self.paused):
                    self._resume(h)
            self.reader = None
            self._shedding = False
        elif not self._shedding or (holder is self.reader and nbytes == 0):
            self._shed()  # crossing the budget, or the reader finished or left
        elif holder is self.reader or nbytes == 0:
            pass
        elif self.reader is None and holder.bytes_to_finish() > 0:
            self.reader = holder  # no one was reading: this one may finish a frame
            self._resume(holder)
        else:
            self._pause(holder)

    def release(self, holder: PoolHolder) -> None:
        """``holder`` closed: its bytes are free."""
        self.update(holder, 0)

    def _shed(self) -> None:
        self._shedding = True
        finishing = [h for h in self._held if h.bytes_to_finish() > 0]
        self.reader = min(finishing, key=lambda h: h.bytes_to_finish()) if finishing else None
        for holder in self._held:
            if holder is self.reader:
                self._resume(holder)
            else:
                self._pause(holder)

    def _pause(self, holder: PoolHolder) -> None:
        gate = holder.gate  # set once served: only served connections hold bytes
        if holder not in self.paused and gate is not None:
            self.paused.add(holder)
            self.pauses_total += 1
            gate.pause("memory")

    def _resume(self, holder: PoolHolder) -> None:
        gate = holder.gate
        if holder in self.paused:
            self.paused.discard(holder)
            if gate is not None:
                gate.resume("memory")


class HostAdmission(Protocol):
    """Admission shared by the processes of one host (proxy.control.worker_link.WorkerLink)."""

    async def admit(self, ip: str) -> Admission: ...

    def release(self, ip: str) -> None: ...


class ConnectionGuard:
    """The limits of ``connections:`` for one proxy, and the counts of what they closed. With
    ``host``, connection counts and creation rates are the host's (every worker's), decided by
    ``host`` (:meth:`admit_by_host`); the memory budget and the deadlines stay this process's."""

    def __init__(self, config: ConnectionsConfig, windows: QuotaWindows, clock_ms: Callable[[], int] = _now_ms,
                 host: HostAdmission | None = None) -> None:
        self.config = config
        self.host = host
        self.idle_s = config.connections_max_idle_ms / 1000
        self.partial_s = config.partial_request_timeout_ms / 1000
        self.quotas = ConnectionQuotas(connection_limits_for(config, windows))
        self.pool = MemoryPool(config.queued_max_request_bytes)
        self.closed: Counter[str] = Counter()  # connections closed by the proxy, by reason
        self.delayed_total = 0  # connections accepted later (max_connection_creation_rate)
        self._clock_ms = clock_ms
        self._logs: dict[str, LogLimiter] = {}

    @property
    def sweep_interval_s(self) -> float:
        """How often :meth:`sweep` should run: a timeout is enforced within a quarter of itself."""
        return max(min(1.0, self.idle_s / 4, self.partial_s / 4), 0.01)

    def admit(self, ip: str) -> Admission:
        """Whether a new connection from ``ip`` is served (an accepted one is counted until
        :meth:`release`). A refusal is counted and logged (rate-limited) here."""
        return self._counted(self.quotas.admit_at(ip, self._clock_ms()), ip)

    async def admit_by_host(self, ip: str) -> Admission:
        """:meth:`admit` by the host's admission; when it does not answer in time, by this
        process's own counts (logged, rate-limited): a client is never left waiting on it."""
        assert self.host is not None
        try:
            admission = await self.host.admit(ip)
        except TimeoutError as exc:
            self.log("host_admission", logging.WARNING, "the host's connection admission did not answer (%s): "
                     "admitting by this worker's own counts", exc)
            return self.admit(ip)
        return self._counted(admission, ip)

    def _counted(self, admission: Admission, ip: str) -> Admission:
        if not admission.accepted:
            self.closed[admission.verdict] += 1
            self.log(admission.verdict, logging.WARNING, "refusing a connection from %s: %s reached%s", ip,
                     admission.verdict, f" (closed after {admission.delay_ms} ms)" if admission.delay_ms else "")
        elif admission.delay_ms:
            self.delayed_total += 1
        return admission

    def release(self, ip: str, by_host: bool = False) -> None:
        """A connection admitted (by the host when ``by_host``) closed."""
        if by_host and self.host is not None:
            self.host.release(ip)
        else:
            self.quotas.release(ip)

    def log(self, reason: str, level: int, msg: str, *args: object, exc_info: ExcInfo = None,
            logger: logging.Logger = log) -> None:
        """A line a client can trigger, at most 10 per 10 s per ``reason``."""
        limiter = self._logs.get(reason)
        if limiter is None:
            limiter = self._logs[reason] = LogLimiter(logger)
        limiter.log(level, msg, *args, exc_info=exc_info)

    def sweep(self, connections: Iterable[Swept], now_s: float) -> int:
        """Closes the connections past a deadline (see ClientConnection.deadline_passed);
        returns how many."""
        expired = []
        for conn in connections:
            reason = conn.deadline_passed(now_s, self.idle_s, self.partial_s)
            if reason is not None:
                expired.append((conn, reason))
        for conn, reason in expired:
            conn.close_for(reason)
        return len(expired)

    def expire(self) -> int:
        """Forgets connection creation rates that have left their window; returns how many."""
        return self.quotas.expire_at(self._clock_ms())


class Deadlines:
    """One connection's clocks for the sweep: since when nothing was read or awaited, and since
    when the frame being read has not finished. Time in which the proxy itself did not read the
    connection counts for neither."""

    __slots__ = ("idle_since", "_partial_since", "_partial_token")

    def __init__(self, now_s: float) -> None:
        self.idle_since = now_s
        self._partial_since = now_s
        self._partial_token: object = None

    def passed(self, now_s: float, idle_s: float, partial_s: float, busy: bool, gate_reasons: Iterable[str],
               frame: object) -> str | None:
        """"idle", "partial_request" or None. ``busy``: bytes came or a response is awaited since
        the last sweep; ``frame``: a token of the frame being read (None: between frames), the
        same while that frame does not move on."""
        paused_by_proxy = proxy_paused(gate_reasons)
        if busy or paused_by_proxy:
            self.idle_since = now_s
        elif now_s - self.idle_since >= idle_s:
            return "idle"
        if frame is None:
            self._partial_token = None
            return None
        if paused_by_proxy or frame != self._partial_token:
            self._partial_token = frame
            self._partial_since = now_s
        elif now_s - self._partial_since >= partial_s:
            return "partial_request"
        return None


def proxy_paused(reasons: Iterable[str]) -> bool:
    """Whether reading is paused by the proxy itself (not for the bytes it holds)."""
    return not _PROXY_PAUSES.isdisjoint(reasons)


class GuardCollector(Collector):
    """``kqp_connections_closed_total{reason}`` and the memory pool, at scrape time."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self._guard = guard

    def collect(self) -> Iterator[Metric]:
        g = self._guard
        closed = CounterMetricFamily("kqp_connections_closed",
                                     "Client connections the proxy closed or refused, by reason",
                                     labels=["reason"])
        for reason, n in sorted(g.closed.items()):
            closed.add_metric([reason], n)
        yield closed
        yield CounterMetricFamily("kqp_connections_accepted_later",
                                  "Connections delayed by max_connection_creation_rate",
                                  value=g.delayed_total)
        yield GaugeMetricFamily("kqp_memory_held_bytes", "Bytes client connections hold in partial frames and waiting "
                                "requests", value=g.pool.held_bytes)
        yield GaugeMetricFamily("kqp_memory_budget_bytes", "connections.queued_max_request_bytes",
                                value=g.pool.budget_bytes)
        yield GaugeMetricFamily("kqp_memory_paused_connections", "Connections not read because the memory budget is "
                                "spent", value=len(g.pool.paused))
        yield CounterMetricFamily("kqp_memory_pauses", "Times a connection stopped being read for the memory budget",
                                  value=g.pool.pauses_total)
        yield GaugeMetricFamily("kqp_connection_quota_ips", "IPs with open connections or a creation rate tracked",
                                value=g.quotas.tracked_ips)
