"""Setting a response's ``throttle_time_ms`` to max(the broker's, the proxy's) (KIP-219)."""

from __future__ import annotations

from struct import Struct
from typing import cast

from .apis import SPECS, ApiKey
from .frames import Buffer
from .headers import response_body_offset
from .messages import decode_response, encode_body
from .scan import need_bytes, scan_produce_response

_INT32 = Struct(">i")


def _throttle_fields() -> tuple[dict[int, int], dict[int, int]]:
    """API key -> first version carrying ThrottleTimeMs, split by whether it is the first field."""
    first: dict[int, int] = {}
    elsewhere: dict[int, int] = {}
    for key, spec in SPECS.items():
        fields = spec.response.json["fields"]
        for i, f in enumerate(fields):
            if f["name"] == "ThrottleTimeMs":
                since = int(f["versions"].split("-")[0].rstrip("+"))
                (first if i == 0 else elsewhere)[key] = since
    return first, elsewhere


_FIRST_FIELD_SINCE, _ELSEWHERE_SINCE = _throttle_fields()


def has_throttle_field(api_key: int, api_version: int) -> bool:
    since = _FIRST_FIELD_SINCE.get(api_key, _ELSEWHERE_SINCE.get(api_key))
    return since is not None and api_version >= since


def _throttle_at(api_key: int, api_version: int, frame: Buffer, offset: int) -> int | None:
    """Where ``throttle_time_ms`` is in the frame, when it can be found without decoding."""
    if api_key in _FIRST_FIELD_SINCE:
        return offset
    if api_key == ApiKey.PRODUCE and api_version >= 9:  # after the partitions: walked, not decoded
        return offset + scan_produce_response(memoryview(frame)[offset:], api_version).throttle_offset
    return None


def with_throttle(api_key: int, api_version: int, frame: Buffer, throttle_ms: int) -> Buffer:
    """The response frame with ``throttle_time_ms`` raised to at least ``throttle_ms``.

    Returns ``frame`` itself when the broker's value is already as high or the version has no
    such field. When the field leads the body, or follows the partitions of a flexible Produce
    (walked, not decoded), it is patched in place of a copy; otherwise (Produce before v9,
    ApiVersions, OffsetDelete) the body is decoded and re-encoded. Raises a
    :class:`~protocol.errors.ProtocolError` for a frame too short or malformed to hold it.
    """
    if not has_throttle_field(api_key, api_version):
        return frame
    offset = response_body_offset(frame, api_key, api_version)
    at = _throttle_at(api_key, api_version, frame, offset)
    if at is not None:
        need_bytes(frame, at, 4, "throttle_time_ms")
        (current,) = _INT32.unpack_from(frame, at)
        if current >= throttle_ms:
            return frame
        patched = bytearray(frame)
        _INT32.pack_into(patched, at, throttle_ms)
        return patched
    resp = decode_response(api_key, api_version, memoryview(frame)[offset:])
    if resp.throttle_time_ms >= throttle_ms:
        return frame
    resp.throttle_time_ms = throttle_ms
    return bytes(frame[:offset]) + encode_body(resp)


def throttle_of(api_key: int, api_version: int, frame: Buffer) -> int:
    """The broker's ``throttle_time_ms`` in a response frame (0 when the version has none)."""
    if not has_throttle_field(api_key, api_version):
        return 0
    offset = response_body_offset(frame, api_key, api_version)
    at = _throttle_at(api_key, api_version, frame, offset)
    if at is not None:
        need_bytes(frame, at, 4, "throttle_time_ms")
        throttle_ms: int = _INT32.unpack_from(frame, at)[0]  # a typed local, not a cast() call
        return throttle_ms
    return cast(int, decode_response(api_key, api_version, memoryview(frame)[offset:]).throttle_time_ms)
