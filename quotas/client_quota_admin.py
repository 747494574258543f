"""DescribeClientQuotas (API 48) and AlterClientQuotas (API 49) as Apache Kafka 4.0 answers them.

The semantic core only: plain values in, plain values out, no I/O. The proxy's filter turns
kafka-python's decoded requests into the arguments of :func:`describe` / :func:`alter` and their
results back into responses.

An entity is Kafka's ``ClientQuotaEntity``: entity type → name, where a None name is the default
entity (KRaft stores the default as a null name; the proxy's config and :class:`QuotaRule` spell
it ``"<default>"``). The proxy knows the ``user`` and ``client-id`` types; ``ip`` quotas
(KIP-612's ``connection_creation_rate``) are not set through this API.

Where Kafka is followed, the class is named next to the rule; where the proxy deliberately differs
(a key it cannot measure, NaN, duplicate entities) the comment says so.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

from quotas.common import ALL_KINDS, CONSUMER_BYTE_RATE, PRODUCER_BYTE_RATE, PRODUCER_IDS_RATE, USER_LEVEL_ONLY_KINDS
from quotas.entities import DEFAULT, QuotaRule

# Kafka's error codes (org.apache.kafka.common.protocol.Errors).
NONE = 0
UNKNOWN_SERVER_ERROR = -1
REQUEST_TIMED_OUT = 7  # retriable (org.apache.kafka.common.errors.TimeoutException)
CLUSTER_AUTHORIZATION_FAILED = 31
UNSUPPORTED_VERSION = 35
INVALID_REQUEST = 42
POLICY_VIOLATION = 44

# Errors' default messages: what Kafka sends when a whole request fails (getErrorResponse).
DEFAULT_MESSAGES: Mapping[int, str] = MappingProxyType({
    UNKNOWN_SERVER_ERROR: "The server experienced an unexpected error when processing the request.",
    CLUSTER_AUTHORIZATION_FAILED: "Cluster authorization failed.",
    UNSUPPORTED_VERSION: "The version of API is not supported.",
    INVALID_REQUEST: "This most likely occurs because of a request being malformed by the client library or "
                     "the message was sent to an incompatible broker. See the broker logs for more details.",
    POLICY_VIOLATION: "Request parameters do not satisfy the configured policy.",
})

# ClientQuotaEntity's entity types.
USER = "user"
CLIENT_ID = "client-id"
IP = "ip"
ENTITY_TYPES = frozenset({USER, CLIENT_ID})

# DescribeClientQuotasRequest.MATCH_TYPE_*.
MATCH_EXACT = 0
MATCH_DEFAULT = 1
MATCH_SPECIFIED = 2

REQUEST_PERCENTAGE = "request_percentage"
# QuotaConfig.buildUserClientQuotaConfigDef: the byte rates are LONG, Kafka's other keys DOUBLE;
# the proxy's own keys are DOUBLE (KIP-936 defines producer_ids_rate as a Double).
LONG_KEYS = frozenset({PRODUCER_BYTE_RATE, CONSUMER_BYTE_RATE})
# QuorumController.MAX_RECORDS_PER_USER_OP: more records than this and the whole request fails.
MAX_CHANGES_PER_REQUEST = 10_000

_LONG_MAX = float(2**63 - 1)  # Java compares the double against (double) Long.MAX_VALUE = 2^63
_GLOB_CHARS = frozenset("*?[")
# A Java HashMap of these types iterates client-id, user, ip (their hash buckets): the order of
# ClientQuotaEntity.toString and of the entity entries in Kafka's responses.
_KAFKA_ORDER = {CLIENT_ID: 0, USER: 1, IP: 2}

EntityParts = Sequence[tuple[str, str | None]]


def _kafka_order(parts: Iterable[tuple[str, str | None]]) -> tuple[tuple[str, str | None], ...]:
    return tuple(sorted(parts, key=lambda p: _KAFKA_ORDER.get(p[0], len(_KAFKA_ORDER))))


def _render(parts: Iterable[tuple[str, str | None]]) -> str:
    """ClientQuotaEntity.toString: ``ClientQuotaEntity(entries={client-id=app, user=null})``."""
    collapsed = dict(parts)  # a Java map: a repeated type keeps its last name
    inner = ", ".join(f"{t}={'null' if n is None else n}" for t, n in _kafka_order(collapsed.items()))
    return f"ClientQuotaEntity(entries={{{inner}}})"


@dataclass(frozen=True)
class QuotaEntity:
    """A quota entity the proxy holds: ``user`` and/or ``client-id``, each a name or None (default).

    ``parts`` is kept in Kafka's order (client-id, then user). Hashable: it is the key of the
    quota mapping that :func:`describe` reads and :func:`alter` returns.
    """

    parts: tuple[tuple[str, str | None], ...]

    def __post_init__(self) -> None:
        parts = _kafka_order(self.parts)
        types = [t for t, _ in parts]
        if not parts or len(set(types)) != len(types) or not ENTITY_TYPES.issuperset(types):
            raise ValueError(f"a quota entity is user and/or client-id, once each; got {list(self.parts)!r}")
        for entity_type, name in parts:
            if name is not None and (not isinstance(name, str) or not name or name == DEFAULT):
                raise ValueError(f"{entity_type} name must be a non-empty name other than {DEFAULT!r}, "
                                 f"or None for the default; got {name!r}")
        object.__setattr__(self, "parts", parts)

    @classmethod
    def of(cls, entries: Mapping[str, str | None]) -> QuotaEntity:
        """``QuotaEntity.of({"user": "alice", "client-id": None})``: alice with the default client."""
        return cls(tuple(entries.items()))

    @classmethod
    def from_rule_key(cls, user: str | None, client_id: str | None) -> QuotaEntity:
        """From QuotaRule's form: None = not part of the entity, ``"<default>"`` = the default."""
        parts: list[tuple[str, str | None]] = []
        if user is not None:
            parts.append((USER, None if user == DEFAULT else user))
        if client_id is not None:
            parts.append((CLIENT_ID, None if client_id == DEFAULT else client_id))
        return cls(tuple(parts))

    @property
    def entries(self) -> Mapping[str, str | None]:
        return MappingProxyType(dict(self.parts))

    @property
    def rule_key(self) -> tuple[str | None, str | None]:
        """(user, client_id) as QuotaRule and the config spell them: the store's key."""
        entries = dict(self.parts)
        user = (DEFAULT if entries[USER] is None else entries[USER]) if USER in entries else None
        client = (DEFAULT if entries[CLIENT_ID] is None else entries[CLIENT_ID]) if CLIENT_ID in entries else None
        return (user, client)

    def to_rule(self, values: Mapping[str, float]) -> QuotaRule:
        user, client_id = self.rule_key
        return QuotaRule(user, client_id, values)

    def __str__(self) -> str:
        return _render(self.parts)


