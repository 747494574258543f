"""Quota entities: which rule applies to a (user, client id), and the per-entity state table.

Precedence is Kafka's (``ClientQuotaManager`` / its ``DefaultQuotaCallback``), with client-id
glob patterns ranked just below the exact client id at the same level:

====  =========================  =====================
 1    user + client id            state per (user, client id)
 1g   user + client-id glob       state per (user, client id)
 2    user + <default> client     state per (user, client id)
 3    user                        state per user
 4    <default> user + client id  state per (user, client id)
 4g   <default> user + glob       state per (user, client id)
 5    <default> + <default>       state per (user, client id)
 6    <default> user              state per user
 7    client id                   state per client id
 7g   client-id glob              state per client id
 8    <default> client            state per client id
====  =========================  =====================

A default or a glob is a quota *each* matching entity gets, never one shared between them: the
state is keyed as Kafka keys its quota sensors (its metric tags), by the actual user and/or
client id. Among several globs at one level, the one with more literal characters wins, then
the one given first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from types import MappingProxyType
from typing import Any, NamedTuple

from quotas.common import USER_LEVEL_ONLY_KINDS

DEFAULT = "<default>"
# Kafka's KafkaPrincipal.ANONYMOUS: the user of a connection nobody authenticated.
ANONYMOUS = "ANONYMOUS"
# Kafka: ClientQuotaManager.InactiveSensorExpirationTimeSeconds = 3600.
DEFAULT_IDLE_MS = 3_600_000
DEFAULT_MAX_ENTITIES = 100_000

_GLOB_CHARS = frozenset("*?[")


class _DefaultName:
    """Stands for ``<default>`` inside the resolver, so a principal literally named
    "<default>" is never mistaken for the default entity."""

    __slots__ = ()

    def __repr__(self) -> str:
        return DEFAULT


_D = _DefaultName()


@dataclass(frozen=True)
class QuotaRule:
    """One quota entity and its quota values, e.g. ``QuotaRule("alice", "connect-*", {...})``.

    ``user`` / ``client_id``: a name, ``"<default>"``, or None for "not part of the entity".
    ``client_id`` may be a glob (``*``, ``?``, ``[...]``, matched by ``fnmatchcase``).
    ``values``: quota kind → bound (per second). ``shadow``: computed and counted, never
    applied (the entry's ``mode: shadow``).
    """

    user: str | None
    client_id: str | None
    values: Mapping[str, float]
    shadow: bool = False

    def __post_init__(self) -> None:
        if self.user is None and self.client_id is None:
            raise ValueError("a quota rule needs a user, a client id, or both")
        for kind, value in self.values.items():
            if not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
                raise ValueError(f"quota {kind} for {self.describe()}: must be >= 0, got {value!r}")
        object.__setattr__(self, "values", MappingProxyType(dict(self.values)))

    def __hash__(self) -> int:
        return hash((self.user, self.client_id, frozenset(self.values.items()), self.shadow))

    def describe(self) -> str:
        parts = []
        if self.user is not None:
            parts.append(f"user={self.user}")
        if self.client_id is not None:
            parts.append(f"client_id={self.client_id}")
        return " ".join(parts)


class ResolvedQuota(NamedTuple):
    """The rule that applies, and the entity whose state it is charged to.

    ``user`` / ``client_id`` are the entity's labels: None when not part of the entity.
    ``level`` is 1–8 as in the table above; ``glob`` the matched pattern, if any; ``shadow``
    whether the rule is in shadow mode.
    """

    kind: str
    quota: float
    user: str | None
    client_id: str | None
    level: int
    glob: str | None = None
    shadow: bool = False

    @property
    def key(self) -> tuple[str, str | None, str | None]:
        return (self.kind, self.user, self.client_id)


def _is_glob(client_id: str) -> bool:
    return not _GLOB_CHARS.isdisjoint(client_id)


def _literal_chars(pattern: str) -> int:
    return sum(1 for c in pattern if c not in "*?[]")


class _KindRules:
    """The rules of one quota kind, indexed for lookup."""

    __slots__ = ("exact", "globs")

    def __init__(self) -> None:
        # (user spec, client spec) → (bound, shadow); a spec is a name, _D, or None.
        self.exact: dict[tuple[Any, Any], tuple[float, bool]] = {}
        # user spec → [(pattern, bound, shadow)], most specific first.
        self.globs: dict[Any, list[tuple[str, float, bool]]] = {}

    def glob_match(self, user_spec: Any, client_id: str) -> tuple[str, float, bool] | None:
        for pattern, bound, shadow in self.globs.get(user_spec, ()):
            if fnmatchcase(client_id, pattern):
                return pattern, bound, shadow
        return None


class EntityResolver:
    """Finds the rule for (kind, user, client id). Immutable: build a new one to change rules;
    one resolver may serve any number of engines (the replay builds one per candidate)."""

    def __init__(
        self, rules: Iterable[QuotaRule], user_level_only_kinds: Iterable[str] = USER_LEVEL_ONLY_KINDS
    ) -> None:
        self.rules: tuple[QuotaRule, ...] = tuple(rules)
        self.user_level_only_kinds = frozenset(user_level_only_kinds)
        self._kinds: dict[str, _KindRules] = {}
        globs: dict[tuple[str, Any], list[tuple[int, int, str, float, bool]]] = {}
        for order, rule in enumerate(self.rules):
            user_spec = _D if rule.user == DEFAULT else rule.user
            client_spec = _D if rule.client_id == DEFAULT else rule.client_id
            for kind, bound in rule.values.items():
                kr = self._kinds.setdefault(kind, _KindRules())
                if isinstance(client_spec, str) and _is_glob(client_spec):
                    entry = globs.setdefault((kind, user_spec), [])
                    if any(p == client_spec for _, _, p, _, _ in entry):
                        raise ValueError(f"two {kind} quotas for {rule.describe()}")
                    entry.append((-_literal_chars(client_spec), order, client_spec, float(bound), rule.shadow))
                    continue
                if (user_spec, client_spec) in kr.exact:
                    raise ValueError(f"two {kind} quotas for {rule.describe()}")
                kr.exact[(user_spec, client_spec)] = (float(bound), rule.shadow)
        for (kind, user_spec), entries in globs.items():
            entries.sort()
            self._kinds[kind].globs[user_spec] = [(p, b, sh) for _, _, p, b, sh in entries]

    def kinds(self) -> frozenset[str]:
        """Quota kinds that have at least one rule."""
        return frozenset(self._kinds)

    def resolve(self, kind: str, user: str, client_id: str) -> ResolvedQuota | None:
        """The quota for this connection's (user, client id), or None when no rule applies."""
        if kind in self.user_level_only_kinds:
            return self.resolve_user_level(kind, user)
        kr = self._kinds.get(kind)
        if kr is None:
            return None
        exact = kr.exact
        # ClientQuotaManager.DefaultQuotaCallback: levels 1-3 for the user, then 4-6 for the
        # <default> user; the sensor is per (user, client id) except at 3 and 6 (per user).
        for level, user_spec in ((1, user), (4, _D)):
            found = exact.get((user_spec, client_id))
            if found is not None:
                return ResolvedQuota(kind, found[0], user, client_id, level, None, found[1])
            hit = kr.glob_match(user_spec, client_id)
            if hit is not None:
                return ResolvedQuota(kind, hit[1], user, client_id, level, hit[0], hit[2])
            found = exact.get((user_spec, _D))
            if found is not None:
                return ResolvedQuota(kind, found[0], user, client_id, level + 1, None, found[1])
            found = exact.get((user_spec, None))
            if found is not None:
                return ResolvedQuota(kind, found[0], user, None, level + 2, None, found[1])
        return self._resolve_client_level(kr, kind, client_id)

    def resolve_user_level(self, kind: str, user: str) -> ResolvedQuota | None:
        """Only rules without a client id: /config/users/<user>, then /config/users/<default>."""
        kr = self._kinds.get(kind)
        if kr is None:
            return None
        found = kr.exact.get((user, None))
        if found is not None:
            return ResolvedQuota(kind, found[0], user, None, 3, None, found[1])
        found = kr.exact.get((_D, None))
        if found is not None:
            return ResolvedQuota(kind, found[0], user, None, 6, None, found[1])
        return None

    def resolve_client_level(self, kind: str, client_id: str) -> ResolvedQuota | None:
        """Only rules without a user: /config/clients/<client-id> (or glob), then <default>."""
        kr = self._kinds.get(kind)
        return None if kr is None else self._resolve_client_level(kr, kind, client_id)

    @staticmethod
    def _resolve_client_level(kr: _KindRules, kind: str, client_id: str) -> ResolvedQuota | None:
        # DefaultQuotaCallback: /config/clients/<client-id>, then <default>; sensor per client id.
        found = kr.exact.get((None, client_id))
        if found is not None:
            return ResolvedQuota(kind, found[0], None, client_id, 7, None, found[1])
        hit = kr.glob_match(None, client_id)
        if hit is not None:
            return ResolvedQuota(kind, hit[1], None, client_id, 7, hit[0], hit[2])
        found = kr.exact.get((None, _D))
        if found is not None:
            return ResolvedQuota(kind, found[0], None, client_id, 8, None, found[1])
        return None

    def resolve_entity(self, kind: str, user: str | None, client_id: str | None) -> ResolvedQuota | None:
        """The rule for an existing state's entity labels (used to keep state across reloads)."""
        if user is not None and client_id is not None:
            return self.resolve(kind, user, client_id)
        if user is not None:
            return self.resolve_user_level(kind, user)
        if client_id is not None:
            return self.resolve_client_level(kind, client_id)
        return None


class EntityTable:
    """Per-entity state, created on first use, dropped after ``idle_ms`` without use.

    Values must have a ``last_used_ms`` attribute, which their owner keeps current. At most
    ``max_entities`` live at once: adding one more first drops idle entries, then the least
    recently used, down to 7/8 of the cap (so the cost is paid once per many additions).
    """

    __slots__ = ("idle_ms", "max_entities", "_states", "expired_total", "evicted_total")

    def __init__(self, idle_ms: int = DEFAULT_IDLE_MS, max_entities: int = DEFAULT_MAX_ENTITIES) -> None:
        if idle_ms < 0 or max_entities < 1:
            raise ValueError("idle_ms must be >= 0 and max_entities >= 1")
        self.idle_ms = idle_ms
        self.max_entities = max_entities
        self._states: dict[Any, Any] = {}
        self.expired_total = 0
        self.evicted_total = 0

    def __len__(self) -> int:
        return len(self._states)

    def get(self, key: Any) -> Any:
        return self._states.get(key)

    def items(self) -> Iterator[tuple[Any, Any]]:
        return iter(list(self._states.items()))

    def values(self) -> list[Any]:
        return list(self._states.values())

    def remove(self, key: Any) -> None:
        self._states.pop(key, None)

    def add(self, key: Any, state: Any, now_ms: int) -> int:
        """Stores ``state``; returns how many other entries had to go to make room."""
        dropped = 0
        if key not in self._states and len(self._states) >= self.max_entities:
            dropped = self._make_room(now_ms)
        self._states[key] = state
        return dropped

    def expire(self, now_ms: int) -> int:
        """Drops entries unused for more than ``idle_ms``; returns how many."""
        # Sensor.hasExpired: expired once now − last record > the inactivity period.
        cutoff = now_ms - self.idle_ms
        stale = [k for k, s in self._states.items() if s.last_used_ms < cutoff]
        for key in stale:
            del self._states[key]
        self.expired_total += len(stale)
        return len(stale)

    def _make_room(self, now_ms: int) -> int:
        dropped = self.expire(now_ms)
        target = self.max_entities - max(1, self.max_entities // 8)
        excess = len(self._states) - target
        if excess > 0:
            by_age = sorted(self._states.items(), key=lambda kv: kv[1].last_used_ms)
            for key, _ in by_age[:excess]:
                del self._states[key]
            self.evicted_total += excess
            dropped += excess
        return dropped


def resolver_of(rules: Iterable[QuotaRule] | EntityResolver) -> EntityResolver:
    """``rules`` indexed, or the resolver given (immutable, so shared as it is)."""
    return rules if isinstance(rules, EntityResolver) else EntityResolver(rules)
