"""FetchRequest fields read from the frame, and the empty response a throttled Fetch gets."""

from __future__ import annotations

from struct import Struct

from kafka.protocol.consumer import FetchResponse

from .frames import Buffer
from .messages import encode_body, versioned
from .scan import need_bytes

_TWO_INT32 = Struct(">ii")


def fetch_session(frame: Buffer, body_offset: int, api_version: int) -> tuple[int, int] | None:
    """(session_id, session_epoch) of a FetchRequest v7+ (KIP-227), None before v7.

    Raises :class:`~protocol.scan.ScanError` when the body ends before them.
    """
    if api_version < 7:
        return None
    pos = body_offset
    if api_version < 15:
        pos += 4  # replica_id, moved into a tagged ReplicaState in v15
    pos += 4 + 4 + 4 + 1  # max_wait_ms, min_bytes, max_bytes, isolation_level
    need_bytes(frame, pos, 8, f"FetchRequest v{api_version} session")
    return _TWO_INT32.unpack_from(frame, pos)


_INT32 = Struct(">i")


def cap_fetch_bytes(frame: Buffer, body_offset: int, api_version: int, cap_bytes: int) -> Buffer:
    """The FetchRequest frame with max_bytes (v3+) and min_bytes lowered to ``cap_bytes``;
    ``frame`` itself when both are already within it. Raises
    :class:`~protocol.scan.ScanError` when the body ends before them."""
    pos = body_offset + (4 if api_version < 15 else 0) + 4  # replica_id, max_wait_ms
    max_pos = pos + 4 if api_version >= 3 else None
    need_bytes(frame, pos, 8 if max_pos is not None else 4, f"FetchRequest v{api_version} min/max bytes")
    (min_bytes,) = _INT32.unpack_from(frame, pos)
    max_bytes = _INT32.unpack_from(frame, max_pos)[0] if max_pos is not None else None
    if min_bytes <= cap_bytes and (max_bytes is None or max_bytes <= cap_bytes):
        return frame
    out = bytearray(frame)
    _INT32.pack_into(out, pos, min(min_bytes, cap_bytes))
    if max_pos is not None:
        # max_bytes is read whenever max_pos is set; mypy cannot tie the two conditionals together.
        _INT32.pack_into(out, max_pos, min(max_bytes, cap_bytes))  # type: ignore[type-var]
    return out


def throttled_fetch_body(api_version: int, throttle_ms: int, session: tuple[int, int] | None) -> bytes:
    """An empty FetchResponse carrying ``throttle_ms``.

    Follows Kafka's FetchContext.getThrottledResponse: an incremental fetch (epoch > 0) keeps
    its session id, a full fetch gets INVALID_SESSION_ID (0), so either kind of session stays
    consistent with what the client will send next. Raises
    :class:`~protocol.messages.UnknownVersionError` for a version kafka-python cannot write.
    """
    session_id = session[0] if session is not None and session[1] > 0 else 0
    resp = versioned(FetchResponse, api_version)(
        throttle_time_ms=throttle_ms, error_code=0, session_id=session_id, responses=[], node_endpoints=[]
    )
    return encode_body(resp)
