"""The fleet's usage exchange, pure part (quotas.fleet) and the quota engine's side of it
(QuotaManager.take_local_usage / add_remote / set_share): synthetic instants, no I/O."""

from __future__ import annotations

import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quotas import CONTROLLER_MUTATION_RATE, PRODUCER_BYTE_RATE, QuotaManager
from quotas.entities import QuotaRule
from quotas.fleet import (
    KINDS,
    MAX_AMOUNT,
    BadReport,
    FleetMembers,
    UsageDecoder,
    UsageEntry,
    UsageReport,
    decode_report,
    decode_usage,
    encode_report,
    usage_entries,
)

REPORT = UsageReport("proxy-a:9092", incarnation=7, seq=41, sent_at_ms=1_700_000_000_000, interval_ms=250,
                     entries=(UsageEntry(PRODUCER_BYTE_RATE, "alice", None, 1_048_576.0),
                              UsageEntry(CONTROLLER_MUTATION_RATE, None, "storm-1", 6.0),
                              UsageEntry("request_rate", "bob", "app-é", 12.5)))


# -- the encoding --------------------------------------------------------------------------------


def test_a_report_round_trips():
    (value,) = encode_report(REPORT)
    assert decode_report(value) == REPORT


def test_a_heartbeat_has_no_entries_and_is_small():
    (value,) = encode_report(UsageReport("a", 1, 0, 5, 250))
    assert decode_report(value).entries == ()
    assert len(value) < 50


def test_a_large_report_is_split_into_records_of_its_own_with_consecutive_sequence_numbers():
    entries = tuple(UsageEntry(PRODUCER_BYTE_RATE, f"user-{i:05d}", None, float(i)) for i in range(2000))
    values = encode_report(UsageReport("a", 1, 10, 5, 250, entries), max_bytes=4096)
    assert len(values) > 1 and all(len(v) <= 4096 for v in values)
    decoded = [decode_report(v) for v in values]
    assert [d.seq for d in decoded] == list(range(10, 10 + len(values)))
    assert tuple(e for d in decoded for e in d.entries) == entries


def test_1000_entities_cost_about_30_bytes_each():
    entries = tuple(UsageEntry(PRODUCER_BYTE_RATE, f"user-{i:04d}", f"app-{i:04d}", 1e6) for i in range(1000))
    (value,) = encode_report(UsageReport("proxy-a:9092", 1, 0, 5, 250, entries))
    assert len(value) < 35 * 1000


@pytest.mark.parametrize("amount", [-1.0, math.nan, math.inf, -math.inf, MAX_AMOUNT * 2])
def test_an_absurd_amount_refuses_the_record(amount):
    (value,) = encode_report(UsageReport("a", 1, 0, 5, 250, (UsageEntry(PRODUCER_BYTE_RATE, "u", None, 1.0),)))
    bad = value[:-8] + struct.pack(">d", amount)
    with pytest.raises(BadReport) as info:
        decode_report(bad)
    assert info.value.reason == "bad_amount"


def test_another_version_or_no_magic_is_refused_by_reason():
    (value,) = encode_report(REPORT)
    with pytest.raises(BadReport, match="unknown_version"):
        decode_report(value[:4] + bytes([2]) + value[5:])
    with pytest.raises(BadReport, match="not_a_report"):
        decode_report(b"{\"json\": true}" + value)
    with pytest.raises(BadReport, match="trailing_bytes"):
        decode_report(value + b"\x00")
    kind_at = len(encode_report(UsageReport("proxy-a:9092", 7, 41, 0, 250))[0])  # the first entry's kind
    assert value[kind_at] == KINDS.index(PRODUCER_BYTE_RATE)
    with pytest.raises(BadReport, match="unknown_kind"):
        decode_report(value[:kind_at] + bytes([200]) + value[kind_at + 1:])


def test_every_truncation_is_refused_never_read_past():
    (value,) = encode_report(REPORT)
    for n in range(len(value)):
        with pytest.raises(BadReport):
            decode_report(value[:n])


def test_an_announced_count_larger_than_the_record_is_refused_before_reading():
    (value,) = encode_report(UsageReport("a", 1, 0, 5, 250))
    with pytest.raises(BadReport, match="truncated"):
        decode_report(value[:-4] + struct.pack(">I", 2**32 - 1))


