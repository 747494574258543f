"""Every DescribeClientQuotas / AlterClientQuotas request form through the proxy, each whole
response compared with the one Apache Kafka 4.0 sends for it.

Each case goes over a raw client connection (kafka-python's protocol classes, v0 and v1) to an
InProcessProxy in front of a real Tansu, and its decoded response is compared whole
(``to_dict()``: throttle_time_ms, error_code, error_message, each entry's entity list in order,
values) with an expected response written from Kafka's code. The comment on each case names
the Kafka class and method that decide it (read at apache/kafka 1eb7644, trunk of October 2024
on the way to 4.0):

- Alter: ``ClientQuotaControlManager.alterClientQuotas`` / ``alterClientQuotaEntity`` /
  ``validateEntity`` / ``configKeysForEntityType`` / ``validateQuotaKeyValue``, with the keys of
  ``QuotaConfig.userAndClientQuotaConfigs`` (producer_byte_rate and consumer_byte_rate LONG,
  request_percentage and controller_mutation_rate DOUBLE); ``QuorumController.alterClientQuotas``
  for validate_only and an empty request; ``AlterClientQuotasRequest.entries`` (the entity folded
  into a HashMap), ``AlterClientQuotasResponse.fromQuotaEntities`` (one entry per entity) and
  ``getErrorResponse`` (a whole-request failure).
- Describe: ``ClientQuotasImage.describe`` / ``matches``; ``DescribeClientQuotasRequest
  .getErrorResponse`` with ``ApiError.fromThrowable`` (no message when it would repeat the
  error's default one).
- Authorization: ``ControllerApis.handleAlterClientQuotas`` (ALTER_CONFIGS on the cluster) and
  ``KafkaApis.handleDescribeClientQuotasRequest`` (DESCRIBE_CONFIGS on the cluster).

Kafka builds an entity from a ``java.util.HashMap``, so it lists ``client-id`` before ``user``
(and ``ip`` after both), whatever order the request used: the expected entity lists are in that
order. The order of Kafka's Alter entries is a HashMap's over the entities, the proxy's the
request's (``alter-entries-in-request-order``); the other multi-entry cases send their entities
in the HashMap's order, so both agree. The order of Describe entries and of each entry's values is a HashMap's over
state the proxy does not share with Kafka, and clients read both into maps
(``DescribeClientQuotasResponse.complete``): Describe responses are compared with entries and
values sorted.

Cases marked "deliberate" are where the proxy differs from Kafka on purpose: the comment says
what Kafka answers instead and why.

Every Alter case starts from the file's quotas alone (``FILE``: a proxy of its own, keeping what
is altered in a quota topic of its own on the module's Tansu) and ends with a Describe of every
quota in force, compared with ``after``. The Describe cases, which change nothing, share one
proxy per module, which starts from ``DESCRIBE_START``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import pytest
from kafka.protocol.admin import (
    AlterClientQuotasRequest,
    AlterClientQuotasResponse,
)

from tests.integration.test_client_quota_api import (
    ALICE,
    ALICE_APP,
    DEFAULT_CLIENT,
    DEFAULT_USER,
    FILE_QUOTAS,
    AdminConnection,
    remove,
    set_,
)
from tests.support.inproc import InProcessProxy
from tests.support.tansu import TansuBroker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

VERSIONS = (0, 1)
EXACT, DEFAULT, SPECIFIED = 0, 1, 2  # DescribeClientQuotasRequest.MATCH_TYPE_*
NONE = 0
CLUSTER_AUTHORIZATION_FAILED = 31
UNSUPPORTED_VERSION = 35
INVALID_REQUEST = 42
POLICY_VIOLATION = 44
POLICY_MESSAGE = "Request parameters do not satisfy the configured policy."  # Errors.POLICY_VIOLATION.message()
CLUSTER_AUTH_MESSAGE = "Cluster authorization failed."  # Errors.CLUSTER_AUTHORIZATION_FAILED.message()

PBR, CBR = "producer_byte_rate", "consumer_byte_rate"  # LONG in QuotaConfig
CMR, RPCT = "controller_mutation_rate", "request_percentage"  # DOUBLE in QuotaConfig
REQUEST_RATE, PIDS = "request_rate", "producer_ids_rate"  # the proxy's own keys

# Entities as Kafka echoes them (client-id before user).
BOB = (("user", "bob"),)
CAROL = (("user", "carol"),)
ERIN = (("user", "erin"),)
ZED = (("user", "zed"),)
APP = (("client-id", "app"),)
DEFAULT_DEFAULT = (("client-id", None), ("user", None))
ALICE_DEFAULT_CLIENT = (("client-id", None), ("user", "alice"))
DEFAULT_USER_APP = (("client-id", "app"), ("user", None))

# FILE_QUOTAS as in force: where every Alter case starts.
FILE: dict[tuple, dict[str, float]] = {
    ALICE: {PBR: 1048576.0},
    ALICE_APP: {CBR: 2097152.0},
    DEFAULT_USER: {REQUEST_RATE: 500.0},
    DEFAULT_CLIENT: {REQUEST_RATE: 1000.0},
}


def entity_of(sent: tuple) -> str:
    """ClientQuotaEntity.toString of an entity as Kafka orders it."""
    inner = ", ".join(f"{t}={'null' if n is None else n}" for t, n in sent)
    return f"ClientQuotaEntity(entries={{{inner}}})"


def in_force(changes: dict[tuple, dict[str, float] | None] | None = None) -> dict[tuple, dict[str, float]]:
    """FILE with each entity of ``changes`` replaced by its values (None: the entity is gone)."""
    state = {entity: dict(values) for entity, values in FILE.items()}
    for entity, values in (changes or {}).items():
        if values is None:
            state.pop(entity)
        else:
            state[entity] = values
    return state


# --- AlterClientQuotas ----------------------------------------------------------------------


@dataclass(frozen=True)
class Alter:
    """``entries``: ((entity as sent, ops), ...); ``answer``: ((entity echoed, error_code,
    error_message), ...) in response order; ``after``: the quotas in force afterwards."""

    entries: tuple
    answer: tuple
    after: dict = field(default_factory=in_force)
    validate_only: bool = False
    principals: tuple = ("User:ANONYMOUS",)
    rate_limiters: tuple | None = None  # None: the default ones (records and batches enforced)


def ok(entity: tuple) -> tuple:
    return (entity, NONE, None)


def bad(entity: tuple, message: str) -> tuple:
    return (entity, INVALID_REQUEST, message)


def one(entity: tuple, *ops) -> tuple:
    """A request of one entry: ``entity`` (as sent) with ``ops``."""
    return ((entity, ops),)


NAN, INF = math.nan, math.inf
NOT_ENFORCED = ("is not enforced by this proxy: no configured rate limiter enforces it "
                "(rate_limiters needs quotas.limiters:RecordRateLimiter or BatchRateLimiter)")

# 10,001 users, one new quota each: one change (a record) more than Kafka takes in one request.
TOO_MANY = tuple(((("user", f"u{i}"),), (set_(PBR, 1),)) for i in range(10_001))

ALTER_CASES = [
    # ClientQuotaControlManager.alterClientQuotaEntity: a key not set yet gets a record.
    pytest.param(Alter(one(BOB, set_(PBR, 1024)), (ok(BOB),), in_force({BOB: {PBR: 1024.0}})), id="add"),
    # alterClientQuotaEntity: a new value for a key already set.
    pytest.param(Alter(one(ALICE, set_(PBR, 2048)), (ok(ALICE),), in_force({ALICE: {PBR: 2048.0}})), id="change"),
    # alterClientQuotaEntity: the same value makes no record (Objects.equals), and succeeds.
    pytest.param(Alter(one(ALICE, set_(PBR, 1048576)), (ok(ALICE),)), id="change-to-same-value"),
    # alterClientQuotaEntity then ClientQuotaControlManager.replay: removing the last key removes the entity.
    pytest.param(Alter(one(ALICE, remove(PBR)), (ok(ALICE),), in_force({ALICE: None})), id="remove-last-key"),
    # The same, for a default entity the file set.
    pytest.param(Alter(one(DEFAULT_CLIENT, remove(REQUEST_RATE)), (ok(DEFAULT_CLIENT),),
                       in_force({DEFAULT_CLIENT: None})), id="remove-file-default"),
    # AlterClientQuotasRequest.entries: remove=true makes the value null (a removal), whatever it was.
    pytest.param(Alter(one(ALICE, (PBR, 5.0, True)), (ok(ALICE),), in_force({ALICE: None})), id="remove-with-a-value"),
    # alterClientQuotaEntity: a removal of a key the entity does not have makes no record, and succeeds.
    pytest.param(Alter(one(ALICE, remove(CBR)), (ok(ALICE),)), id="remove-key-never-set"),
    # alterClientQuotaEntity: removals are not validated, so even an unknown key is a no-op.
    pytest.param(Alter(one(ALICE, remove("bogus")), (ok(ALICE),)), id="remove-unknown-key"),
    # alterClientQuotaEntity: an entity without quotas (currentQuotas empty): a no-op.
    pytest.param(Alter(one(ZED, remove(PBR)), (ok(ZED),)), id="remove-from-entity-never-set"),
    # alterClientQuotaEntity: every op of an entry, a change and two additions.
    pytest.param(Alter(one(ALICE, set_(PBR, 1), set_(CBR, 2), set_(CMR, 2.5)), (ok(ALICE),),
                       in_force({ALICE: {PBR: 1.0, CBR: 2.0, CMR: 2.5}})), id="several-ops"),
    # alterClientQuotaEntity: a removal and an addition; the entity sent user first, echoed client-id first.
    pytest.param(Alter(one((("user", "alice"), ("client-id", "app")), remove(CBR), set_(PBR, 4096)),
                       (ok(ALICE_APP),), in_force({ALICE_APP: {PBR: 4096.0}})), id="remove-and-add"),
    # alterClientQuotaEntity: the first failing op fails the entry, whose other ops are not applied.
    pytest.param(Alter(one(ALICE, set_(PBR, 5), set_("bogus", 1)),
                       (bad(ALICE, "Invalid configuration key bogus"),)), id="one-bad-op-fails-the-entry"),
    # alterClientQuotaEntity checks the ops in the HashMap order of their keys: bogus before producer_byte_rate.
    pytest.param(Alter(one(ALICE, set_("bogus", 1), set_(PBR, 1.5)),
                       (bad(ALICE, "Invalid configuration key bogus"),)), id="two-bad-ops"),
    # Deliberate: the same ops sent the other way round. Kafka still reports bogus (the HashMap
    # order of the keys, an accident of String.hashCode); the proxy reports the first bad op in
    # request order, which a caller can predict. Either way the entry fails and nothing changes.
    pytest.param(Alter(one(ALICE, set_(PBR, 1.5), set_("bogus", 1)),
                       (bad(ALICE, f"{PBR} cannot be a fractional value."),)), id="two-bad-ops-reversed"),
    # Deliberate: alterClientQuotas puts "Duplicate quota key ..." and then overwrites it with
    # "Ignoring duplicate entity <entity>"; nothing is applied either way. The proxy sends the
    # message Kafka's code means to send, which names the key.
    pytest.param(Alter(one(ALICE, set_(PBR, 1), set_(PBR, 2)), (bad(
        ALICE, f"Duplicate quota key {PBR} not updating quota for this entity {entity_of(ALICE)}"),)),
        id="same-key-twice"),
    # Deliberate, as above: a removal and a set of one key are the same key twice.
    pytest.param(Alter(one(ALICE, remove(PBR), set_(PBR, 2)), (bad(
        ALICE, f"Duplicate quota key {PBR} not updating quota for this entity {entity_of(ALICE)}"),)),
        id="same-key-removed-and-set"),
    # Deliberate: alterClientQuotas applies the first entry of an entity and answers
    # "Ignoring duplicate entity" for it (fromQuotaEntities: one entry per entity), so Kafka ends
    # with alice's producer_byte_rate 1; the proxy applies neither, so that the error is true.
    pytest.param(Alter(((ALICE, (set_(PBR, 1),)), (ALICE, (set_(CBR, 2),))),
                       (bad(ALICE, f"Ignoring duplicate entity {entity_of(ALICE)}"),)), id="same-entity-twice"),
    # Deliberate, as above (Kafka applies alice/app's producer_byte_rate 1); an entity is a map, so
    # the order of its parts does not matter; bob's entry is applied by both.
    pytest.param(Alter((((("user", "alice"), ("client-id", "app")), (set_(PBR, 1),)),
                        (BOB, (set_(PBR, 2),)),
                        ((("client-id", "app"), ("user", "alice")), (set_(PBR, 3),))),
                       (bad(ALICE_APP, f"Ignoring duplicate entity {entity_of(ALICE_APP)}"), ok(BOB)),
                       in_force({BOB: {PBR: 2.0}})), id="same-entity-twice-parts-reordered"),
    # validateEntity keeps a null name: the default user.
    pytest.param(Alter(one((("user", None),), set_(PBR, 1000)), (ok(DEFAULT_USER),),
                       in_force({DEFAULT_USER: {REQUEST_RATE: 500.0, PBR: 1000.0}})), id="default-user"),
    # validateEntity: the default client id.
    pytest.param(Alter(one((("client-id", None),), set_(CBR, 2000)), (ok(DEFAULT_CLIENT),),
                       in_force({DEFAULT_CLIENT: {REQUEST_RATE: 1000.0, CBR: 2000.0}})), id="default-client-id"),
    # validateEntity: the default user with the default client id.
    pytest.param(Alter(one((("user", None), ("client-id", None)), set_(PBR, 100)), (ok(DEFAULT_DEFAULT),),
                       in_force({DEFAULT_DEFAULT: {PBR: 100.0}})), id="default-user-default-client-id"),
    # validateEntity: a user with the default client id.
    pytest.param(Alter(one((("user", "alice"), ("client-id", None)), set_(PBR, 400)), (ok(ALICE_DEFAULT_CLIENT),),
                       in_force({ALICE_DEFAULT_CLIENT: {PBR: 400.0}})), id="user-default-client-id"),
    # validateEntity: the default user with a client id.
    pytest.param(Alter(one((("user", None), ("client-id", "app")), set_(CBR, 300)), (ok(DEFAULT_USER_APP),),
                       in_force({DEFAULT_USER_APP: {CBR: 300.0}})), id="default-user-client-id"),
    # QuorumController.alterClientQuotas: validateOnly answers the results without their records.
    pytest.param(Alter(((ALICE, (set_(PBR, 1),)), (BOB, (set_(CBR, 2),))), (ok(ALICE), ok(BOB)),
                       validate_only=True), id="validate-only-good"),
    # The same, with a bad entry: it fails on its own.
    pytest.param(Alter(((ALICE, (set_(PBR, 1),)), (BOB, (set_("producer_byte_rat", 1),))),
                       (ok(ALICE), bad(BOB, "Invalid configuration key producer_byte_rat")),
                       validate_only=True), id="validate-only-bad"),
    # alterClientQuotas: each entry on its own; the good one is applied, the bad one is not.
    pytest.param(Alter(((BOB, (set_(PBR, 1),)), (CAROL, (set_("bogus", 1),))),
                       (ok(BOB), bad(CAROL, "Invalid configuration key bogus")), in_force({BOB: {PBR: 1.0}})),
                 id="good-and-bad-entries"),
    # Deliberate: AlterClientQuotasResponse.fromQuotaEntities iterates ClientQuotaControlManager's
    # HashMap of results, so Kafka answers erin (bucket 1) before bob (bucket 10); the proxy
    # answers in request order. Clients read the entries into a map keyed by entity
    # (AlterClientQuotasResponse.complete), so the order carries nothing.
    pytest.param(Alter(((BOB, (set_(PBR, 1),)), (ERIN, (set_(PBR, 2),))), (ok(BOB), ok(ERIN)),
                       in_force({BOB: {PBR: 1.0}, ERIN: {PBR: 2.0}})), id="alter-entries-in-request-order"),
    # QuorumController: more than MAX_RECORDS_PER_USER_OP (10,000) records overflow the BoundedList
    # of alterClientQuotas → EventHandlerExceptionInfo makes it a PolicyViolationException →
    # AlterClientQuotasRequest.getErrorResponse: every entry, in request order; nothing applied.
    pytest.param(Alter(TOO_MANY, tuple((entity, POLICY_VIOLATION, POLICY_MESSAGE) for entity, _ in TOO_MANY)),
                 id="too-many-changes"),
    # The same when validating only: the records are built before validateOnly drops them.
    pytest.param(Alter(TOO_MANY, tuple((entity, POLICY_VIOLATION, POLICY_MESSAGE) for entity, _ in TOO_MANY),
                       validate_only=True), id="too-many-changes-validate-only"),
    # QuorumController.alterClientQuotas: no alterations, an empty map of results.
    pytest.param(Alter((), ()), id="empty-entries"),
    pytest.param(Alter((), (), validate_only=True), id="empty-entries-validate-only"),
    # validateQuotaKeyValue: a key not in QuotaConfig.userAndClientQuotaConfigs.
    pytest.param(Alter(one(BOB, set_("bogus", 1)), (bad(BOB, "Invalid configuration key bogus"),)), id="unknown-key"),
    # validateQuotaKeyValue: value <= 0.0.
    pytest.param(Alter(one(BOB, set_(PBR, 0)), (bad(BOB, f"Quota {PBR} must be greater than 0"),)), id="zero"),
    pytest.param(Alter(one(BOB, set_(PBR, -1)), (bad(BOB, f"Quota {PBR} must be greater than 0"),)),
                 id="negative-long-key"),
    pytest.param(Alter(one(BOB, set_(CMR, -0.5)), (bad(BOB, f"Quota {CMR} must be greater than 0"),)),
                 id="negative-double-key"),
    pytest.param(Alter(one(BOB, set_(CMR, -INF)), (bad(BOB, f"Quota {CMR} must be greater than 0"),)),
                 id="negative-infinity"),
    # Deliberate: NaN fails none of validateQuotaKeyValue's comparisons (nor the LONG ones), so
    # Kafka stores it; the proxy's engines need a real bound.
    pytest.param(Alter(one(BOB, set_(PBR, NAN)), (bad(BOB, f"Quota {PBR} must be a finite number, got nan"),)),
                 id="nan-long-key"),
    pytest.param(Alter(one(BOB, set_(CMR, NAN)), (bad(BOB, f"Quota {CMR} must be a finite number, got nan"),)),
                 id="nan-double-key"),
    # validateQuotaKeyValue, LONG: value > Long.MAX_VALUE, for +Infinity too.
    pytest.param(Alter(one(BOB, set_(PBR, INF)), (bad(BOB, f"Proposed value for {PBR} is too large for a LONG."),)),
                 id="infinity-long-key"),
    pytest.param(Alter(one(BOB, set_(CBR, 1e19)), (bad(BOB, f"Proposed value for {CBR} is too large for a LONG."),)),
                 id="too-large-long-key"),
    # validateQuotaKeyValue: 2^63 is not > (double) Long.MAX_VALUE, which is 2^63, and is whole.
    pytest.param(Alter(one(BOB, set_(PBR, 2.0**63)), (ok(BOB),), in_force({BOB: {PBR: 2.0**63}})),
                 id="largest-long-key"),
    # Deliberate: a DOUBLE key takes +Infinity in Kafka (no bound checked); the proxy wants a real bound.
    pytest.param(Alter(one(BOB, set_(CMR, INF)), (bad(BOB, f"Quota {CMR} must be a finite number, got inf"),)),
                 id="infinity-double-key"),
    # validateQuotaKeyValue → getErrorForIntegralQuotaValue: |value % 1.0| > 1e-6 for a LONG key.
    pytest.param(Alter(one(BOB, set_(PBR, 1.5)), (bad(BOB, f"{PBR} cannot be a fractional value."),)),
                 id="fractional-producer-byte-rate"),
    pytest.param(Alter(one(BOB, set_(CBR, 0.5)), (bad(BOB, f"{CBR} cannot be a fractional value."),)),
                 id="fractional-consumer-byte-rate"),
    # getErrorForIntegralQuotaValue: a remainder within 1e-6 passes, and the value is stored as sent.
    pytest.param(Alter(one(BOB, set_(PBR, 5.0000001)), (ok(BOB),), in_force({BOB: {PBR: 5.0000001}})),
                 id="fraction-within-tolerance"),
    # validateQuotaKeyValue: a DOUBLE key takes any positive value.
    pytest.param(Alter(one(BOB, set_(CMR, 1.5)), (ok(BOB),), in_force({BOB: {CMR: 1.5}})),
                 id="fractional-controller-mutation-rate"),
    # Deliberate: request_rate is the proxy's own DOUBLE key (requests per second); Kafka answers
    # "Invalid configuration key request_rate" (not in QuotaConfig).
    pytest.param(Alter(one(BOB, set_(REQUEST_RATE, 1.5)), (ok(BOB),), in_force({BOB: {REQUEST_RATE: 1.5}})),
                 id="fractional-request-rate"),
    # Deliberate: request_percentage is a DOUBLE key Kafka accepts; the proxy cannot measure
    # broker thread time, so it refuses the key rather than ignore it.
    pytest.param(Alter(one(BOB, set_(RPCT, 50)), (bad(BOB, (
        f"Quota {RPCT} is not supported by the proxy: it cannot measure the broker's request handler and "
        "network thread time; use request_rate (requests per second) instead")),)), id="request-percentage"),
    # Deliberate: producer_ids_rate (KIP-936) is the proxy's own key, users only; Kafka 4.0 answers
    # "Invalid configuration key producer_ids_rate" for any entity.
    pytest.param(Alter(one(APP, set_(PIDS, 5)), (bad(APP, (
        f"Invalid configuration key {PIDS} for an entity with client-id: it applies to users only")),)),
        id="producer-ids-rate-client-id"),
    pytest.param(Alter(one(BOB, set_(PIDS, 5)), (ok(BOB),), in_force({BOB: {PIDS: 5.0}})),
                 id="producer-ids-rate-user"),
    pytest.param(Alter(one(BOB, set_(PIDS, 0.5)), (bad(
        BOB, f"Quota {PIDS} must be at least 1 (new producer ids per window), got 0.5"),)),
        id="producer-ids-rate-below-one"),
    # Deliberate: a KIP-731 record rate is the proxy's own key, taken when a rate limiter enforces
    # it (the default ones do) and refused otherwise; Kafka answers "Invalid configuration key
    # producer_record_rate" (not in QuotaConfig) either way.
    pytest.param(Alter(one(BOB, set_("producer_record_rate", 10)), (ok(BOB),),
                       in_force({BOB: {"producer_record_rate": 10.0}})), id="record-rate"),
    pytest.param(Alter(one(BOB, set_("producer_record_rate", 10)), (bad(
        BOB, f"Quota producer_record_rate {NOT_ENFORCED}"),), rate_limiters=()), id="unenforced-record-rate"),
    # validateEntity: no entity type at all.
    pytest.param(Alter(one((), set_(PBR, 1)), (bad((), "Invalid empty client quota entity"),)), id="empty-entity"),
    # validateEntity: a type other than user, client-id and ip.
    pytest.param(Alter(one((("group", "g"),), set_(PBR, 1)), (bad(
        (("group", "g"),), "Unhandled client quota entity type: group"),)), id="unknown-entity-type"),
    # The same beside a user; a HashMap of 4 buckets puts user (1) before group (3).
    pytest.param(Alter(one((("group", "g"), ("user", "bob")), set_(PBR, 1)), (bad(
        (("user", "bob"), ("group", "g")), "Unhandled client quota entity type: group"),)),
        id="unknown-entity-type-with-user"),
    # Deliberate: two unknown types. validateEntity reports the first in the entity HashMap's
    # order (4 buckets: broker 0, group 3), and fromQuotaEntities echoes the parts in that
    # order; the proxy names the first in request order and echoes the unknown parts as sent.
    pytest.param(Alter(one((("group", "g"), ("broker", "b")), set_(PBR, 1)), (bad(
        (("group", "g"), ("broker", "b")), "Unhandled client quota entity type: group"),)),
        id="two-unknown-entity-types"),
    # validateEntity: an empty name.
    pytest.param(Alter(one((("user", ""),), set_(PBR, 1)), (bad((("user", ""),), "Empty user not supported"),)),
                 id="empty-user-name"),
    pytest.param(Alter(one((("client-id", ""),), set_(PBR, 1)), (bad(
        (("client-id", ""),), "Empty client-id not supported"),)), id="empty-client-id-name"),
    # Deliberate: AlterClientQuotasRequest.entries folds the entity into a HashMap, the last name
    # winning, so Kafka applies {user=carol} and answers NONE for it (validateEntity's duplicate
    # check is never reached); the proxy refuses the ambiguous entity and echoes it as sent.
    pytest.param(Alter(one((("user", "bob"), ("user", "carol")), set_(PBR, 1)), (bad(
        (("user", "bob"), ("user", "carol")), "Invalid client quota entity, duplicate entity entry user"),)),
        id="duplicate-entity-type"),
    # Deliberate: configKeysForEntityType accepts an ip entity (QuotaConfig.ipConfigs:
    # connection_creation_rate); the proxy takes ip quotas from its configuration only.
    pytest.param(Alter(one((("ip", "10.0.0.1"),), set_("connection_creation_rate", 10)), (bad(
        (("ip", "10.0.0.1"),), "ip quotas (connection_creation_rate) cannot be altered through the proxy; set "
        "connections.connection_creation_rate(_overrides) in the proxy's configuration"),)), id="ip"),
    pytest.param(Alter(one((("ip", None),), set_("connection_creation_rate", 10)), (bad(
        (("ip", None),), "ip quotas (connection_creation_rate) cannot be altered through the proxy; set "
        "connections.connection_creation_rate(_overrides) in the proxy's configuration"),)), id="ip-default"),
    # configKeysForEntityType: ip with user or client-id (the message's missing space is Kafka's).
    pytest.param(Alter(one((("ip", "10.0.0.1"), ("user", "bob")), set_(PBR, 1)), (bad(
        (("user", "bob"), ("ip", "10.0.0.1")),
        "Invalid quota entity combination, IP entity shouldnot be combined with User or ClientId"),)),
        id="ip-with-user"),
    pytest.param(Alter(one((("ip", "10.0.0.1"), ("client-id", "app")), set_(PBR, 1)), (bad(
        (("client-id", "app"), ("ip", "10.0.0.1")),
        "Invalid quota entity combination, IP entity shouldnot be combined with User or ClientId"),)),
        id="ip-with-client-id"),
    # Deliberate: Kafka takes "<default>" as a literal user name; the proxy's configuration spells
    # the default entity so, and it refuses the name rather than confuse the two.
    pytest.param(Alter(one((("user", "<default>"),), set_(PBR, 1)), (bad((("user", "<default>"),), (
        "user name <default> is reserved by the proxy for the default entity; send a null name to set the "
        "default")),)), id="reserved-default-name"),
    # Deliberate: Kafka takes any user name; in the proxy's configuration a glob matches client ids only.
    pytest.param(Alter(one((("user", "team-*"),), set_(PBR, 1)), (bad(
        (("user", "team-*"),), "user name team-* looks like a glob; globs apply to client ids only"),)),
        id="glob-user-name"),
    # ControllerApis.handleAlterClientQuotas: ALTER_CONFIGS on the cluster refused →
    # AlterClientQuotasRequest.getErrorResponse: every entry, the error's default message, nothing applied.
    pytest.param(Alter(((BOB, (set_(PBR, 1),)), (CAROL, (set_("bogus", 1),))),
                       (((BOB, CLUSTER_AUTHORIZATION_FAILED, CLUSTER_AUTH_MESSAGE)),
                        ((CAROL, CLUSTER_AUTHORIZATION_FAILED, CLUSTER_AUTH_MESSAGE))),
                       principals=("alice",)), id="unauthorized"),
    pytest.param(Alter((), (), principals=("alice",)), id="unauthorized-empty-entries"),
    # getErrorResponse echoes each entity's parts as the request sent them (user, then client-id).
    pytest.param(Alter(one((("user", "bob"), ("client-id", "app")), set_(PBR, 1)),
                       (((("user", "bob"), ("client-id", "app")), CLUSTER_AUTHORIZATION_FAILED, CLUSTER_AUTH_MESSAGE),),
                       principals=("alice",)), id="unauthorized-entity-as-sent"),
    # getErrorResponse answers every request entry, a repeated entity as often as it was sent.
    pytest.param(Alter(((BOB, (set_(PBR, 1),)), (BOB, (set_(CBR, 1),))),
                       (((BOB, CLUSTER_AUTHORIZATION_FAILED, CLUSTER_AUTH_MESSAGE)),) * 2,
                       principals=("alice",)), id="unauthorized-same-entity-twice"),
]


def alter_request(version: int, case: Alter):
    R = AlterClientQuotasRequest[version]
    E = R.EntryData
    return R(entries=[E(entity=[E.EntityData(entity_type=t, entity_name=n) for t, n in entity],
                        ops=[E.OpData(key=k, value=v, remove=r) for k, v, r in ops]) for entity, ops in case.entries],
             validate_only=case.validate_only)


def alter_response(case: Alter) -> dict:
    return {"throttle_time_ms": 0, "entries": [
        {"error_code": code, "error_message": message,
         "entity": [{"entity_type": t, "entity_name": n} for t, n in entity]}
        for entity, code, message in case.answer]}


@pytest.fixture(scope="module")
def broker():
    """One Tansu for the module (each Alter case's proxy keeps its changes in a topic of its own)."""
    with TansuBroker() as b:
        yield b


_topics = itertools.count()


def fresh_proxy(broker, principals=("User:ANONYMOUS",), describe="admins", rate_limiters=None) -> InProcessProxy:
    """test_client_quota_api.admin_proxy's proxy with a quota topic of its own (and the rate
    limiters given), so that FILE is all that is in force when it starts."""
    sections = {} if rate_limiters is None else {"rate_limiters": list(rate_limiters)}
    return InProcessProxy([broker.bootstrap], quotas=FILE_QUOTAS, quota_windows={
        "quota_window_num": 2, "quota_window_size_seconds": 1,
    }, quota_admin={
        "enabled": True, "principals": list(principals), "describe": describe,
        "topic": f"__kqp_client_quota_forms_{next(_topics)}"}, **sections)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", ALTER_CASES)
def test_alter_client_quotas_form(broker, version, case: Alter):
    with fresh_proxy(broker, case.principals, rate_limiters=case.rate_limiters) as p:
        c = AdminConnection(p.address)
        try:
            resp = c.round_trip(alter_request(version, case), AlterClientQuotasResponse, version)
            assert resp.to_dict() == alter_response(case)
            if case.principals != ("alice",):
                assert _same_values(c.quotas(version), case.after)
            else:  # the principal may not describe either: read the quotas in force
                assert p.run(lambda: p.server.rules_in_force) == p.server.config.quotas
        finally:
            c.close()


def _same_values(got: dict, expected: dict) -> bool:
    """Equal, NaN included (a NaN never equals itself)."""
    return got.keys() == expected.keys() and all(
        got[e].keys() == expected[e].keys()
        and all(got[e][k] == v or (math.isnan(got[e][k]) and math.isnan(v)) for k, v in expected[e].items())
        for e in expected)


# --- DescribeClientQuotas -------------------------------------------------------------------

# Added to FILE once per module, for the Describe cases: each combination of user and client-id.
DESCRIBE_SETUP = (
    ((("user", None), ("client-id", None)), (set_(PBR, 100),)),
    ((("user", None), ("client-id", "app")), (set_(CBR, 300),)),
    ((("user", "alice"), ("client-id", None)), (set_(PBR, 400),)),
    ((("client-id", "app"),), (set_(REQUEST_RATE, 50),)),
    ((("user", "bob"),), (set_(CBR, 700),)),
)
DESCRIBE_START = {
    **FILE,
    DEFAULT_DEFAULT: {PBR: 100.0},
    DEFAULT_USER_APP: {CBR: 300.0},
    ALICE_DEFAULT_CLIENT: {PBR: 400.0},
    APP: {REQUEST_RATE: 50.0},
    BOB: {CBR: 700.0},
}
ALL = tuple(DESCRIBE_START)


@dataclass(frozen=True)
class Describe:
    """``entities``: the entities of DESCRIBE_START answered (None: the request fails with
    ``error``, and Entries is null)."""

    components: tuple
    entities: tuple | None
    strict: bool = False
    error: tuple = (NONE, None)


def fails(code: int, message: str | None) -> dict:
    return {"entities": None, "error": (code, message)}


DESCRIBE_CASES = [
    # ClientQuotasImage.matches: no component matches every entity, unless strict (size 0).
    pytest.param(Describe((), ALL), id="no-filter"),
    pytest.param(Describe((), (), strict=True), id="no-filter-strict"),
    # matches: EXACT is "has the type with this name"; strict also wants no other type.
    pytest.param(Describe((("user", EXACT, "alice"),), (ALICE, ALICE_APP, ALICE_DEFAULT_CLIENT)), id="user-exact"),
    pytest.param(Describe((("user", EXACT, "alice"),), (ALICE,), strict=True), id="user-exact-strict"),
    # DEFAULT is EXACT with a null name.
    pytest.param(Describe((("user", DEFAULT, None),), (DEFAULT_USER, DEFAULT_DEFAULT, DEFAULT_USER_APP)),
                 id="user-default"),
    pytest.param(Describe((("user", DEFAULT, None),), (DEFAULT_USER,), strict=True), id="user-default-strict"),
    # SPECIFIED ("any") is "has the type", the default name included.
    pytest.param(Describe((("user", SPECIFIED, None),), (ALICE, ALICE_APP, DEFAULT_USER, DEFAULT_DEFAULT,
                                                          DEFAULT_USER_APP, ALICE_DEFAULT_CLIENT, BOB)),
                 id="user-specified"),
    pytest.param(Describe((("user", SPECIFIED, None),), (ALICE, DEFAULT_USER, BOB), strict=True),
                 id="user-specified-strict"),
    pytest.param(Describe((("client-id", EXACT, "app"),), (ALICE_APP, DEFAULT_USER_APP, APP)), id="client-id-exact"),
    pytest.param(Describe((("client-id", EXACT, "app"),), (APP,), strict=True), id="client-id-exact-strict"),
    pytest.param(Describe((("client-id", DEFAULT, None),), (DEFAULT_CLIENT, DEFAULT_DEFAULT, ALICE_DEFAULT_CLIENT)),
                 id="client-id-default"),
    pytest.param(Describe((("client-id", DEFAULT, None),), (DEFAULT_CLIENT,), strict=True),
                 id="client-id-default-strict"),
    pytest.param(Describe((("client-id", SPECIFIED, None),), (ALICE_APP, DEFAULT_CLIENT, DEFAULT_DEFAULT,
                                                               DEFAULT_USER_APP, ALICE_DEFAULT_CLIENT, APP)),
                 id="client-id-specified"),
    pytest.param(Describe((("client-id", SPECIFIED, None),), (DEFAULT_CLIENT, APP), strict=True),
                 id="client-id-specified-strict"),
    # matches: every component must hold; two components, strict or not, are the pair alone.
    pytest.param(Describe((("user", EXACT, "alice"), ("client-id", EXACT, "app")), (ALICE_APP,)),
                 id="user-exact-client-id-exact"),
    pytest.param(Describe((("user", EXACT, "alice"), ("client-id", EXACT, "app")), (ALICE_APP,), strict=True),
                 id="user-exact-client-id-exact-strict"),
    pytest.param(Describe((("user", DEFAULT, None), ("client-id", DEFAULT, None)), (DEFAULT_DEFAULT,)),
                 id="user-default-client-id-default"),
    pytest.param(Describe((("user", EXACT, "alice"), ("client-id", DEFAULT, None)), (ALICE_DEFAULT_CLIENT,)),
                 id="user-exact-client-id-default"),
    pytest.param(Describe((("client-id", EXACT, "app"), ("user", DEFAULT, None)), (DEFAULT_USER_APP,)),
                 id="user-default-client-id-exact"),
    pytest.param(Describe((("user", SPECIFIED, None), ("client-id", SPECIFIED, None)),
                          (ALICE_APP, DEFAULT_DEFAULT, DEFAULT_USER_APP, ALICE_DEFAULT_CLIENT)),
                 id="user-specified-client-id-specified"),
    pytest.param(Describe((("user", SPECIFIED, None), ("client-id", SPECIFIED, None)),
                          (ALICE_APP, DEFAULT_DEFAULT, DEFAULT_USER_APP, ALICE_DEFAULT_CLIENT), strict=True),
                 id="user-specified-client-id-specified-strict"),
    pytest.param(Describe((("user", EXACT, "alice"), ("client-id", SPECIFIED, None)),
                          (ALICE_APP, ALICE_DEFAULT_CLIENT)), id="user-exact-client-id-specified"),
    pytest.param(Describe((("user", DEFAULT, None), ("client-id", SPECIFIED, None)), (DEFAULT_DEFAULT,
                                                                                      DEFAULT_USER_APP)),
                 id="user-default-client-id-specified"),
    # matches: a name nobody has: no entry, no error.
    pytest.param(Describe((("user", EXACT, "nobody"),), ()), id="user-exact-unknown-name"),
    # describe: ip is a valid filter type; the proxy holds no ip entity, so nothing matches.
    pytest.param(Describe((("ip", SPECIFIED, None),), ()), id="ip-specified"),
    pytest.param(Describe((("ip", EXACT, "10.0.0.1"),), ()), id="ip-exact"),
    pytest.param(Describe((("ip", DEFAULT, None),), (), strict=True), id="ip-default-strict"),
    # describe: ip with user or client-id → InvalidRequestException.
    pytest.param(Describe((("ip", SPECIFIED, None), ("user", SPECIFIED, None)), **fails(INVALID_REQUEST, (
        "Invalid entity filter component combination. IP filter component should not be used with user or "
        "clientId filter component."))), id="ip-with-user"),
    pytest.param(Describe((("client-id", EXACT, "app"), ("ip", DEFAULT, None)), **fails(INVALID_REQUEST, (
        "Invalid entity filter component combination. IP filter component should not be used with user or "
        "clientId filter component."))), id="ip-with-client-id"),
    # describe: an entity type twice → InvalidRequestException, whatever the match types.
    pytest.param(Describe((("user", EXACT, "alice"), ("user", DEFAULT, None)), **fails(
        INVALID_REQUEST, "Entity type user cannot appear more than once in the filter.")), id="user-twice"),
    pytest.param(Describe((("client-id", SPECIFIED, None), ("client-id", SPECIFIED, None)), **fails(
        INVALID_REQUEST, "Entity type client-id cannot appear more than once in the filter.")),
        id="client-id-twice"),
    # describe: an unknown entity type → UnsupportedVersionException (not InvalidRequest).
    pytest.param(Describe((("group", SPECIFIED, None),), **fails(UNSUPPORTED_VERSION, "Unsupported entity type group")),
                 id="unknown-entity-type"),
    # describe checks the type before the match: an unknown type with a bad match is still unsupported.
    pytest.param(Describe((("group", EXACT, None),), **fails(UNSUPPORTED_VERSION, "Unsupported entity type group")),
                 id="unknown-entity-type-bad-match"),
    pytest.param(Describe((("", SPECIFIED, None),), **fails(INVALID_REQUEST, "Invalid empty entity type.")),
                 id="empty-entity-type"),
    # describe: a match string that contradicts the match type.
    pytest.param(Describe((("user", EXACT, None),), **fails(
        INVALID_REQUEST, "Request specified MATCH_TYPE_EXACT, but set match string to null.")), id="exact-null"),
    pytest.param(Describe((("user", DEFAULT, "alice"),), **fails(
        INVALID_REQUEST, "Request specified MATCH_TYPE_DEFAULT, but also specified a match string.")),
        id="default-with-match"),
    pytest.param(Describe((("client-id", SPECIFIED, "app"),), **fails(
        INVALID_REQUEST, "Request specified MATCH_TYPE_SPECIFIED, but also specified a match string.")),
        id="specified-with-match"),
    pytest.param(Describe((("user", 3, None),), **fails(INVALID_REQUEST, "Unknown match type 3")),
                 id="unknown-match-type"),
    # describe: the components in order, the first failure wins (a valid one before it changes nothing).
    pytest.param(Describe((("user", EXACT, "alice"), ("client-id", EXACT, None), ("group", SPECIFIED, None)), **fails(
        INVALID_REQUEST, "Request specified MATCH_TYPE_EXACT, but set match string to null.")),
        id="first-failure-wins"),
]


def describe_response(case: Describe, state: dict) -> dict:
    if case.entities is None:
        code, message = case.error
        return {"throttle_time_ms": 0, "error_code": code, "error_message": message, "entries": None}
    return canonical({"throttle_time_ms": 0, "error_code": NONE, "error_message": None, "entries": [
        {"entity": [{"entity_type": t, "entity_name": n} for t, n in entity],
         "values": [{"key": k, "value": v} for k, v in state[entity].items()]}
        for entity in case.entities]})


def canonical(response: dict) -> dict:
    """Entries sorted by entity, values by key: both are a Java HashMap's order in Kafka."""
    if response["entries"] is None:
        return response
    entries = [{**e, "values": sorted(e["values"], key=lambda v: v["key"])} for e in response["entries"]]
    return {**response, "entries": sorted(entries, key=lambda e: repr(e["entity"]))}


@pytest.fixture(scope="module")
def describe_proxy(broker):
    """One proxy for every Describe case: DESCRIBE_START in force, nothing altered after."""
    with fresh_proxy(broker) as p:
        c = AdminConnection(p.address)
        try:
            assert c.alter(1, DESCRIBE_SETUP) == [ok(entity) for entity in (
                DEFAULT_DEFAULT, DEFAULT_USER_APP, ALICE_DEFAULT_CLIENT, APP, BOB)]
            assert c.quotas(1) == DESCRIBE_START
        finally:
            c.close()
        yield p


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", DESCRIBE_CASES)
def test_describe_client_quotas_form(describe_proxy, version, case: Describe):
    c = AdminConnection(describe_proxy.address)
    try:
        resp = c.describe(version, case.components, case.strict)
        assert canonical(resp.to_dict()) == describe_response(case, DESCRIBE_START)
    finally:
        c.close()


# --- Authorization of Describe ----------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_describe_by_an_unauthorized_principal(broker, version):
    # KafkaApis.handleDescribeClientQuotasRequest: DESCRIBE_CONFIGS on the cluster refused →
    # getErrorResponse(CLUSTER_AUTHORIZATION_FAILED): ApiError.fromThrowable drops the default
    # message, Entries is null.
    with fresh_proxy(broker, principals=["alice"]) as p:
        c = AdminConnection(p.address)
        try:
            resp = c.describe(version, (("user", SPECIFIED, None),))
            assert resp.to_dict() == {"throttle_time_ms": 0, "error_code": CLUSTER_AUTHORIZATION_FAILED,
                                      "error_message": None, "entries": None}
        finally:
            c.close()


@pytest.mark.parametrize("version", VERSIONS)
def test_describe_anyone_lets_any_principal_describe_but_not_alter(broker, version):
    # With describe: anyone the proxy grants what a Kafka ACL allowing DESCRIBE_CONFIGS on the
    # cluster to every principal grants (KafkaApis.handleDescribeClientQuotasRequest), and Alter
    # still needs ALTER_CONFIGS (ControllerApis.handleAlterClientQuotas).
    with fresh_proxy(broker, principals=["alice"], describe="anyone") as p:
        c = AdminConnection(p.address)
        try:
            resp = c.describe(version)
            assert canonical(resp.to_dict()) == describe_response(Describe((), tuple(FILE)), FILE)
            case = Alter(one(BOB, set_(PBR, 1)), ((BOB, CLUSTER_AUTHORIZATION_FAILED, CLUSTER_AUTH_MESSAGE),))
            resp = c.round_trip(alter_request(version, case), AlterClientQuotasResponse, version)
            assert resp.to_dict() == alter_response(case)
            assert c.quotas(version) == FILE
        finally:
            c.close()

