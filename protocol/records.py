"""Record-batch headers read straight from Produce requests and Fetch responses.

Nothing here decompresses or copies records: a batch is known by its fixed-width header
(``DefaultRecordBatch`` in Kafka, magic 2) and skipped by its length. Legacy message sets
(magic 0/1, ``LegacyRecord``) carry no producer id; each entry counts as one record, and a
compressed legacy wrapper counts as one (its inner messages are inside the compressed value).
"""

from __future__ import annotations

from collections.abc import Iterator
from struct import Struct
from struct import error as StructError
from typing import NamedTuple, TypeVar

from .errors import ProtocolError
from .frames import Buffer
from .headers import HeaderError, read_uvarint, skip_tagged_fields

_INT16 = Struct(">h")
_INT32 = Struct(">i")
_LENGTH_AND_MAGIC = Struct(">qiib")  # base offset, length, partition leader epoch, magic
# DefaultRecordBatch from offset 21: attributes, last offset delta, base timestamp,
# max timestamp, producer id, producer epoch, base sequence, records count.
_V2_TAIL = Struct(">hiqqqhii")
_V2_TAIL_AT = 21
_V2_PRODUCER = Struct(">qhii")  # producer id, epoch, base sequence, records count at 43
LOG_OVERHEAD = 12  # base offset + length: what every batch and legacy message starts with
V2_HEADER_BYTES = 61  # DefaultRecordBatch.RECORD_BATCH_OVERHEAD
_LEGACY_MIN_SIZE = {0: 14, 1: 22}  # LegacyRecord.RECORD_OVERHEAD_V0 / _V1
NO_PRODUCER_ID = -1
_CONTROL_FLAG = 0x20  # DefaultRecordBatch.CONTROL_FLAG_MASK: transaction markers, not data


class RecordsError(ProtocolError):
    """A record set, or the request or response around it, that does not match its schema."""


class BatchHeader(NamedTuple):
    """One batch's header. For magic 0/1: one (possibly compressed) legacy message."""

    position: int  # where the batch starts in the buffer
    base_offset: int
    batch_length: int  # bytes after the length field
    magic: int
    attributes: int
    producer_id: int  # -1: no producer id (magic 0/1, or a producer that is not idempotent)
    producer_epoch: int
    base_sequence: int
    record_count: int

    @property
    def compression(self) -> int:
        """0 none, 1 gzip, 2 snappy, 3 lz4, 4 zstd."""
        return self.attributes & 0x07

    @property
    def is_transactional(self) -> bool:
        return self.magic >= 2 and bool(self.attributes & 0x10)

    @property
    def is_control(self) -> bool:
        return self.magic >= 2 and bool(self.attributes & _CONTROL_FLAG)


def batch_headers(
    buf: Buffer, start: int = 0, end: int | None = None, *, partial_tail: bool = False
) -> Iterator[BatchHeader]:
    """Every batch header in ``buf[start:end]``.

    ``partial_tail``: a Fetch response may end in a batch cut short by the size limit, which
    the consumer discards (``ByteBufferLogInputStream``); stop there instead of failing.
    Raises :class:`RecordsError` for anything else that does not add up.
    """
    end = len(buf) if end is None else end
    pos = start
    while pos < end:
        if end - pos < 17:
            if partial_tail:
                return
            raise RecordsError(f"{end - pos} bytes at {pos} are too short for a batch header")
        base_offset, length, _epoch, magic = _LENGTH_AND_MAGIC.unpack_from(buf, pos)
        nxt = pos + LOG_OVERHEAD + length
        if magic == 2:
            if length < V2_HEADER_BYTES - LOG_OVERHEAD:
                raise RecordsError(f"batch at {pos}: length {length} is shorter than its header")
            if nxt > end:
                if partial_tail:
                    return
                raise RecordsError(f"batch at {pos}: length {length} runs past the record set")
            attributes, _, _, _, producer_id, producer_epoch, base_sequence, count = _V2_TAIL.unpack_from(
                buf, pos + _V2_TAIL_AT
            )
            if count < 0:
                raise RecordsError(f"batch at {pos}: negative record count {count}")
            yield BatchHeader(
                pos, base_offset, length, 2, attributes, producer_id, producer_epoch, base_sequence, count
            )
        elif magic in _LEGACY_MIN_SIZE:
            if length < _LEGACY_MIN_SIZE[magic]:
                raise RecordsError(f"message at {pos}: size {length} is shorter than a magic {magic} message")
            if nxt > end:
                if partial_tail:
                    return
                raise RecordsError(f"message at {pos}: size {length} runs past the message set")
            attributes = buf[pos + 17]
            yield BatchHeader(pos, base_offset, length, magic, attributes, NO_PRODUCER_ID, -1, -1, 1)
        else:
            raise RecordsError(f"batch at {pos}: unknown magic {magic}")
        pos = nxt


class ProduceScan(NamedTuple):
    """What a ProduceRequest carries, read without decoding its records."""

    acks: int
    # (topic, partition indexes) in request order; the topic is its name, or its 16-byte id
    # from Produce v13 on. Enough to answer the request without forwarding it.
    topics: tuple[tuple[str | bytes, tuple[int, ...]], ...]
    batches: int
    records: int
    producer_ids: tuple[int, ...]  # distinct producer ids ≥ 0, in order of appearance


