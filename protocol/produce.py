"""ProduceRequest fields read straight from the frame, and ProduceResponses the proxy answers itself."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from struct import Struct
from struct import error as struct_error

from .apis import FIRST_FLEXIBLE_VERSION, SPECS, ApiKey
from .errors import ProtocolError
from .frames import Buffer
from .headers import encode_response_header, read_uvarint
from .messages import encode_body, versioned
from .scan import ScanError, need_bytes

_INT16 = Struct(">h")
_FIRST_FLEXIBLE = FIRST_FLEXIBLE_VERSION[ApiKey.PRODUCE]


def produce_acks(frame: Buffer, body_offset: int, api_version: int) -> int:
    """The ``acks`` field of a ProduceRequest whose body starts at ``body_offset``.

    Raises :class:`~protocol.scan.ScanError` (:class:`~protocol.headers.HeaderError` for a
    varint cut short) when ``frame`` ends before acks: the connection's hot path hands this the
    first chunk of a frame, which may end anywhere.
    """
    pos = body_offset
    if api_version >= 3:  # transactional_id comes first
        if api_version >= _FIRST_FLEXIBLE:
            n, pos = read_uvarint(frame, pos)
            pos += max(n - 1, 0)
        else:
            need_bytes(frame, pos, 2, "ProduceRequest transactional_id")
            (n,) = _INT16.unpack_from(frame, pos)
            if n < -1:
                raise ScanError(f"ProduceRequest transactional_id of length {n}")
            pos += 2 + max(n, 0)
    need_bytes(frame, pos, 2, "ProduceRequest acks")
    acks: int = _INT16.unpack_from(frame, pos)[0]  # a typed local: cast() is a call per request
    return acks


def framed_acks_not_zero(data: Buffer, pos: int, version: int) -> bool:
    """Whether a Produce frame (with its size prefix; its first chunk is enough), whose request
    header ends at the client id at ``pos``, has an acks other than 0. False too when it cannot
    tell (header tagged fields, cut short, a bad varint): the caller then parses it in full."""
    try:
        if version >= _FIRST_FLEXIBLE:
            if data[pos] != 0:
                return False  # the header has tagged fields
            pos += 1  # no header tagged fields: the body follows
            if data[pos] != 0:  # a transactional id (a compact string; 0: null)
                return produce_acks(data, pos, version) != 0
            pos += 1
        elif version >= 3:
            if data[pos] != 0xFF or data[pos + 1] != 0xFF:  # a transactional id (-1: null)
                return produce_acks(data, pos, version) != 0
            pos += 2
        return data[pos] != 0 or data[pos + 1] != 0  # acks, an int16
    except (IndexError, struct_error, ProtocolError):
        return False


def produce_error_response(
    correlation_id: int,
    api_version: int,
    topics: Sequence[tuple[str | bytes, Sequence[int]]],
    error_code: int,
    throttle_ms: int,
    error_message: str | None = None,
) -> bytes:
    """A whole ProduceResponse frame (header + body) failing every partition with ``error_code``.

    ``topics`` as :class:`protocol.records.ProduceScan` gives them: names, or 16-byte topic ids
    from v13 on. Offsets are -1, as Kafka fills them for a partition that was not appended.
    Raises :class:`~protocol.messages.UnknownVersionError` for a version kafka-python cannot write.
    """
    cls = versioned(SPECS[ApiKey.PRODUCE].response, api_version)
    T = cls.TopicProduceResponse
    P = T.PartitionProduceResponse
    responses = []
    for topic, partitions in topics:
        t = T(partition_responses=[
            P(index=i, error_code=error_code, base_offset=-1, log_append_time_ms=-1, log_start_offset=-1,
              record_errors=[], error_message=error_message)
            for i in partitions
        ])
        if isinstance(topic, bytes):
            t.topic_id = uuid.UUID(bytes=topic)
        else:
            t.name = topic
        responses.append(t)
    body = encode_body(cls(responses=responses, throttle_time_ms=throttle_ms))
    return encode_response_header(correlation_id, SPECS[ApiKey.PRODUCE].is_flexible(api_version)) + body
