"""What a member applies of the totals topic (``fleet.aggregation: owners``): the others' part of
each total (its own taken out), from the partition's owner only, each range once, within the
read budget; a forged owner changes nothing. The records are built as a broker returns them."""

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
from quotas.fleet import MAX_RECORD_ENTRIES, UsageEntry, UsageReport, encode_report
from quotas.fleet_totals import Included, Totals, encode_totals, owner_of
from tests.unit.test_fleet_reads import Clock, records

KEY = (PRODUCER_BYTE_RATE, None, "tenant")


def exchange(clock: Clock) -> OwnersExchange:
    config = FleetConfig(enabled=True, instance_id="a", aggregation="owners", partitions=1,
                         max_remote_entries_per_s=MAX_RECORD_ENTRIES)
    manager = QuotaManager([QuotaRule(None, "<default>", {PRODUCER_BYTE_RATE: 1e9})], max_entities=100_000)
    cluster = SimpleNamespace(dialer=BrokerDialer(UpstreamConfig(bootstrap_servers=("127.0.0.1:9",)), ProxyStats()))
    fleet = OwnersExchange(config, cluster, manager, 1.0, 1000, clock)  # type: ignore[arg-type]
    fleet.loaded.set()
    return fleet


def totals_value(owner: str, start: int, end: int, members: tuple[Included, ...], amount: float,
                 clients: int = 1) -> bytes:
    (value,) = encode_totals(Totals(owner, 1, 0, start, end, int(time.time() * 1000), 250, members, tuple(
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
    fleet._own.note(4, [UsageEntry(*KEY, 1000.0)])
    fleet._own.note(5, [UsageEntry(*KEY, 200.0)])
    # Its own totals (it owns the one partition): b's 300 and its own 1,000 of seq 4.
    members = (Included("a", fleet.incarnation, 4, 4), Included("b", 9, 1, 1))
    apply(fleet, [totals_value("a", 0, 10, members, 1300.0)])
    assert remote(fleet) == 300.0
    assert fleet.size() == 2 and fleet.remote_applied == 1


def test_a_forged_owner_a_repeated_range_and_a_flood_change_nothing():
    fleet = exchange(Clock())
    apply(fleet, [
        totals_value("mallory", 0, 10, (Included("mallory", 1, 1, 1),), 5e6),  # never named by a trusted owner
        totals_value("a", 0, 10, (Included("b", 9, 1, 1),), 300.0),
    ])
    assert remote(fleet) == 300.0
    assert fleet.ignored["untrusted_owner"] == 1 and fleet.size() == 2
    owner = owner_of(0, ["a", "b"])
    apply(fleet, [
        totals_value(owner, 5, 10, (Included("b", 9, 1, 1),), 300.0),  # a range already applied
        totals_value(owner, 10, 20, (Included("b", 9, 2, 2),), 50.0, clients=MAX_RECORD_ENTRIES + 1),
    ])
    assert fleet.ignored["duplicate"] == 1
    assert fleet.ignored["over_budget"] == 1 and fleet.remote_dropped == MAX_RECORD_ENTRIES + 1
    assert remote(fleet) == 300.0


def test_an_owner_sums_its_partitions_reports_and_its_own():
    fleet = exchange(Clock())
    values = [encode_report(UsageReport(m, inc, seq, int(time.time() * 1000), 250, (UsageEntry(*KEY, 10.0),)))[0]
              for m, inc, seq in (("a", fleet.incarnation, 0), ("b", 9, 0), ("b", 9, 1), ("b", 9, 1))]
    fleet._reader.next_offsets = {0: 0}
    asyncio.run(fleet._apply_owned(records(values), {0: 0}, 0))
    t = fleet._sums[0].take("a", fleet.incarnation, int(time.time() * 1000), 250, 1500)
    assert t.entries == (UsageEntry(*KEY, 30.0),)  # the duplicate (b's seq 1 twice) once
    assert (t.from_offset, t.next_offset) == (0, 4)
    assert set(t.members) == {Included("a", fleet.incarnation, 0, 0), Included("b", 9, 0, 1)}
    assert remote(fleet) == 0.0  # an owner's sums go to the totals topic, not into its samples