def scan_produce_request(frame: Buffer, body_offset: int, api_version: int) -> ProduceScan:
    """Walks a ProduceRequest body (v0 to v13) and every batch header in it.

    Raises :class:`RecordsError` for a body or record set that does not match its schema.
    """
    return all_steps(scan_produce_steps(frame, body_offset, api_version, ALL_ENTRIES))


def scan_produce_steps(frame: Buffer, body_offset: int, api_version: int,
                       entries_per_step: int) -> Iterator[ProduceScan | None]:
    """:func:`scan_produce_request` in steps: yields None after every ``entries_per_step``
    partitions and batches (a pause only when more follow), then the scan. The same result and
    the same errors, raised by the step that meets them; ``frame`` must not change meanwhile."""
    try:
        yield from _scan_produce(frame, body_offset, api_version, entries_per_step)
    except RecordsError:
        raise
    except (HeaderError, IndexError, StructError, ValueError) as exc:
        raise RecordsError(f"malformed ProduceRequest v{api_version}: {exc}") from exc


ALL_ENTRIES = 2**62  # a step size that takes a scan in one step
_R = TypeVar("_R")


def all_steps(steps: Iterator[_R | None]) -> _R:
    """The result of a scan made in steps (``*_steps``), every step taken at once."""
    for result in steps:
        if result is not None:
            return result
    raise AssertionError("a scan in steps ends with its result")  # pragma: no cover


def _scan_produce(buf: Buffer, pos: int, version: int, step: int) -> Iterator[ProduceScan | None]:
    flexible = version >= 9
    size = len(buf)
    if version >= 3:  # transactional id
        pos = _skip_string(buf, pos, flexible)
    acks = _INT16.unpack_from(buf, pos)[0]
    pos += 2 + 4  # acks, timeout
    topics: list[tuple[str | bytes, tuple[int, ...]]] = []
    batches = records = 0
    # Distinct producer ids in order (a dict: a frame may hold a million batches of as many ids).
    pids: dict[int, None] = {}
    in_step = 0  # partitions and batches read since the last pause
    n_topics, pos = _array_len(buf, pos, flexible)
    for _ in range(n_topics):
        topic, pos = _produce_topic(buf, pos, version, flexible)
        indexes = []
        n_parts, pos = _array_len(buf, pos, flexible)
        for _ in range(n_parts):
            if in_step >= step:  # a pause only between two partitions or batches
                yield None
                in_step = 0
            in_step += 1
            indexes.append(_INT32.unpack_from(buf, pos)[0])
            pos += 4
            n, pos = _bytes_len(buf, pos, flexible)
            end = pos + n
            if end > size:
                raise RecordsError(f"record set of {n} bytes at {pos} runs past the request")
            while pos < end:
                if in_step >= step:
                    yield None
                    in_step = 0
                in_step += 1
                if end - pos < V2_HEADER_BYTES or buf[pos + 16] != 2:  # legacy or short: the slow path
                    tally = [batches, records, in_step]
                    yield from counted_batches(buf, pos, end, step, tally)
                    batches, records, in_step = tally
                    break
                length = _INT32.unpack_from(buf, pos + 8)[0]
                nxt = pos + LOG_OVERHEAD + length
                if length < V2_HEADER_BYTES - LOG_OVERHEAD or nxt > end:
                    list(batch_headers(buf, pos, end))  # raises with the reason
                pid, _epoch, _seq, count = _V2_PRODUCER.unpack_from(buf, pos + 43)
                if count < 0:
                    raise RecordsError(f"batch at {pos}: negative record count {count}")
                batches += 1
                records += count
                if pid >= 0:
                    pids[pid] = None
                pos = nxt
            pos = max(pos, end)  # a null record set (n = -1) ends where it began
            if flexible:
                pos = skip_tagged_fields(buf, pos)
        if flexible:
            pos = skip_tagged_fields(buf, pos)
        topics.append((topic, tuple(indexes)))
    if flexible:
        pos = skip_tagged_fields(buf, pos)
    if pos != size:
        raise RecordsError(f"ProduceRequest body ends at {pos}, frame has {size} bytes")
    yield ProduceScan(acks, tuple(topics), batches, records, tuple(pids))


def _produce_topic(buf: Buffer, pos: int, version: int, flexible: bool) -> tuple[str | bytes, int]:
    """A Produce topic's key (its name, or its 16-byte id from v13 on) and where it ends."""
    if version >= 13:
        return bytes(buf[pos : pos + 16]), pos + 16
    n, pos = _string_len(buf, pos, flexible)
    if n < 0 or pos + n > len(buf):
        raise RecordsError(f"topic name of length {n} at {pos}")
    return bytes(buf[pos : pos + n]).decode("utf-8", "replace"), pos + n


