"""Decoding and encoding of message bodies with kafka-python's schema classes."""

from __future__ import annotations

import io
import threading
from collections.abc import Iterable
from struct import Struct
from typing import Any, cast

from kafka.protocol.api_message import ApiMessage

from .apis import SPECS, ApiKey
from .errors import ProtocolError
from .frames import Buffer

_INT16 = Struct(">h")


class DecodeError(ProtocolError):
    """A message body the proxy needed to read could not be decoded."""


class UnknownVersionError(DecodeError):
    """A request or response at a version kafka-python has no schema for: the proxy can neither
    read nor answer it (ApiVersions never offers such a version, so only a client that ignores
    it sends one; Kafka closes such a connection too)."""


def versioned(cls: type[ApiMessage], version: int) -> type[ApiMessage]:
    """``cls``, a kafka-python message class, at ``version``; :class:`UnknownVersionError`
    outside the versions it has a schema for."""
    if not cls.min_version <= version <= cls.max_version:
        known = f"v{cls.min_version} to v{cls.max_version}"
        raise UnknownVersionError(f"{cls.__name__} v{version}: the proxy knows {known}")
    return cast("type[ApiMessage]", cls[version])


def decode_request(api_key: int, api_version: int, body: Buffer) -> ApiMessage:
    """Decodes a client's request body; one that would make kafka-python copy it over and over
    for its tagged fields is refused (see _TaggedCopies)."""
    return _decode(SPECS[api_key].request, api_version, body, _tagged_budget_bytes(len(memoryview(body))))


def decode_response(api_key: int, api_version: int, body: Buffer) -> ApiMessage:
    view = memoryview(body)
    # Kafka encodes an ApiVersionsResponse carrying an error as v0 whatever the request's
    # version, so that any client can read it (ApiVersionsResponse / KIP-511).
    if api_key == ApiKey.API_VERSIONS and len(view) >= 2 and _INT16.unpack_from(view)[0] != 0:
        api_version = 0
    # A broker's response is trusted to be the broker's: its tagged fields are not counted.
    return _decode(SPECS[api_key].response, api_version, view, _UNCOUNTED)


class _TaggedCopies(threading.local):
    """How many bytes kafka-python's decoder may still copy for tagged fields in one decode
    (per thread: a big body is decoded off the event loop, proxy.cluster.offload). Outside
    :func:`_decode` nothing is counted: kafka-python's own clients share these decoders in the
    same process (the demo, the proxy's own connections) and must not be refused.

    Its generated decoders read a struct's non-empty tagged fields from a copy of everything
    after them (``BytesIO(bytes(data[pos:]))``), so a body with tags on many structs costs time
    quadratic in its size: a 1.4 MB CreateTopics with a tag on each topic took 3.5 s of the
    event loop. Kafka's own clients send no tags there; a body that needs more copying than a
    few times its size is refused instead."""

    budget_bytes: float = float("inf")


_tagged_copies = _TaggedCopies()


def _counted_bytes_io(copy: bytes) -> io.BytesIO:
    _tagged_copies.budget_bytes -= len(copy)
    if _tagged_copies.budget_bytes < 0:
        raise DecodeError("tagged fields on too many structs (decoding it would copy the body over and over)")
    return io.BytesIO(copy)


def _tagged_budget_bytes(body_bytes: int) -> int:
    return (1 << 20) + min(16 * body_bytes, 64 << 20)


_UNCOUNTED = float("inf")


def _decode(cls: type[ApiMessage], version: int, body: Buffer, tagged_budget_bytes: float) -> ApiMessage:
    """Decodes a whole body. Guarantees: every byte belongs to the message, and no field its
    schema says is not nullable is null (kafka-python reads a -1 length as None anywhere;
    Kafka's generated readers refuse it: "non-nullable field ... was serialized as null")."""
    versioned(cls, version)
    view = memoryview(body)
    try:
        flexible = cls.flexible_version_q(version)
        decode_from = cls._struct.compiled_decode_from(
            version, compact=flexible, tagged=flexible, data_class=cls[None]
        )
        # The generated decoder looks its BytesIO up in its own globals: count what it copies.
        decode_from.__globals__["_BytesIO"] = _counted_bytes_io
        _tagged_copies.budget_bytes = tagged_budget_bytes
        try:
            message, end = decode_from(view, 0)
        finally:
            _tagged_copies.budget_bytes = _UNCOUNTED
    except DecodeError:
        raise
    except Exception as exc:  # kafka-python raises assorted errors on malformed input
        raise DecodeError(f"cannot decode {cls.__name__} v{version}: {exc!r}") from exc
    if end != len(view):
        raise DecodeError(f"{cls.__name__} v{version}: {len(view) - end} bytes after the message")
    null = _null_field(message, _nulls_plan(cls, version))
    if null is not None:
        raise DecodeError(f"{cls.__name__} v{version}: non-nullable field {null} is null")
    return message


# (field name, may be null, is an array, plan of its struct or None) for each field of a version
# that may be null on the wire and matters: strings, bytes, records, arrays, and structs holding
# one. Fixed-width fields never are (a zero uuid or an all-ones bitfield reads as None, but is a
# value). Built once per class and version.
_NullsPlan = tuple[tuple[str, bool, bool, "_NullsPlan | None"], ...]
_FIXED_WIDTH = frozenset({"int8", "int16", "uint16", "int32", "int64", "float64", "bool", "uuid", "bitfield"})
_plans: dict[tuple[type, int], _NullsPlan] = {}


def _nulls_plan(cls: type[ApiMessage], version: int) -> _NullsPlan:
    plan = _plans.get((cls, version))
    if plan is None:
        plan = _plans[(cls, version)] = _plan(cls.fields.values(), version)
    return plan


def _plan(fields: Iterable[Any], version: int) -> _NullsPlan:
    plan = []
    for f in fields:
        if not f.for_version_q(version):
            continue
        if f.type_str in _FIXED_WIDTH and not f.is_array():
            continue
        inner = _plan(f.fields.values(), version) if f.is_struct() or f.is_struct_array() else None
        # A tagged field left out is its default (often None), and kafka-python reads a struct
        # that is not nullable whole: for these only what they hold is checked.
        nullable = f.tagged_field_q(version) or f.nullable_for_version_q(version) or f.is_struct()
        if inner or not nullable:
            plan.append((f.name, nullable, f.is_array(), inner or None))
    return tuple(plan)


def _null_field(message: object, plan: _NullsPlan) -> str | None:
    """The path of the first field ``plan`` says may not be null and is, or None."""
    for name, nullable, many, inner in plan:
        value = getattr(message, name)
        if value is None:
            if not nullable:
                return name
        elif inner is not None:
            for item in value if many else (value,):
                null = _null_field(item, inner)
                if null is not None:
                    return f"{name}.{null}"
    return None


def encode_body(message: ApiMessage) -> bytes:
    """The message body without header or size prefix.

    Tagged fields kafka-python has no schema for are not re-encoded; the proxy caps every API
    it decodes at kafka-python's versions, so only a broker that adds tags to a version it
    already shipped can lose one (README, "Known limits").
    """
    if not hasattr(message, "_header"):
        # A decoded message has no header slot set, and some kafka-python encoders
        # (DeleteTopicsRequest) pass version= explicitly, whose setter reads it.
        message._header = None
    return bytes(message.encode())
