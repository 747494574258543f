"""Entity resolution (Kafka's eight levels + client-id globs) and the per-entity state table."""

from __future__ import annotations

import pytest

from quotas.entities import DEFAULT, EntityResolver, EntityTable, QuotaRule

K = "producer_byte_rate"

# One rule per level, each with a distinct bound: the bound tells which level answered.
ALL_LEVELS = [
    QuotaRule("alice", "app", {K: 1}),  # 1
    QuotaRule("alice", "connect-*", {K: 1.5}),  # 1g
    QuotaRule("alice", DEFAULT, {K: 2}),  # 2
    QuotaRule("alice", None, {K: 3}),  # 3
    QuotaRule(DEFAULT, "app", {K: 4}),  # 4
    QuotaRule(DEFAULT, "connect-*", {K: 4.5}),  # 4g
    QuotaRule(DEFAULT, DEFAULT, {K: 5}),  # 5
    QuotaRule(DEFAULT, None, {K: 6}),  # 6
    QuotaRule(None, "app", {K: 7}),  # 7
    QuotaRule(None, "connect-*", {K: 7.5}),  # 7g
    QuotaRule(None, DEFAULT, {K: 8}),  # 8
]


def _resolver_without(*levels: float) -> EntityResolver:
    return EntityResolver([r for r in ALL_LEVELS if r.values[K] not in levels])


# Remove the levels above one at a time: each time the next level down must answer, with the
# state keyed as Kafka keys its sensors (user and/or client id labels).
@pytest.mark.parametrize(
    ("removed", "client_id", "bound", "user_label", "client_label", "level"),
    [
        ((), "app", 1, "alice", "app", 1),
        ((1,), "app", 2, "alice", "app", 2),  # "app" does not match connect-*
        ((), "connect-s3", 1.5, "alice", "connect-s3", 1),
        ((1.5,), "connect-s3", 2, "alice", "connect-s3", 2),
        ((1, 1.5, 2), "app", 3, "alice", None, 3),
        ((1, 1.5, 2, 3), "app", 4, "alice", "app", 4),
        ((1, 1.5, 2, 3), "connect-s3", 4.5, "alice", "connect-s3", 4),
        ((1, 1.5, 2, 3, 4, 4.5), "app", 5, "alice", "app", 5),
        ((1, 1.5, 2, 3, 4, 4.5, 5), "app", 6, "alice", None, 6),
        ((1, 1.5, 2, 3, 4, 4.5, 5, 6), "app", 7, None, "app", 7),
        ((1, 1.5, 2, 3, 4, 4.5, 5, 6), "connect-s3", 7.5, None, "connect-s3", 7),
        ((1, 1.5, 2, 3, 4, 4.5, 5, 6, 7), "app", 8, None, "app", 8),
        ((1, 1.5, 2, 3, 4, 4.5, 5, 6, 7, 7.5, 8), "app", None, None, None, None),
    ],
)
def test_eight_levels_and_globs(removed, client_id, bound, user_label, client_label, level):
    resolved = _resolver_without(*removed).resolve(K, "alice", client_id)
    if bound is None:
        assert resolved is None
        return
    assert (resolved.quota, resolved.user, resolved.client_id, resolved.level) == (
        bound,
        user_label,
        client_label,
        level,
    )
    assert resolved.key == (K, user_label, client_label)


def test_other_users_fall_to_default_levels():
    resolver = EntityResolver(ALL_LEVELS)
    assert resolver.resolve(K, "bob", "app").level == 4
    assert resolver.resolve(K, "bob", "other").quota == 5
    assert resolver.resolve(K, "bob", "connect-x").glob == "connect-*"


def test_rules_are_per_kind():
    resolver = EntityResolver(
        [QuotaRule("alice", None, {K: 1}), QuotaRule(None, DEFAULT, {"request_rate": 9})]
    )
    assert resolver.resolve(K, "alice", "c").quota == 1
    assert resolver.resolve(K, "bob", "c") is None
    assert resolver.resolve("request_rate", "alice", "c").quota == 9
    assert resolver.resolve("consumer_byte_rate", "alice", "c") is None
    assert resolver.kinds() == {K, "request_rate"}