@settings(max_examples=300)
@given(st.binary(max_size=300))
def test_garbage_raises_only_bad_report(data):
    try:
        decode_report(data)
    except BadReport:
        pass


def test_usage_entries_keep_positive_amounts_of_known_kinds():
    pending = [((PRODUCER_BYTE_RATE, "a", None), 5.0), ((PRODUCER_BYTE_RATE, "b", None), 0.0),
               (("no_such_kind", "c", None), 1.0)]
    assert usage_entries(pending) == (UsageEntry(PRODUCER_BYTE_RATE, "a", None, 5.0),)


# -- members ---------------------------------------------------------------------------------------


def test_a_record_read_twice_or_out_of_order_is_not_news_a_new_incarnation_is():
    members = FleetMembers(timeout_ms=1000)
    r = UsageReport("b", incarnation=1, seq=5, sent_at_ms=0, interval_ms=250)
    assert members.admit(r, 0)
    assert not members.admit(r, 10)
    assert not members.admit(UsageReport("b", 1, 4, 0, 250), 20)
    assert members.admit(UsageReport("b", 1, 6, 0, 250), 30)
    assert members.admit(UsageReport("b", 2, 0, 0, 250), 40)  # restarted: its sequence starts again


def test_members_silent_for_the_timeout_leave():
    members = FleetMembers(timeout_ms=1000)
    members.admit(UsageReport("b", 1, 0, 0, 250), 0)
    members.admit(UsageReport("c", 1, 0, 0, 250), 500)
    assert members.expire(999) == [] and len(members) == 2
    assert members.expire(1000) == ["b"] and [i for i, _ in members.live()] == ["c"]


def test_a_flood_of_made_up_members_is_capped():
    members = FleetMembers(timeout_ms=1000, max_members=3)
    assert all(members.admit(UsageReport(f"m{i}", 1, 0, 0, 250), 0) for i in range(3))
    assert not members.admit(UsageReport("m9", 1, 0, 0, 250), 10)
    assert len(members) == 3
    assert members.admit(UsageReport("m9", 1, 0, 0, 250), 1000)  # once the others timed out


# -- the quota engine's side ---------------------------------------------------------------------------


def manager(quota: float = 1000.0, kind: str = PRODUCER_BYTE_RATE, **kw) -> QuotaManager:
    return QuotaManager([QuotaRule("alice", None, {kind: quota})], **kw)


def test_local_usage_is_taken_once_and_remote_usage_is_never_reported_again():
    m = manager()
    m.check_and_record("alice", "app", PRODUCER_BYTE_RATE, 300, 1000)
    m.check_and_record("alice", "app", PRODUCER_BYTE_RATE, 200, 1100)
    assert m.add_remote(PRODUCER_BYTE_RATE, "alice", None, 700, 1100)
    assert m.take_local_usage() == [((PRODUCER_BYTE_RATE, "alice", None), 500)]
    assert m.take_local_usage() == []


def test_a_give_back_is_carried_into_the_next_report():
    m = manager()
    m.check_and_record("alice", "app", PRODUCER_BYTE_RATE, 300, 1000)
    assert m.take_local_usage() == [((PRODUCER_BYTE_RATE, "alice", None), 300)]
    m.unrecord("alice", "app", PRODUCER_BYTE_RATE, 100, 1100)  # a throttled Fetch's bytes
    assert m.take_local_usage() == []
    m.check_and_record("alice", "app", PRODUCER_BYTE_RATE, 250, 1200)
    assert m.take_local_usage() == [((PRODUCER_BYTE_RATE, "alice", None), 150)]


def test_two_instances_sharing_usage_throttle_as_one_would():
    """Two members each take half of one client's load; exchanging usage every 250 ms, each
    throttles as one instance taking all of it would (Kafka's formula on the fleet rate)."""
    one, a, b = manager(), manager(), manager()
    throttle_one = throttle_a = 0
    for t in range(0, 12_000, 50):
        now = 1_000_000 + t
        throttle_one = one.check_and_record("alice", "x", PRODUCER_BYTE_RATE, 200, now).throttle_ms
        throttle_a = a.check_and_record("alice", "x", PRODUCER_BYTE_RATE, 100, now).throttle_ms
        b.check_and_record("alice", "y", PRODUCER_BYTE_RATE, 100, now)
        if t % 250 == 0:
            for src, dst in ((a, b), (b, a)):
                for (kind, user, client_id), amount in src.take_local_usage():
                    dst.add_remote(kind, user, client_id, amount, now)
    assert throttle_one > 0
    assert abs(throttle_a - throttle_one) <= 0.05 * throttle_one + 250


