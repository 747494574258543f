"""bench.fleet_scale's simulated members write what members write: a report encoded once, its
incarnation, sequence number and send time rewritten in place, decodes (quotas.fleet) as the
report those counters name, every entry intact, in one chunk or several."""

from __future__ import annotations

import pytest

from bench.fleet_scale import _COUNTERS, _COUNTERS_AT, parse_grid
from quotas.common import PRODUCER_BYTE_RATE
from quotas.fleet import UsageEntry, UsageReport, decode_report, encode_report


@pytest.mark.parametrize("entities, max_bytes", [(3, 1 << 20), (400, 4096)])
def test_a_report_rewritten_in_place_decodes_as_the_report_it_names(entities, max_bytes):
    entries = tuple(UsageEntry(PRODUCER_BYTE_RATE, None, f"client-{i}", float(i + 1)) for i in range(entities))
    chunks = [bytearray(v) for v in encode_report(UsageReport("sim-member-0", 1, 0, 0, 250, entries), max_bytes)]
    for i, chunk in enumerate(chunks):
        _COUNTERS.pack_into(chunk, _COUNTERS_AT, 7, 1000 + i, 1_700_000_000_123)
    decoded = [decode_report(bytes(c)) for c in chunks]
    assert [(r.incarnation, r.seq, r.sent_at_ms, r.interval_ms, r.instance_id) for r in decoded] == [
        (7, 1000 + i, 1_700_000_000_123, 250, "sim-member-0") for i in range(len(chunks))]
    assert tuple(e for r in decoded for e in r.entries) == entries
    assert (len(chunks) > 1) == (max_bytes < 1 << 20)


def test_the_grid_reads_members_by_entities():
    assert [(p.members, p.entities, p.label) for p in parse_grid("4x2000, 32x10000")] == [
        (4, 2000, "4x2000"), (32, 10000, "32x10000")]


def test_simulated_owners_sum_what_the_members_they_stand_for_write():
    """With aggregation owners: the real member is given an id that owns a partition, and the
    partitions the simulated members own carry every entity of theirs, summed over the members,
    once; none the real member owns."""
    from bench.fleet_scale import Load, Point, member_entries, owned_totals, real_member_id, sim_ids
    from quotas.fleet_totals import entity_partition, owner_of

    point, load, partitions = Point(40, 2000), Load(0.05, 0.001, 0.5, "owners"), 8
    ids = sim_ids(point)
    real = real_member_id(point, load, partitions)
    owners = {p: owner_of(p, [*ids, real]) for p in range(partitions)}
    assert real in owners.values()
    totals = owned_totals(point, load, partitions, ids, real)
    assert set(totals) == {p for p, owner in owners.items() if owner != real}
    expected: dict[tuple, float] = {}
    for m in range(point.members):
        for e in member_entries(point, load, m):
            key = (e.kind, e.user, e.client_id)
            if owners[entity_partition(key, partitions)] != real:
                expected[key] = expected.get(key, 0.0) + e.amount
    summed = {(e.kind, e.user, e.client_id): e.amount for _, entries in totals.values() for e in entries}
    assert summed == pytest.approx(expected) and expected
    assert all(owner == totals[p][0] for p, owner in owners.items() if p in totals)