def test_most_literal_glob_wins_then_first_given():
    resolver = EntityResolver(
        [
            QuotaRule(None, "connect-*", {K: 1}),
            QuotaRule(None, "connect-s3-*", {K: 2}),
            QuotaRule(None, "*-s3-*", {K: 3}),
            QuotaRule(None, "connect-?3-*", {K: 4}),
        ]
    )
    assert resolver.resolve(K, "u", "connect-s3-sink-0").quota == 2  # 11 literal characters
    assert resolver.resolve(K, "u", "connect-x3-sink-0").quota == 4
    assert resolver.resolve(K, "u", "mirror-s3-0").quota == 3
    assert resolver.resolve(K, "u", "CONNECT-X3-0") is None  # case-sensitive (fnmatchcase)
    tie = EntityResolver([QuotaRule(None, "a*", {K: 1}), QuotaRule(None, "*a", {K: 2})])
    assert tie.resolve(K, "u", "aa").quota == 1


def test_producer_ids_rate_is_user_level_only():
    kind = "producer_ids_rate"
    resolver = EntityResolver(
        [
            QuotaRule("alice", "app", {kind: 1}),
            QuotaRule(DEFAULT, DEFAULT, {kind: 2}),
            QuotaRule(None, DEFAULT, {kind: 3}),
            QuotaRule(DEFAULT, None, {kind: 6}),
        ]
    )
    resolved = resolver.resolve(kind, "alice", "app")
    assert (resolved.quota, resolved.user, resolved.client_id, resolved.level) == (6, "alice", None, 6)
    only_client_rules = EntityResolver([QuotaRule(None, DEFAULT, {kind: 3})])
    assert only_client_rules.resolve(kind, "alice", "app") is None
    assert EntityResolver([QuotaRule("alice", None, {kind: 7})]).resolve_user_level(kind, "alice").level == 3


def test_a_principal_named_default_is_not_the_default_entity():
    resolver = EntityResolver([QuotaRule("<default>", None, {K: 6}), QuotaRule(None, "<default>", {K: 8})])
    # The user literally named "<default>" gets the default user quota, as any other user does,
    # charged to its own entity — never a lookup that treats the name as the default.
    resolved = resolver.resolve(K, "<default>", "c")
    assert (resolved.level, resolved.user) == (6, "<default>")


def test_rule_validation():
    with pytest.raises(ValueError):
        QuotaRule(None, None, {K: 1})
    with pytest.raises(ValueError):
        QuotaRule("a", None, {K: -1})
    with pytest.raises(ValueError):
        QuotaRule("a", None, {K: float("nan")})
    with pytest.raises(ValueError, match="two producer_byte_rate quotas"):
        EntityResolver([QuotaRule("a", None, {K: 1}), QuotaRule("a", None, {K: 2})])
    with pytest.raises(ValueError):
        EntityResolver([QuotaRule(None, "c-*", {K: 1}), QuotaRule(None, "c-*", {K: 2})])
    # Same entity, different kinds: fine.
    EntityResolver([QuotaRule("a", None, {K: 1}), QuotaRule("a", None, {"request_rate": 2})])
    rule = QuotaRule("a", None, {K: 1})
    assert hash(rule) is not None  # values are frozen
    with pytest.raises(TypeError):
        rule.values[K] = 2  # type: ignore[index]


class _S:
    def __init__(self, last_used_ms: int) -> None:
        self.last_used_ms = last_used_ms


def test_table_expires_after_idle_period():
    table = EntityTable(idle_ms=3_600_000)
    table.add("a", _S(0), 0)
    table.add("b", _S(1000), 1000)
    assert table.expire(3_600_000) == 0  # exactly the idle period: not yet (Sensor.hasExpired is >)
    assert table.expire(3_600_001) == 1
    assert table.get("a") is None and table.get("b") is not None
    assert table.expired_total == 1


def test_table_cap_drops_idle_then_least_recently_used():
    table = EntityTable(idle_ms=10_000, max_entities=16)
    for i in range(16):
        table.add(i, _S(i), i)
    assert len(table) == 16
    assert table.add(100, _S(20), 20) == 2  # down to 14, then the new one
    assert len(table) == 15
    assert table.get(0) is None and table.get(1) is None and table.get(2) is not None
    assert table.evicted_total == 2
    table.add(101, _S(30), 30)
    table.add(102, _S(10_009), 10_009)  # at the cap: entries idle > 10 s go first
    assert table.expired_total == 7  # last used at 2..8, before 10_009 − 10_000
    assert table.evicted_total == 2  # no LRU eviction needed this time
    assert len(table) == 10