def quotas_from_rules(rules: Iterable[QuotaRule]) -> dict[QuotaEntity, dict[str, float]]:
    """The mapping :func:`describe` and :func:`alter` work on; a later rule's value wins per key."""
    quotas: dict[QuotaEntity, dict[str, float]] = {}
    for rule in rules:
        quotas.setdefault(QuotaEntity.from_rule_key(rule.user, rule.client_id), {}).update(rule.values)
    return quotas


def rules_from_quotas(quotas: Mapping[QuotaEntity, Mapping[str, float]]) -> tuple[QuotaRule, ...]:
    return tuple(entity.to_rule(values) for entity, values in quotas.items() if values)


# --- DescribeClientQuotas -------------------------------------------------------------------


class FilterComponent(NamedTuple):
    """DescribeClientQuotasRequest's ComponentData; a plain 3-tuple works as well."""

    entity_type: str
    match_type: int
    match: str | None = None


@dataclass(frozen=True)
class DescribeEntry:
    entity: QuotaEntity
    values: Mapping[str, float]


@dataclass(frozen=True)
class DescribeResult:
    """``entries`` is None when ``error_code`` is not NONE (Kafka sends a null Entries array)."""

    error_code: int
    error_message: str | None
    entries: tuple[DescribeEntry, ...] | None


def describe_error(error_code: int, error_message: str | None = None) -> DescribeResult:
    """A whole-request failure, e.g. CLUSTER_AUTHORIZATION_FAILED: Kafka's ApiError.fromThrowable
    leaves the message null when it would only repeat the error's default message."""
    return DescribeResult(error_code, error_message, None)