def test_a_principal_on_one_instance_keeps_its_whole_quota():
    a = manager()
    for t in range(0, 11_000, 100):
        decision = a.check_and_record("alice", "x", PRODUCER_BYTE_RATE, 90, 1_000_000 + t)  # 900 B/s < 1000
        assert decision.throttle_ms == 0


def test_remote_usage_of_an_entity_no_rule_here_gives_is_ignored_and_never_evicts():
    m = QuotaManager([QuotaRule("<default>", None, {PRODUCER_BYTE_RATE: 10.0})], max_entities=2)
    assert not m.add_remote(PRODUCER_BYTE_RATE, None, "app", 5, 0)  # no client-level rule here
    assert not m.add_remote("no_such_kind", "alice", None, 5, 0)
    m.check_and_record("alice", "x", PRODUCER_BYTE_RATE, 1, 0)
    m.check_and_record("bob", "x", PRODUCER_BYTE_RATE, 1, 0)
    assert not m.add_remote(PRODUCER_BYTE_RATE, "carol", None, 5, 0)  # full: nothing of ours goes
    assert m.live_entities == 2 and m.evicted_total == 0
    assert m.add_remote(PRODUCER_BYTE_RATE, "alice", None, 5, 0)


def test_remote_mutations_debit_the_token_bucket():
    m = manager(quota=1.0, kind=CONTROLLER_MUTATION_RATE)  # burst 11
    assert m.add_remote(CONTROLLER_MUTATION_RATE, "alice", None, 12, 0)
    assert m.tokens("alice", "x", CONTROLLER_MUTATION_RATE, 0) == pytest.approx(-1)
    assert not m.try_admit("alice", "x", CONTROLLER_MUTATION_RATE, 1, 0).admitted
    assert m.take_local_usage() == []


def test_the_share_fallback_divides_every_bound_and_comes_back_whole():
    m = manager(quota=900.0)
    m.check_and_record("alice", "x", PRODUCER_BYTE_RATE, 1, 0)
    m.set_share(3)
    assert [s.quota for s in m.entity_stats(0)] == [300.0]
    b = manager(quota=3.0, kind=CONTROLLER_MUTATION_RATE)
    b.set_share(3)
    b.try_admit("alice", "x", CONTROLLER_MUTATION_RATE, 0, 0)  # a new state takes the share too
    assert b.tokens("alice", "x", CONTROLLER_MUTATION_RATE, 0) == pytest.approx(11)
    m.set_share(1)
    assert [s.quota for s in m.entity_stats(0)] == [900.0]


