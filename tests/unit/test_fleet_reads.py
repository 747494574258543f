"""What reading the usage topic may cost a fleet member: at most ``max_remote_entries_per_s``
entries a second are applied (a record past it is dropped unread, counted, and still tells who is
in the fleet), and a long read gives the event loop a turn every few hundred entries. The
records are built here as a broker would return them; the topic itself is not needed for what
is checked."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from types import SimpleNamespace

from kafka.record.memory_records import MemoryRecordsBuilder

from config.model import FleetConfig, UpstreamConfig
from proxy.cluster.dialer import BrokerDialer
from proxy.control.fleet import APPLY_SLICE_ENTRIES, FleetExchange
from proxy.observability.stats import ProxyStats
from quotas import PRODUCER_BYTE_RATE, QuotaManager
from quotas.entities import QuotaRule
from quotas.fleet import MAX_RECORD_ENTRIES, UsageEntry, UsageReport, encode_report

BUDGET = MAX_RECORD_ENTRIES  # the least max_remote_entries_per_s may be


class Clock:
    def __init__(self) -> None:
        self.now_ms = 1_000_000

    def __call__(self) -> int:
        return self.now_ms


def exchange(clock: Clock, window_ms: int = 1000, loaded: bool = True) -> FleetExchange:
    config = FleetConfig(enabled=True, instance_id="a:9092", max_remote_entries_per_s=BUDGET)
    manager = QuotaManager([QuotaRule(None, "<default>", {PRODUCER_BYTE_RATE: 1e9})], max_entities=1_000_000)
    # Only the dialer's rate-limited failure log is used of the cluster: reading is not.
    cluster = SimpleNamespace(dialer=BrokerDialer(UpstreamConfig(bootstrap_servers=("127.0.0.1:9",)), ProxyStats()))
    fleet = FleetExchange(config, cluster, manager, timeout_s=1.0, window_ms=window_ms,  # type: ignore[arg-type]
                          clock=clock)
    if loaded:
        fleet.loaded.set()
    return fleet


def report(member: str, seq: int, entries: int, sent_at_ms: int) -> bytes:
    values = encode_report(UsageReport(member, 1, seq, sent_at_ms, 250, tuple(
        UsageEntry(PRODUCER_BYTE_RATE, None, f"client-{i}", 1.0) for i in range(entries))),
        max_entries=entries or 1)
    assert len(values) == 1
    return values[0]


def wall_ms() -> int:
    return int(time.time() * 1000)


def records(values: list[bytes]) -> bytes:
    builder = MemoryRecordsBuilder(magic=2, compression_type=0, batch_size=1 << 26)
    for i, value in enumerate(values):
        builder.append(i, None, value)
    builder.close()
    return bytes(builder.buffer())


def apply(fleet: FleetExchange, values: list[bytes]) -> int:
    """Reads ``values`` as one fetch of partition 0 returns them; the entries applied."""
    before = fleet.remote_applied
    fleet._reader.next_offsets = {0: 0}
    asyncio.run(fleet._apply(records(values), {0: 0}, 0))
    return fleet.remote_applied - before


def test_a_flood_past_the_budget_is_dropped_unread_and_still_counts_as_a_heartbeat():
    clock = Clock()
    fleet = exchange(clock)
    now = wall_ms()
    assert apply(fleet, [report("forger", 1, BUDGET + 1, now)]) == 0
    assert fleet.ignored["over_budget"] == 1 and fleet.remote_dropped == BUDGET + 1
    assert len(fleet.members) == 1  # its heartbeat counts: it is a member, its entries are not applied
    # A second's worth is applied, then nothing more until the budget refills with time.
    assert apply(fleet, [report("b", 1, BUDGET // 2, now), report("c", 1, BUDGET // 2, now),
                         report("d", 1, 1, now)]) == BUDGET
    assert fleet.ignored["over_budget"] == 2 and len(fleet.members) == 4
    clock.now_ms += 500
    assert apply(fleet, [report("d", 2, BUDGET // 2, now)]) == BUDGET // 2
    assert fleet.ignored["over_budget"] == 2


def test_at_start_the_history_inside_the_window_has_a_window_of_budget():
    """Until the usage inside the window is read, it may hold a window's worth of entries (here
    11 s of 10,000 a second): a restart reads what the fleet really reported."""
    clock = Clock()
    fleet = exchange(clock, window_ms=11_000, loaded=False)
    old = wall_ms() - 10_000  # written before this instance started, by members maybe gone
    assert apply(fleet, [report(f"m{i}", 1, BUDGET, old) for i in range(12)]) == 11 * BUDGET
    assert fleet.ignored["over_budget"] == 1


def test_the_entries_of_one_read_are_summed_per_entity_and_applied_once():
    clock = Clock()
    fleet = exchange(clock)
    now = wall_ms()
    assert apply(fleet, [report(f"m{i}", 1, 3, now) for i in range(5)]) == 15
    stats = {s.client_id: s.rate for s in fleet._manager.entity_stats(clock())}
    single = exchange(Clock())
    apply(single, [report("m0", 1, 3, now)])
    one = {s.client_id: s.rate for s in single._manager.entity_stats(clock())}
    assert sorted(stats) == sorted(one) == ["client-0", "client-1", "client-2"]
    assert all(stats[c] == 5 * one[c] > 0 for c in stats)  # five members' 1.0 each, as one sum


def test_a_read_cut_short_applies_nothing_twice_and_loses_nothing():
    """A read cancelled at a turn of the loop (its timeout) has moved its offset past what it
    applied only: read again from there, every entry counts once."""
    clock = Clock()
    fleet = exchange(clock)
    now = wall_ms()
    data = records([report(f"m{i}", 1, 100, now) for i in range(40)])
    fleet._reader.next_offsets = {0: 0}

    async def cut() -> None:
        task = asyncio.create_task(fleet._apply(data, {0: 0}, 0))
        for _ in range(3):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(cut())
    first = fleet.remote_applied
    assert 0 < first < 4_000 and fleet._reader.next_offsets[0] == first // 100
    asyncio.run(fleet._apply(data, {0: fleet._reader.next_offsets[0]}, 0))
    assert fleet.remote_applied == 4_000


def test_a_long_read_gives_the_loop_a_turn_every_few_hundred_entries_and_moves_the_offset_as_it_goes():
    clock = Clock()
    fleet = exchange(clock)
    now = wall_ms()
    data = records([report(f"m{i}", 1, 100, now) for i in range(40)])  # 4,000 entries
    turns = []

    async def main() -> dict[int, int]:
        offsets = {0: 0}
        fleet._reader.next_offsets = {0: 0}
        stop = asyncio.Event()

        async def ticker() -> None:
            while not stop.is_set():
                turns.append(fleet.remote_applied)
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        await fleet._apply(data, offsets, 0)
        stop.set()
        await task
        return offsets

    offsets = asyncio.run(main())
    assert fleet.remote_applied == 4_000
    assert offsets == {0: 40} and fleet._reader.next_offsets == {0: 40}
    # The ticker saw the entries applied grow a slice at a time.
    seen = sorted(set(turns))
    assert len(seen) >= 4_000 // APPLY_SLICE_ENTRIES
    assert all(b - a <= APPLY_SLICE_ENTRIES + 100 for a, b in itertools.pairwise(seen))