def counted_batches(buf: Buffer, pos: int, end: int, step: int, tally: list[int],
                    fetched: bool = False) -> Iterator[None]:
    """Adds a record set's batches and records to ``tally`` ([batches, records, entries since the
    last pause]), pausing every ``step`` entries; ``fetched``: as a consumer is handed them (a
    batch cut short at the end dropped, control batches not counted)."""
    for b in batch_headers(buf, pos, end, partial_tail=fetched):
        if tally[2] >= step:
            yield None
            tally[2] = 0
        tally[2] += 1
        if not (fetched and b.is_control):
            tally[0] += 1
            tally[1] += b.record_count


class FetchRecords(NamedTuple):
    """Complete batches and data records in a FetchResponse (control batches not counted)."""

    batches: int
    records: int


def count_fetch_records(body: Buffer, api_version: int) -> FetchRecords:
    """Counts what a FetchResponse body (v0 to v18) delivers to the consumer.

    A batch cut short at the end of a partition's records is not counted: the consumer drops it.
    """
    return all_steps(count_fetch_steps(body, api_version, ALL_ENTRIES))


def count_fetch_steps(body: Buffer, api_version: int, entries_per_step: int) -> Iterator[FetchRecords | None]:
    """:func:`count_fetch_records` in steps: yields None after every ``entries_per_step``
    partitions and batches (a pause only when more follow), then the count. The same result
    and the same errors, raised by the step that meets them; ``body`` must not change meanwhile."""
    try:
        yield from _count_fetch(body, api_version, entries_per_step)
    except RecordsError:
        raise
    except (HeaderError, IndexError, StructError, ValueError) as exc:
        raise RecordsError(f"malformed FetchResponse v{api_version}: {exc}") from exc


def _count_fetch(buf: Buffer, version: int, step: int) -> Iterator[FetchRecords | None]:
    flexible = version >= 12
    size = len(buf)
    pos = 0
    if version >= 1:
        pos += 4  # throttle time
    if version >= 7:
        pos += 2 + 4  # error code, session id
    batches = records = 0
    in_step = 0  # partitions and batches read since the last pause
    n_topics, pos = _array_len(buf, pos, flexible)
    for _ in range(n_topics):
        if version >= 13:
            pos += 16  # topic id
        else:
            pos = _skip_string(buf, pos, flexible)
        n_parts, pos = _array_len(buf, pos, flexible)
        for _ in range(n_parts):
            if in_step >= step:  # a pause only between two partitions or batches
                yield None
                in_step = 0
            in_step += 1
            pos = _skip_fetch_partition_head(buf, pos, version, flexible)
            n, pos = _bytes_len(buf, pos, flexible)
            if n > 0:
                end = pos + n
                if end > size:
                    raise RecordsError(f"record set of {n} bytes at {pos} runs past the response")
                tally = [batches, records, in_step]
                yield from counted_batches(buf, pos, end, step, tally, fetched=True)
                batches, records, in_step = tally
                pos = end
            if flexible:
                pos = skip_tagged_fields(buf, pos)
        if flexible:
            pos = skip_tagged_fields(buf, pos)
    if flexible:
        pos = skip_tagged_fields(buf, pos)
    if pos != size:
        raise RecordsError(f"FetchResponse body ends at {pos}, frame has {size} bytes")
    yield FetchRecords(batches, records)


def _skip_fetch_partition_head(buf: Buffer, pos: int, version: int, flexible: bool) -> int:
    """Where a FetchResponse partition's records length starts."""
    pos += 4 + 2 + 8  # partition index, error code, high watermark
    if version >= 4:
        pos += 8  # last stable offset
    if version >= 5:
        pos += 8  # log start offset
    if version >= 4:
        n_aborted, pos = _array_len(buf, pos, flexible)
        for _ in range(n_aborted):
            pos += 16  # producer id, first offset
            if flexible:
                pos = skip_tagged_fields(buf, pos)
    if version >= 11:
        pos += 4  # preferred read replica
    return pos


def _array_len(buf: Buffer, pos: int, flexible: bool) -> tuple[int, int]:
    if flexible:
        n, pos = read_uvarint(buf, pos)
        n -= 1
    else:
        n = _INT32.unpack_from(buf, pos)[0]
        pos += 4
    # A null array (-1) has no entries; a count beyond the bytes left is malformed.
    if n > len(buf) - pos:
        raise RecordsError(f"array of {n} entries at {pos} is longer than the body")
    return max(n, 0), pos


def _string_len(buf: Buffer, pos: int, flexible: bool) -> tuple[int, int]:
    if flexible:
        n, pos = read_uvarint(buf, pos)
        return n - 1, pos
    return _INT16.unpack_from(buf, pos)[0], pos + 2


def _bytes_len(buf: Buffer, pos: int, flexible: bool) -> tuple[int, int]:
    if flexible:
        n, pos = read_uvarint(buf, pos)
        return n - 1, pos
    return _INT32.unpack_from(buf, pos)[0], pos + 4


def _skip_string(buf: Buffer, pos: int, flexible: bool) -> int:
    n, pos = _string_len(buf, pos, flexible)
    pos += max(n, 0)
    if pos > len(buf):
        raise RecordsError("string runs past the body")
    return pos
