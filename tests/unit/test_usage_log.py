"""The usage log: the aggregator (pure, time as an argument), the Parquet writer, the UsageLog
that owns both (flush, retry, bounded backlog, clean close), its metrics, the producer-id
observer behind ``new_producer_ids``, and the ``usage_log`` configuration section."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prometheus_client import CollectorRegistry

from config import ConfigError, parse_config
from config.model import UsageLogConfig
from proxy.observability.usage_log import (
    COLUMN_NAMES,
    COUNTER_COLUMNS,
    OTHER,
    SCHEMA_VERSION,
    Interval,
    UsageAggregator,
    UsageLog,
    UsageLogCollector,
    UsageLogWriter,
    arrow_schema,
)
from quotas.producer_ids import ProducerIdObserver, ProducerIdSettings
from usage.schema import ADDED_IN, READABLE_VERSIONS, zero_of

PRODUCE, FETCH, CREATE_TOPICS = 0, 1, 19
T0 = 1_700_000_000  # 2023-11-14 22:13:20 UTC, a multiple of 10


def row(interval: Interval, user: str, client_id: str, api_key: int) -> dict:
    """One aggregated row as {counter column: value}."""
    return dict(zip(COUNTER_COLUMNS, interval.rows[(user, client_id, api_key)]))


def visible_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def hidden_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name.startswith("."))


def read_rows(root: Path) -> list[dict]:
    rows = []
    for path in visible_files(root):
        rows.extend(pq.read_table(path).to_pylist())
    return rows


# -- aggregator ----------------------------------------------------------------------------------


def test_counters_are_summed_per_interval_user_client_and_api():
    agg = UsageAggregator(10, 100)
    agg.add(T0 + 1, "alice", "app", PRODUCE, request_bytes=100, response_bytes=40, records=10, batches=2,
            new_producer_ids=1, upstream_ms=1.5)
    agg.add(T0 + 2, "alice", "app", PRODUCE, request_bytes=50, response_bytes=40, records=5, batches=1,
            upstream_ms=2.25)
    agg.add(T0 + 3, "alice", "app", FETCH, request_bytes=60, response_bytes=900, records=30, batches=3)
    agg.add(T0 + 4, "alice", "other-app", PRODUCE, request_bytes=7)
    agg.add(T0 + 5, "bob", "app", PRODUCE, request_bytes=8)
    agg.add(T0 + 6, "bob", "app", CREATE_TOPICS, request_bytes=9, mutations=3)
    agg.add(T0 + 7, "bob", "app", CREATE_TOPICS, request_bytes=9, mutations=4)
    [interval] = agg.drain(None)
    assert (interval.start_s, interval.seconds) == (T0, 10)
    assert set(interval.rows) == {
        ("alice", "app", PRODUCE), ("alice", "app", FETCH), ("alice", "other-app", PRODUCE),
        ("bob", "app", PRODUCE), ("bob", "app", CREATE_TOPICS),
    }
    assert row(interval, "alice", "app", PRODUCE) == {
        "requests": 2, "request_bytes": 150, "response_bytes": 80, "records": 15, "batches": 3,
        "partition_mutations": 0, "new_producer_ids": 1, "throttle_time_ms_sum": 0, "throttle_time_ms_max": 0,
        "throttled": 0, "rejected": 0, "upstream_latency_ms_sum": 3.75, "shadow_throttle_time_ms_sum": 0,
        "shadow_throttle_time_ms_max": 0, "shadow_throttled": 0, "shadow_rejected": 0,
    }
    fetch = row(interval, "alice", "app", FETCH)
    assert (fetch["requests"], fetch["response_bytes"], fetch["records"], fetch["batches"]) == (1, 900, 30, 3)
    assert row(interval, "alice", "other-app", PRODUCE)["request_bytes"] == 7
    assert row(interval, "bob", "app", PRODUCE)["request_bytes"] == 8
    create = row(interval, "bob", "app", CREATE_TOPICS)
    assert (create["requests"], create["partition_mutations"], create["request_bytes"]) == (2, 7, 18)


def test_upstream_latency_stays_a_float():
    agg = UsageAggregator(10, 1)
    agg.add(T0, "u", "c", PRODUCE, request_bytes=1)
    agg.add(T0, "v", "c", PRODUCE, request_bytes=1, upstream_ms=0.25)  # the (other) row
    [interval] = agg.drain(None)
    assert all(isinstance(c[COUNTER_COLUMNS.index("upstream_latency_ms_sum")], float)
               for c in interval.rows.values())


def test_shadow_decisions_are_counted_apart_from_applied_ones():
    agg = UsageAggregator(10, 100)
    agg.add(T0, "alice", "app", PRODUCE, request_bytes=1, throttle_ms=5, shadow_throttle_ms=300)
    agg.add(T0 + 1, "alice", "app", PRODUCE, request_bytes=1, shadow_throttle_ms=700, shadow_rejected=True)
    agg.add(T0 + 2, "alice", "app", PRODUCE, request_bytes=1)
    [interval] = agg.drain(None)
    r = row(interval, "alice", "app", PRODUCE)
    assert (r["throttled"], r["throttle_time_ms_sum"], r["rejected"]) == (1, 5, 0)
    assert (r["shadow_throttled"], r["shadow_throttle_time_ms_sum"], r["shadow_throttle_time_ms_max"],
            r["shadow_rejected"]) == (2, 1000, 700, 1)


@pytest.mark.parametrize(
    ("now", "start"),
    [(T0, T0), (T0 + 0.001, T0), (T0 + 9.999, T0), (T0 + 10, T0 + 10), (T0 - 0.001, T0 - 10)],
)
def test_interval_assignment_at_the_boundaries(now, start):
    agg = UsageAggregator(10, 100)
    agg.add(now, "u", "c", PRODUCE, request_bytes=1)
    [interval] = agg.drain(None)
    assert interval.start_s == start
    assert isinstance(interval.start_s, int)


def test_interval_start_is_aligned_to_the_interval_length():
    agg = UsageAggregator(60, 100)
    agg.add(T0 + 59.5, "u", "c", PRODUCE, request_bytes=1)  # T0 is 20 s past the minute 1_699_999_980
    agg.add(T0 + 100, "u", "c", PRODUCE, request_bytes=1)
    assert [i.start_s for i in agg.drain(None)] == [1_699_999_980 + 60, 1_699_999_980 + 120]


def test_throttle_sum_max_and_throttled_count_and_rejections():
    agg = UsageAggregator(10, 100)
    agg.add(T0, "u", "c", CREATE_TOPICS, request_bytes=1, throttle_ms=200)
    agg.add(T0, "u", "c", CREATE_TOPICS, request_bytes=1, throttle_ms=0)  # not throttled
    agg.add(T0, "u", "c", CREATE_TOPICS, request_bytes=1, throttle_ms=1300, rejected=True)
    agg.add(T0, "u", "c", CREATE_TOPICS, request_bytes=1, throttle_ms=50, rejected=True)
    agg.add(T0, "u", "c", CREATE_TOPICS, request_bytes=1, rejected=False)
    [interval] = agg.drain(None)
    r = row(interval, "u", "c", CREATE_TOPICS)
    assert r["requests"] == 5
    assert r["throttle_time_ms_sum"] == 1550
    assert r["throttle_time_ms_max"] == 1300
    assert r["throttled"] == 3
    assert r["rejected"] == 2


def test_drain_returns_only_ended_intervals_oldest_first_and_forgets_them():
    agg = UsageAggregator(10, 100)
    # Added out of order: drain sorts by start.
    agg.add(T0 + 25, "u", "c", PRODUCE, request_bytes=3)
    agg.add(T0 + 5, "u", "c", PRODUCE, request_bytes=1)
    agg.add(T0 + 15, "u", "c", PRODUCE, request_bytes=2)
    assert agg.drain(T0 + 9.99) == []
    # T0 + 10 is the first interval's end: it has ended, the one starting there has not.
    assert [i.start_s for i in agg.drain(T0 + 10)] == [T0]
    assert agg.drain(T0 + 10) == []  # forgotten
    assert agg.drain(T0 + 19.99) == []
    ended = agg.drain(T0 + 40)
    assert [i.start_s for i in ended] == [T0 + 10, T0 + 20]
    assert [row(i, "u", "c", PRODUCE)["request_bytes"] for i in ended] == [2, 3]
    assert agg.drain(None) == []


def test_drain_none_returns_everything_including_the_current_interval():
    agg = UsageAggregator(10, 100)
    agg.add(T0 + 15, "u", "c", PRODUCE, request_bytes=2)
    agg.add(T0 + 5, "u", "c", PRODUCE, request_bytes=1)
    assert [i.start_s for i in agg.drain(None)] == [T0, T0 + 10]
    assert agg.drain(None) == []
    assert agg.keys_now(T0 + 15) == 0


def test_max_keys_folds_new_keys_into_other_rows_per_api_and_existing_keys_keep_counting():
    agg = UsageAggregator(10, 2)
    agg.add(T0, "a", "c1", PRODUCE, request_bytes=1)
    agg.add(T0, "b", "c2", FETCH, request_bytes=2)
    assert agg.keys_now(T0) == 2
    # Full: new keys go to one (other) row per API key.
    agg.add(T0, "c", "c3", PRODUCE, request_bytes=10, records=5)
    agg.add(T0, "d", "c4", PRODUCE, request_bytes=20, records=6)
    agg.add(T0, "e", "c5", FETCH, request_bytes=30)
    agg.add(T0, "f", "c6", CREATE_TOPICS, request_bytes=40, mutations=3)
    # Known keys still get their own rows.
    agg.add(T0, "a", "c1", PRODUCE, request_bytes=100)
    agg.add(T0, "b", "c2", FETCH, request_bytes=200)
    assert agg.overflow_requests_total == 4
    [interval] = agg.drain(None)
    assert set(interval.rows) == {
        ("a", "c1", PRODUCE), ("b", "c2", FETCH),
        (OTHER, OTHER, PRODUCE), (OTHER, OTHER, FETCH), (OTHER, OTHER, CREATE_TOPICS),
    }
    other_produce = row(interval, OTHER, OTHER, PRODUCE)
    assert (other_produce["requests"], other_produce["request_bytes"], other_produce["records"]) == (2, 30, 11)
    assert row(interval, OTHER, OTHER, FETCH)["request_bytes"] == 30
    assert row(interval, OTHER, OTHER, CREATE_TOPICS)["partition_mutations"] == 3
    known = row(interval, "a", "c1", PRODUCE)
    assert (known["requests"], known["request_bytes"]) == (2, 101)
    assert row(interval, "b", "c2", FETCH)["request_bytes"] == 202


def test_max_keys_is_per_interval():
    agg = UsageAggregator(10, 1)
    agg.add(T0, "a", "c", PRODUCE, request_bytes=1)
    agg.add(T0, "b", "c", PRODUCE, request_bytes=1)  # overflow
    agg.add(T0 + 10, "b", "c", PRODUCE, request_bytes=1)  # a new interval: room again
    first, second = agg.drain(None)
    assert set(first.rows) == {("a", "c", PRODUCE), (OTHER, OTHER, PRODUCE)}
    assert set(second.rows) == {("b", "c", PRODUCE)}
    assert agg.overflow_requests_total == 1


@pytest.mark.parametrize(("interval_s", "max_keys"), [(0, 10), (10, 0)])
def test_aggregator_refuses_nonsense_sizes(interval_s, max_keys):
    with pytest.raises(ValueError):
        UsageAggregator(interval_s, max_keys)


# -- writer --------------------------------------------------------------------------------------


def _sample_interval() -> Interval:
    agg = UsageAggregator(10, 100)
    agg.add(T0 + 1, "alice", "app-1", PRODUCE, request_bytes=1500, response_bytes=60, records=100, batches=2,
            new_producer_ids=1, throttle_ms=25, upstream_ms=3.5)
    agg.add(T0 + 2, "bob", "", CREATE_TOPICS, request_bytes=80, response_bytes=70, mutations=3,
            throttle_ms=2_000_000_000, rejected=True, upstream_ms=0.0, shadow_throttle_ms=40, shadow_rejected=True)
    [interval] = agg.drain(None)
    return interval


def test_writer_writes_parquet_with_the_schema_and_round_trips_the_values(tmp_path, monkeypatch):
    # The partition is UTC whatever the local time zone is.
    monkeypatch.setenv("TZ", "Pacific/Kiritimati")  # UTC+14: another date and hour
    time.tzset()
    try:
        path = UsageLogWriter(tmp_path, "proxy-a").write(_sample_interval())
    finally:
        monkeypatch.undo()
        time.tzset()
    assert path.parent == tmp_path / "date=2023-11-14" / "hour=22"
    assert path.name.startswith(f"usage-{T0}-proxy-a-") and path.name.endswith(".parquet")
    assert visible_files(tmp_path) == [path]
    assert hidden_files(tmp_path) == []

    assert pq.read_schema(path).equals(arrow_schema(), check_metadata=True)
    table = pq.read_table(path)
    assert table.schema.equals(arrow_schema(), check_metadata=True)
    assert table.schema.metadata == {b"kqp.usage.schema_version": b"3"}
    assert table.column_names == list(COLUMN_NAMES)
    assert all(not f.nullable for f in table.schema)
    assert table.schema.field("interval_start").type == pa.timestamp("ms", tz="UTC")
    rows = sorted(table.to_pylist(), key=lambda r: r["user"])
    start = datetime.fromtimestamp(T0, UTC)
    assert rows == [
        {"schema_version": SCHEMA_VERSION, "interval_start": start, "interval_seconds": 10, "proxy": "proxy-a",
         "user": "alice", "client_id": "app-1", "api_key": PRODUCE, "requests": 1, "request_bytes": 1500,
         "response_bytes": 60, "records": 100, "batches": 2, "partition_mutations": 0, "new_producer_ids": 1,
         "throttle_time_ms_sum": 25, "throttle_time_ms_max": 25, "throttled": 1, "rejected": 0,
         "upstream_latency_ms_sum": 3.5, "shadow_throttle_time_ms_sum": 0, "shadow_throttle_time_ms_max": 0,
         "shadow_throttled": 0, "shadow_rejected": 0, "fleet": ""},
        {"schema_version": SCHEMA_VERSION, "interval_start": start, "interval_seconds": 10, "proxy": "proxy-a",
         "user": "bob", "client_id": "", "api_key": CREATE_TOPICS, "requests": 1, "request_bytes": 80,
         "response_bytes": 70, "records": 0, "batches": 0, "partition_mutations": 3, "new_producer_ids": 0,
         "throttle_time_ms_sum": 2_000_000_000, "throttle_time_ms_max": 2_000_000_000, "throttled": 1,
         "rejected": 1, "upstream_latency_ms_sum": 0.0, "shadow_throttle_time_ms_sum": 40,
         "shadow_throttle_time_ms_max": 40, "shadow_throttled": 1, "shadow_rejected": 1, "fleet": ""},
    ]


def test_a_fleet_member_writes_its_fleets_usage_topic_on_every_row(tmp_path):
    path = UsageLogWriter(tmp_path, "proxy-a", "__kqp_quota_usage").write(_sample_interval())
    table = pq.read_table(path)
    assert table.schema.equals(arrow_schema(), check_metadata=True)
    assert table.column_names[-1] == "fleet"
    assert table.column("fleet").to_pylist() == ["__kqp_quota_usage"] * 2
    # The counters are the same as alone: the fleet only names the setting.
    alone = pq.read_table(UsageLogWriter(tmp_path / "alone", "proxy-a").write(_sample_interval()))
    assert alone.column("fleet").to_pylist() == ["", ""]
    assert alone.drop_columns(["fleet"]).to_pylist() == table.drop_columns(["fleet"]).to_pylist()


def test_schema_version_3_adds_fleet_after_the_counters_and_older_files_read_it_as_empty():
    assert SCHEMA_VERSION == 3 and SCHEMA_VERSION in READABLE_VERSIONS and set(READABLE_VERSIONS) == {1, 2, 3}
    assert COLUMN_NAMES[-1] == "fleet" and "fleet" not in COUNTER_COLUMNS
    assert COUNTER_COLUMNS == COLUMN_NAMES[7:-1]
    assert ADDED_IN["fleet"] == 3 and zero_of("fleet") == ""
    shadow = [c for c in COLUMN_NAMES if c.startswith("shadow_")]
    assert {c: ADDED_IN[c] for c in shadow} == dict.fromkeys(shadow, 2)
    assert [zero_of(c) for c in shadow] == [0] * 4
    # Every column an older file lacks has a zero of its own type.
    assert {type(zero_of(c)) for c in ADDED_IN} == {int, str}


def test_writer_partitions_by_utc_date_and_hour():
    writer = UsageLogWriter("/data/usage", "p")
    # 2024-02-29 23:59:50 UTC and ten seconds later.
    leap = int(datetime(2024, 2, 29, 23, 59, 50, tzinfo=UTC).timestamp())
    assert writer.path_for(leap).parent == Path("/data/usage/date=2024-02-29/hour=23")
    assert writer.path_for(leap + 10).parent == Path("/data/usage/date=2024-03-01/hour=00")


def test_writer_file_names_are_safe_and_differ_per_run(tmp_path):
    a, b = UsageLogWriter(tmp_path, "host/1 x"), UsageLogWriter(tmp_path, "host/1 x")
    name_a, name_b = a.path_for(T0).name, b.path_for(T0).name
    assert "/" not in name_a and " " not in name_a and name_a.startswith(f"usage-{T0}-host_1_x-")
    assert name_a != name_b  # a restarted proxy never replaces the files of the run before
    interval = _sample_interval()
    assert a.write(interval) != b.write(interval)
    assert len(visible_files(tmp_path)) == 2
    assert {r["proxy"] for r in read_rows(tmp_path)} == {"host/1 x"}  # the column keeps the real name


def test_a_write_failing_half_way_leaves_no_visible_file(tmp_path, monkeypatch):
    real = pq.write_table

    def half_then_fail(table, where, **kwargs):
        sink = pa.BufferOutputStream()
        real(table, sink, **kwargs)
        data = sink.getvalue().to_pybytes()
        Path(where).write_bytes(data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    writer = UsageLogWriter(tmp_path, "p")
    monkeypatch.setattr(pq, "write_table", half_then_fail)
    with pytest.raises(OSError, match="No space"):
        writer.write(_sample_interval())
    assert visible_files(tmp_path) == []
    # Once writes work again, the same interval lands whole and nothing hidden remains.
    monkeypatch.setattr(pq, "write_table", real)
    path = writer.write(_sample_interval())
    assert visible_files(tmp_path) == [path]
    assert hidden_files(tmp_path) == []
    assert pq.read_table(path).num_rows == 2


def test_a_failing_rename_leaves_no_visible_file(tmp_path, monkeypatch):
    def refuse(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(PermissionError):
        UsageLogWriter(tmp_path, "p").write(_sample_interval())
    assert visible_files(tmp_path) == []


# -- UsageLog: flush, retry, backlog, close, metrics -----------------------------------------------


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _log(directory, clock: Clock, **kwargs) -> UsageLog:
    return UsageLog(directory, interval_s=10, max_keys=100, proxy_name="p", clock=clock, **kwargs)


def _starts(root: Path) -> list[int]:
    """The interval starts of the files written, in the order the file names sort."""
    return sorted(int(p.name.split("-")[1]) for p in visible_files(root))


def test_flush_writes_the_intervals_that_ended(tmp_path):
    clock = Clock(T0 + 1)

    async def scenario():
        usage = _log(tmp_path, clock)
        usage.add("alice", "app", PRODUCE, request_bytes=10, records=2)
        clock.now = T0 + 11
        usage.add("alice", "app", PRODUCE, request_bytes=20, records=3)
        await usage.flush(clock.now)  # the interval at T0 ended, the one at T0 + 10 has not
        assert _starts(tmp_path) == [T0]
        assert (usage.files_written_total, usage.rows_written_total) == (1, 1)
        assert usage.last_write_s > 0
        await usage.flush(T0 + 19.9)
        assert _starts(tmp_path) == [T0]
        await usage.flush(T0 + 20)
        assert _starts(tmp_path) == [T0, T0 + 10]
        await usage.close()
        return usage

    usage = asyncio.run(scenario())
    assert usage.files_written_total == 2
    rows = sorted(read_rows(tmp_path), key=lambda r: r["interval_start"])
    assert [(r["request_bytes"], r["records"]) for r in rows] == [(10, 2), (20, 3)]
    assert hidden_files(tmp_path) == []


def _fail_first_write(usage, written: list[int] | None = None) -> None:
    """The writer's first write raises an I/O error; later ones write (and are noted in ``written``)."""
    real = usage.writer.write
    calls = {"n": 0}

    def fails_once(interval):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(5, "Input/output error")
        path = real(interval)
        if written is not None:
            written.append(interval.start_s)
        return path

    usage.writer.write = fails_once