def greedy_fleet(members: int, seconds: float, request: int = 100_000, sync_ms: int = 250, quota: float = 1e6,
                 clients: int | None = None) -> float:
    """``clients`` greedy clients (one per member, default every member) sending ``request`` bytes
    as soon as their throttle ends (held first while QuotaManager.paced_ms asks, as the rate
    filter does), members exchanging usage every ``sync_ms`` (read half an interval later); the
    bytes admitted in all."""
    ms = [QuotaManager([QuotaRule("alice", None, {PRODUCER_BYTE_RATE: quota})]) for _ in range(members)]
    for m in ms:
        m.set_fleet(members, sync_ms)
    free_at = [0] * (clients or members)
    in_flight: list[tuple[int, int, list]] = []  # (read at, by member, usage)
    admitted = 0.0
    for now in range(0, int(seconds * 1000), 5):
        for i, t in enumerate(free_at):
            if now >= t:
                held_ms = ms[i].paced_ms("alice", "x", PRODUCER_BYTE_RATE, request, now)
                if held_ms:  # the filter holds the request (proxy.dataplane.filters.quotas)
                    free_at[i] = now + held_ms
                    continue
                decision = ms[i].check_and_record("alice", "x", PRODUCER_BYTE_RATE, request, now)
                admitted += request
                free_at[i] = now + max(decision.throttle_ms, 5)
        if now % sync_ms == 0:
            in_flight += [(now + sync_ms // 2, i, m.take_local_usage(now)) for i, m in enumerate(ms)]
        for read_at, src, usage in [x for x in in_flight if x[0] <= now]:
            in_flight.remove((read_at, src, usage))
            for j, m in enumerate(ms):
                if j != src:
                    for (kind, user, client_id), amount in usage:
                        m.add_remote(kind, user, client_id, amount, now)
    return admitted


def test_a_burst_on_every_member_at_once_is_paced_to_about_one_burst():
    """Greedy clients starting together on three members: in the first second, about what one
    member alone admits (its window's burst), plus at most a request per member; unpaced, three
    bursts."""
    one = greedy_fleet(1, 1.0)
    three = greedy_fleet(3, 1.0)
    assert three <= one + 3 * 100_000 + 0.25 * 1e6 * 3, (one, three)
    assert three >= 0.8 * one


def test_pacing_leaves_a_principal_on_one_member_its_whole_quota():
    alone = greedy_fleet(1, 30.0)
    in_fleet = greedy_fleet(3, 30.0, clients=1)
    assert 0.95 <= in_fleet / alone <= 1.0, (alone, in_fleet)


def test_a_fetch_larger_than_a_members_part_of_the_burst_is_not_throttled_for_it():
    """Pacing a Fetch would starve its consumer: a throttled Fetch is answered empty and its
    bytes un-recorded, so the same large response would be refused again and again. It is
    throttled on the fleet's rate only (here under the bound: not at all)."""
    from quotas import CONSUMER_BYTE_RATE

    m = manager(quota=256 * 1024, kind=CONSUMER_BYTE_RATE)
    m.set_fleet(3, 250)
    m.take_local_usage(1_000_000)
    for i in range(5):
        now = 1_000_000 + 2_000 * i
        assert m.check_and_record("alice", "c", CONSUMER_BYTE_RATE, 320 * 1024, now, paced=False).throttle_ms == 0


def test_new_producer_ids_admitted_on_one_member_take_the_others_tokens():
    from quotas import PRODUCER_IDS_RATE
    from quotas.producer_ids import ProducerIdQuotaManager

    rules = [QuotaRule("alice", None, {PRODUCER_IDS_RATE: 4})]
    a, b = ProducerIdQuotaManager(rules), ProducerIdQuotaManager(rules)
    assert a.admit("alice", [1, 2, 3], 0).admitted
    usage = a.take_local_usage()
    assert usage == [((PRODUCER_IDS_RATE, "alice", None), 3.0)] and a.take_local_usage() == []
    for (_, user, _), amount in usage:
        assert b.add_remote(user, amount, 10)
    assert b.admit("alice", [10], 20).admitted  # the fourth new id of the fleet
    assert not b.admit("alice", [11], 30).admitted  # the fifth: over the quota fleet-wide
    assert b.take_local_usage() == [((PRODUCER_IDS_RATE, "alice", None), 1.0)]  # remote ids are not reported
    assert not b.add_remote("bob", 1, 40)  # no producer-id quota for bob here


# -- reporting what matters (fleet.report_threshold) ---------------------------------------------


def test_an_entity_far_below_its_bound_is_withheld_and_one_near_it_reported():
    """Four members, a bound of 1000 B/s, 250 ms intervals: an amount is worth reporting from
    0.5 x 1000 x 0.25 / 4 = 31.25 bytes an interval."""
    m = QuotaManager([QuotaRule("<default>", None, {PRODUCER_BYTE_RATE: 1000.0})])
    m.set_fleet(4, 250)
    m.check_and_record("cold", "x", PRODUCER_BYTE_RATE, 31, 1000)
    m.check_and_record("warm", "x", PRODUCER_BYTE_RATE, 32, 1000)
    assert m.take_local_usage(1250, 0.5) == [((PRODUCER_BYTE_RATE, "warm", None), 32)]
    assert m.withheld_total == 1
    # What was withheld is dropped, not added to the next interval's amount.
    m.check_and_record("cold", "x", PRODUCER_BYTE_RATE, 31, 1300)
    assert m.take_local_usage(1500, 0.5) == []
    assert m.withheld_total == 2


def test_the_threshold_scales_with_the_members_and_zero_reports_every_amount():
    m = QuotaManager([QuotaRule("<default>", None, {PRODUCER_BYTE_RATE: 1000.0})])
    m.set_fleet(64, 250)  # 0.5 x 1000 x 0.25 / 64 = 1.95 bytes an interval
    m.check_and_record("cold", "x", PRODUCER_BYTE_RATE, 2, 1000)
    assert m.take_local_usage(1250, 0.5) == [((PRODUCER_BYTE_RATE, "cold", None), 2)]
    m.check_and_record("cold", "x", PRODUCER_BYTE_RATE, 0.001, 1300)
    assert m.take_local_usage(1500, 0.0) == [((PRODUCER_BYTE_RATE, "cold", None), 0.001)]


def test_an_entity_the_fleet_shares_is_reported_whatever_the_amount_for_one_window():
    """Once a member reports an entity, every member reports every amount of it for the quota
    window (11 x 1 s), so what the fleet counts of a principal near its bound is all of it."""
    m = QuotaManager([QuotaRule("<default>", None, {PRODUCER_BYTE_RATE: 1000.0})])
    m.set_fleet(4, 250)
    assert m.add_remote(PRODUCER_BYTE_RATE, "hot", None, 500, 1000)  # another member reported it
    m.check_and_record("hot", "x", PRODUCER_BYTE_RATE, 1, 1100)
    assert m.take_local_usage(1250, 0.5) == [((PRODUCER_BYTE_RATE, "hot", None), 1)]
    m.check_and_record("hot", "x", PRODUCER_BYTE_RATE, 1, 1250 + 10_900)  # still shared: reported at 1250
    assert m.take_local_usage(1250 + 11_000 - 1, 0.5) == [((PRODUCER_BYTE_RATE, "hot", None), 1)]
    m.check_and_record("hot", "x", PRODUCER_BYTE_RATE, 1, 30_000)  # a window with no report since
    assert m.take_local_usage(30_000, 0.5) == []


def test_withholding_cold_entities_throttles_a_hot_principal_exactly_as_reporting_everything():
    """Four members share one principal near its bound and each serves a client far below its
    own: with report_threshold 0.5 the hot principal's throttles are those of the fleet that
    reports everything, the cold client is never reported, and never throttled either way."""
    def fleet(threshold: float) -> tuple[list[int], int, int]:
        members = [QuotaManager([QuotaRule("<default>", None, {PRODUCER_BYTE_RATE: 1000.0})]) for _ in range(4)]
        for m in members:
            m.set_fleet(4, 250)
        throttles, cold_throttled, reported = [], 0, 0
        for t in range(0, 20_000, 50):
            now = 1_000_000 + t
            for i, m in enumerate(members):
                throttles.append(m.check_and_record("hot", "x", PRODUCER_BYTE_RATE, 17 + i, now).throttle_ms)
                cold_throttled += m.check_and_record("cold", "y", PRODUCER_BYTE_RATE, 1, now).throttle_ms > 0
            if t % 250 == 200:  # after each interval's five charges
                taken = [m.take_local_usage(now, threshold) for m in members]
                for i, entries in enumerate(taken):
                    reported += len(entries)
                    for j, other in enumerate(members):
                        if j != i:
                            for (kind, user, client_id), amount in entries:
                                other.add_remote(kind, user, client_id, amount, now)
        return throttles, cold_throttled, reported

    everything, cold_all, reported_all = fleet(0.0)
    withheld, cold_withheld, reported_withheld = fleet(0.5)
    assert max(everything) > 0  # the hot principal (4 x 17-20 bytes each 50 ms: ~1480 B/s) is held
    assert withheld == everything
    assert cold_all == cold_withheld == 0
    assert reported_withheld * 2 == reported_all  # the cold client's entries were half of them


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["charge", "give_back", "remote", "take"]), st.integers(0, 5),
                          st.integers(1, 400)), max_size=60),
       st.sampled_from([0.0, 0.5]))
