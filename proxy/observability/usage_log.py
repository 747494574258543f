"""The usage log: what each principal asked of the cluster, per interval, written as Parquet.

Schema version ``usage.schema.SCHEMA_VERSION`` (one row per interval start, proxy, user, client id
and API key; every column is documented in ``usage.schema.COLUMNS``; ``fleet``, the usage topic
of the fleet this proxy enforced its quotas with, is the same on every row). Files land in
``<directory>/date=YYYY-MM-DD/hour=HH/`` (UTC), one per flushed interval and proxy run, written
under a hidden temporary name and renamed into place, so a reader (Spark ignores names starting
with ``.``) never sees half a file.

Guarantees:
- the event loop only adds to in-memory counters; Parquet encoding and disk writes happen on
  one worker thread, in interval order;
- memory is bounded: at most ``max_keys_per_interval`` distinct (user, client id, API) keys per
  interval; later keys are folded into an ``(other)`` row per API and counted;
- a crash loses at most the interval being counted; a write that fails is retried at the next
  flush (up to ``max_pending_intervals`` intervals are kept, then the oldest is dropped and counted);
- a clean stop writes the partial interval.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple, Required, TypedDict, Unpack

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# The schema is ``usage.schema``'s (shared with ``pipeline``); its names stay importable from here.
from usage.schema import (  # noqa: F401
    COLUMN_NAMES,
    COLUMNS,
    COUNTER_COLUMNS,
    KEY_COLUMNS,
    OTHER,
    SCHEMA_VERSION,
    arrow_schema,
)

log = logging.getLogger(__name__)

# Positions of the counters after the key columns, in COLUMNS order.
_COUNTERS = COUNTER_COLUMNS
_REQUESTS, _REQ_BYTES, _RESP_BYTES, _RECORDS, _BATCHES, _MUTATIONS, _NEW_PIDS = range(7)
_THROTTLE_SUM, _THROTTLE_MAX, _THROTTLED, _REJECTED, _UPSTREAM_MS = range(7, 12)
_SHADOW_SUM, _SHADOW_MAX, _SHADOW_THROTTLED, _SHADOW_REJECTED = range(12, 16)
# Applied and shadow throttles are laid out alike: sum, max, count from the sum's position.
assert (_THROTTLE_MAX, _THROTTLED, _SHADOW_MAX, _SHADOW_THROTTLED) == (
    _THROTTLE_SUM + 1, _THROTTLE_SUM + 2, _SHADOW_SUM + 1, _SHADOW_SUM + 2)


def _count_throttle(c: list[float], at: int, throttle_ms: int) -> None:
    """Adds one throttle to the (sum, max, count) counters starting at ``at``."""
    c[at] += throttle_ms
    if throttle_ms > c[at + 1]:
        c[at + 1] = throttle_ms
    c[at + 2] += 1


class Interval(NamedTuple):
    """One interval's counters: key (user, client id, api key) → counters in ``_COUNTERS`` order."""

    start_s: int
    seconds: int
    rows: dict[tuple[str, str, int], list[float]]  # counters are ints but for upstream_ms