def test_write_failure_is_counted_and_retried_in_order_at_the_next_flush(tmp_path):
    clock = Clock(T0)
    written: list[int] = []

    async def scenario():
        usage = _log(tmp_path, clock)
        _fail_first_write(usage, written)
        for k in range(3):
            clock.now = T0 + 10 * k + 1
            usage.add("u", "c", PRODUCE, request_bytes=k + 1)
        await usage.flush(T0 + 20)  # two intervals ended; the first write fails
        assert usage.write_failures_total == 1
        assert written == [] and visible_files(tmp_path) == []
        assert len(usage._pending) == 2
        await usage.flush(T0 + 30)  # the two kept, then the third
        assert written == [T0, T0 + 10, T0 + 20]
        assert usage.write_failures_total == 1
        assert (usage.files_written_total, usage.rows_written_total, usage.dropped_rows_total) == (3, 3, 0)
        await usage.close()

    asyncio.run(scenario())
    rows = sorted(read_rows(tmp_path), key=lambda r: r["interval_start"])
    assert [r["request_bytes"] for r in rows] == [1, 2, 3]


def test_intervals_drained_during_a_failing_write_are_written_after_it(tmp_path):
    """A flush during a write only queues; the failed interval goes back in front of the queue."""
    clock = Clock(T0 + 1)
    written: list[int] = []
    in_write, release = threading.Event(), threading.Event()

    async def scenario():
        usage = _log(tmp_path, clock)
        real = usage.writer.write
        calls = {"n": 0}

        def write(interval):
            calls["n"] += 1
            if calls["n"] == 1:
                in_write.set()
                release.wait(5)
                raise OSError(5, "Input/output error")
            written.append(interval.start_s)
            return real(interval)

        usage.writer.write = write
        usage.add("u", "c", PRODUCE, request_bytes=1)
        clock.now = T0 + 11
        usage.add("u", "c", PRODUCE, request_bytes=2)
        first = asyncio.ensure_future(usage.flush(T0 + 10))
        while not in_write.is_set():
            await asyncio.sleep(0.005)
        await usage.flush(T0 + 20)  # the write is busy: T0 + 10 waits in the queue
        assert [i.start_s for i in usage._pending] == [T0 + 10]
        release.set()
        await first
        assert [i.start_s for i in usage._pending] == [T0, T0 + 10]
        await usage.flush(T0 + 20)
        await usage.close()

    try:
        asyncio.run(scenario())
    finally:
        release.set()
    assert written == [T0, T0 + 10]


