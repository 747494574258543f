"""scan_produce_response / scan_fetch_response against bodies kafka-python encodes."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kafka.protocol.consumer import FetchResponse
from kafka.protocol.producer import ProduceResponse

from protocol.messages import encode_body
from protocol.scan import ScanError, scan_fetch_head, scan_fetch_response, scan_fetch_tail, scan_produce_response
from tests.support.kafka_messages import TOPIC_ID, make

PRODUCE_VERSIONS = range(9, ProduceResponse.max_version + 1)
FETCH_VERSIONS = range(12, FetchResponse.max_version + 1)
THROTTLE_MS = 0x0102_0304  # distinctive: found only where the field is


def produce_body(v, *, errors_by_topic=((0, 6), (0,)), endpoints=True, throttle=THROTTLE_MS) -> bytes:
    R = ProduceResponse
    T = R.TopicProduceResponse
    P = T.PartitionProduceResponse
    bad_record = make(P.BatchIndexAndErrorMessage, v, batch_index=2, batch_index_error_message="bad record")
    topics = []
    for t, codes in enumerate(errors_by_topic):
        parts = []
        for i, code in enumerate(codes):
            moved = code in (6, 74)
            parts.append(
                make(
                    P,
                    v,
                    index=i,
                    error_code=code,
                    base_offset=-1 if code else 100 * i,
                    log_append_time_ms=-1,
                    log_start_offset=0,
                    record_errors=[bad_record] if code == 87 else [],
                    error_message="moved" if moved else None,
                    current_leader=make(P.LeaderIdAndEpoch, v, leader_id=3, leader_epoch=4) if moved else None,
                )
            )
        topics.append(make(T, v, name=f"topic-{t}", topic_id=TOPIC_ID, partition_responses=parts))
    node_endpoints = [make(R.NodeEndpoint, v, node_id=3, host="b3.internal", port=9094, rack=None)]
    node_endpoints = node_endpoints if endpoints else []
    return encode_body(make(R, v, responses=topics, throttle_time_ms=throttle, node_endpoints=node_endpoints))


def fetch_body(v, *, errors_by_topic=((0, 74), (0,)), endpoints=True, throttle=THROTTLE_MS) -> bytes:
    R = FetchResponse
    T = R.FetchableTopicResponse
    P = T.PartitionData
    aborted = make(P.AbortedTransaction, v, producer_id=7, first_offset=1)
    topics = []
    for t, codes in enumerate(errors_by_topic):
        parts = []
        for i, code in enumerate(codes):
            moved = code in (6, 74)
            parts.append(
                make(
                    P,
                    v,
                    partition_index=i,
                    error_code=code,
                    high_watermark=10,
                    last_stable_offset=10,
                    log_start_offset=0,
                    aborted_transactions=None if moved else [aborted],
                    preferred_read_replica=-1,
                    records=None if moved else b"\xab" * (50 + i),
                    diverging_epoch=make(P.EpochEndOffset, v, epoch=1, end_offset=5) if i == 0 else None,
                    current_leader=make(P.LeaderIdAndEpoch, v, leader_id=3, leader_epoch=4) if moved else None,
                )
            )
        topics.append(make(T, v, topic=f"topic-{t}", topic_id=TOPIC_ID, partitions=parts))
    node_endpoints = [make(R.NodeEndpoint, v, node_id=3, host="b3.internal", port=9094, rack="r")]
    node_endpoints = node_endpoints if endpoints else []
    return encode_body(
        make(R, v, throttle_time_ms=throttle, error_code=0, session_id=9, responses=topics,
             node_endpoints=node_endpoints)
    )


def _throttle_at(body: bytes, offset: int) -> int:
    return struct.unpack_from(">i", body, offset)[0]


# --- Produce ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", PRODUCE_VERSIONS)
@pytest.mark.parametrize("endpoints", [True, False], ids=["endpoints", "no-endpoints"])
def test_produce_scan(version, endpoints):
    body = produce_body(version, errors_by_topic=((0, 6), (0, 87, 74)), endpoints=endpoints)
    scan = scan_produce_response(body, version)
    assert _throttle_at(body, scan.throttle_offset) == THROTTLE_MS
    assert scan.error_codes == {0, 6, 87, 74}
    # NodeEndpoints is the only top-level tagged field, and exists from v10 (KIP-951).
    assert (scan.node_endpoints > 0) is (endpoints and version >= 10)


@pytest.mark.parametrize("version", PRODUCE_VERSIONS)
def test_produce_scan_no_topics(version):
    body = produce_body(version, errors_by_topic=(), endpoints=False, throttle=0)
    scan = scan_produce_response(body, version)
    assert scan.throttle_offset == 1  # right after the empty compact array
    assert scan.error_codes == frozenset()
    assert scan.node_endpoints == 0


@pytest.mark.parametrize("version", PRODUCE_VERSIONS)
def test_produce_scan_from_memoryview(version):
    frame = b"\x00\x00\x00\x01\x00" + produce_body(version)
    scan = scan_produce_response(memoryview(frame)[5:], version)
    assert _throttle_at(frame, 5 + scan.throttle_offset) == THROTTLE_MS


@pytest.mark.parametrize("version", [0, 3, 8])
def test_produce_scan_refuses_non_flexible_versions(version):
    with pytest.raises(ScanError):
        scan_produce_response(b"\x00" * 64, version)


# --- Fetch --------------------------------------------------------------------------------


@pytest.mark.parametrize("version", FETCH_VERSIONS)
@pytest.mark.parametrize("endpoints", [True, False], ids=["endpoints", "no-endpoints"])
def test_fetch_scan(version, endpoints):
    body = fetch_body(version, errors_by_topic=((0, 74), (6, 0, 1)), endpoints=endpoints)
    scan = scan_fetch_response(body, version)
    assert scan.throttle_offset == 0
    assert _throttle_at(body, scan.throttle_offset) == THROTTLE_MS
    assert scan.error_codes == {0, 74, 6, 1}
    assert (scan.node_endpoints > 0) is (endpoints and version >= 16)


@pytest.mark.parametrize("scanner, build, version", [
    (scan_produce_response, produce_body, 10), (scan_produce_response, produce_body, 13),
    (scan_fetch_response, fetch_body, 16), (scan_fetch_response, fetch_body, 18),
])
def test_empty_node_endpoints_tag_needs_no_rewrite(scanner, build, version):
    # Tansu sends NodeEndpoints as tag 0 holding an empty array on every response.
    body = build(version, endpoints=False)
    assert body.endswith(b"\x00")
    scan = scanner(body[:-1] + b"\x01\x00\x01\x01", version)
    assert scan.node_endpoints == 0
    assert scanner(build(version, endpoints=True), version).node_endpoints == 1


@pytest.mark.parametrize("version", FETCH_VERSIONS)
def test_fetch_scan_no_topics(version):
    body = fetch_body(version, errors_by_topic=(), endpoints=False)
    scan = scan_fetch_response(body, version)
    assert scan.error_codes == frozenset()
    assert scan.node_endpoints == 0


@pytest.mark.parametrize("version", [4, 11])
def test_fetch_scan_refuses_non_flexible_versions(version):
    with pytest.raises(ScanError):
        scan_fetch_response(b"\x00" * 64, version)


# --- malformed bodies ---------------------------------------------------------------------

SCANNERS = [
    pytest.param(scan_produce_response, produce_body, v, id=f"Produce-v{v}") for v in PRODUCE_VERSIONS
] + [pytest.param(scan_fetch_response, fetch_body, v, id=f"Fetch-v{v}") for v in FETCH_VERSIONS]





@pytest.mark.parametrize("scanner, build, version", SCANNERS)
def test_every_truncation_without_endpoints_raises_scan_error(scanner, build, version):
    body = build(version, endpoints=False)
    for cut in range(len(body)):
        with pytest.raises(ScanError):
            scanner(body[:cut], version)


@pytest.mark.parametrize("scanner, build, version", SCANNERS)
def test_every_truncation_with_endpoints_raises_scan_error(scanner, build, version):
    body = build(version, endpoints=True)
    passed = []
    for cut in range(len(body)):
        try:
            scanner(body[:cut], version)
        except ScanError:
            continue
        passed.append(cut)
    assert passed == [], f"{len(body)}-byte body scanned without error when cut to {passed}"


@pytest.mark.parametrize("scanner, build, version", SCANNERS)
@pytest.mark.parametrize("garbage", [b"\x00", b"\x01\x02\x03", b"\xff" * 9])
def test_trailing_garbage_without_endpoints_raises_scan_error(scanner, build, version, garbage):
    with pytest.raises(ScanError):
        scanner(build(version, endpoints=False) + garbage, version)


@pytest.mark.parametrize("scanner, build, version", SCANNERS)
def test_trailing_garbage_with_endpoints_raises_scan_error(scanner, build, version):
    with pytest.raises(ScanError):
        scanner(build(version, endpoints=True) + b"\x00\x01\x02", version)


@pytest.mark.parametrize("scanner, build, version", SCANNERS)
def test_empty_body_raises_scan_error(scanner, build, version):
    with pytest.raises(ScanError):
        scanner(b"", version)


def test_huge_counts_raise_scan_error_quickly():
    # A topic count of 2^32 must end at the first read past the body, not loop.
    huge = b"\xff\xff\xff\xff\x0f"
    with pytest.raises(ScanError):
        scan_produce_response(huge + b"\x00" * 8, 9)
    with pytest.raises(ScanError):
        scan_fetch_response(b"\x00" * 10 + huge + b"\x00" * 8, 12)


# --- Hypothesis: nothing but ScanError, whatever the bytes --------------------------------

_bodies = st.sampled_from(
    [(scan_produce_response, v, produce_body(v)) for v in PRODUCE_VERSIONS]
    + [(scan_produce_response, v, produce_body(v, endpoints=False)) for v in PRODUCE_VERSIONS]
    + [(scan_fetch_response, v, fetch_body(v)) for v in FETCH_VERSIONS]
    + [(scan_fetch_response, v, fetch_body(v, endpoints=False)) for v in FETCH_VERSIONS]
)


def _scan_or_scan_error(scanner, body, version):
    try:
        scan = scanner(body, version)
    except ScanError:
        return None
    assert 0 <= scan.throttle_offset <= len(body) - 4
    return scan


@settings(max_examples=400, deadline=None)
@given(case=_bodies, data=st.data())
def test_random_truncation_only_raises_scan_error(case, data):
    scanner, version, body = case
    cut = data.draw(st.integers(0, len(body)))
    _scan_or_scan_error(scanner, body[:cut], version)


@settings(max_examples=400, deadline=None)
@given(case=_bodies, data=st.data())
def test_random_corruption_only_raises_scan_error(case, data):
    scanner, version, body = case
    mutated = bytearray(body)
    for _ in range(data.draw(st.integers(1, 4))):
        mutated[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(mutated)))
    tail = data.draw(st.binary(max_size=8))
    _scan_or_scan_error(scanner, bytes(mutated[:cut]) + tail, version)


@settings(max_examples=400, deadline=None)
@given(version=st.sampled_from(list(FETCH_VERSIONS)), body=st.binary(max_size=80))
def test_random_bytes_only_raise_scan_error(version, body):
    _scan_or_scan_error(scan_fetch_response, body, version)
    _scan_or_scan_error(scan_produce_response, body, min(version, ProduceResponse.max_version))


# --- Fetch, first part only (a response streamed through the filters) ----------------------


@pytest.mark.parametrize("version", FETCH_VERSIONS)
@pytest.mark.parametrize("errors_by_topic", [((0,),), ((0, 74), (0,)), ((3,), (0, 0))], ids=["one", "moved", "three"])
@pytest.mark.parametrize("endpoints", [True, False], ids=["endpoints", "no-endpoints"])
def test_fetch_head_agrees_with_the_whole_scan_on_every_first_part(version, errors_by_topic, endpoints):
    body = fetch_body(version, errors_by_topic=errors_by_topic, endpoints=endpoints)
    whole = scan_fetch_response(body, version)
    head = scan_fetch_head(memoryview(body), version)
    assert head.error_codes == whole.error_codes
    # Only tagged fields follow the last partition's records, NodeEndpoints among them.
    assert scan_fetch_tail(body[head.tail_offset:]) == whole.node_endpoints
    records_length_at = head.tail_offset - (50 + len(errors_by_topic[-1]) - 1) - 1
    for cut in range(len(body)):
        part = scan_fetch_head(memoryview(body)[:cut], version)
        # Known once the last partition's records length is in; never wrong before.
        assert part == (head if cut > records_length_at else None), cut


@pytest.mark.parametrize("version", FETCH_VERSIONS)
def test_fetch_head_of_a_response_without_partitions_is_none(version):
    assert scan_fetch_head(fetch_body(version, errors_by_topic=(), endpoints=False), version) is None
    assert scan_fetch_head(fetch_body(version, errors_by_topic=((),), endpoints=False), version) is None


def test_a_fetch_tail_that_does_not_end_the_body_is_malformed():
    with pytest.raises(ScanError):
        scan_fetch_tail(b"\x00\x00\x00\x00")  # a byte after the top-level tagged fields
    with pytest.raises(ScanError):
        scan_fetch_tail(b"\x00\x00")  # no top-level tagged fields