def describe(
    quotas: Mapping[QuotaEntity, Mapping[str, float]],
    components: Iterable[tuple[str, int, str | None]],
    strict: bool,
) -> DescribeResult:
    """The entities that match the filter, as ClientQuotasImage.describe selects them."""
    exact: dict[str, str | None] = {}
    specified: set[str] = set()
    for entity_type, match_type, match in components:
        # ClientQuotasImage.describe: the checks, in its order; the first failure fails the request.
        if not entity_type:
            return describe_error(INVALID_REQUEST, "Invalid empty entity type.")
        if entity_type in exact or entity_type in specified:
            return describe_error(
                INVALID_REQUEST, f"Entity type {entity_type} cannot appear more than once in the filter."
            )
        if entity_type not in (IP, USER, CLIENT_ID):
            # ClientQuotasImage.describe throws UnsupportedVersionException here, not InvalidRequest.
            return describe_error(UNSUPPORTED_VERSION, f"Unsupported entity type {entity_type}")
        if match_type == MATCH_EXACT:
            if match is None:
                return describe_error(
                    INVALID_REQUEST, "Request specified MATCH_TYPE_EXACT, but set match string to null."
                )
            exact[entity_type] = match
        elif match_type == MATCH_DEFAULT:
            if match is not None:
                return describe_error(
                    INVALID_REQUEST, "Request specified MATCH_TYPE_DEFAULT, but also specified a match string."
                )
            exact[entity_type] = None
        elif match_type == MATCH_SPECIFIED:
            if match is not None:
                return describe_error(
                    INVALID_REQUEST, "Request specified MATCH_TYPE_SPECIFIED, but also specified a match string."
                )
            specified.add(entity_type)
        else:
            return describe_error(INVALID_REQUEST, f"Unknown match type {match_type}")
    filtered = exact.keys() | specified
    if IP in filtered and (USER in filtered or CLIENT_ID in filtered):
        return describe_error(
            INVALID_REQUEST,
            "Invalid entity filter component combination. IP filter component should not be used with "
            "user or clientId filter component.",
        )
    # An ip filter is valid (Kafka's) and matches nothing: the proxy holds no ip entities.
    entries = tuple(
        DescribeEntry(entity, MappingProxyType(dict(values)))
        for entity, values in quotas.items()
        if values and _matches(entity.entries, exact, specified, strict)
    )
    return DescribeResult(NONE, None, entries)


def _matches(
    entity: Mapping[str, str | None], exact: Mapping[str, str | None], specified: set[str], strict: bool
) -> bool:
    # ClientQuotasImage.matches: strict = exactly the filtered types; SPECIFIED is "has the type",
    # so it matches the default (null) name too.
    if strict and len(entity) != len(exact) + len(specified):
        return False
    for entity_type, name in exact.items():
        if entity_type not in entity or entity[entity_type] != name:
            return False
    return all(entity_type in entity for entity_type in specified)


# --- AlterClientQuotas ----------------------------------------------------------------------


class AlterOp(NamedTuple):
    """AlterClientQuotasRequest's OpData; ``value`` is ignored when ``remove``."""

    key: str
    value: float
    remove: bool = False


class AlterEntry(NamedTuple):
    """AlterClientQuotasRequest's EntryData: the entity as sent, and its ops."""

    entity: EntityParts
    ops: Sequence[tuple[str, float, bool]]


@dataclass(frozen=True)
class EntryResult:
    """The outcome of one request entry; ``entity`` is the entity as sent, in Kafka's order."""

    entity: tuple[tuple[str, str | None], ...]
    error_code: int
    error_message: str | None


@dataclass(frozen=True)
class QuotaChange:
    """One applied change, for the audit log: ``old`` None = added, ``new`` None = removed."""

    entity: QuotaEntity
    key: str
    old: float | None
    new: float | None


@dataclass(frozen=True)
class AlterResult:
    """``results[i]`` answers request entry ``i``; ``changes`` is empty when validating only.
    ``whole_request``: the request failed as a whole (:func:`alter_error`). ``rules``:
    ``new_quotas`` as rules, when the caller made them already (None: not made)."""

    new_quotas: Mapping[QuotaEntity, Mapping[str, float]]
    results: tuple[EntryResult, ...]
    changes: tuple[QuotaChange, ...]
    whole_request: bool = False
    rules: tuple[QuotaRule, ...] | None = None

    def response_entries(self) -> tuple[EntryResult, ...]:
        """The response's entries. One per distinct entity, as Kafka answers
        (AlterClientQuotasResponse.fromQuotaEntities builds the response from a map keyed by
        entity), in first appearance order; for a whole-request failure one per request entry
        (AlterClientQuotasRequest.getErrorResponse walks the request)."""
        if self.whole_request:
            return self.results
        seen: dict[frozenset[tuple[str, str | None]], EntryResult] = {}
        for result in self.results:
            seen.setdefault(_entity_key(result.entity), result)
        return tuple(seen.values())