def test_a_file_in_the_way_of_the_directory_fails_the_write_until_it_is_gone(tmp_path):
    blocker = tmp_path / "usage"
    blocker.write_text("not a directory")  # works as root too, unlike a read-only directory
    clock = Clock(T0 + 1)

    async def scenario():
        usage = _log(blocker / "log", clock)
        usage.add("u", "c", PRODUCE, request_bytes=1)
        clock.now = T0 + 11
        usage.add("u", "c", FETCH, request_bytes=2)
        await usage.flush(T0 + 10)
        await usage.flush(T0 + 10.5)  # still in the way: one more failure, nothing lost
        assert usage.write_failures_total == 2
        assert usage.files_written_total == 0
        blocker.unlink()
        await usage.flush(T0 + 20)
        assert usage.files_written_total == 2
        await usage.close()
        return usage

    usage = asyncio.run(scenario())
    assert usage.dropped_rows_total == 0
    assert _starts(blocker / "log") == [T0, T0 + 10]


def test_max_pending_intervals_drops_the_oldest_and_counts_its_rows(tmp_path):
    clock = Clock(T0)

    async def scenario():
        usage = _log(tmp_path, clock, max_pending_intervals=2)
        real = usage.writer.write
        broken = {"on": True}

        def write(interval):
            if broken["on"]:
                raise OSError(5, "Input/output error")
            return real(interval)

        usage.writer.write = write
        # Intervals with 1, 2, 3 and 4 rows.
        for k in range(4):
            clock.now = T0 + 10 * k
            for user in range(k + 1):
                usage.add(f"u{user}", "c", PRODUCE, request_bytes=1)
        await usage.flush(T0 + 40)
        assert usage.dropped_rows_total == 1 + 2  # the two oldest
        assert [i.start_s for i in usage._pending] == [T0 + 20, T0 + 30]
        assert usage.write_failures_total == 1
        clock.now = T0 + 41
        usage.add("late", "c", PRODUCE, request_bytes=1)
        await usage.flush(T0 + 50)  # three pending now: the oldest goes too
        assert usage.dropped_rows_total == 1 + 2 + 3
        assert [i.start_s for i in usage._pending] == [T0 + 30, T0 + 40]
        broken["on"] = False
        await usage.flush(T0 + 50)
        assert usage._pending == []
        assert (usage.files_written_total, usage.rows_written_total) == (2, 5)
        await usage.close()

    asyncio.run(scenario())
    assert _starts(tmp_path) == [T0 + 30, T0 + 40]