def test_a_take_reads_only_what_was_touched_and_reports_what_a_full_scan_would(ops, threshold):
    """take_local_usage visits the states charged, given back, told of or reported since the
    last call, not every entity known: what it reports, and every state after it, is what
    visiting them all reports."""
    def fresh() -> QuotaManager:
        m = QuotaManager([QuotaRule("<default>", None, {PRODUCER_BYTE_RATE: 1000.0})])
        m.set_fleet(3, 250)
        return m

    tracked, scanned = fresh(), fresh()
    now = 1_000_000
    for op, who, amount in ops:
        now += 50
        for m in (tracked, scanned):
            user = f"u{who}"
            if op == "charge":
                m.check_and_record(user, "x", PRODUCER_BYTE_RATE, amount, now)
            elif op == "give_back":
                m.unrecord(user, "x", PRODUCER_BYTE_RATE, amount, now)
            elif op == "remote":
                m.add_remote(PRODUCER_BYTE_RATE, user, None, amount, now)
        if op == "take":
            scanned._active = None  # a full scan, every time
            assert sorted(tracked.take_local_usage(now, threshold)) == sorted(scanned.take_local_usage(now, threshold))
    state_of = {k: (s.pending, s.reported, s.remote, s.local_share) for k, s in scanned._table.items()}
    assert {k: (s.pending, s.reported, s.remote, s.local_share) for k, s in tracked._table.items()} == state_of


