"""Request and response headers (Kafka's RequestHeader v1/v2 and ResponseHeader v0/v1)."""

from __future__ import annotations

from functools import lru_cache
from struct import Struct
from typing import NamedTuple

from .apis import FIRST_FLEXIBLE_VERSION, ApiKey
from .errors import ProtocolError
from .frames import Buffer

_HEADER_PREFIX = Struct(">hhi")  # api_key, api_version, correlation_id
_INT16 = Struct(">h")
_INT32 = Struct(">i")


class HeaderError(ProtocolError):
    """A request or response header (or a varint) that cannot be parsed."""


class RequestHeader(NamedTuple):
    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None
    # Offset of the body within the frame; -1 when the header's version is unknown
    # (an API the proxy cannot decode, whose frame is forwarded untouched).
    body_offset: int


def read_uvarint(buf: Buffer, pos: int) -> tuple[int, int]:
    """Reads Kafka's unsigned varint at ``pos``; returns (value, next position)."""
    # Up to three bytes (under 2 MiB: nearly every length and count, a record set's included)
    # read inline; longer ones, and one cut short, by the loop below.
    try:
        b = buf[pos]
        if b < 0x80:
            return b, pos + 1
        c = buf[pos + 1]
        if c < 0x80:
            return (b & 0x7F) | c << 7, pos + 2
        d = buf[pos + 2]
        if d < 0x80:
            return (b & 0x7F) | (c & 0x7F) << 7 | d << 14, pos + 3
    except IndexError:
        pass
    value = 0
    shift = 0
    while True:
        if pos >= len(buf):
            raise HeaderError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift > 28:
            raise HeaderError("varint longer than 5 bytes")


def skip_tagged_fields(buf: Buffer, pos: int) -> int:
    """Skips a tagged-field section; returns the position after it."""
    if pos < len(buf) and buf[pos] == 0:  # none: nearly every section
        return pos + 1
    count, pos = read_uvarint(buf, pos)
    for _ in range(count):
        _tag, pos = read_uvarint(buf, pos)
        size, pos = read_uvarint(buf, pos)
        pos += size
        if pos > len(buf):
            raise HeaderError("truncated tagged field")
    return pos


def request_header_is_flexible(api_key: int, api_version: int) -> bool | None:
    """True for request header v2, False for v1, None when the API is unknown to the proxy."""
    first = FIRST_FLEXIBLE_VERSION.get(api_key)
    if first is None:
        return None
    return api_version >= first


def response_header_is_flexible(api_key: int, api_version: int) -> bool:
    """Whether the response header carries tagged fields (ResponseHeader v1)."""
    # ApiVersionsResponse always uses header v0 so that any client can read it (KIP-511).
    if api_key == ApiKey.API_VERSIONS:
        return False
    return bool(request_header_is_flexible(api_key, api_version))


@lru_cache(maxsize=256)
def request_head(client_id_field_bytes: int) -> Struct:
    """Size, api key, api version, correlation id, and a client id field this long (int16
    length and bytes): how a framed request with header v1 or v2 starts."""
    return Struct(f">ihhi{client_id_field_bytes}s")


_client_id_cache: dict[bytes, str] = {}


def parse_request_header(frame: Buffer) -> RequestHeader:
    """Parses the header at the start of a request frame (size prefix removed).

    Guarantees: never reads past ``frame``; raises :class:`HeaderError` on any malformed header.
    """
    n = len(frame)
    if n < 10:
        raise HeaderError(f"request header needs at least 10 bytes, frame has {n}")
    api_key, api_version, correlation_id = _HEADER_PREFIX.unpack_from(frame, 0)
    if api_key < 0 or api_version < 0:
        raise HeaderError(f"invalid api_key {api_key} / api_version {api_version}")
    (id_len,) = _INT16.unpack_from(frame, 8)
    pos = 10
    if id_len < 0:
        if id_len != -1:
            raise HeaderError(f"invalid client_id length {id_len}")
        client_id = None
    else:
        if pos + id_len > n:
            raise HeaderError(f"client_id length {id_len} runs past the frame")
        raw = bytes(frame[pos : pos + id_len])
        client_id = _client_id_cache.get(raw)
        if client_id is None:
            try:
                client_id = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise HeaderError("client_id is not UTF-8") from exc
            if len(_client_id_cache) < 10_000:
                _client_id_cache[raw] = client_id
        pos += id_len
    first_flexible = FIRST_FLEXIBLE_VERSION.get(api_key)
    if first_flexible is None:
        return RequestHeader(api_key, api_version, correlation_id, client_id, -1)
    if api_version >= first_flexible:
        pos = skip_tagged_fields(frame, pos)
    return RequestHeader(api_key, api_version, correlation_id, client_id, pos)


def response_body_offset(frame: Buffer, api_key: int, api_version: int) -> int:
    """Offset of the body in a response frame (after correlation id and any tagged fields).

    Raises :class:`HeaderError` for a header that runs past the frame.
    """
    if len(frame) < 4:
        raise HeaderError(f"response frame of {len(frame)} bytes has no correlation id")
    if response_header_is_flexible(api_key, api_version):
        return skip_tagged_fields(frame, 4)
    return 4


def response_correlation_id(frame: Buffer) -> int:
    if len(frame) < 4:
        raise HeaderError(f"response frame of {len(frame)} bytes has no correlation id")
    correlation_id: int = _INT32.unpack_from(frame, 0)[0]  # a typed local: cast() is a call per response
    return correlation_id


def encode_response_header(correlation_id: int, flexible: bool) -> bytes:
    return _INT32.pack(correlation_id) + (b"\x00" if flexible else b"")