class UsageAggregator:
    """Counts usage per (interval, user, client id, API key). Pure: time is an argument."""

    def __init__(self, interval_s: int, max_keys: int) -> None:
        if interval_s < 1 or max_keys < 1:
            raise ValueError("interval_s and max_keys must be at least 1")
        self.interval_s = interval_s
        self.max_keys = max_keys
        self._intervals: dict[int, dict[tuple[str, str, int], list[float]]] = {}
        self.overflow_requests_total = 0  # requests counted in an (other) row

    def add(
        self, now_s: float, user: str, client_id: str, api_key: int, *, request_bytes: int,
        response_bytes: int = 0, records: int = 0, batches: int = 0, mutations: int = 0,
        new_producer_ids: int = 0, throttle_ms: int = 0, rejected: bool = False, upstream_ms: float = 0.0,
        shadow_throttle_ms: int = 0, shadow_rejected: bool = False,
    ) -> None:
        start = int(now_s // self.interval_s) * self.interval_s
        rows = self._intervals.get(start)
        if rows is None:
            rows = self._intervals[start] = {}
        key = (user, client_id, api_key)
        c = rows.get(key)
        if c is None:
            if len(rows) >= self.max_keys:
                key = (OTHER, OTHER, api_key)
                self.overflow_requests_total += 1
                c = rows.get(key)
            if c is None:
                c = rows[key] = [0] * len(_COUNTERS)
                c[_UPSTREAM_MS] = 0.0
        c[_REQUESTS] += 1
        c[_REQ_BYTES] += request_bytes
        c[_RESP_BYTES] += response_bytes
        c[_RECORDS] += records
        c[_BATCHES] += batches
        c[_MUTATIONS] += mutations
        c[_NEW_PIDS] += new_producer_ids
        if throttle_ms:
            _count_throttle(c, _THROTTLE_SUM, throttle_ms)
        if rejected:
            c[_REJECTED] += 1
        c[_UPSTREAM_MS] += upstream_ms
        if shadow_throttle_ms:
            _count_throttle(c, _SHADOW_SUM, shadow_throttle_ms)
        if shadow_rejected:
            c[_SHADOW_REJECTED] += 1

    def keys_now(self, now_s: float) -> int:
        start = int(now_s // self.interval_s) * self.interval_s
        return len(self._intervals.get(start, ()))

    def drain(self, now_s: float | None = None) -> list[Interval]:
        """The intervals that ended by ``now_s`` (all of them when None), oldest first; they are
        forgotten here."""
        out = []
        for start in sorted(self._intervals):
            if now_s is not None and start + self.interval_s > now_s:
                break
            out.append(Interval(start, self.interval_s, self._intervals.pop(start)))
        return out


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


class UsageLogWriter:
    """Writes intervals as Parquet files; blocking, meant for a worker thread."""

    def __init__(self, directory: str | Path, proxy_name: str, fleet: str = "") -> None:
        self.directory = Path(directory)
        self.proxy_name = proxy_name
        self.fleet = fleet  # the fleet's usage topic, "" when this proxy enforces alone
        # A restarted proxy may flush the same interval again: its files must not replace these.
        self._run = f"{_UNSAFE.sub('_', proxy_name)}-{secrets.token_hex(4)}"

    def path_for(self, start_s: int) -> Path:
        t = datetime.fromtimestamp(start_s, UTC)
        return self.directory / f"date={t:%Y-%m-%d}" / f"hour={t:%H}" / f"usage-{start_s}-{self._run}.parquet"

    def write(self, interval: Interval) -> Path:
        import pyarrow as pa
        import pyarrow.parquet as pq

        keys = list(interval.rows)
        counters = list(zip(*interval.rows.values())) if keys else [()] * len(_COUNTERS)
        n = len(keys)
        columns = [
            [SCHEMA_VERSION] * n,
            [interval.start_s * 1000] * n,
            [interval.seconds] * n,
            [self.proxy_name] * n,
            [k[0] for k in keys],
            [k[1] for k in keys],
            [k[2] for k in keys],
            *counters,
            [self.fleet] * n,
        ]
        schema = arrow_schema()
        table = pa.Table.from_arrays([pa.array(c, type=f.type) for c, f in zip(columns, schema)], schema=schema)
        path = self.path_for(interval.start_s)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        pq.write_table(table, tmp, compression="zstd")
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: a reader sees the whole file or none
        return path


class UsageCounters(TypedDict, total=False):
    """The counters :meth:`UsageLog.add` takes: :meth:`UsageAggregator.add`'s keyword arguments."""

    request_bytes: Required[int]
    response_bytes: int
    records: int
    batches: int
    mutations: int
    new_producer_ids: int
    throttle_ms: int
    rejected: bool
    upstream_ms: float
    shadow_throttle_ms: int
    shadow_rejected: bool


class UsageLog:
    """Owns the aggregator (event loop side) and the writer thread. ``fleet``: the usage topic
    of the fleet the proxy enforces its quotas with (``fleet.topic``), "" when it enforces alone."""

    def __init__(self, directory: str | Path, interval_s: int = 10, max_keys: int = 10_000,
                 proxy_name: str = "proxy", max_pending_intervals: int = 60,
                 clock: Callable[[], float] = time.time, fleet: str = "") -> None:
        self.aggregator = UsageAggregator(interval_s, max_keys)
        self.writer = UsageLogWriter(directory, proxy_name, fleet)
        self.max_pending_intervals = max_pending_intervals
        self.clock = clock
        self._pending: list[Interval] = []  # drained, not yet written (oldest first)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="usage-log")
        self._writing: asyncio.Future[list[Interval]] | None = None
        self._task: asyncio.Task[None] | None = None
        self.rows_written_total = 0
        self.files_written_total = 0
        self.write_failures_total = 0
        self.dropped_rows_total = 0
        self.last_write_s = 0.0

    def add(self, user: str, client_id: str, api_key: int, **counters: Unpack[UsageCounters]) -> None:
        self.aggregator.add(self.clock(), user, client_id, api_key, **counters)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._flush_periodically())

    async def _flush_periodically(self) -> None:
        interval = self.aggregator.interval_s
        while True:
            now = self.clock()
            # Just after the boundary, so the interval that ended is complete.
            await asyncio.sleep(interval - now % interval + 0.05)
            await self.flush(self.clock())

    async def flush(self, now_s: float | None) -> None:
        """Hands the intervals ended by ``now_s`` (all when None) to the writer thread."""
        self._pending.extend(self.aggregator.drain(now_s))
        overflow = len(self._pending) - self.max_pending_intervals
        if overflow > 0:
            for lost in self._pending[:overflow]:
                self.dropped_rows_total += len(lost.rows)
                log.error("usage log: dropped the interval starting %d (%d rows): writes keep failing",
                          lost.start_s, len(lost.rows))
            del self._pending[:overflow]
        if not self._pending or self._writing is not None:
            return
        batch, self._pending = self._pending, []
        loop = asyncio.get_running_loop()
        self._writing = loop.run_in_executor(self._executor, self._write_all, batch)
        try:
            failed = await self._writing
        finally:
            self._writing = None
        self._pending[:0] = failed  # retried at the next flush, still in order

    def _write_all(self, batch: list[Interval]) -> list[Interval]:
        """Writes in order; returns what could not be written (the first failure and after)."""
        for i, interval in enumerate(batch):
            started = time.perf_counter()
            try:
                path = self.writer.write(interval)
            except Exception as exc:
                self.write_failures_total += 1
                log.error("usage log: cannot write the interval starting %d to %s: %s; will retry",
                          interval.start_s, self.writer.directory, exc)
                return batch[i:]
            self.last_write_s = time.perf_counter() - started
            self.rows_written_total += len(interval.rows)
            self.files_written_total += 1
            log.debug("usage log: %d rows to %s", len(interval.rows), path)
        return []

    async def close(self) -> None:
        """Writes everything counted so far, the partial interval included."""
        while self._writing is not None:
            # Cancelling the periodic flush while it awaits its write would cancel the write's
            # future too; let it finish (that flush puts back what failed), then cancel.
            await asyncio.wait([self._writing])
            await asyncio.sleep(0)
        if self._task is not None:
            self._task.cancel()
        self._pending.extend(self.aggregator.drain(None))
        batch, self._pending = self._pending, []
        if batch:
            failed = await asyncio.get_running_loop().run_in_executor(self._executor, self._write_all, batch)
            for lost in failed:
                self.dropped_rows_total += len(lost.rows)
        self._executor.shutdown(wait=True)


class UsageLogCollector(Collector):
    def __init__(self, usage: UsageLog) -> None:
        self.usage = usage

    def collect(self) -> Iterator[Metric]:
        u = self.usage
        for name, doc, value in (
            ("kqp_usage_log_rows_written", "Usage log rows written", u.rows_written_total),
            ("kqp_usage_log_files_written", "Usage log files written", u.files_written_total),
            ("kqp_usage_log_write_failures", "Usage log writes that failed (retried at the next flush)",
             u.write_failures_total),
            ("kqp_usage_log_dropped_rows", "Usage log rows dropped after writes kept failing", u.dropped_rows_total),
            ("kqp_usage_log_overflow_requests", "Requests counted in an (other) row: the interval had "
             "usage_log.max_keys_per_interval keys already", u.aggregator.overflow_requests_total),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily("kqp_usage_log_keys", "Distinct (user, client id, API) keys in the current interval",
                                value=u.aggregator.keys_now(u.clock()))
        yield GaugeMetricFamily("kqp_usage_log_pending_intervals", "Intervals waiting to be written",
                                value=len(u._pending))
        yield GaugeMetricFamily("kqp_usage_log_last_write_seconds", "Time the last interval's write took",
                                value=u.last_write_s)