def test_close_writes_the_partial_interval_and_what_was_pending(tmp_path):
    clock = Clock(T0 + 1)

    async def scenario():
        usage = _log(tmp_path, clock)
        _fail_first_write(usage)
        usage.add("u", "c", PRODUCE, request_bytes=1)
        await usage.flush(T0 + 10)  # fails: pending
        clock.now = T0 + 12
        usage.add("u", "c", PRODUCE, request_bytes=2)  # the current interval, not ended
        await usage.close()
        return usage

    usage = asyncio.run(scenario())
    assert (usage.files_written_total, usage.rows_written_total, usage.dropped_rows_total) == (2, 2, 0)
    assert _starts(tmp_path) == [T0, T0 + 10]
    assert usage._executor._shutdown


def test_close_counts_what_it_cannot_write_as_dropped(tmp_path):
    blocker = tmp_path / "usage"
    blocker.write_text("")
    clock = Clock(T0 + 1)

    async def scenario():
        usage = _log(blocker, clock)
        usage.add("u", "c1", PRODUCE, request_bytes=1)
        usage.add("u", "c2", PRODUCE, request_bytes=1)
        await usage.close()
        return usage

    usage = asyncio.run(scenario())
    assert usage.dropped_rows_total == 2
    assert usage.write_failures_total == 1


