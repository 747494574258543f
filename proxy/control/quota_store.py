"""Quotas set through the Admin API (AlterClientQuotas), layered over the configuration file's.

The YAML ``quotas:`` are the base. A store holds an *overlay*: for each (entity, key) it was told
about, either a value, which overrides the base's, or a removal (:data:`REMOVED`), which masks
the base's value, so that a quota defined only in the file can be removed through the API too.
A removal is kept only for a key the file sets for that entity when it is made (``file_keys``):
removing a key the file does not set leaves nothing behind, and an entity left with nothing is
forgotten (in the topic: a tombstone). A key the overlay does not name keeps the base's value,
and follows the file when it is reloaded. Once the overlay names an (entity, key), it alone
decides it: a later change of that key in the file is not in force.

:class:`QuotaStore` is what the proxy needs of a store; :class:`OverlayStore` keeps the overlay
in this process's memory only (lost on restart); proxy.control.quota_topic_store.TopicStore keeps it in
a compacted topic, and implements :meth:`QuotaStore.commit` by writing the changes and applying
them only once they are written.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Final, Protocol

from quotas.client_quota_admin import QuotaChange, QuotaEntity, quotas_from_rules
from quotas.entities import QuotaRule

REMOVED: Final = None  # an overlay value: the key is removed, whatever the base says

Overlay = Mapping[QuotaEntity, Mapping[str, float | None]]
FileKeys = Callable[[QuotaEntity], Collection[str]]  # the keys the file sets for an entity


def overlay_values(current: Mapping[str, float | None], changes: Iterable[QuotaChange],
                   file_keys: Collection[str] | None) -> dict[str, float | None]:
    """One entity's overlay after ``changes``: each set or removed key, the removals of keys the
    file does not set (``file_keys``; None: keep every removal) dropped, since they mask nothing."""
    values = dict(current)
    for change in changes:
        values[change.key] = change.new
    if file_keys is None:
        return values
    return {k: v for k, v in values.items() if v is not REMOVED or k in file_keys}


def file_keys_of(file_keys: FileKeys | None, entity: QuotaEntity) -> Collection[str] | None:
    return None if file_keys is None else file_keys(entity)


def by_entity(changes: Iterable[QuotaChange]) -> dict[QuotaEntity, list[QuotaChange]]:
    grouped: dict[QuotaEntity, list[QuotaChange]] = {}
    for change in changes:
        grouped.setdefault(change.entity, []).append(change)
    return grouped


class StoreUnavailable(Exception):
    """The store could not record changes (its storage unreachable or refusing): nothing
    changed. The message says why, for the client. ``retriable``: trying again later may
    succeed; False when the storage answered an error that retrying would not change (the
    proxy's own principal not authorized, say)."""

    def __init__(self, message: str, retriable: bool = True) -> None:
        super().__init__(message)
        self.retriable = retriable


class QuotaStore(Protocol):
    def __len__(self) -> int:
        """The number of (entity, key) the overlay decides (0: the base alone is in force)."""
        ...

    def merged(self, base: Iterable[QuotaRule]) -> dict[QuotaEntity, dict[str, float]]:
        """The quotas in force over ``base``: see :func:`merge`."""
        ...

    async def commit(self, changes: Sequence[QuotaChange]) -> None:
        """Records ``changes`` (each a set or a removal of one key of one entity): all of them, or,
        raising (StoreUnavailable when the store says why), none. Once it returns, :meth:`merged`
        reflects them. Cancelled (its caller's deadline passed), it records none."""
        ...

    def write_trouble(self) -> str | None:
        """Why the write under way is taking long (its last retried failure), for a caller whose
        deadline passes first; None when nothing failed."""
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
    Without ``file_keys``, every removal is kept."""

    def __init__(self, file_keys: FileKeys | None = None) -> None:
        self._overlay: dict[QuotaEntity, dict[str, float | None]] = {}
        self._file_keys = file_keys

    @property
    def overlay(self) -> Overlay:
        """A read-only copy of the overlay."""
        return MappingProxyType({e: MappingProxyType(dict(v)) for e, v in self._overlay.items()})

    def __len__(self) -> int:
        """The number of (entity, key) the overlay decides."""
        return sum(len(values) for values in self._overlay.values())

    def apply(self, changes: Iterable[QuotaChange]) -> None:
        """Records each change: its new value, or :data:`REMOVED` (``change.new`` None), kept
        while the file sets that key."""
        for entity, mine in by_entity(changes).items():
            values = overlay_values(self._overlay.get(entity, {}), mine, file_keys_of(self._file_keys, entity))
            if values:
                self._overlay[entity] = values
            else:
                self._overlay.pop(entity, None)

    def merged(self, base: Iterable[QuotaRule]) -> dict[QuotaEntity, dict[str, float]]:
        return merge(base, self._overlay)

    async def commit(self, changes: Sequence[QuotaChange]) -> None:
        self.apply(changes)

    def write_trouble(self) -> str | None:
        return None