def alter_error(
    quotas: Mapping[QuotaEntity, Mapping[str, float]],
    entries: Iterable[tuple[EntityParts, Sequence[tuple[str, float, bool]]]],
    error_code: int,
) -> AlterResult:
    """A whole-request failure: AlterClientQuotasRequest.getErrorResponse answers every request
    entry, its entity's parts as sent, with the error's default message (not the exception's).
    Nothing changes."""
    results = tuple(
        EntryResult(tuple(entity), error_code, DEFAULT_MESSAGES.get(error_code)) for entity, _ in entries
    )
    return AlterResult(_copy(quotas), results, (), whole_request=True)


def alter(
    quotas: Mapping[QuotaEntity, Mapping[str, float]],
    entries: Iterable[tuple[EntityParts, Sequence[tuple[str, float, bool]]]],
    validate_only: bool = False,
    unenforced: Collection[str] = frozenset(),
) -> AlterResult:
    """Validates each entry on its own and applies the valid ones (unless ``validate_only``).

    ClientQuotaControlManager.alterClientQuotas: an entry that fails changes nothing of its
    entity and nothing of the others; within an entry, the first bad op fails the whole entry.
    Setting a key of ``unenforced`` (a record or batch rate no configured rate limiter enforces)
    fails its entry as an unknown key does: the proxy does not accept a quota it would ignore.
    """
    request = [(tuple(entity), tuple(ops)) for entity, ops in entries]
    occurrences: dict[frozenset[tuple[str, str | None]], int] = {}
    for entity_parts, _ in request:
        key = _entity_key(entity_parts)
        occurrences[key] = occurrences.get(key, 0) + 1
    working = _copy(quotas)
    results: list[EntryResult] = []
    changes: list[QuotaChange] = []
    for entity_parts, ops in request:
        duplicated = occurrences[_entity_key(entity_parts)] > 1
        error, entity, entry_changes = _check_entry(working, entity_parts, ops, duplicated, unenforced)
        results.append(EntryResult(_kafka_order(entity_parts), *error))
        if entity is not None:
            changes.extend(entry_changes)
            _apply(working, entry_changes)
    if len(changes) > MAX_CHANGES_PER_REQUEST:
        # QuorumController: a BoundedList of records overflows → PolicyViolationException for the
        # whole request, validateOnly or not (the records are built before validateOnly drops them).
        return alter_error(quotas, request, POLICY_VIOLATION)
    if validate_only:
        # QuorumController.alterClientQuotas: validateOnly returns the results without the records.
        return AlterResult(_copy(quotas), tuple(results), ())
    return AlterResult(working, tuple(results), tuple(changes))


_OK: tuple[int, str | None] = (NONE, None)


def _check_entry(
    quotas: Mapping[QuotaEntity, Mapping[str, float]],
    entity_parts: tuple[tuple[str, str | None], ...],
    ops: tuple[tuple[str, float, bool], ...],
    duplicated: bool,
    unenforced: Collection[str] = frozenset(),
) -> tuple[tuple[int, str | None], QuotaEntity | None, list[QuotaChange]]:
    """(error_code, error_message), the entity when valid, and the changes it would make."""
    rendered = _render(entity_parts)
    if duplicated:
        # ClientQuotaControlManager.alterClientQuotas answers a repeated entity with this error but
        # has applied its first occurrence; the proxy applies none, so that the answer is true.
        return (INVALID_REQUEST, f"Ignoring duplicate entity {rendered}"), None, []
    keys: set[str] = set()
    for key, _, _ in ops:
        if key in keys:
            # ClientQuotaControlManager.alterClientQuotas means to send this message, but then
            # overwrites it with "Ignoring duplicate entity"; the proxy sends the intended one.
            message = f"Duplicate quota key {key} not updating quota for this entity {rendered}"
            return (INVALID_REQUEST, message), None, []
        keys.add(key)
    error = _check_entity(entity_parts)
    if error is not None:
        return (INVALID_REQUEST, error), None, []
    entity = QuotaEntity(entity_parts)
    current = quotas.get(entity, {})
    entry_changes: list[QuotaChange] = []
    for key, value, remove in ops:
        if remove:
            # ClientQuotaControlManager.alterClientQuotaEntity: a removal is not validated; removing
            # a key that is not set (even an unknown one) is a successful no-op.
            if key in current:
                entry_changes.append(QuotaChange(entity, key, current[key], None))
            continue
        error = _check_value(entity, key, value, unenforced)
        if error is not None:
            return (INVALID_REQUEST, error), None, []
        old = current.get(key)
        if old != value:  # Kafka records a value only when it changes
            entry_changes.append(QuotaChange(entity, key, old, float(value)))
    return _OK, entity, entry_changes