def test_close_while_the_periodic_flush_is_writing(tmp_path):
    """A stop that arrives while the periodic flush is writing waits for that write, then writes
    the partial interval; it neither raises nor loses rows."""
    started, release = threading.Event(), threading.Event()

    async def scenario():
        usage = UsageLog(tmp_path, interval_s=1, proxy_name="p")
        real = usage.writer.write

        def slow(interval):
            started.set()
            release.wait(5)
            return real(interval)

        usage.writer.write = slow
        usage.start()
        usage.add("u", "c", PRODUCE, request_bytes=1)
        deadline = time.monotonic() + 5
        while not started.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert started.is_set(), "the periodic flush did not start a write"
        usage.add("u", "c", FETCH, request_bytes=2)  # the partial interval
        threading.Timer(0.2, release.set).start()
        await asyncio.wait_for(usage.close(), 10)
        return usage

    try:
        usage = asyncio.run(scenario())
    finally:
        release.set()
    assert usage.rows_written_total == 2
    assert sorted(r["request_bytes"] for r in read_rows(tmp_path)) == [1, 2]


def test_periodic_flush_writes_shortly_after_each_boundary(tmp_path):
    async def scenario():
        usage = UsageLog(tmp_path, interval_s=1, proxy_name="p")
        usage.start()
        usage.add("u", "c", PRODUCE, request_bytes=1)
        deadline = time.monotonic() + 10  # the next 1 s boundary, however late a busy machine runs the flush
        while usage.files_written_total == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        written = usage.files_written_total
        await usage.close()
        return written

    assert asyncio.run(scenario()) == 1


