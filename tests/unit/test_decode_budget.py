"""kafka-python's decoder copies the rest of a body for each struct that carries tagged fields;
a client's request that would make it do so over and over is refused, not decoded for seconds."""

from __future__ import annotations

import struct

import pytest

from protocol.messages import DecodeError, decode_request


def _varint(n: int) -> bytes:
    out = b""
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            return out + bytes([low])
        out += bytes([low | 0x80])


def _create_topics_v5(topics: int, tagged: bool) -> bytes:
    """CreateTopics v5: ``topics`` one-partition topics, each with an unknown tagged field if
    ``tagged`` (Kafka's clients send none)."""
    tags = _varint(1) + _varint(99) + _varint(1) + b"x" if tagged else b"\x00"
    topic = _varint(2) + b"t" + struct.pack(">ih", 1, 1) + _varint(1) + _varint(1) + tags
    return _varint(topics + 1) + topic * topics + struct.pack(">i", 1000) + b"\x00\x00"


def test_a_request_with_tags_on_every_struct_is_refused():
    # 1.4 MB: 3.5 s of the event loop before the budget.
    with pytest.raises(DecodeError, match="tagged fields on too many structs"):
        decode_request(19, 5, _create_topics_v5(100_000, tagged=True))


def test_a_few_tagged_structs_and_large_untagged_requests_still_decode():
    assert len(decode_request(19, 5, _create_topics_v5(50, tagged=True)).topics) == 50
    assert len(decode_request(19, 5, _create_topics_v5(100_000, tagged=False)).topics) == 100_000
