"""QuotaManager: decisions per kind, entity state lifecycle, reloads, counters and stats."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quotas import (
    ADMIT,
    CONSUMER_BYTE_RATE,
    CONTROLLER_MUTATION_RATE,
    DEFAULT,
    PRODUCER_BYTE_RATE,
    PRODUCER_IDS_RATE,
    REQUEST_RATE,
    Decision,
    EntityResolver,
    QuotaManager,
    QuotaRule,
    TokenBucket,
    WindowedRate,
)

HOUR_MS = 3_600_000
MUT = CONTROLLER_MUTATION_RATE


def test_no_rule_admits_without_state():
    qm = QuotaManager([QuotaRule("alice", None, {PRODUCER_BYTE_RATE: 10})])
    assert qm.check_and_record("bob", "c", PRODUCER_BYTE_RATE, 10**9, 0) is ADMIT
    assert qm.check_and_record("alice", "c", CONSUMER_BYTE_RATE, 10**9, 0) is ADMIT
    assert qm.try_admit("alice", "c", MUT, 10**6, 0) is ADMIT
    assert qm.live_entities == 0


def test_byte_rate_records_then_checks():
    qm = QuotaManager([QuotaRule(DEFAULT, None, {PRODUCER_BYTE_RATE: 100})])
    assert qm.check_and_record("alice", "c", PRODUCER_BYTE_RATE, 1000, 0) == ADMIT  # 1000 / 10 s
    assert qm.check_and_record("alice", "c", PRODUCER_BYTE_RATE, 1000, 0) == Decision(True, 10_000)
    assert qm.check_and_record("alice", "c", PRODUCER_BYTE_RATE, 1, 20_000) == ADMIT  # samples purged
    (throttled,) = [c for c in qm.kind_counters() if c.kind == PRODUCER_BYTE_RATE]
    assert (throttled.throttled, throttled.rejected) == (1, 0)


def test_request_rate_throttle_is_bounded_by_one_window():
    qm = QuotaManager([QuotaRule(None, DEFAULT, {REQUEST_RATE: 1})], quota_window_size_s=2)
    for _ in range(100):  # 100 requests over a 20 s window: 5/s against 1/s
        decision = qm.check_and_record("u", "c", REQUEST_RATE, 1, 0)
    assert decision == Decision(True, 2000)  # ClientRequestQuotaManager: at most one window
    qm2 = QuotaManager([QuotaRule(None, DEFAULT, {CONSUMER_BYTE_RATE: 1})], quota_window_size_s=2)
    for _ in range(100):
        decision = qm2.check_and_record("u", "c", CONSUMER_BYTE_RATE, 1, 0)
    assert decision.throttle_ms > 2000  # byte rates are not bounded


def test_throttled_fetch_is_unrecorded():
    qm = QuotaManager([QuotaRule(None, DEFAULT, {CONSUMER_BYTE_RATE: 100})])
    assert qm.check_and_record("u", "c", CONSUMER_BYTE_RATE, 900, 0) == ADMIT
    decision = qm.check_and_record("u", "c", CONSUMER_BYTE_RATE, 500, 100)
    assert decision.throttle_ms > 0
    qm.unrecord("u", "c", CONSUMER_BYTE_RATE, 500, 100)  # empty response sent instead
    (stats,) = qm.entity_stats(100)
    assert stats.rate == pytest.approx(900 / 10.1)
    assert stats.last_throttle_ms == decision.throttle_ms


def kip599_manager(**kw) -> QuotaManager:
    rules = [QuotaRule(DEFAULT, None, {CONTROLLER_MUTATION_RATE: 5})]
    return QuotaManager(rules, controller_quota_window_num=100, **kw)  # R = 5, B = 500


def test_kip599_example_strict():
    qm = kip599_manager()
    assert [qm.try_admit("alice", "admin", MUT, 80, 0) for _ in range(7)] == [ADMIT] * 7
    assert qm.try_admit("alice", "admin", MUT, 80, 0) == Decision(False, 12_000)
    assert qm.try_admit("alice", "admin", MUT, 1, 6000) == Decision(False, 6000)
    (stats,) = qm.entity_stats(6000)
    assert (stats.user, stats.client_id, stats.tokens) == ("alice", "", -30.0)
    assert stats.last_throttle_ms == 6000 and stats.throttle_ms == 6000
    assert qm.entity_stats(9000)[0].throttle_ms == 3000  # what is left of it
    assert [c.rejected for c in qm.kind_counters() if c.kind == CONTROLLER_MUTATION_RATE] == [2]
    assert qm.try_admit("alice", "admin", MUT, 1, 12_000) == ADMIT
    # Another user has a bucket of its own under the <default> user quota.
    assert qm.try_admit("bob", "admin", MUT, 80, 0) == ADMIT


def test_kip599_example_permissive():
    qm = kip599_manager()
    assert qm.record("alice", "admin", MUT, 560, 0) == Decision(True, 12_000)
    (stats,) = qm.entity_stats(0)
    assert stats.tokens == -60
    assert stats.rate == pytest.approx(560 / 99)  # mutation rate over 99 padded windows
    qm.unrecord("alice", "admin", CONTROLLER_MUTATION_RATE, 60, 0)
    assert qm.check_and_record("alice", "admin", CONTROLLER_MUTATION_RATE, 0, 0) == ADMIT


def test_try_admit_only_for_token_buckets_and_unknown_kinds_raise():
    qm = QuotaManager([QuotaRule(DEFAULT, None, {PRODUCER_BYTE_RATE: 1, PRODUCER_IDS_RATE: 3})])
    with pytest.raises(ValueError):
        qm.try_admit("u", "c", PRODUCER_BYTE_RATE, 1, 0)
    with pytest.raises(ValueError):
        qm.record("u", "c", PRODUCER_BYTE_RATE, 1, 0)
    with pytest.raises(ValueError):
        qm.check_and_record("u", "c", "bogus_rate", 1, 0)
    with pytest.raises(ValueError):
        qm.check_and_record("u", "c", PRODUCER_IDS_RATE, 1, 0)  # engine: a later issue
    assert qm.resolve("u", "c", PRODUCER_IDS_RATE).level == 6


def test_entity_sharing_follows_kafka_sensor_keys():
    qm = QuotaManager(
        [
            QuotaRule("alice", None, {PRODUCER_BYTE_RATE: 100}),  # shared by all alice's clients
            QuotaRule(None, "connect-*", {PRODUCER_BYTE_RATE: 100}),  # one quota per client id
        ]
    )
    qm.check_and_record("alice", "a", PRODUCER_BYTE_RATE, 1000, 0)
    assert qm.check_and_record("alice", "b", PRODUCER_BYTE_RATE, 1000, 0).throttle_ms == 10_000
    qm.check_and_record("bob", "connect-1", PRODUCER_BYTE_RATE, 1000, 0)
    assert qm.check_and_record("bob", "connect-2", PRODUCER_BYTE_RATE, 1000, 0) == ADMIT
    assert qm.check_and_record("carol", "connect-1", PRODUCER_BYTE_RATE, 1000, 0).throttle_ms == 10_000
    labels = sorted((s.user, s.client_id) for s in qm.entity_stats(0))
    assert labels == [("", "connect-1"), ("", "connect-2"), ("alice", "")]
    assert qm.entity_stats_for("zed", "connect-2", PRODUCER_BYTE_RATE, 0).rate == 100
    assert qm.entity_stats_for("zed", "other", PRODUCER_BYTE_RATE, 0) is None


def test_idle_entities_expire_after_an_hour_and_come_back_fresh():
    qm = QuotaManager([QuotaRule(DEFAULT, None, {PRODUCER_BYTE_RATE: 100})])
    qm.check_and_record("alice", "c", PRODUCER_BYTE_RATE, 10**6, 0)
    qm.check_and_record("bob", "c", PRODUCER_BYTE_RATE, 1, HOUR_MS)
    assert qm.expire(HOUR_MS) == 0
    assert qm.expire(HOUR_MS + 1) == 1
    assert [s.user for s in qm.entity_stats(HOUR_MS + 1)] == ["bob"]
    assert qm.expired_total == 1
    assert qm.check_and_record("alice", "c", PRODUCER_BYTE_RATE, 1, HOUR_MS + 2) == ADMIT
    assert qm.live_entities == 2


def test_idle_period_is_configurable_and_rejections_count_as_use():
    qm = kip599_manager(idle_ms=1000)
    qm.try_admit("alice", "c", MUT, 600, 0)
    qm.try_admit("alice", "c", MUT, 1, 900)  # rejected, but the entity is in use
    assert qm.expire(1500) == 0
    assert qm.expire(1901) == 1


def test_hard_cap_on_live_entities():
    qm = QuotaManager([QuotaRule(None, DEFAULT, {REQUEST_RATE: 10})], max_entities=1000)
    for i in range(5000):
        qm.check_and_record("u", f"client-{i}", REQUEST_RATE, 1, i)
    assert qm.live_entities <= 1000
    assert qm.evicted_total >= 4000
    # The most recent entities survive, with their state.
    assert qm.entity_stats_for("u", "client-4999", REQUEST_RATE, 5000) is not None


def test_replace_rules_keeps_state_of_entities_that_still_have_a_quota():
    qm = QuotaManager(
        [
            QuotaRule("alice", None, {PRODUCER_BYTE_RATE: 100}),
            QuotaRule("bob", None, {PRODUCER_BYTE_RATE: 100}),
        ]
    )
    qm.check_and_record("alice", "c", PRODUCER_BYTE_RATE, 1000, 0)
    qm.check_and_record("bob", "c", PRODUCER_BYTE_RATE, 1000, 0)
    qm.replace_rules([QuotaRule("alice", None, {PRODUCER_BYTE_RATE: 50})])
    # alice keeps her 1000 bytes, now measured against 50/s; bob has no quota any more.
    assert qm.check_and_record("alice", "c", PRODUCER_BYTE_RATE, 0, 0) == Decision(True, 10_000)
    assert qm.check_and_record("bob", "c", PRODUCER_BYTE_RATE, 10**6, 0) == ADMIT
    assert [(s.user, s.quota) for s in qm.entity_stats(0)] == [("alice", 50.0)]


def test_replace_rules_keeps_tokens_and_moves_entities_between_levels():
    qm = kip599_manager()
    qm.try_admit("alice", "c", MUT, 560, 0)
    qm.replace_rules([QuotaRule(DEFAULT, None, {CONTROLLER_MUTATION_RATE: 10})])
    assert qm.try_admit("alice", "c", MUT, 1, 0) == Decision(False, 6000)  # −60 tokens at 10/s
    # alice now matches a user+client rule: her per-user state is no longer the one charged.
    qm.replace_rules([QuotaRule("alice", DEFAULT, {CONTROLLER_MUTATION_RATE: 10})])
    assert qm.try_admit("alice", "c", MUT, 1, 0) == ADMIT
    assert [(s.user, s.client_id) for s in qm.entity_stats(0)] == [("alice", "c")]


def test_replace_rules_invalidates_cached_resolutions_and_rejects_bad_rules():
    qm = QuotaManager([])
    assert qm.check_and_record("u", "c", REQUEST_RATE, 100, 0) == ADMIT  # cached: no quota
    rules = [QuotaRule(None, "c", {REQUEST_RATE: 1})]
    qm.replace_rules(rules)
    assert qm.check_and_record("u", "c", REQUEST_RATE, 100, 0).throttle_ms > 0
    with pytest.raises(ValueError):
        qm.replace_rules([QuotaRule(None, "c", {REQUEST_RATE: 1}), QuotaRule(None, "c", {REQUEST_RATE: 2})])
    assert qm.rules == tuple(rules)


def test_resolve_answers_as_the_rules_before_and_after_a_charge_and_across_reloads():
    rules = [QuotaRule(None, "connect-*", {CONSUMER_BYTE_RATE: 100}),
             QuotaRule(None, DEFAULT, {CONSUMER_BYTE_RATE: 50})]
    qm, walked = QuotaManager(rules), EntityResolver(rules)
    cases = [("u", "connect-1"), ("u", "other"), ("", "")]
    for user, client_id in cases:  # nothing charged yet: walked through the rules
        assert qm.resolve(user, client_id, CONSUMER_BYTE_RATE) == walked.resolve(CONSUMER_BYTE_RATE, user, client_id)
    for user, client_id in cases:  # charged: answered from the state cache, the same rule
        qm.check_and_record(user, client_id, CONSUMER_BYTE_RATE, 1, 0)
        assert qm.resolve(user, client_id, CONSUMER_BYTE_RATE) == walked.resolve(CONSUMER_BYTE_RATE, user, client_id)
    assert qm.resolve("u", "connect-1", CONSUMER_BYTE_RATE).quota == 100
    # A reload's new bound and mode are what the next read sees; a rule removed, no rule.
    qm.replace_rules([QuotaRule(None, "connect-*", {CONSUMER_BYTE_RATE: 7}, shadow=True)])
    got = qm.resolve("u", "connect-1", CONSUMER_BYTE_RATE)
    assert (got.quota, got.shadow) == (7, True)
    qm.check_and_record("u", "connect-1", CONSUMER_BYTE_RATE, 1, 0)
    got = qm.resolve("u", "connect-1", CONSUMER_BYTE_RATE)
    assert (got.quota, got.shadow) == (7, True)
    assert qm.resolve("u", "other", CONSUMER_BYTE_RATE) is None
    qm.check_and_record("u", "other", CONSUMER_BYTE_RATE, 1, 0)  # cached as "no rule"
    assert qm.resolve("u", "other", CONSUMER_BYTE_RATE) is None


def test_time_going_backwards_is_no_time_passing():
    qm = kip599_manager()
    qm.check_and_record("u", "c", CONTROLLER_MUTATION_RATE, 560, 10_000)
    assert qm.try_admit("u", "c", MUT, 1, 0) == Decision(False, 12_000)
    assert qm.try_admit("u", "c", MUT, 1, 16_000) == Decision(False, 6000)
    assert qm.expire(10_000 + HOUR_MS) == 0  # last use is still 16 000


def test_resolution_cache_is_bounded():
    qm = QuotaManager([QuotaRule("u", None, {REQUEST_RATE: 10**9})], max_cached_resolutions=100)
    for i in range(1000):
        qm.check_and_record("u", f"c{i}", REQUEST_RATE, 1, 0)
    assert len(qm._cache) <= 100
    assert qm.live_entities == 1


entity_st = st.tuples(
    st.sampled_from([None, DEFAULT, "alice", "bob"]),
    st.sampled_from([None, DEFAULT, "app", "connect-1", "connect-*", "*-1"]),
).filter(lambda e: e != (None, None))
rules_st = st.lists(
    st.builds(
        lambda entity, values: QuotaRule(*entity, values),
        entity_st,
        st.fixed_dictionaries(
            {},
            optional={
                PRODUCER_BYTE_RATE: st.sampled_from([10.0, 1000.0]),
                CONTROLLER_MUTATION_RATE: st.sampled_from([1.0, 5.0]),
            },
        ),
    ),
    max_size=8,
    unique_by=lambda r: (r.user, r.client_id),
)
ops_st = st.lists(
    st.tuples(
        st.sampled_from(["alice", "bob", "carol"]),
        st.sampled_from(["app", "connect-1", "x-1", "other"]),
        st.sampled_from(["rate", "strict", "permissive", "unrecord"]),
        st.integers(min_value=0, max_value=400),
        st.integers(min_value=-500, max_value=3000),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(rules=rules_st, ops=ops_st)
def test_manager_equals_one_engine_per_resolved_entity(rules, ops):
    """Caching, sharing and dispatch never change a decision: the manager answers exactly as
    a fresh engine per resolved entity key would."""
    qm = QuotaManager(rules, controller_quota_window_num=5)
    resolver = EntityResolver(rules)
    engines: dict = {}
    now = 0
    for user, client, op, amount, step in ops:
        now += step
        kind = PRODUCER_BYTE_RATE if op in ("rate", "unrecord") else CONTROLLER_MUTATION_RATE
        resolved = resolver.resolve(kind, user, client)
        if resolved is None:
            expected = ADMIT
            engine = None
        else:
            if resolved.key not in engines:
                if kind == PRODUCER_BYTE_RATE:
                    engines[resolved.key] = WindowedRate(11, 1000)
                else:
                    engines[resolved.key] = TokenBucket(resolved.quota, 5, 1000, now)
            engine = engines[resolved.key]
        if op == "rate":
            got = qm.check_and_record(user, client, kind, amount, now)
            if engine is not None:
                expected = Decision(True, engine.record_and_throttle_at(amount, resolved.quota, now))
        elif op == "unrecord":
            qm.unrecord(user, client, kind, amount, now)
            if engine is not None:
                engine.unrecord_at(amount, now)
            continue
        elif op == "strict":
            got = qm.try_admit(user, client, MUT, amount, now)
            if engine is not None:
                expected = engine.try_admit_at(amount, now)
        else:
            got = qm.check_and_record(user, client, kind, amount, now)
            if engine is not None:
                expected = engine.record_and_throttle_at(amount, now)
        assert got == expected


def test_managers_sharing_one_resolver_keep_their_own_state():
    # The replay builds fresh engines per user over one resolver per candidate.
    rules = EntityResolver([QuotaRule(None, DEFAULT, {REQUEST_RATE: 10})])
    busy, fresh = QuotaManager(rules), QuotaManager(rules)
    assert busy.rules is fresh.rules
    assert busy.check_and_record("u", "c", REQUEST_RATE, 1_000, 0).throttle_ms > 0
    assert fresh.check_and_record("u", "c", REQUEST_RATE, 1, 0).throttle_ms == 0
    busy.replace_rules(EntityResolver([QuotaRule(None, DEFAULT, {REQUEST_RATE: 1e9})]))
    assert fresh.resolve("u", "c", REQUEST_RATE).quota == 10  # one manager's reload is its own