def test_collector_exposes_the_usage_log_metrics(tmp_path):
    clock = Clock(T0 + 1)
    registry = CollectorRegistry()

    def value(name):
        return registry.get_sample_value(name)

    async def scenario():
        usage = UsageLog(tmp_path, interval_s=10, max_keys=2, proxy_name="p", max_pending_intervals=1, clock=clock)
        registry.register(UsageLogCollector(usage))
        assert value("kqp_usage_log_rows_written_total") == 0
        assert value("kqp_usage_log_keys") == 0
        for user in ("a", "b", "c", "d"):  # c and d overflow into one (other) row
            usage.add(user, "x", PRODUCE, request_bytes=1)
        assert value("kqp_usage_log_keys") == 3
        assert value("kqp_usage_log_overflow_requests_total") == 2
        await usage.flush(T0 + 10)
        assert value("kqp_usage_log_rows_written_total") == 3
        assert value("kqp_usage_log_files_written_total") == 1
        assert value("kqp_usage_log_last_write_seconds") > 0
        clock.now = T0 + 10
        assert value("kqp_usage_log_keys") == 0  # a new interval

        real = usage.writer.write

        def broken(interval):
            raise OSError(5, "Input/output error")

        usage.writer.write = broken
        usage.add("a", "x", PRODUCE, request_bytes=1)
        usage.add("b", "x", PRODUCE, request_bytes=1)
        assert value("kqp_usage_log_keys") == 2
        await usage.flush(T0 + 20)
        assert value("kqp_usage_log_write_failures_total") == 1
        assert value("kqp_usage_log_pending_intervals") == 1
        clock.now = T0 + 20
        usage.add("a", "x", PRODUCE, request_bytes=1)
        await usage.flush(T0 + 30)  # two pending, one allowed: the 2-row interval is dropped
        assert value("kqp_usage_log_dropped_rows_total") == 2
        assert value("kqp_usage_log_write_failures_total") == 2
        assert value("kqp_usage_log_pending_intervals") == 1
        usage.writer.write = real
        await usage.close()
        assert value("kqp_usage_log_pending_intervals") == 0
        assert value("kqp_usage_log_rows_written_total") == 4
        assert value("kqp_usage_log_files_written_total") == 2

    asyncio.run(scenario())


