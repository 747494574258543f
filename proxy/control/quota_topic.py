"""The record format of the quota topic (``quota_admin.topic``): one record per quota entity.

Pure: bytes in, values out, no I/O (proxy.control.quota_topic_store reads and writes the topic).

Key: the entity, as canonical JSON (keys sorted, no spaces, UTF-8), so that compaction keeps
one record per entity whatever instance wrote it::

    {"client-id":null,"user":"alice"}        (null: the default entity of that type)

Value, version 1 (UTF-8 JSON)::

    {"v":1,"entity":{"client-id":null,"user":"alice"},
     "quotas":{"producer_byte_rate":1048576.0},"removed":["request_rate"]}

``quotas`` holds the values set through the Admin API, ``removed`` the keys removed through it
(they mask the file's value, see proxy.control.quota_store.REMOVED): together, the entity's whole
overlay, which the record replaces. A null value (a tombstone) drops the entity from the
overlay: the file alone decides it again. ``entity`` repeats the key so a record can be read
on its own; they must agree.

A reader ignores (and counts, see :class:`BadRecord`) a record it cannot read: not JSON, a
version other than :data:`FORMAT_VERSION`, a key and an entity that differ, a value that is
not a finite number >= 0, a key both set and removed. A later version may add fields; a
reader of version 1 ignores a record of another version rather than guessing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Final

from quotas.client_quota_admin import CLIENT_ID, USER, QuotaEntity

FORMAT_VERSION: Final = 1

Values = Mapping[str, float | None]  # key -> value, or None (REMOVED) for a removal


class BadRecord(ValueError):
    """A record of the quota topic that cannot be read; ``reason`` is a metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def entity_key(entity: QuotaEntity) -> bytes:
    """The record key of ``entity`` (canonical JSON of its entries)."""
    return _dumps(dict(entity.parts))


def encode_value(entity: QuotaEntity, values: Values) -> bytes | None:
    """The record value of ``entity`` with overlay ``values``; None (a tombstone) when empty."""
    if not values:
        return None
    quotas = {k: float(v) for k, v in sorted(values.items()) if v is not None}
    removed = sorted(k for k, v in values.items() if v is None)
    return _dumps({"v": FORMAT_VERSION, "entity": dict(entity.parts), "quotas": quotas, "removed": removed})


def encode(entity: QuotaEntity, values: Values) -> tuple[bytes, bytes | None]:
    """(key, value) of the record carrying ``entity``'s whole overlay."""
    return entity_key(entity), encode_value(entity, values)


def encode_all(overlays: Mapping[QuotaEntity, Values]) -> list[tuple[bytes, bytes | None]]:
    """The records carrying each entity's whole overlay, in ``overlays``' order."""
    return [encode(entity, values) for entity, values in overlays.items()]


def _entity(data: Any, what: str) -> QuotaEntity:
    if not isinstance(data, dict) or not data or not set(data) <= {USER, CLIENT_ID}:
        raise BadRecord("bad_entity", f"{what} is not an object of user and/or client-id: {data!r:.200}")
    try:
        return QuotaEntity.of(data)
    except ValueError as exc:
        raise BadRecord("bad_entity", f"{what}: {exc}") from exc


def decode(key: bytes | None, value: bytes | None) -> tuple[QuotaEntity, dict[str, float | None] | None]:
    """(entity, its overlay) from one record; overlay None for a tombstone. Raises BadRecord."""
    if key is None:
        raise BadRecord("no_key", "a record without a key")
    try:
        entity = _entity(json.loads(bytes(key)), "the key")
        if value is None:
            return entity, None
        data = json.loads(bytes(value))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRecord("not_json", str(exc)) from exc
    if not isinstance(data, dict):
        raise BadRecord("not_json", f"the value is not a JSON object: {data!r:.200}")
    version = data.get("v")
    if version != FORMAT_VERSION:
        raise BadRecord("unknown_version", f"format version {version!r:.50}, this proxy reads {FORMAT_VERSION}")
    if _entity(data.get("entity"), "the value's entity") != entity:
        raise BadRecord("bad_entity", "the value's entity is not the key's")
    quotas, removed = data.get("quotas", {}), data.get("removed", [])
    if not isinstance(quotas, dict) or not isinstance(removed, list):
        raise BadRecord("bad_values", "quotas must be an object, removed a list")
    values: dict[str, float | None] = {}
    for k, v in quotas.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise BadRecord("bad_values", f"{k!r:.100} is not a finite number >= 0: {v!r:.100}")
        values[k] = float(v)
    for k in removed:
        if not isinstance(k, str) or k in values:
            raise BadRecord("bad_values", f"removed {k!r:.100}: not a key name, or also set")
        values[k] = None
    return entity, values
