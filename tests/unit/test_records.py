"""The record-batch header scanner against batches built by kafka-python's own record builder,
in every ProduceRequest and FetchResponse version kafka-python has, whole and truncated."""

from __future__ import annotations

import struct
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kafka.protocol.consumer.fetch import FetchResponse
from kafka.protocol.producer import ProduceRequest
from kafka.record import MemoryRecordsBuilder

from protocol.headers import parse_request_header, response_body_offset
from protocol.records import (
    RecordsError,
    batch_headers,
    count_fetch_records,
    count_fetch_steps,
    scan_produce_request,
    scan_produce_steps,
)
from tests.support.kafka_messages import make
from tests.support.steps import one_piece, run_steps

# kafka-python builds gzip without extra packages; the golden frames cover the other codecs.
NONE, GZIP = 0, 1


def batch(records: int, *, magic: int = 2, codec: int = NONE, pid: int = -1, epoch: int = -1, seq: int = -1,
          transactional: bool = False, offset: int = 0) -> bytes:
    b = MemoryRecordsBuilder(magic, codec, 1 << 20, offset=offset, transactional=transactional,
                             producer_id=pid, producer_epoch=epoch, base_sequence=seq)
    for i in range(records):
        b.append(timestamp=1_700_000_000_000 + i, key=b"key-%d" % i, value=b"value-%d" % i * 3, headers=[])
    b.close()
    return bytes(b.buffer())


def produce_frame(version: int, partitions: dict[str, dict[int, bytes | None]], acks: int = -1,
                  txn: str | None = None) -> bytes:
    T = ProduceRequest[version].TopicProduceData
    topics = []
    for name, parts in partitions.items():
        t = T(partition_data=[T.PartitionProduceData(index=i, records=r) for i, r in parts.items()])
        if version >= 13:
            t.topic_id = uuid.uuid5(uuid.NAMESPACE_DNS, name)
        else:
            t.name = name
        topics.append(t)
    req = ProduceRequest[version](transactional_id=txn, acks=acks, timeout_ms=100, topic_data=topics)
    req.with_header(correlation_id=9, client_id="golden")
    return bytes(req.encode(header=True))


def scan(frame: bytes, version: int):
    return scan_produce_request(frame, parse_request_header(frame).body_offset, version)


@pytest.mark.parametrize("version", range(3, ProduceRequest.max_version + 1))
@pytest.mark.parametrize("codec", [NONE, GZIP])
def test_produce_request_batches_counted_and_producer_ids_found(version, codec):
    frame = produce_frame(version, {
        "orders": {0: batch(5, codec=codec, pid=4001, epoch=2, seq=10),
                   3: batch(2, codec=codec, pid=4001, epoch=2, seq=0)},
        "audit": {1: batch(7, codec=codec, pid=99, epoch=0, seq=0, transactional=True), 2: None},
    }, acks=1, txn="txn-é" if version >= 3 else None)
    s = scan(frame, version)
    assert s.acks == 1
    assert s.batches == 3
    assert s.records == 14
    assert s.producer_ids == (4001, 99)
    assert [i for _, i in s.topics] == [(0, 3), (1, 2)]
    if version < 13:
        assert [t for t, _ in s.topics] == ["orders", "audit"]
    else:
        assert s.topics[0][0] == uuid.uuid5(uuid.NAMESPACE_DNS, "orders").bytes


@pytest.mark.parametrize("version", range(0, 3))
@pytest.mark.parametrize("magic,codec", [(0, NONE), (1, NONE), (1, GZIP)])
def test_legacy_message_sets_carry_no_producer_id(version, magic, codec):
    frame = produce_frame(version, {"t": {0: batch(4, magic=magic, codec=codec)}}, acks=0)
    s = scan(frame, version)
    assert s.acks == 0
    assert s.producer_ids == ()
    # An uncompressed legacy set is one message per record; a compressed one is one wrapper.
    assert s.records == (4 if codec == NONE else 1)
    assert s.batches == s.records


def test_not_idempotent_batches_have_no_producer_id():
    s = scan(produce_frame(9, {"t": {0: batch(3)}}), 9)
    assert (s.batches, s.records, s.producer_ids) == (1, 3, ())


def test_several_batches_in_one_record_set_are_all_walked():
    records = (batch(2, pid=1, epoch=0, seq=0) + batch(3, pid=2, epoch=0, seq=0, offset=2)
               + batch(1, pid=1, epoch=0, seq=2, offset=5))
    s = scan(produce_frame(11, {"t": {0: records}}), 11)
    assert (s.batches, s.records, s.producer_ids) == (3, 6, (1, 2))
    headers = list(batch_headers(records))
    assert [h.position for h in headers] == [0, len(batch(2, pid=1, epoch=0, seq=0)),
                                             len(records) - len(batch(1, pid=1, epoch=0, seq=2))]
    assert [h.base_sequence for h in headers] == [0, 0, 2]
    assert all(h.magic == 2 and h.compression == NONE for h in headers)


