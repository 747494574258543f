"""quotas.fleet_totals: the totals records owners publish (``fleet.aggregation: owners``), who
owns which partition, and what a member applies of them."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quotas import PRODUCER_BYTE_RATE, REQUEST_RATE, QuotaManager
from quotas.entities import QuotaRule
from quotas.fleet import MAX_AMOUNT, BadReport, UsageEntry, UsageReport
from quotas.fleet_totals import (
    Included,
    OwnersView,
    OwnReports,
    PartitionSums,
    Totals,
    TotalsRanges,
    decode_totals,
    encode_totals,
    owner_of,
    totals_head,
)

ENTRY = UsageEntry(PRODUCER_BYTE_RATE, None, "tenant", 1000.0)


def totals(owner: str = "o", partition: int = 0, start: int = 0, end: int = 10,
           members: tuple[Included, ...] = (), entries: tuple[UsageEntry, ...] = (ENTRY,)) -> Totals:
    return Totals(owner, 7, partition, start, end, 1_700_000_000_000, 250, members, entries)


names = st.one_of(st.none(), st.text(max_size=20))
entries = st.lists(st.builds(UsageEntry, st.sampled_from([PRODUCER_BYTE_RATE, REQUEST_RATE]), names, names,
                             st.floats(0, MAX_AMOUNT)), max_size=30)
included = st.lists(st.builds(Included, st.text(min_size=1, max_size=20), st.integers(0, 2**63),
                              st.integers(0, 2**40), st.integers(2**40, 2**41), st.booleans()), max_size=8)


@given(entries, included, st.integers(0, 2**40), st.integers(0, 2**40))
def test_totals_read_back_as_written(written, members, start, length):
    t = totals(start=start, end=start + length, members=tuple(members), entries=tuple(written))
    (value,) = encode_totals(t)
    back, read = decode_totals(value)
    assert back == Totals(t.owner_id, t.owner_incarnation, t.partition, t.from_offset, t.next_offset, t.sent_at_ms,
                          t.interval_ms, t.members)
    assert read == [((e.kind, e.user, e.client_id), e.amount) for e in written]


def test_large_totals_are_split_into_records_of_the_same_range_and_members():
    members = (Included("m", 1, 3, 9),)
    many = tuple(UsageEntry(PRODUCER_BYTE_RATE, None, f"c{i}", 1.0) for i in range(25))
    values = encode_totals(totals(start=5, end=9, members=members, entries=many), max_entries=10)
    assert len(values) == 3
    heads = [totals_head(v).totals for v in values]
    assert {(h.from_offset, h.next_offset, h.members) for h in heads} == {(5, 9, members)}
    assert sum(len(decode_totals(v)[1]) for v in values) == 25


def test_hostile_totals_are_refused_with_a_reason():
    (good,) = encode_totals(totals(members=(Included("m", 1, 3, 9),)))
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
    # A member count far past what the record holds: refused before anything is allocated.
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


def test_partition_sums_add_up_reports_and_name_who_sent_them():
    sums = PartitionSums(2, from_offset=100)
    key = (PRODUCER_BYTE_RATE, None, "tenant")
    sums.add(UsageReport("a", 1, 5, 10_000, 250), [(key, 10.0)], 101)
    sums.add(UsageReport("a", 1, 6, 10_250, 250), [(key, 5.0)], 102)
    sums.add(UsageReport("b", 4, 9, 9_000, 250), [(key, 1.0)], 103)
    sums.moved_to(110)  # records that summed nothing (bad ones, duplicates)
    t = sums.take("owner", 3, 10_500, 250, fresh_ms=1000)
    assert (t.from_offset, t.next_offset, t.partition) == (100, 110, 2)
    assert t.entries == (UsageEntry(PRODUCER_BYTE_RATE, None, "tenant", 16.0),)
    assert set(t.members) == {Included("a", 1, 5, 6, True), Included("b", 4, 9, 9, False)}  # b's is 1.5 s old
    empty = sums.take("owner", 3, 10_750, 250, fresh_ms=1000)
    assert (empty.from_offset, empty.next_offset, empty.members, empty.entries) == (110, 110, (), ())


def test_own_reports_give_this_members_part_of_a_range_of_them():
    own = OwnReports(max_reports=3)
    key = (PRODUCER_BYTE_RATE, None, "tenant")
    own.note(1, [UsageEntry(*key, 10.0)])
    own.note(2, [UsageEntry(*key, 20.0)])
    own.note(2, [UsageEntry(*key, 25.0)])  # written again after a failed write: what it carries now
    own.note(3, [])
    assert own.part(1, 2) == {key: 35.0}
    assert own.part(3, 3) == {}
    own.note(4, [UsageEntry(*key, 1.0)])  # past max_reports: the oldest is forgotten
    assert own.part(1, 4) == {key: 26.0}


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


def test_a_starting_member_owns_every_partition_until_its_own_totals_name_the_others():
    view = OwnersView("a", 16, timeout_ms=2000)
    assert view.live(0) == ["a"] and view.owned(0) == list(range(16))
    # Another owner's totals are not trusted before a trusted record names it: they change nothing.
    assert view.read(totals("b", members=(Included("b", 1, 1, 1), Included("c", 1, 1, 1))), 100) == "untrusted_owner"
    assert view.live(100) == ["a"]
    # Its own totals (it owns every partition) name the members whose reports it read.
    assert view.read(totals("a", members=(Included("b", 1, 1, 1), Included("c", 1, 1, 1))), 200) is None
    assert view.live(200) == ["a", "b", "c"]
    owned = view.owned(200)
    assert owned == [p for p in range(16) if owner_of(p, ["a", "b", "c"]) == "a"]
    someone_elses = next(p for p in range(16) if p not in owned)
    rightful = owner_of(someone_elses, ["a", "b", "c"])
    wrong = next(m for m in ("b", "c") if m != rightful)
    assert view.read(totals(wrong, partition=someone_elses), 300) == "not_owner"
    assert view.read(totals(rightful, partition=someone_elses), 300) is None


def test_a_failed_owner_is_dropped_after_the_timeout_and_its_members_are_not():
    # Ids where v owns the partition b writes its reports to, and b owns nothing.
    ids = next(ids for k in range(1000) for ids in [[f"a{k}", f"b{k}", f"v{k}"]]
               if owner_of(OwnersView("", 3, 1).home(ids[1]), ids) == ids[2]
               and all(owner_of(p, ids) != ids[1] for p in range(3)))
    a, b, v = ids
    view = OwnersView(a, 3, timeout_ms=2000)
    view.read(totals(a, members=tuple(Included(i, 1, 1, 1) for i in ids)), 0)
    assert view.live(0) == ids
    # Until 1,000 ms every owner publishes each interval, naming who writes to its partitions;
    # then v is killed: nothing more from it, and nobody names b (v summed its partition).
    for t in range(0, 3300, 250):
        for p in range(3):
            owner = owner_of(p, view.live(t))
            named = tuple(Included(m, 1, t, t) for m in ids if view.home(m) == p)
            if owner == a or (owner == v and t <= 1000):
                assert view.read(totals(owner, partition=p, start=t, end=t, members=named), t) is None
        if t < 3000:
            assert v in view.live(t), t  # within the timeout of its last totals
    assert view.live(3000) == [a, b]  # v gone after the timeout; b kept: its silence was v's
    assert view.owned(3000) == [p for p in range(3) if owner_of(p, [a, b]) == a]
    assert owner_of(view.home(b), [a, b]) in (a, b)  # b's partition has an owner again
    # The new owner reads v's last reports late: they do not bring v back.
    view.read(totals(a, partition=view.home(v), start=3000, end=3100, members=(Included(v, 1, 9, 9, fresh=False),)),
              3100)
    assert v not in view.live(3100)


def test_a_member_of_a_silent_partition_goes_after_three_timeouts():
    view = OwnersView("a", 2, timeout_ms=1000)
    view.read(totals("a", partition=1 - view.home("x"), members=(Included("x", 1, 1, 1),)), 0)
    # x never published (owns nothing); no totals were read of its partition since it was named.
    assert "x" in view.live(2999)
    assert "x" not in view.live(3000)
    view.read(totals("a", partition=1 - view.home("y"), members=(Included("y", 1, 1, 1),)), 4000)
    view.read(totals("a", partition=view.home("y")), 4100)  # its partition heard from without it
    assert "y" in view.live(4999) and "y" not in view.live(5000)


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
