"""What a new rule set changes, entity by entity and value by value (what a reload logs)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import NamedTuple

from quotas.entities import QuotaRule


class QuotaChange(NamedTuple):
    """One change a new rule set makes to one entity's quotas (what a reload logs).

    ``kind`` None: the entity gains or loses all its quotas (``before`` or ``after`` is empty);
    otherwise one value, which ``before`` / ``after`` hold (empty when it is added / removed).
    """

    entity: str  # QuotaRule.describe(): "user=alice client_id=app-1"
    kind: str | None
    before: Mapping[str, float]
    after: Mapping[str, float]

    @property
    def removes_a_quota(self) -> bool:
        """True when something this entity was held to is no longer in force."""
        return not self.after

    def describe(self) -> str:
        if self.kind is None:
            verb, values = ("removes", self.before) if self.removes_a_quota else ("adds", self.after)
            return f"{verb} the quotas of {self.entity} ({_values(values)})"
        if not self.before:
            return f"adds {_values(self.after)} to {self.entity}"
        if not self.after:
            return f"removes {_values(self.before)} of {self.entity} (its other quotas stay)"
        old, new = _values(self.before, named=False), _values(self.after, named=False)
        return f"changes {self.kind} of {self.entity} from {old} to {new}"


def quota_changes(before: Iterable[QuotaRule], after: Iterable[QuotaRule]) -> list[QuotaChange]:
    """What replacing the rules ``before`` by ``after`` changes: each entity (user, client id as
    written, defaults and globs included) that loses or gains all its quotas, and each value
    changed, added or removed for an entity in both. Entities in the order of ``before``, then
    the new ones in the order of ``after``; values by kind."""
    old = {(r.user, r.client_id): r for r in before}
    new = {(r.user, r.client_id): r for r in after}
    changes: list[QuotaChange] = []
    for key, rule in old.items():
        if key in new:
            changes.extend(_value_changes(rule, new[key]))
        else:
            changes.append(QuotaChange(rule.describe(), None, rule.values, {}))
    changes.extend(QuotaChange(r.describe(), None, {}, r.values) for k, r in new.items() if k not in old)
    return changes


def _value_changes(old: QuotaRule, new: QuotaRule) -> Iterator[QuotaChange]:
    for kind in sorted(old.values.keys() | new.values.keys()):
        b, a = old.values.get(kind), new.values.get(kind)
        if b != a:
            yield QuotaChange(old.describe(), kind, {} if b is None else {kind: b}, {} if a is None else {kind: a})


def _values(values: Mapping[str, float], named: bool = True) -> str:
    """``producer_byte_rate=1048576, request_rate=2.5`` (whole numbers without ".0")."""
    return ", ".join(f"{k}={v:.15g}" if named else f"{v:.15g}" for k, v in sorted(values.items()))
