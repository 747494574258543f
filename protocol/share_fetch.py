"""ShareFetchRequest fields read and capped in the frame (KIP-932), as protocol.fetch does for
Fetch."""

from __future__ import annotations

from struct import Struct

from .frames import Buffer
from .headers import HeaderError, read_uvarint
from .scan import ScanError, need_bytes

_INT32 = Struct(">i")


def _min_bytes_at(frame: Buffer, body_offset: int, api_version: int) -> int:
    """Where MinBytes is: after GroupId and MemberId (compact nullable strings),
    ShareSessionEpoch and MaxWaitMs; MaxBytes follows it. The same in v0-2 (v1's MaxRecords and
    BatchSize, v2's ShareAcquireMode and IsRenewAck come after MaxBytes)."""
    pos = body_offset
    try:
        for _ in range(2):  # GroupId, MemberId
            n, pos = read_uvarint(frame, pos)
            pos += max(n - 1, 0)
    except HeaderError as exc:
        raise ScanError(f"ShareFetchRequest v{api_version}: {exc}") from exc
    pos += 4 + 4  # ShareSessionEpoch, MaxWaitMs
    need_bytes(frame, pos, 8, f"ShareFetchRequest v{api_version} min/max bytes")
    return pos


def cap_share_fetch_bytes(frame: Buffer, body_offset: int, api_version: int, cap_bytes: int) -> Buffer:
    """The ShareFetchRequest frame with MinBytes and MaxBytes lowered to ``cap_bytes``;
    ``frame`` itself when both are within it already (a 0 stays 0). Raises
    :class:`~protocol.scan.ScanError` when the body ends before them."""
    pos = _min_bytes_at(frame, body_offset, api_version)
    min_bytes, max_bytes = _INT32.unpack_from(frame, pos)[0], _INT32.unpack_from(frame, pos + 4)[0]
    # KIP-1222: a v2 request with IsRenewAck must have MaxBytes and MinBytes 0 (INVALID_REQUEST
    # otherwise); the cap only lowers, to cap_bytes >= 1 (RateQuotaFilter), so a 0 stays 0.
    if min_bytes <= cap_bytes and max_bytes <= cap_bytes:
        return frame
    out = bytearray(frame)
    _INT32.pack_into(out, pos, min(min_bytes, cap_bytes))
    _INT32.pack_into(out, pos + 4, min(max_bytes, cap_bytes))
    return out
