"""What a member applies of the totals topic (``fleet.aggregation: owners``): the others' part of
each total (its own taken out), from the partition's owner only, each range once, within the
read budget; heartbeats make the members; an owner sums its partitions' reports once each. The
records are built as a broker returns them; the topics themselves are not needed here."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from config.model import FleetConfig, UpstreamConfig
from proxy.cluster.dialer import BrokerDialer
from proxy.control.fleet_owners import OwnersExchange
from proxy.observability.stats import ProxyStats
from quotas import PRODUCER_BYTE_RATE, QuotaManager
from quotas.entities import QuotaRule
from quotas.fleet import MAX_RECORD_ENTRIES, UsageEntry, UsageReport, decode_report, encode_report
from quotas.fleet_totals import Totals, encode_totals, entity_partition, owner_of
from tests.unit.test_fleet_reads import Clock, records

KEY = (PRODUCER_BYTE_RATE, None, "tenant")


def exchange(clock: Clock, partitions: int = 1) -> OwnersExchange:
    config = FleetConfig(enabled=True, instance_id="a", aggregation="owners", partitions=partitions,
                         max_remote_entries_per_s=MAX_RECORD_ENTRIES)
    manager = QuotaManager([QuotaRule(None, "<default>", {PRODUCER_BYTE_RATE: 1e9})], max_entities=100_000)
    cluster = SimpleNamespace(dialer=BrokerDialer(UpstreamConfig(bootstrap_servers=("127.0.0.1:9",)), ProxyStats()))
    fleet = OwnersExchange(config, cluster, manager, 1.0, 1000, clock)  # type: ignore[arg-type]
    fleet.loaded.set()
    return fleet


def heartbeat(member: str, seq: int = 1) -> bytes:
    return encode_report(UsageReport(member, 9, seq, int(time.time() * 1000), 250))[0]


def totals_value(owner: str, start: int, end: int, amount: float, clients: int = 1, partition: int = 0) -> bytes:
    (value,) = encode_totals(Totals(owner, 1, partition, start, end, int(time.time() * 1000), 250, tuple(
        UsageEntry(PRODUCER_BYTE_RATE, None, "tenant" if i == 0 else f"c{i}", amount) for i in range(clients))),
        max_entries=MAX_RECORD_ENTRIES * 2)
    return value


def apply(fleet: OwnersExchange, values: list[bytes]) -> None:
    fleet._totals.next_offsets = {0: 0}
    asyncio.run(fleet._apply_totals(records(values), {0: 0}, 0))


def remote(fleet: OwnersExchange) -> float:
    state = fleet._manager._table.get(KEY)
    return 0.0 if state is None else state.remote


def test_a_member_applies_the_others_part_of_its_owners_totals():
    fleet = exchange(Clock())
    fleet._own.note(0, 4, [UsageEntry(*KEY, 1000.0)])
    fleet._own.note(0, 15, [UsageEntry(*KEY, 200.0)])  # past the range: in the next totals
    # Alone, it owns the one partition: b's 300 and its own 1,000 at offset 4.
    apply(fleet, [totals_value("a", 0, 10, 1300.0)])
    assert remote(fleet) == 300.0 and fleet.remote_applied == 1


def test_heartbeats_make_the_members_and_the_owner_theirs():
    fleet = exchange(Clock(), partitions=8)
    apply(fleet, [heartbeat("b"), heartbeat("c"), heartbeat("c")])
    assert fleet.size() == 3 and fleet.ignored["duplicate"] == 1  # a heartbeat read twice is not news
    assert fleet.owned() == [p for p in range(8) if owner_of(p, ["a", "b", "c"]) == "a"]


def test_a_made_up_owner_a_repeated_range_and_a_flood_change_nothing():
    fleet = exchange(Clock())
    apply(fleet, [heartbeat("b")])
    owner = owner_of(0, ["a", "b"])
    other = "a" if owner == "b" else "b"
    apply(fleet, [
        totals_value("mallory", 0, 10, 5e6),  # no heartbeat: not a member, owns nothing
        totals_value(other, 0, 10, 5e6),  # a member, not this partition's owner
        totals_value(owner, 0, 10, 300.0),
        totals_value(owner, 5, 10, 300.0),  # a range already applied
        totals_value(owner, 10, 20, 50.0, clients=MAX_RECORD_ENTRIES + 1),  # past the read budget
    ])
    assert fleet.ignored["not_owner"] == 2 and fleet.ignored["duplicate"] == 1
    assert fleet.ignored["over_budget"] == 1 and fleet.remote_dropped == MAX_RECORD_ENTRIES + 1
    assert remote(fleet) == 300.0 and fleet.size() == 2


def test_an_owner_sums_its_partitions_reports_and_its_own_once_each():
    fleet = exchange(Clock())
    now = int(time.time() * 1000)
    values = [encode_report(UsageReport(m, inc, seq, now, 250, (UsageEntry(*KEY, 10.0),)))[0]
              for m, inc, seq in (("a", fleet.incarnation, 0), ("b", 9, 0), ("b", 9, 1), ("b", 9, 1))]
    fleet._reader.next_offsets = {0: 0}
    asyncio.run(fleet._apply_owned(records(values), {0: 0}, 0))
    t = fleet._sums[0].take("a", fleet.incarnation, now, 250)
    assert t.entries == (UsageEntry(*KEY, 30.0),)  # b's seq 1 read twice: once
    assert (t.from_offset, t.next_offset) == (0, 4)
    assert remote(fleet) == 0.0 and fleet.size() == 1  # sums go to the totals topic; reports are not heartbeats


def test_a_members_report_goes_to_its_entities_partitions():
    config = FleetConfig(enabled=True, instance_id="a", aggregation="owners", partitions=8)
    manager = QuotaManager([QuotaRule(None, "<default>", {PRODUCER_BYTE_RATE: 1e9})])
    fleet = OwnersExchange(config, None, manager, 1.0, 1000, Clock())  # type: ignore[arg-type]
    written: list[tuple[int, bytes]] = []

    async def write(value: bytes, partition: int) -> int:
        written.append((partition, value))
        return 100 + len(written)  # an offset of the partition

    fleet._write = write  # type: ignore[method-assign]
    entries = tuple(UsageEntry(PRODUCER_BYTE_RATE, None, f"c{i}", float(i + 1)) for i in range(40))
    asyncio.run(fleet._send_report(UsageReport("a", fleet.incarnation, 0, 0, 250, entries)))
    decoded = [(p, decode_report(v)) for p, v in written]
    assert [r.seq for _, r in decoded] == list(range(len(written)))
    assert len({p for p, _ in decoded}) == len(decoded) > 1  # one record a partition
    for i, (p, r) in enumerate(decoded):
        assert all(entity_partition((e.kind, e.user, e.client_id), 8) == p for e in r.entries)
        offset = 101 + i
        assert fleet._own.part(p, offset, offset + 1) == {(e.kind, e.user, e.client_id): e.amount for e in r.entries}
    assert sorted((e.client_id, e.amount) for _, r in decoded for e in r.entries) == sorted(
        (e.client_id, e.amount) for e in entries)


def test_the_history_read_at_start_is_taken_from_whoever_owned_it_then():
    fleet = exchange(Clock())
    fleet.loaded.clear()  # reading the totals inside the quota window, at start
    apply(fleet, [totals_value("gone", 0, 10, 300.0), totals_value("also-gone", 5, 12, 300.0),
                  totals_value("gone", 10, 20, 200.0)])
    assert remote(fleet) == 500.0 and fleet.ignored["duplicate"] == 1  # each range once
    fleet.loaded.set()
    apply(fleet, [totals_value("gone", 20, 30, 100.0)])  # now only its owner's (this one, alone)
    assert remote(fleet) == 500.0 and fleet.ignored["not_owner"] == 1


def test_a_report_flood_on_an_owned_partition_makes_no_one_a_member():
    """Reports on the usage topic never make members with owners (heartbeats do): not even a
    report dropped unread past the budget, which the flat exchange still counts as a heartbeat."""
    fleet = exchange(Clock())
    now = int(time.time() * 1000)
    entries = tuple(UsageEntry(PRODUCER_BYTE_RATE, None, f"c{i}", 1.0) for i in range(MAX_RECORD_ENTRIES))
    flood = [encode_report(UsageReport("forger", 1, seq, now, 250, entries))[0] for seq in range(2)]
    fleet._reader.next_offsets = {0: 0}
    asyncio.run(fleet._apply_owned(records(flood), {0: 0}, 0))  # the second is past a second's budget
    assert fleet.ignored["over_budget"] >= 1 and fleet.size() == 1