# -- reading a member's reports fast (UsageDecoder) ---------------------------------------------

_NAMES = st.one_of(st.none(), st.sampled_from(["alice", "bob", "app-é", "", "x" * 40]))
_AMOUNTS = st.one_of(st.floats(0, 1e6), st.sampled_from([0.0, MAX_AMOUNT, -1.0, math.nan, math.inf, 2e13]))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["m1", "m2"]),
                          st.lists(st.tuples(st.sampled_from(KINDS[:3]), _NAMES, _NAMES), min_size=0, max_size=6),
                          st.lists(_AMOUNTS, min_size=6, max_size=6),
                          st.integers(0, 3)), min_size=1, max_size=12))
def test_the_fast_decoder_reads_every_report_as_decode_usage_does(reports):
    """Members' reports in a row, each naming the same entities as that member's last or not,
    with amounts that may be refused, and sometimes cut short or with a byte more: the decoder
    returns what decode_usage returns, or raises the same reason."""
    decoder = UsageDecoder()
    last: dict[str, list] = {}
    for seq, (member, entities, amounts, damage) in enumerate(reports):
        entities = last.get(member, entities) if damage == 3 else entities
        last[member] = entities
        entries = tuple(UsageEntry(k, u, c, a) for (k, u, c), a in zip(entities, amounts))
        raw = struct.pack(">4sBQQqI", b"KQPU", 1, 1, seq, 0, 250) + struct.pack(">H", len(member)) + member.encode()
        raw += struct.pack(">I", len(entries)) + b"".join(
            bytes([KINDS.index(e.kind)]) + _name(e.user) + _name(e.client_id) + struct.pack(">d", e.amount)
            for e in entries)
        raw = raw[:-1] if damage == 1 else raw + b"\0" if damage == 2 else raw
        try:
            expected = decode_usage(raw)
        except BadReport as exc:
            with pytest.raises(BadReport) as got:
                decoder.decode(raw)
            assert got.value.reason == exc.reason
        else:
            assert decoder.decode(raw) == expected


def _name(s: str | None) -> bytes:
    if s is None:
        return struct.pack(">h", -1)
    raw = s.encode()
    return struct.pack(">h", len(raw)) + raw


def test_a_member_naming_what_it_named_before_is_read_without_the_slow_way(monkeypatch):
    import quotas.fleet as fleet

    def report(seq: int, amounts: list[float]) -> bytes:
        return encode_report(UsageReport("m1", 1, seq, 0, 250, tuple(
            UsageEntry(PRODUCER_BYTE_RATE, None, f"client-{i}", a) for i, a in enumerate(amounts))))[0]

    decoder = UsageDecoder()
    decoder.decode(report(0, [1.0, 2.0, 3.0]))
    slow = []
    monkeypatch.setattr(fleet, "decode_usage", lambda data, read=None: slow.append(data) or decode_usage(data, read))
    _, entries = decoder.decode(report(1, [4.0, 5.0, 6.0]))
    assert entries == [((PRODUCER_BYTE_RATE, None, f"client-{i}"), a) for i, a in enumerate([4.0, 5.0, 6.0])]
    assert slow == []
    decoder.decode(report(2, [4.0, 5.0]))  # another entity set: the slow way, then remembered
    with pytest.raises(BadReport, match="bad_amount"):
        decoder.decode(report(3, [7.0, math.nan]))  # a refused amount: the slow way says which
    assert len(slow) == 2