@pytest.mark.parametrize("version", [3, 8, 9, 11])
def test_every_truncation_of_a_produce_request_is_reported_not_crashed(version):
    frame = produce_frame(version, {"t": {0: batch(3, pid=5, epoch=0, seq=0)}, "u": {1: batch(2, codec=GZIP)}})
    body_offset = parse_request_header(frame).body_offset
    for cut in range(body_offset, len(frame)):
        with pytest.raises(RecordsError):
            scan_produce_request(frame[:cut], body_offset, version)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.sampled_from([3, 9, 11]))
def test_garbage_bodies_raise_records_error_only(garbage, version):
    header = produce_frame(version, {})
    body_offset = parse_request_header(header).body_offset
    try:
        scan_produce_request(header[:body_offset] + garbage, body_offset, version)
    except RecordsError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 200), st.integers(0, 255))
def test_a_corrupted_byte_in_a_record_set_never_escapes_as_another_error(pos, value):
    records = bytearray(batch(3, pid=5, epoch=0, seq=0) + batch(2, magic=2, offset=3))
    records[pos % len(records)] = value
    try:
        list(batch_headers(bytes(records)))
    except RecordsError:
        pass


def test_unknown_magic_and_short_lengths_are_named():
    good = bytearray(batch(1, pid=3, epoch=0, seq=0))
    bad_magic = bytearray(good)
    bad_magic[16] = 7
    with pytest.raises(RecordsError, match="unknown magic 7"):
        list(batch_headers(bytes(bad_magic)))
    short = bytearray(good)
    short[8:12] = (20).to_bytes(4, "big")
    with pytest.raises(RecordsError, match="shorter than its header"):
        list(batch_headers(bytes(short)))
    with pytest.raises(RecordsError, match="runs past"):
        list(batch_headers(bytes(good[:-1])))


def fetch_frame(version: int, records: bytes | None) -> bytes:
    R = FetchResponse
    T = R.FetchableTopicResponse
    P = T.PartitionData
    part = make(P, version, partition_index=0, error_code=0, high_watermark=50, last_stable_offset=48,
                log_start_offset=0,
                aborted_transactions=[make(P.AbortedTransaction, version, producer_id=4, first_offset=1)],
                preferred_read_replica=-1, records=records)
    empty = make(P, version, partition_index=1, error_code=0, high_watermark=0, last_stable_offset=0,
                 log_start_offset=0, aborted_transactions=None, preferred_read_replica=-1, records=None)
    resp = make(R, version, throttle_time_ms=0, error_code=0, session_id=0,
                responses=[make(T, version, topic="orders", topic_id=uuid.uuid4(), partitions=[part, empty])],
                node_endpoints=[])
    resp.with_header(correlation_id=5)
    return bytes(resp.encode(header=True))


@pytest.mark.parametrize("version", range(0, FetchResponse.max_version + 1))
def test_fetch_response_records_counted_and_partial_tail_dropped(version):
    magic = 2 if version >= 4 else 1
    full = batch(4, magic=magic, pid=8 if magic == 2 else -1, epoch=0, seq=0) + batch(3, magic=magic, offset=4)
    partial = full + batch(5, magic=magic, offset=7)[:-9]
    # Magic 2: the cut batch is dropped whole. Legacy: each message stands alone, so the four
    # complete messages of the cut set still count.
    cases = ((full, (2, 7) if magic == 2 else (7, 7)), (partial, (2, 7) if magic == 2 else (11, 11)), (None, (0, 0)))
    for records, expected in cases:
        frame = fetch_frame(version, records)
        body = memoryview(frame)[response_body_offset(frame, 1, version):]
        assert tuple(count_fetch_records(body, version)) == expected


def test_control_batches_are_not_counted_as_records():
    control = bytearray(batch(1, pid=9, epoch=0, seq=2, transactional=True))
    attributes = int.from_bytes(control[21:23], "big") | 0x20
    control[21:23] = attributes.to_bytes(2, "big")
    frame = fetch_frame(12, batch(2, pid=9, epoch=0, seq=0, transactional=True) + bytes(control))
    body = memoryview(frame)[response_body_offset(frame, 1, 12):]
    assert tuple(count_fetch_records(body, 12)) == (1, 2)


