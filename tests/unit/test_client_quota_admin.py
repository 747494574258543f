"""DescribeClientQuotas / AlterClientQuotas semantics (quotas.client_quota_admin).

Expected values come from Apache Kafka's KRaft code, named in each test: ClientQuotasImage.describe
and .matches (metadata/image), ClientQuotaControlManager.alterClientQuotas / alterClientQuotaEntity
/ validateEntity / configKeysForEntityType / validateQuotaKeyValue (metadata/controller),
QuorumController.alterClientQuotas, and the request/response classes in clients/.../requests.
Where the proxy differs on purpose, the test says so.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quotas.client_quota_admin import (
    CLIENT_ID,
    CLUSTER_AUTHORIZATION_FAILED,
    DEFAULT_MESSAGES,
    INVALID_REQUEST,
    IP,
    MATCH_DEFAULT,
    MATCH_EXACT,
    MATCH_SPECIFIED,
    MAX_CHANGES_PER_REQUEST,
    NONE,
    POLICY_VIOLATION,
    UNSUPPORTED_VERSION,
    USER,
    AlterEntry,
    AlterOp,
    DescribeResult,
    EntryResult,
    FilterComponent,
    QuotaChange,
    QuotaEntity,
    alter,
    alter_error,
    describe,
    describe_error,
    quotas_from_rules,
    rules_from_quotas,
)
from quotas.common import ALL_KINDS
from quotas.entities import DEFAULT, QuotaRule

ALICE = QuotaEntity.of({USER: "alice"})
ALICE_APP = QuotaEntity.of({USER: "alice", CLIENT_ID: "app"})
ALICE_DEFAULT_CLIENT = QuotaEntity.of({USER: "alice", CLIENT_ID: None})
DEFAULT_USER = QuotaEntity.of({USER: None})
DEFAULT_USER_APP = QuotaEntity.of({USER: None, CLIENT_ID: "app"})
APP = QuotaEntity.of({CLIENT_ID: "app"})
DEFAULT_CLIENT = QuotaEntity.of({CLIENT_ID: None})
BOB = QuotaEntity.of({USER: "bob"})

STORE = {
    ALICE: {"producer_byte_rate": 1000.0},
    ALICE_APP: {"consumer_byte_rate": 2000.0},
    ALICE_DEFAULT_CLIENT: {"request_rate": 10.0},
    DEFAULT_USER: {"controller_mutation_rate": 0.5},
    DEFAULT_USER_APP: {"producer_record_rate": 100.0},
    APP: {"consumer_record_rate": 50.0},
    DEFAULT_CLIENT: {"producer_batch_rate": 5.0},
    BOB: {"producer_ids_rate": 20.0},
}


def ents(result: DescribeResult) -> set[QuotaEntity]:
    assert result.error_code == NONE and result.entries is not None, result
    return {e.entity for e in result.entries}


def set_op(key: str, value: float) -> AlterOp:
    return AlterOp(key, value, False)


def remove_op(key: str) -> AlterOp:
    return AlterOp(key, 0.0, True)


def one(entity: list[tuple[str, str | None]], *ops: AlterOp, quotas=None, validate_only=False):
    """Alters one entry; returns (its result, the AlterResult)."""
    result = alter(STORE if quotas is None else quotas, [AlterEntry(entity, list(ops))], validate_only)
    assert len(result.results) == 1
    return result.results[0], result


def refused(entity: list[tuple[str, str | None]], *ops: AlterOp) -> str:
    """The INVALID_REQUEST message for an entry that must change nothing."""
    res, result = one(entity, *ops)
    assert res.error_code == INVALID_REQUEST, res
    assert result.changes == ()
    assert result.new_quotas == STORE
    assert res.error_message is not None
    return res.error_message


# --- Entities --------------------------------------------------------------------------------


def test_entity_is_hashable_and_kept_in_kafkas_order():
    """ClientQuotaEntity is a map; a Java HashMap of user and client-id iterates client-id first,
    which is the order of ClientQuotaEntity.toString and of response entities."""
    a = QuotaEntity(((USER, "alice"), (CLIENT_ID, "app")))
    b = QuotaEntity(((CLIENT_ID, "app"), (USER, "alice")))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.parts == ((CLIENT_ID, "app"), (USER, "alice"))
    assert str(a) == "ClientQuotaEntity(entries={client-id=app, user=alice})"
    assert str(DEFAULT_USER) == "ClientQuotaEntity(entries={user=null})"
    assert a.entries == {USER: "alice", CLIENT_ID: "app"}


def test_entity_to_and_from_the_rule_form():
    """None name (Kafka's default entity) ↔ "<default>" in QuotaRule; absent type ↔ None."""
    cases = [
        (ALICE, ("alice", None)),
        (ALICE_APP, ("alice", "app")),
        (ALICE_DEFAULT_CLIENT, ("alice", DEFAULT)),
        (DEFAULT_USER, (DEFAULT, None)),
        (DEFAULT_USER_APP, (DEFAULT, "app")),
        (APP, (None, "app")),
        (DEFAULT_CLIENT, (None, DEFAULT)),
    ]
    for entity, key in cases:
        assert entity.rule_key == key
        assert QuotaEntity.from_rule_key(*key) == entity
        rule = entity.to_rule({"request_rate": 3.0})
        assert (rule.user, rule.client_id) == key and dict(rule.values) == {"request_rate": 3.0}


@pytest.mark.parametrize("parts", [
    (),
    ((IP, "10.0.0.1"),),
    ((USER, "a"), (USER, "b")),
    (("group", "g"),),
    ((USER, ""),),
    ((USER, DEFAULT),),
])
def test_entity_refuses_what_the_store_cannot_hold(parts):
    with pytest.raises(ValueError):
        QuotaEntity(parts)


def test_quotas_from_rules_and_back():
    rules = (
        QuotaRule("alice", None, {"producer_byte_rate": 1000}),
        QuotaRule(DEFAULT, "connect-*", {"producer_record_rate": 10}),
        QuotaRule(None, DEFAULT, {"request_rate": 5}),
    )
    quotas = quotas_from_rules(rules)
    assert quotas == {
        ALICE: {"producer_byte_rate": 1000},
        QuotaEntity.of({USER: None, CLIENT_ID: "connect-*"}): {"producer_record_rate": 10},
        DEFAULT_CLIENT: {"request_rate": 5},
    }
    assert rules_from_quotas(quotas) == rules


# --- DescribeClientQuotas ------------------------------------------------------------------


def test_describe_exact_name_is_open_ended_unless_strict():
    """ClientQuotasImage.matches: EXACT needs the type with that name; non-strict admits other
    types (Kafka's ClientQuotasRequestTest "Match open-ended existing user")."""
    f = [FilterComponent(USER, MATCH_EXACT, "alice")]
    assert ents(describe(STORE, f, strict=False)) == {ALICE, ALICE_APP, ALICE_DEFAULT_CLIENT}
    assert ents(describe(STORE, f, strict=True)) == {ALICE}
    assert ents(describe(STORE, [(USER, MATCH_EXACT, "nobody")], False)) == set()


def test_describe_default_matches_the_null_name_only():
    """MATCH_TYPE_DEFAULT puts a null into the exact map: only default names match."""
    assert ents(describe(STORE, [(USER, MATCH_DEFAULT, None)], False)) == {DEFAULT_USER, DEFAULT_USER_APP}
    assert ents(describe(STORE, [(USER, MATCH_DEFAULT, None)], True)) == {DEFAULT_USER}
    both = [(USER, MATCH_EXACT, "alice"), (CLIENT_ID, MATCH_DEFAULT, None)]
    assert ents(describe(STORE, both, True)) == {ALICE_DEFAULT_CLIENT}


def test_describe_specified_matches_any_name_including_the_default():
    """MATCH_TYPE_SPECIFIED only asks that the entity has the type (containsKey), so default
    names match too (ClientQuotasRequestTest: 10 of its user entities, defaults included)."""
    users = {ALICE, ALICE_APP, ALICE_DEFAULT_CLIENT, DEFAULT_USER, DEFAULT_USER_APP, BOB}
    assert ents(describe(STORE, [(USER, MATCH_SPECIFIED, None)], False)) == users
    assert ents(describe(STORE, [(USER, MATCH_SPECIFIED, None)], True)) == {ALICE, DEFAULT_USER, BOB}
    clients = [(CLIENT_ID, MATCH_SPECIFIED, None)]
    assert ents(describe(STORE, clients, True)) == {APP, DEFAULT_CLIENT}


def test_describe_strict_means_exactly_the_filtered_types():
    """strict: entity size == number of components; no components matches everything when not
    strict and nothing when strict (no entity is empty)."""
    assert ents(describe(STORE, [], False)) == set(STORE)
    assert ents(describe(STORE, [], True)) == set()
    pair = [(USER, MATCH_SPECIFIED, None), (CLIENT_ID, MATCH_SPECIFIED, None)]
    assert ents(describe(STORE, pair, True)) == {ALICE_APP, ALICE_DEFAULT_CLIENT, DEFAULT_USER_APP}


def test_describe_returns_the_values_and_skips_empty_entities():
    result = describe({**STORE, QuotaEntity.of({USER: "empty"}): {}}, [(USER, MATCH_SPECIFIED, None)], True)
    assert result.error_message is None
    assert {e.entity: dict(e.values) for e in result.entries or ()} == {
        ALICE: {"producer_byte_rate": 1000.0},
        DEFAULT_USER: {"controller_mutation_rate": 0.5},
        BOB: {"producer_ids_rate": 20.0},
    }


def test_describe_names_are_literal():
    """Kafka compares names with equals: a glob is a name, and "<default>" is not the default."""
    store = {QuotaEntity.of({CLIENT_ID: "connect-*"}): {"request_rate": 1.0}, DEFAULT_CLIENT: {"request_rate": 2.0}}
    assert ents(describe(store, [(CLIENT_ID, MATCH_EXACT, "connect-*")], True)) == set(list(store)[:1])
    assert ents(describe(store, [(CLIENT_ID, MATCH_EXACT, "connect-x")], True)) == set()
    assert ents(describe(store, [(CLIENT_ID, MATCH_EXACT, DEFAULT)], True)) == set()


def test_describe_ip_filter_is_valid_and_matches_nothing():
    """Kafka accepts an ip component; the proxy holds no ip entity, so nothing matches."""
    assert describe(STORE, [(IP, MATCH_SPECIFIED, None)], False) == DescribeResult(NONE, None, ())
    assert describe(STORE, [(IP, MATCH_EXACT, "10.0.0.1")], True) == DescribeResult(NONE, None, ())


@pytest.mark.parametrize("components, code, message", [
    ([("", MATCH_SPECIFIED, None)], INVALID_REQUEST, "Invalid empty entity type."),
    ([(USER, MATCH_EXACT, "a"), (USER, MATCH_EXACT, "b")], INVALID_REQUEST,
     "Entity type user cannot appear more than once in the filter."),
    ([(CLIENT_ID, MATCH_SPECIFIED, None), (CLIENT_ID, MATCH_DEFAULT, None)], INVALID_REQUEST,
     "Entity type client-id cannot appear more than once in the filter."),
    ([("group", MATCH_SPECIFIED, None)], UNSUPPORTED_VERSION, "Unsupported entity type group"),
    ([(USER, MATCH_EXACT, None)], INVALID_REQUEST,
     "Request specified MATCH_TYPE_EXACT, but set match string to null."),
    ([(USER, MATCH_DEFAULT, "a")], INVALID_REQUEST,
     "Request specified MATCH_TYPE_DEFAULT, but also specified a match string."),
    ([(USER, MATCH_SPECIFIED, "a")], INVALID_REQUEST,
     "Request specified MATCH_TYPE_SPECIFIED, but also specified a match string."),
    ([(USER, 3, None)], INVALID_REQUEST, "Unknown match type 3"),
    ([(IP, MATCH_SPECIFIED, None), (USER, MATCH_EXACT, "a")], INVALID_REQUEST,
     "Invalid entity filter component combination. IP filter component should not be used with "
     "user or clientId filter component."),
    ([(CLIENT_ID, MATCH_DEFAULT, None), (IP, MATCH_DEFAULT, None)], INVALID_REQUEST,
     "Invalid entity filter component combination. IP filter component should not be used with "
     "user or clientId filter component."),
])
def test_describe_errors(components, code, message):
    """ClientQuotasImage.describe throws InvalidRequestException (UnsupportedVersionException for
    an unknown type); KafkaApis answers with getErrorResponse: that code and message, null entries."""
    assert describe(STORE, components, False) == DescribeResult(code, message, None)


def test_describe_errors_come_in_kafkas_order():
    """Per component: empty type, repeat, unknown type, then the match checks; the first wins."""
    bad_then_dup = [(USER, MATCH_EXACT, None), (USER, MATCH_EXACT, None)]
    assert describe(STORE, bad_then_dup, False).error_message == (
        "Request specified MATCH_TYPE_EXACT, but set match string to null.")
    # The type is checked before the match type, and a repeat before the type.
    assert describe(STORE, [("group", 9, None)], False).error_code == UNSUPPORTED_VERSION
    dup_first = [(USER, MATCH_SPECIFIED, None), (USER, 9, "x"), ("group", 0, "g")]
    assert describe(STORE, dup_first, False).error_message == (
        "Entity type user cannot appear more than once in the filter.")


def test_describe_error_for_a_refused_request():
    """KafkaApis: no DESCRIBE_CONFIGS on the cluster → CLUSTER_AUTHORIZATION_FAILED; ApiError.fromThrowable
    drops a message that only repeats the default one, so the message is null."""
    assert describe_error(CLUSTER_AUTHORIZATION_FAILED) == DescribeResult(31, None, None)


# --- AlterClientQuotas: applying -------------------------------------------------------------


def test_add_change_and_unchanged():
    """ClientQuotaControlManager.alterClientQuotaEntity: a record for each changed value only."""
    res, result = one([(USER, "carol")], set_op("producer_byte_rate", 500))
    assert res == EntryResult(((USER, "carol"),), NONE, None)
    carol = QuotaEntity.of({USER: "carol"})
    assert result.new_quotas[carol] == {"producer_byte_rate": 500.0}
    assert result.changes == (QuotaChange(carol, "producer_byte_rate", None, 500.0),)

    res, result = one([(USER, "alice")], set_op("producer_byte_rate", 1500), set_op("request_rate", 7.5))
    assert res.error_code == NONE
    assert result.new_quotas[ALICE] == {"producer_byte_rate": 1500.0, "request_rate": 7.5}
    assert result.changes == (
        QuotaChange(ALICE, "producer_byte_rate", 1000.0, 1500.0),
        QuotaChange(ALICE, "request_rate", None, 7.5),
    )

    res, result = one([(USER, "alice")], set_op("producer_byte_rate", 1000))
    assert res.error_code == NONE and result.changes == () and result.new_quotas == STORE


def test_remove_and_remove_the_last_key():
    """ClientQuotaControlManager.replay: removing a key; the entity goes with its last key."""
    quotas = {ALICE: {"producer_byte_rate": 1000.0, "request_rate": 3.0}}
    res, result = one([(USER, "alice")], remove_op("request_rate"), quotas=quotas)
    assert res.error_code == NONE
    assert result.new_quotas == {ALICE: {"producer_byte_rate": 1000.0}}
    assert result.changes == (QuotaChange(ALICE, "request_rate", 3.0, None),)

    res, result = one([(USER, "alice")], remove_op("producer_byte_rate"), remove_op("request_rate"), quotas=quotas)
    assert res.error_code == NONE and result.new_quotas == {}
    assert [c.key for c in result.changes] == ["producer_byte_rate", "request_rate"]


def test_removing_what_is_not_set_is_a_successful_no_op():
    """alterClientQuotaEntity validates set ops only: a removal of an absent key, even an unknown
    or refused one, is no record and no error."""
    for key in ("consumer_byte_rate", "no_such_key", "request_percentage"):
        res, result = one([(USER, "alice")], remove_op(key))
        assert res == EntryResult(((USER, "alice"),), NONE, None)
        assert result.changes == () and result.new_quotas == STORE
    res, result = one([(USER, "nobody")], remove_op("producer_byte_rate"))
    assert res.error_code == NONE and result.new_quotas == STORE


def test_defaults_are_null_names():
    """KRaft's default entity is a null name (ClientQuotaEntity); the response echoes the null."""
    res, result = one([(CLIENT_ID, None), (USER, "alice")], set_op("consumer_byte_rate", 10))
    assert res == EntryResult(((CLIENT_ID, None), (USER, "alice")), NONE, None)
    assert result.new_quotas[ALICE_DEFAULT_CLIENT] == {"request_rate": 10.0, "consumer_byte_rate": 10.0}
    assert ALICE_DEFAULT_CLIENT.to_rule(result.new_quotas[ALICE_DEFAULT_CLIENT]).client_id == DEFAULT

    res, result = one([(USER, None)], remove_op("controller_mutation_rate"))
    assert res.error_code == NONE and DEFAULT_USER not in result.new_quotas


def test_validate_only_answers_the_same_and_changes_nothing():
    """QuorumController.alterClientQuotas: validateOnly keeps the results, drops the records."""
    entries = [
        AlterEntry([(USER, "alice")], [set_op("producer_byte_rate", 2)]),
        AlterEntry([(USER, "zed")], [set_op("producer_byte_rate", 2.5)]),
        AlterEntry([(CLIENT_ID, "app")], [remove_op("consumer_record_rate")]),
    ]
    real = alter(STORE, entries, validate_only=False)
    dry = alter(STORE, entries, validate_only=True)
    assert dry.results == real.results
    assert [r.error_code for r in dry.results] == [NONE, INVALID_REQUEST, NONE]
    assert dry.new_quotas == STORE and dry.changes == ()
    assert real.new_quotas != STORE and len(real.changes) == 2


def test_entries_are_independent():
    """alterClientQuotas evaluates each entity on its own: one failing leaves the others applied."""
    entries = [
        ([(USER, "alice")], [("producer_byte_rate", 1.0, False)]),
        ([(USER, "bob")], [("no_such_key", 1.0, False)]),
        ([(CLIENT_ID, "app")], [("consumer_record_rate", 60.0, False)]),
    ]
    result = alter(STORE, entries)
    assert [r.error_code for r in result.results] == [NONE, INVALID_REQUEST, NONE]
    assert result.new_quotas[ALICE] == {"producer_byte_rate": 1.0}
    assert result.new_quotas[BOB] == STORE[BOB]
    assert result.new_quotas[APP] == {"consumer_record_rate": 60.0}


def test_one_bad_op_fails_its_whole_entry():
    """alterClientQuotaEntity returns at the first invalid value: none of the entry's ops apply,
    removals included."""
    quotas = {ALICE: {"producer_byte_rate": 1000.0, "request_rate": 3.0}}
    res, result = one(
        [(USER, "alice")], remove_op("request_rate"), set_op("consumer_byte_rate", 5), set_op("consumer_byte_rate2", 1),
        quotas=quotas,
    )
    assert res.error_code == INVALID_REQUEST and res.error_message == "Invalid configuration key consumer_byte_rate2"
    assert result.new_quotas == quotas and result.changes == ()


def test_input_is_not_modified():
    before = {e: dict(v) for e, v in STORE.items()}
    alter(STORE, [([(USER, "alice")], [remove_op("producer_byte_rate")])])
    assert STORE == before


def test_every_proxy_key_is_accepted_on_a_user():
    """The keys the proxy knows (quotas.common.ALL_KINDS) are set on a user entity."""
    ops = [set_op(k, 1000) for k in sorted(ALL_KINDS)]
    res, result = one([(USER, "carol")], *ops)
    assert res.error_code == NONE
    assert set(result.new_quotas[QuotaEntity.of({USER: "carol"})]) == ALL_KINDS


def test_describe_sees_what_alter_applied():
    result = alter({}, [([(USER, "u"), (CLIENT_ID, None)], [("producer_byte_rate", 10.0, False)])])
    found = describe(result.new_quotas, [(USER, MATCH_EXACT, "u"), (CLIENT_ID, MATCH_DEFAULT, None)], True)
    assert [(e.entity.rule_key, dict(e.values)) for e in found.entries or ()] == [
        (("u", DEFAULT), {"producer_byte_rate": 10.0})
    ]


# --- AlterClientQuotas: keys and values -------------------------------------------------------


def test_unknown_key():
    """validateQuotaKeyValue: a key outside the entity type's ConfigDef."""
    assert refused([(USER, "alice")], set_op("replica_rate", 1)) == "Invalid configuration key replica_rate"
    # connection_creation_rate is an ip key in Kafka (QuotaConfig.ipConfigs), unknown for a user.
    assert refused([(USER, "alice")], set_op("connection_creation_rate", 1)) == (
        "Invalid configuration key connection_creation_rate")


def test_request_percentage_is_refused_with_a_reason():
    """Kafka accepts request_percentage (a DOUBLE); the proxy cannot measure thread time."""
    message = refused([(USER, "alice")], set_op("request_percentage", 50))
    assert message.startswith("Quota request_percentage is not supported by the proxy")
    assert "thread time" in message and "request_rate" in message


def test_producer_ids_rate_is_for_users_only():
    """KIP-936: producer_ids_rate is /config/users/<user> or <default> only."""
    for entity in ([(USER, "alice"), (CLIENT_ID, "app")], [(CLIENT_ID, "app")], [(USER, None), (CLIENT_ID, None)]):
        assert refused(entity, set_op("producer_ids_rate", 10)) == (
            "Invalid configuration key producer_ids_rate for an entity with client-id: it applies to users only")
    res, _ = one([(USER, None)], set_op("producer_ids_rate", 10))
    assert res.error_code == NONE


def test_producer_ids_rate_is_at_least_one():
    """As the proxy's configuration: a token is a whole producer id."""
    assert refused([(USER, "alice")], set_op("producer_ids_rate", 0.5)) == (
        "Quota producer_ids_rate must be at least 1 (new producer ids per window), got 0.5")


@pytest.mark.parametrize("key", sorted(ALL_KINDS - {"producer_ids_rate"}))
@pytest.mark.parametrize("value", [0.0, -0.0, -1.0, -math.inf])
def test_zero_and_negative_values(key, value):
    """validateQuotaKeyValue: value <= 0.0 → "Quota K must be greater than 0" (KAFKA-14943)."""
    assert refused([(USER, "alice")], set_op(key, value)) == f"Quota {key} must be greater than 0"


@pytest.mark.parametrize("key", ["producer_byte_rate", "consumer_byte_rate"])
def test_long_keys_must_be_integral(key):
    """QuotaConfig: the byte rates are LONG; getErrorForIntegralQuotaValue refuses |v % 1| > 1e-6,
    so just above a whole number passes and just below it fails."""
    assert refused([(USER, "alice")], set_op(key, 1.5)) == f"{key} cannot be a fractional value."
    assert refused([(USER, "alice")], set_op(key, 4.9999999)) == f"{key} cannot be a fractional value."
    for ok in (5.0000001, 1.0, 1e15):
        res, result = one([(USER, "alice")], set_op(key, ok))
        assert res.error_code == NONE, ok
        assert result.new_quotas[ALICE][key] == ok


@pytest.mark.parametrize("key", ["producer_byte_rate", "consumer_byte_rate"])
def test_long_keys_too_large(key):
    """validateQuotaKeyValue: value > (double) Long.MAX_VALUE, i.e. above 2^63; 2^63 itself passes
    (the double comparison), +Infinity is "too large" too."""
    for big in (1e19, math.inf):
        assert refused([(USER, "alice")], set_op(key, big)) == f"Proposed value for {key} is too large for a LONG."
    res, _ = one([(USER, "alice")], set_op(key, float(2**63)))
    assert res.error_code == NONE


@pytest.mark.parametrize("key", ["controller_mutation_rate", "request_rate", "producer_record_rate",
                                 "producer_batch_rate", "consumer_record_rate"])
def test_double_keys_take_fractions(key):
    """controller_mutation_rate is a DOUBLE (KAFKA-10163); the proxy's own keys are too."""
    res, result = one([(USER, "alice")], set_op(key, 0.25))
    assert res.error_code == NONE and result.new_quotas[ALICE][key] == 0.25


@pytest.mark.parametrize("key", sorted(ALL_KINDS))
def test_nan_is_refused(key):
    """Kafka lets NaN through every check (NaN <= 0 and NaN % 1 > 1e-6 are false); the proxy
    refuses it, as its engines need a real bound."""
    assert refused([(USER, None)], set_op(key, math.nan)) == f"Quota {key} must be a finite number, got nan"


def test_infinity_is_refused_for_double_keys():
    """Kafka accepts +Infinity for a DOUBLE key; the proxy refuses it (an unlimited quota is no quota)."""
    assert refused([(USER, "alice")], set_op("controller_mutation_rate", math.inf)) == (
        "Quota controller_mutation_rate must be a finite number, got inf")


def test_duplicate_key_in_an_entry():
    """alterClientQuotas refuses an entry that names a key twice (the proxy sends the message
    Kafka builds and then overwrites with "Ignoring duplicate entity")."""
    assert refused([(USER, "alice")], set_op("request_rate", 1), remove_op("request_rate")) == (
        "Duplicate quota key request_rate not updating quota for this entity "
        "ClientQuotaEntity(entries={user=alice})")


def test_duplicate_entity_in_a_request():
    """alterClientQuotas answers a repeated entity with "Ignoring duplicate entity"; Kafka has
    applied the first occurrence by then, the proxy applies none of them. Entities are compared
    as Kafka's maps, so the order of their parts does not matter."""
    entries = [
        ([(USER, "alice"), (CLIENT_ID, "app")], [("request_rate", 1.0, False)]),
        ([(USER, "bob")], [("request_rate", 2.0, False)]),
        ([(CLIENT_ID, "app"), (USER, "alice")], [("request_rate", 3.0, False)]),
    ]
    result = alter(STORE, entries)
    message = "Ignoring duplicate entity ClientQuotaEntity(entries={client-id=app, user=alice})"
    assert [(r.error_code, r.error_message) for r in result.results] == [
        (INVALID_REQUEST, message), (NONE, None), (INVALID_REQUEST, message)]
    assert result.new_quotas[ALICE_APP] == STORE[ALICE_APP]
    assert result.new_quotas[BOB] == {"producer_ids_rate": 20.0, "request_rate": 2.0}
    # AlterClientQuotasResponse.fromQuotaEntities: one response entry per entity.
    assert result.response_entries() == (
        EntryResult(((CLIENT_ID, "app"), (USER, "alice")), INVALID_REQUEST, message),
        EntryResult(((USER, "bob"),), NONE, None),
    )


# --- AlterClientQuotas: entities --------------------------------------------------------------


@pytest.mark.parametrize("entity, message", [
    ([], "Invalid empty client quota entity"),
    ([(USER, "a"), (USER, "b")], "Invalid client quota entity, duplicate entity entry user"),
    ([("group", "g")], "Unhandled client quota entity type: group"),
    ([(USER, "a"), ("User", "b")], "Unhandled client quota entity type: User"),
    ([(USER, "")], "Empty user not supported"),
    ([(USER, "a"), (CLIENT_ID, "")], "Empty client-id not supported"),
    ([(IP, "10.0.0.1"), (USER, "a")],
     "Invalid quota entity combination, IP entity shouldnot be combined with User or ClientId"),
    ([(CLIENT_ID, None), (IP, None)],
     "Invalid quota entity combination, IP entity shouldnot be combined with User or ClientId"),
])
def test_invalid_entities(entity, message):
    """ClientQuotaControlManager.validateEntity and configKeysForEntityType, messages verbatim
    (including Kafka's missing space in "shouldnot"). Kafka folds repeated types into a map before
    validateEntity sees them; the proxy refuses them with validateEntity's message."""
    assert refused(entity, set_op("request_rate", 1)) == message


@pytest.mark.parametrize("entity", [[(IP, "10.0.0.1")], [(IP, None)]])
def test_ip_quotas_are_refused(entity):
    """Kafka would set connection_creation_rate on an ip entity; the proxy does not take ip quotas
    through this API, set or remove."""
    for op in (set_op("connection_creation_rate", 5), remove_op("connection_creation_rate")):
        message = refused(entity, op)
        assert message.startswith("ip quotas (connection_creation_rate) cannot be altered through the proxy")


def test_literal_default_name_is_refused():
    """"<default>" is how the proxy's rules spell the default entity, so a name that is literally
    "<default>" (a distinct entity in Kafka) would be confused with it."""
    assert refused([(USER, DEFAULT)], set_op("request_rate", 1)) == (
        "user name <default> is reserved by the proxy for the default entity; send a null name to set the default")


def test_user_globs_need_a_client_id():
    """As the proxy's configuration: globs are client-id patterns; a user-only glob is refused."""
    assert refused([(USER, "team-*")], set_op("request_rate", 1)) == (
        "user name team-* looks like a glob; globs apply to client ids only")
    res, _ = one([(USER, None), (CLIENT_ID, "connect-*")], set_op("producer_record_rate", 10))
    assert res.error_code == NONE


# --- AlterClientQuotas: whole-request errors --------------------------------------------------


def test_too_many_changes_fail_the_whole_request():
    """QuorumController.MAX_RECORDS_PER_USER_OP (10000): a BoundedList overflow becomes a
    PolicyViolationException for the whole request, validateOnly included; getErrorResponse sends
    POLICY_VIOLATION's default message for every entry."""
    entries = [([(USER, f"u{i}")], [("request_rate", 1.0, False)]) for i in range(MAX_CHANGES_PER_REQUEST + 1)]
    for validate_only in (False, True):
        result = alter({}, entries, validate_only)
        assert result.new_quotas == {} and result.changes == ()
        assert len(result.results) == len(entries)
        assert set((r.error_code, r.error_message) for r in result.results) == {
            (POLICY_VIOLATION, "Request parameters do not satisfy the configured policy.")}
    result = alter({}, entries[:MAX_CHANGES_PER_REQUEST])
    assert len(result.new_quotas) == MAX_CHANGES_PER_REQUEST


def test_alter_error_for_a_refused_request():
    """ControllerApis: no ALTER_CONFIGS on the cluster → every request entry (a repeated entity
    too) CLUSTER_AUTHORIZATION_FAILED with the error's default message, its parts as sent
    (AlterClientQuotasRequest.getErrorResponse)."""
    entries = [([(USER, "a"), (CLIENT_ID, "b")], [("request_rate", 1.0, False)]),
               ([(USER, "a"), (CLIENT_ID, "b")], [("consumer_byte_rate", 1.0, False)])]
    result = alter_error(STORE, entries, CLUSTER_AUTHORIZATION_FAILED)
    assert result.response_entries() == (
        EntryResult(((USER, "a"), (CLIENT_ID, "b")), 31, "Cluster authorization failed."),) * 2
    assert result.new_quotas == STORE and result.changes == ()
    assert DEFAULT_MESSAGES[CLUSTER_AUTHORIZATION_FAILED] == "Cluster authorization failed."


def test_empty_request():
    """QuorumController.alterClientQuotas: no alterations, no results."""
    result = alter(STORE, [])
    assert result.results == () and result.changes == () and result.new_quotas == STORE


# --- Properties -------------------------------------------------------------------------------

_names = st.sampled_from(["a", "b", None])
_entities = st.one_of(
    st.tuples(st.tuples(st.just(USER), _names)),
    st.tuples(st.tuples(st.just(CLIENT_ID), _names)),
    st.tuples(st.tuples(st.just(USER), _names), st.tuples(st.just(CLIENT_ID), _names)),
)
_ops = st.lists(
    st.tuples(
        st.sampled_from(["producer_byte_rate", "request_rate", "controller_mutation_rate", "bogus"]),
        st.sampled_from([1.0, 2.5, 3.0, -1.0]),
        st.booleans(),
    ),
    max_size=4,
)


@given(st.lists(st.tuples(_entities, _ops), max_size=6))
def test_changes_replayed_on_the_old_quotas_give_the_new(entries):
    """new_quotas is exactly the old quotas with the changes replayed in order; validate_only
    gives the same results and no change."""
    result = alter(STORE, entries)
    replayed = {e: dict(v) for e, v in STORE.items()}
    for c in result.changes:
        assert replayed.get(c.entity, {}).get(c.key) == c.old
        if c.new is None:
            del replayed[c.entity][c.key]
            if not replayed[c.entity]:
                del replayed[c.entity]
        else:
            replayed.setdefault(c.entity, {})[c.key] = c.new
    assert replayed == result.new_quotas
    assert all(v for v in result.new_quotas.values())
    dry = alter(STORE, entries, validate_only=True)
    assert dry.results == result.results and dry.changes == () and dry.new_quotas == STORE


def test_a_key_no_limiter_enforces_fails_its_entry_but_can_still_be_removed():
    # The proxy's own rule (config.loader refuses such a quota in the file too).
    quotas = {BOB: {"producer_record_rate": 5.0}}
    result = alter(quotas, [AlterEntry([(USER, "bob")], [set_op("producer_batch_rate", 10.0)]),
                            AlterEntry([(USER, "carol")], [set_op("request_rate", 1.0)])],
                   unenforced=frozenset({"producer_batch_rate", "producer_record_rate"}))
    assert result.results[0].error_code == INVALID_REQUEST
    assert "no configured rate limiter enforces it" in (result.results[0].error_message or "")
    assert result.results[1].error_code == NONE
    removed = alter(quotas, [AlterEntry([(USER, "bob")], [remove_op("producer_record_rate")])],
                    unenforced=frozenset({"producer_record_rate"}))
    assert removed.results[0].error_code == NONE and removed.new_quotas == {}
