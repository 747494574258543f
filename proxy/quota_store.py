"""Quotas set through the Admin API (AlterClientQuotas), layered over the configuration file's.

The YAML ``quotas:`` are the base. A store holds an *overlay*: for each (entity, key) it was told
about, either a value, which overrides the base's, or a removal (:data:`REMOVED`), which masks
the base's value, so that a quota defined only in the file can be removed through the API too.
A key the overlay does not name keeps the base's value, and follows the file when it is
reloaded. Once an (entity, key) has been set or removed through the API, the overlay alone
decides it: a later change of that key in the file is not in force.

:class:`QuotaStore` is what the proxy needs of a store; :class:`OverlayStore` keeps the overlay
in this process's memory only (lost on restart); proxy.quota_topic_store.TopicStore keeps it in
a compacted topic, and implements :meth:`QuotaStore.commit` by writing the changes and applying
them only once they are written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Final, Protocol

from quotas.client_quota_admin import QuotaChange, QuotaEntity, quotas_from_rules
from quotas.entities import QuotaRule

REMOVED: Final = None  # an overlay value: the key is removed, whatever the base says

Overlay = Mapping[QuotaEntity, Mapping[str, float | None]]


class StoreUnavailable(Exception):
    """The store could not record changes (its storage unreachable or refusing): nothing
    changed, and trying again later may succeed. The message says why, for the client."""


class QuotaStore(Protocol):
    def __len__(self) -> int:
        """The number of (entity, key) the overlay decides (0: the base alone is in force)."""
        ...

    def merged(self, base: Iterable[QuotaRule]) -> dict[QuotaEntity, dict[str, float]]:
        """The quotas in force over ``base``: see :func:`merge`."""
        ...

    async def commit(self, changes: Sequence[QuotaChange]) -> None:
        """Records ``changes`` (each a set or a removal of one key of one entity): all of them, or,
        raising (StoreUnavailable when a retry may succeed), none. Once it returns, :meth:`merged`
        reflects them."""
        ...


def merge(base: Iterable[QuotaRule], overlay: Overlay) -> dict[QuotaEntity, dict[str, float]]:
    """``base`` with ``overlay`` on top, per (entity, key); an entity left with no value is not
    in the result. Entities in the order of ``base``, then the overlay's new ones in its order
    (the order decides between client-id globs of equal rank, see quotas.entities)."""
    quotas = quotas_from_rules(base)
    for entity, values in overlay.items():
        merged = quotas.setdefault(entity, {})
        for key, value in values.items():
            if value is None:  # REMOVED
                merged.pop(key, None)
            else:
                merged[key] = value
    return {entity: values for entity, values in quotas.items() if values}


class OverlayStore:
    """The overlay in this process's memory: :meth:`commit` applies at once and never fails.

    Every (entity, key) ever set or removed stays in the overlay (a removal as :data:`REMOVED`),
    so it holds one entry per key the administrators have touched."""

    def __init__(self) -> None:
        self._overlay: dict[QuotaEntity, dict[str, float | None]] = {}

    @property
    def overlay(self) -> Overlay:
        """A read-only copy of the overlay."""
        return MappingProxyType({e: MappingProxyType(dict(v)) for e, v in self._overlay.items()})

    def __len__(self) -> int:
        """The number of (entity, key) the overlay decides."""
        return sum(len(values) for values in self._overlay.values())

    def apply(self, changes: Iterable[QuotaChange]) -> None:
        """Records each change: its new value, or :data:`REMOVED` (``change.new`` None)."""
        for change in changes:
            self._overlay.setdefault(change.entity, {})[change.key] = change.new

    def merged(self, base: Iterable[QuotaRule]) -> dict[QuotaEntity, dict[str, float]]:
        return merge(base, self._overlay)

    async def commit(self, changes: Sequence[QuotaChange]) -> None:
        self.apply(changes)