def _check_entity(parts: tuple[tuple[str, str | None], ...]) -> str | None:
    # ClientQuotaControlManager.validateEntity, then configKeysForEntityType; then the proxy's own.
    if not parts:
        return "Invalid empty client quota entity"
    seen: set[str] = set()
    for entity_type, name in _kafka_order(parts):
        if entity_type in seen:
            # Kafka's own check; on the wire Kafka never reaches it, as AlterClientQuotasRequest.entries
            # folds the entity into a map (the last name wins). The proxy refuses the ambiguity.
            return f"Invalid client quota entity, duplicate entity entry {entity_type}"
        seen.add(entity_type)
        if entity_type not in (USER, CLIENT_ID, IP):
            return f"Unhandled client quota entity type: {entity_type}"
        if name is not None and not name:
            return f"Empty {entity_type} not supported"
    if IP in seen:
        if USER in seen or CLIENT_ID in seen:
            # ClientQuotaControlManager.configKeysForEntityType, its message verbatim ("shouldnot").
            return "Invalid quota entity combination, IP entity shouldnot be combined with User or ClientId"
        return ("ip quotas (connection_creation_rate) cannot be altered through the proxy; set "
                "connections.connection_creation_rate(_overrides) in the proxy's configuration")
    for entity_type, name in parts:
        if name == DEFAULT:
            return (f"{entity_type} name {DEFAULT} is reserved by the proxy for the default entity; "
                    "send a null name to set the default")
    user = dict(parts).get(USER)
    if CLIENT_ID not in seen and user is not None and not _GLOB_CHARS.isdisjoint(user):
        # As the proxy's configuration: a glob is a client-id pattern, never a user's.
        return f"user name {user} looks like a glob; globs apply to client ids only"
    return None


def _check_value(entity: QuotaEntity, key: str, value: float, unenforced: Collection[str] = frozenset()) -> str | None:
    """ClientQuotaControlManager.validateQuotaKeyValue's checks in its order, then the proxy's."""
    if key == REQUEST_PERCENTAGE:
        return (f"Quota {REQUEST_PERCENTAGE} is not supported by the proxy: it cannot measure the broker's "
                "request handler and network thread time; use request_rate (requests per second) instead")
    if key not in ALL_KINDS:
        return f"Invalid configuration key {key}"
    if key in unenforced:
        # As the proxy's configuration refuses it (config.loader._check_limited).
        return (f"Quota {key} is not enforced by this proxy: no configured rate limiter enforces it "
                "(rate_limiters needs quotas.limiters:RecordRateLimiter or BatchRateLimiter)")
    if key in USER_LEVEL_ONLY_KINDS and CLIENT_ID in entity.entries:
        # KIP-936: producer_ids_rate is keyed by user only, like the proxy's configuration.
        return f"Invalid configuration key {key} for an entity with client-id: it applies to users only"
    if value <= 0.0:  # false for NaN, as in Java
        return f"Quota {key} must be greater than 0"
    if key in LONG_KEYS:
        if value > _LONG_MAX:
            return f"Proposed value for {key} is too large for a LONG."
        # getErrorForIntegralQuotaValue: |value % 1.0| > 1e-6 (so 5.0000001 passes, 4.9999999 fails).
        if abs(math.fmod(value, 1.0)) > 1e-6:
            return f"{key} cannot be a fractional value."
    if not math.isfinite(value):
        # Kafka accepts NaN (and +Infinity for DOUBLE keys); the proxy's engines need a real bound.
        return f"Quota {key} must be a finite number, got {value}"
    if key == PRODUCER_IDS_RATE and value < 1:
        # As the proxy's configuration: a token is a whole producer id.
        return f"Quota {key} must be at least 1 (new producer ids per window), got {value}"
    return None


def _apply(quotas: dict[QuotaEntity, dict[str, float]], changes: Iterable[QuotaChange]) -> None:
    for change in changes:
        values = quotas.setdefault(change.entity, {})
        if change.new is None:
            values.pop(change.key, None)
            # ClientQuotaControlManager.replay: an entity whose last quota is removed is gone.
            if not values:
                del quotas[change.entity]
        else:
            values[change.key] = change.new


def _copy(quotas: Mapping[QuotaEntity, Mapping[str, float]]) -> dict[QuotaEntity, dict[str, float]]:
    return {entity: dict(values) for entity, values in quotas.items() if values}


def _entity_key(parts: Iterable[tuple[str, str | None]]) -> frozenset[tuple[str, str | None]]:
    # ClientQuotaEntity equality: its map, where a repeated type keeps its last name.
    return frozenset(dict(parts).items())
