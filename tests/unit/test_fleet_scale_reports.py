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