# -- producer-id observer ------------------------------------------------------------------------

WINDOW_MS = 1000


def _observer(**kwargs) -> ProducerIdObserver:
    return ProducerIdObserver(ProducerIdSettings(window_size_s=WINDOW_MS / 1000, layer_count=2), **kwargs)


def test_a_producer_id_is_new_once_per_window():
    obs = _observer()
    assert obs.new_ids("alice", [1, 2], 0) == 2
    assert obs.new_ids("alice", [1, 2, 3], 100) == 1
    assert obs.new_ids("alice", [1, 2, 3], 900) == 0
    assert obs.new_ids("alice", [4, 4], 950) == 1  # twice in one request: one new id


def test_a_producer_id_counts_again_after_a_window_without_it():
    obs = _observer()
    assert obs.new_ids("alice", [7], 0) == 1
    assert obs.new_ids("alice", [7], WINDOW_MS - 1) == 0  # still in the window (and seen again)
    assert obs.new_ids("alice", [7], 2 * WINDOW_MS - 2) == 0
    assert obs.new_ids("alice", [7], 3 * WINDOW_MS + 10) == 1  # a whole window without it


def test_producer_ids_are_counted_per_user():
    obs = _observer()
    assert obs.new_ids("alice", [1, 2], 0) == 2
    assert obs.new_ids("bob", [1, 2], 0) == 2
    assert obs.new_ids("alice", [1, 2], 10) == 0
    assert obs.new_ids("bob", [2, 3], 10) == 1
    assert obs.tracked_users == 2


def test_the_user_seen_longest_ago_makes_room():
    obs = _observer(max_users=2)
    obs.new_ids("a", [1], 0)
    obs.new_ids("b", [1], 1)
    obs.new_ids("a", [2], 2)  # a is now the most recent
    obs.new_ids("c", [1], 3)  # b goes
    assert obs.tracked_users == 2
    assert obs.new_ids("a", [1, 2], 4) == 0  # a was kept
    assert obs.new_ids("c", [1], 5) == 0
    assert obs.new_ids("b", [1], 6) == 1  # b was forgotten: new again (and a, seen longest ago, goes)
    assert obs.tracked_users == 2
    assert obs.new_ids("c", [1], 7) == 0
    assert obs.new_ids("a", [1], 8) == 1


def test_cleanup_forgets_idle_users_only():
    obs = _observer()
    obs.new_ids("idle", [1], 0)
    obs.new_ids("busy", [1], 600)
    assert obs.cleanup(WINDOW_MS - 1) == 0
    assert obs.tracked_users == 2
    assert obs.cleanup(WINDOW_MS + 100) == 1
    assert obs.tracked_users == 1
    assert obs.new_ids("busy", [1], WINDOW_MS + 200) == 0  # still known
    assert obs.new_ids("idle", [1], WINDOW_MS + 200) == 1
    assert obs.cleanup(10 * WINDOW_MS) == 2
    assert obs.tracked_users == 0


