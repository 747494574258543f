"""quotas.fleet_totals: the totals records owners publish (``fleet.aggregation: owners``), who
owns which partition, and what a member applies of them."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quotas import PRODUCER_BYTE_RATE, REQUEST_RATE, QuotaManager
from quotas.entities import QuotaRule
from quotas.fleet import MAX_AMOUNT, BadReport, UsageEntry
from quotas.fleet_totals import (
    Ownership,
    OwnReports,
    PartitionSums,
    Totals,
    TotalsRanges,
    decode_totals,
    encode_totals,
    entity_partition,
    owner_of,
    totals_head,
)

ENTRY = UsageEntry(PRODUCER_BYTE_RATE, None, "tenant", 1000.0)


def totals(owner: str = "o", partition: int = 0, start: int = 0, end: int = 10,
           entries: tuple[UsageEntry, ...] = (ENTRY,)) -> Totals:
    return Totals(owner, 7, partition, start, end, 1_700_000_000_000, 250, entries)


names = st.one_of(st.none(), st.text(max_size=20))
entries = st.lists(st.builds(UsageEntry, st.sampled_from([PRODUCER_BYTE_RATE, REQUEST_RATE]), names, names,
                             st.floats(0, MAX_AMOUNT)), max_size=30)
@given(entries, st.integers(0, 2**40), st.integers(0, 2**40))
def test_totals_read_back_as_written(written, start, length):
    t = totals(start=start, end=start + length, entries=tuple(written))
    (value,) = encode_totals(t)
    back, read = decode_totals(value)
    assert back == Totals(t.owner_id, t.owner_incarnation, t.partition, t.from_offset, t.next_offset, t.sent_at_ms,
                          t.interval_ms)
    assert read == [((e.kind, e.user, e.client_id), e.amount) for e in written]


def test_large_totals_are_split_into_records_of_the_same_range():
    many = tuple(UsageEntry(PRODUCER_BYTE_RATE, None, f"c{i}", 1.0) for i in range(25))
    values = encode_totals(totals(start=5, end=9, entries=many), max_entries=10)
    assert len(values) == 3
    heads = [totals_head(v).totals for v in values]
    assert {(h.from_offset, h.next_offset) for h in heads} == {(5, 9)}
    assert sum(len(decode_totals(v)[1]) for v in values) == 25


def test_hostile_totals_are_refused_with_a_reason():
    (good,) = encode_totals(totals())
    head_size = struct.calcsize(">4sBQIqqqI")
    cases = {
        "not_totals": b"KQPU" + good[4:],
        "truncated": good[: head_size - 1],
        "unknown_version": good[:4] + b"\x02" + good[5:],
        "bad_range": good[:17] + struct.pack(">qq", 10, 5) + good[33:],
    }
    for reason, value in cases.items():
        with pytest.raises(BadReport) as info:
            decode_totals(value)
        assert info.value.reason == reason, reason
    # An entry count far past what the record holds: refused before anything is allocated.
    at = good.index(b"\x00\x00\x00\x01", head_size)
    with pytest.raises(BadReport, match="truncated"):
        decode_totals(good[:at] + struct.pack(">I", 2**31) + good[at + 4:])
    # Every cut of a good record is refused, never misread.
    for cut in range(len(good)):
        with pytest.raises(BadReport):
            decode_totals(good[:cut])


def test_ownership_moves_only_the_partitions_a_member_takes_or_held():
    members = [f"proxy-{i}" for i in range(8)]
    before = {p: owner_of(p, members) for p in range(64)}
    assert set(before.values()) == set(members)  # every member owns some of 64
    assert owner_of(3, reversed(members)) == before[3]  # the order members are known in does not matter
    after = {p: owner_of(p, members[:-1]) for p in range(64)}
    assert {p for p in before if before[p] != after[p]} == {p for p in before if before[p] == "proxy-7"}
    joined = {p: owner_of(p, [*members, "proxy-8"]) for p in range(64)}
    assert all(joined[p] in (before[p], "proxy-8") for p in before)
    assert owner_of(0, []) is None


def test_partition_sums_add_up_reports_by_entity():
    sums = PartitionSums(2, from_offset=100)
    key = (PRODUCER_BYTE_RATE, None, "tenant")
    sums.add([(key, 10.0)], 101)
    sums.add([(key, 5.0), ((REQUEST_RATE, None, "tenant"), 2.0)], 102)
    sums.moved_to(110)  # records that summed nothing (bad ones, duplicates)
    t = sums.take("owner", 3, 10_500, 250)
    assert (t.owner_id, t.from_offset, t.next_offset, t.partition) == ("owner", 100, 110, 2)
    assert t.entries == (UsageEntry(PRODUCER_BYTE_RATE, None, "tenant", 15.0),
                         UsageEntry(REQUEST_RATE, None, "tenant", 2.0))
    empty = sums.take("owner", 3, 10_750, 250)
    assert (empty.from_offset, empty.next_offset, empty.entries) == (110, 110, ())


def test_own_reports_give_what_this_member_wrote_in_a_range_of_offsets():
    own = OwnReports(max_reports=3)
    key = (PRODUCER_BYTE_RATE, None, "tenant")
    own.note(0, 10, [UsageEntry(*key, 10.0)])
    own.note(1, 11, [UsageEntry(*key, 99.0)])  # another partition: not in partition 0's totals
    own.note(0, 15, [UsageEntry(*key, 20.0)])
    own.note(0, 30, [UsageEntry(*key, 1.0)])
    assert own.part(0, 12, 20) == {key: 20.0}  # offset 10 was before the range: dropped
    assert own.part(0, 12, 20) == {key: 20.0}  # the next chunk of the same totals
    assert own.part(0, 20, 30) == {}
    assert own.part(0, 30, 31) == {key: 1.0}
    assert own.part(1, 0, 100) == {key: 99.0}
    for offset in range(5):
        own.note(2, offset, [UsageEntry(*key, 1.0)])  # past max_reports a partition: the oldest forgotten
    assert own.part(2, 0, 5) == {key: 3.0}


def test_every_entity_is_summed_in_one_partition_and_they_spread():
    keys = [(PRODUCER_BYTE_RATE, None, f"client-{i}") for i in range(3200)]
    counts = [0] * 32
    for key in keys:
        counts[entity_partition(key, 32)] += 1
    assert min(counts) > 50 and max(counts) < 150  # 100 each on average
    # A label the entity does not have is not the empty name.
    assert {entity_partition((REQUEST_RATE, u, c), 1 << 20) for u, c in
            [(None, "a"), ("", "a"), ("a", None), ("a", "")]}.__len__() == 4


def test_ranges_are_applied_in_order_and_never_twice():
    ranges = TotalsRanges()
    assert ranges.end(0) is None
    assert ranges.accept(totals("a", start=0, end=10))
    assert ranges.accept(totals("a", start=0, end=10))  # the next chunk of the same record
    assert not ranges.accept(totals("b", start=5, end=20))  # another owner's overlapping range
    assert ranges.accept(totals("b", start=10, end=20))
    assert ranges.accept(totals("b", start=25, end=30))  # a gap (totals lost): later ones still count
    assert ranges.end(0) == 30 and ranges.end(1) is None
    assert ranges.accept(totals("b", partition=1, start=0, end=3))


def test_ownership_is_worked_out_again_only_when_the_members_change():
    ownership = Ownership("a", 16)
    assert ownership.owned(["a"]) == list(range(16))  # alone: every partition
    owners = ownership.owners(["c", "a", "b"])
    assert owners == [owner_of(p, ["a", "b", "c"]) for p in range(16)]
    assert ownership.owned(["b", "c", "a"]) == [p for p in range(16) if owners[p] == "a"]
    assert ownership.owners(["a", "b", "c"]) is owners  # the same members: not hashed again
    assert ownership.owners(["a", "b"]) is not owners


def test_a_fleet_of_owners_paces_by_two_reports_on_their_way():
    manager = QuotaManager([QuotaRule(None, "<default>", {PRODUCER_BYTE_RATE: 1000.0})])
    manager.set_fleet(3, 250, reports_in_flight=2)
    manager.take_local_usage(0)
    state = lambda: manager._table.get((PRODUCER_BYTE_RATE, None, "c"))  # noqa: E731
    manager.check_and_record("", "c", PRODUCER_BYTE_RATE, 300.0, 10)
    manager.take_local_usage(250)
    assert state().reported == 300.0
    manager.check_and_record("", "c", PRODUCER_BYTE_RATE, 100.0, 260)
    manager.take_local_usage(500)
    assert state().reported == 400.0  # this report and the one before, still on their way
    manager.take_local_usage(750)
    assert state().reported == 100.0
    manager.take_local_usage(1000)
    assert state().reported == 0.0
    manager.set_fleet(3, 250)  # the flat exchange: the last report only
    manager.check_and_record("", "c", PRODUCER_BYTE_RATE, 50.0, 1010)
    manager.take_local_usage(1250)
    manager.take_local_usage(1500)
    assert state().reported == 0.0
