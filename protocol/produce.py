"""ProduceRequest fields read straight from the frame, without decoding the records."""

from __future__ import annotations

from struct import Struct

from .apis import SPECS, ApiKey
from .headers import read_uvarint

_INT16 = Struct(">h")


def produce_acks(frame, body_offset: int, api_version: int) -> int:
    """The ``acks`` field of a ProduceRequest whose body starts at ``body_offset``."""
    pos = body_offset
    if api_version >= 3:  # transactional_id comes first
        if SPECS[ApiKey.PRODUCE].is_flexible(api_version):
            n, pos = read_uvarint(frame, pos)
            pos += max(n - 1, 0)
        else:
            (n,) = _INT16.unpack_from(frame, pos)
            pos += 2 + max(n, 0)
    return _INT16.unpack_from(frame, pos)[0]