# -- configuration -------------------------------------------------------------------------------

UPSTREAM = {"bootstrap_servers": ["k:9092"]}


def _config(usage_log):
    return parse_config({"upstream": UPSTREAM, "usage_log": usage_log})


def test_usage_log_is_off_by_default():
    cfg = parse_config({"upstream": UPSTREAM})
    assert cfg.usage_log == UsageLogConfig()
    assert cfg.usage_log.enabled is False
    assert cfg.usage_log.directory is None
    assert _config(None).usage_log == UsageLogConfig()
    assert _config({}).usage_log.enabled is False


def test_usage_log_defaults_with_only_a_directory():
    u = _config({"directory": "/var/lib/kqp/usage"}).usage_log
    assert u.enabled is True
    assert (u.directory, u.interval_seconds, u.max_keys_per_interval) == ("/var/lib/kqp/usage", 10, 10_000)
    assert (u.count_fetch_records, u.proxy_name, u.max_pending_intervals) == (True, "", 60)


def test_usage_log_every_setting():
    u = _config({"directory": "usage", "interval_seconds": 3600, "max_keys_per_interval": 1,
                 "count_fetch_records": False, "proxy_name": "proxy-7", "max_pending_intervals": 1}).usage_log
    assert u == UsageLogConfig(directory="usage", interval_seconds=3600, max_keys_per_interval=1,
                               count_fetch_records=False, proxy_name="proxy-7", max_pending_intervals=1)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("directory", ""),
        ("directory", 5),
        ("directory", ["/tmp"]),
        ("interval_seconds", 0),
        ("interval_seconds", 3601),
        ("interval_seconds", -10),
        ("interval_seconds", 1.5),
        ("interval_seconds", "10"),
        ("interval_seconds", True),
        ("max_keys_per_interval", 0),
        ("max_keys_per_interval", 10_000_001),
        ("max_keys_per_interval", None),
        ("count_fetch_records", "yes"),
        ("count_fetch_records", 1),
        ("count_fetch_records", None),
        ("proxy_name", 5),
        ("proxy_name", None),
        ("max_pending_intervals", 0),
        ("max_pending_intervals", 100_001),
        ("max_pending_intervals", 2.0),
    ],
)
def test_bad_usage_log_values_name_their_path(key, value):
    with pytest.raises(ConfigError) as raised:
        _config({"directory": "/tmp/usage", key: value})
    assert raised.value.path == f"usage_log.{key}"
    assert str(raised.value).startswith(f"usage_log.{key}: ")
    assert repr(value) in str(raised.value)


def test_unknown_usage_log_key_is_rejected():
    with pytest.raises(ConfigError) as raised:
        _config({"directory": "/tmp/usage", "dir": "/tmp"})
    assert raised.value.path == "usage_log.dir"
    assert "unknown key" in str(raised.value)


@pytest.mark.parametrize("value", [["/tmp"], "/tmp/usage", 5])
def test_usage_log_must_be_a_mapping(value):
    with pytest.raises(ConfigError) as raised:
        _config(value)
    assert raised.value.path == "usage_log"


def test_the_proxy_name_defaults_to_the_host_name(tmp_path):
    from proxy.app.server import ProxyServer

    server = ProxyServer(_config({"directory": str(tmp_path)}))
    try:
        assert server.usage is not None
        assert server.usage.writer.proxy_name == socket.gethostname()
    finally:
        server.usage._executor.shutdown()
    named = ProxyServer(_config({"directory": str(tmp_path), "proxy_name": "edge-1", "interval_seconds": 5}))
    try:
        assert named.usage.writer.proxy_name == "edge-1"
        assert named.usage.aggregator.interval_s == 5
    finally:
        named.usage._executor.shutdown()
    assert ProxyServer(parse_config({"upstream": UPSTREAM})).usage is None


@pytest.mark.parametrize(("fleet", "written"), [
    ({"enabled": True}, "__kqp_quota_usage"),
    ({"enabled": True, "topic": "edge-usage"}, "edge-usage"),
    ({"enabled": False, "topic": "edge-usage"}, ""),
    (None, ""),
])
def test_the_proxy_tells_the_usage_log_its_fleets_topic(tmp_path, fleet, written):
    from proxy.app.server import ProxyServer

    raw = {"upstream": UPSTREAM, "usage_log": {"directory": str(tmp_path)}}
    if fleet is not None:
        raw["fleet"] = fleet
    server = ProxyServer(parse_config(raw))
    try:
        assert server.usage is not None and server.usage.writer.fleet == written
    finally:
        server.usage._executor.shutdown()
