"""Decoding and encoding of message bodies with kafka-python's schema classes."""

from __future__ import annotations

from kafka.protocol.api_message import ApiMessage

from .apis import SPECS


class DecodeError(ValueError):
    """A message body the proxy needed to read could not be decoded."""


def decode_request(api_key: int, api_version: int, body) -> ApiMessage:
    return _decode(SPECS[api_key].request, api_key, api_version, body)


def decode_response(api_key: int, api_version: int, body) -> ApiMessage:
    return _decode(SPECS[api_key].response, api_key, api_version, body)


def _decode(cls, api_key: int, api_version: int, body) -> ApiMessage:
    try:
        return cls.decode(memoryview(body), version=api_version)
    except Exception as exc:  # kafka-python raises assorted errors on malformed input
        raise DecodeError(f"cannot decode {cls.__name__} v{api_version}: {exc!r}") from exc


def encode_body(message: ApiMessage) -> bytes:
    """The message body without header or size prefix."""
    return bytes(message.encode())
