"""Decoding and encoding of message bodies with kafka-python's schema classes."""

from __future__ import annotations

from struct import Struct

from kafka.protocol.api_message import ApiMessage

from .apis import SPECS, ApiKey

_INT16 = Struct(">h")


class DecodeError(ValueError):
    """A message body the proxy needed to read could not be decoded."""


def decode_request(api_key: int, api_version: int, body) -> ApiMessage:
    return _decode(SPECS[api_key].request, api_version, body)


def decode_response(api_key: int, api_version: int, body) -> ApiMessage:
    view = memoryview(body)
    # Kafka encodes an ApiVersionsResponse carrying an error as v0 whatever the request's
    # version, so that any client can read it (ApiVersionsResponse / KIP-511).
    if api_key == ApiKey.API_VERSIONS and len(view) >= 2 and _INT16.unpack_from(view)[0] != 0:
        api_version = 0
    return _decode(SPECS[api_key].response, api_version, view)


def _decode(cls, version: int, body) -> ApiMessage:
    """Decodes a whole body; every byte must belong to the message."""
    view = memoryview(body)
    try:
        flexible = cls.flexible_version_q(version)
        decode_from = cls._struct.compiled_decode_from(
            version, compact=flexible, tagged=flexible, data_class=cls[None]
        )
        message, end = decode_from(view, 0)
    except Exception as exc:  # kafka-python raises assorted errors on malformed input
        raise DecodeError(f"cannot decode {cls.__name__} v{version}: {exc!r}") from exc
    if end != len(view):
        raise DecodeError(f"{cls.__name__} v{version}: {len(view) - end} bytes after the message")
    return message


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