@pytest.mark.parametrize("version", [4, 11, 12, 16])
def test_every_truncation_of_a_fetch_response_is_reported(version):
    frame = fetch_frame(version, batch(3, pid=5, epoch=0, seq=0))
    offset = response_body_offset(frame, 1, version)
    for cut in range(offset, len(frame)):
        with pytest.raises(RecordsError):
            count_fetch_records(memoryview(frame)[offset:cut], version)


def _steps(frame: bytes, version: int, step: int) -> tuple[int, object]:
    """(how many steps yielded None, the scan or the RecordsError's message) of scan_produce_steps."""
    return run_steps(scan_produce_steps(frame, parse_request_header(frame).body_offset, version, step))


@settings(max_examples=100, deadline=None)
@given(topics=st.lists(st.lists(st.sampled_from([None, b"", 1, 2]), min_size=0, max_size=7), max_size=4),
       version=st.sampled_from([3, 8, 9, 13]), step=st.integers(1, 9), cut=st.integers(0, 40))
def test_a_scan_in_steps_gives_the_one_piece_scan_and_errors(topics, version, step, cut):
    """A pause every ``step`` partitions and batches, nothing else changes: the same scan, or
    the same error for the same truncated frame."""
    parts = {f"t{i}": {j: (batch(r, pid=10 + j, epoch=0, seq=0) if isinstance(r, int) else r)
                       for j, r in enumerate(t)} for i, t in enumerate(topics)}
    frame = produce_frame(version, parts)
    entries = sum(len(t) for t in topics) + sum(isinstance(r, int) for t in topics for r in t)  # partitions, batches
    for data in (frame, frame[: max(len(frame) - cut, parse_request_header(frame).body_offset)]):
        whole = one_piece(scan, data, version)
        pauses, stepped = _steps(data, version, step)
        assert stepped == whole
        if not isinstance(whole, str):
            assert pauses == (entries - 1) // step if entries else pauses == 0


def test_distinct_producer_ids_of_many_batches_are_found_in_linear_time():
    """A frame of many batches, each of its own producer id (no quadratic membership test)."""
    one = batch(1, pid=0, epoch=0, seq=0)
    pid_at = 43  # the producer id's offset in a v2 batch header
    records = b"".join(one[:pid_at] + struct.pack(">q", pid) + one[pid_at + 8:] for pid in range(20_000))
    s = scan(produce_frame(9, {"t": {0: records}}), 9)
    assert s.batches == 20_000 and s.producer_ids == tuple(range(20_000))


def test_a_scan_in_steps_pauses_inside_one_partition_of_many_batches():
    """One partition may hold as many batches as a frame can: the steps count batches too."""
    records = b"".join(batch(1, offset=i) for i in range(50))
    pauses, result = _steps(produce_frame(9, {"t": {0: records}}), 9, 10)
    assert pauses == (1 + 50 - 1) // 10 and result.batches == 50
    legacy = b"".join(batch(1, magic=1, offset=i) for i in range(50))
    pauses, result = _steps(produce_frame(2, {"t": {0: legacy}}), 2, 10)
    assert pauses >= 5 and result.batches == 50


@pytest.mark.parametrize("version", [4, 11, 12, 16])
@pytest.mark.parametrize("step", [1, 2, 3])
def test_a_fetch_count_in_steps_gives_the_one_piece_count_and_errors(version, step):
    records = batch(2, offset=0) + batch(3, offset=2) + batch(1, offset=5)
    frame = fetch_frame(version, records)
    body = memoryview(frame)[response_body_offset(frame, 1, version):]
    for cut in range(0, len(body), 7):
        data = body[: len(body) - cut]
        whole = one_piece(count_fetch_records, data, version)
        pauses, stepped = run_steps(count_fetch_steps(data, version, step))
        assert stepped == whole
        if cut == 0:
            assert pauses == (2 + 3 - 1) // step  # two partitions, three batches


def _uvarint_bytes(value: int) -> bytes:
    out = bytearray()
    while True:
        if value < 0x80:
            out.append(value)
            return bytes(out)
        out.append(value & 0x7F | 0x80)
        value >>= 7


@given(st.integers(min_value=0, max_value=2**28 - 1), st.binary(max_size=3), st.integers(min_value=0, max_value=6))
def test_the_inline_varint_reads_what_read_uvarint_reads(value, before, cut):
    """Varints read with their first three bytes inline (protocol.headers.read_uvarint, which
    the scans' lengths use) give the value and next position of the encoding, and fail with a
    HeaderError on one cut short, wherever the cut falls."""
    from protocol.headers import HeaderError, read_uvarint

    encoded = _uvarint_bytes(value)
    buf = memoryview(before + encoded)
    assert read_uvarint(buf, len(before)) == (value, len(buf))
    if cut < len(encoded):
        short = memoryview(before + encoded[:cut])
        with pytest.raises(HeaderError):
            read_uvarint(short, len(before))
