"""ShareFetch and ShareAcknowledge responses (KIP-932), v0 to v2: golden bodies written field by
field from Kafka's message definitions (ShareFetchResponse.json, ShareAcknowledgeResponse.json:
v0 as Kafka 4.0 shipped it; v1 adds AcquisitionLockTimeoutMs to ShareFetchResponse, as Kafka
4.1+ and librdkafka 2.16 read it; v2, Kafka 4.2, adds it to ShareAcknowledgeResponse too,
KIP-1222, and leaves ShareFetchResponse as v1), without kafka-python's encoder.

They decode to the fields written and encode back to the same bytes; the scanners read their
error codes, NodeEndpoints and delivered records without decoding; the endpoint filter rewrites
NodeEndpoints to proxy addresses and leaves every other byte as it was; the leader-hint filter
learns a moved partition's CurrentLeader; every truncation and garbage are refused as a
ProtocolError, never anything else.
"""

from __future__ import annotations

import random
import struct
import uuid
from array import array
from types import SimpleNamespace

import pytest
from kafka.protocol.metadata import ApiVersionsResponse
from kafka.record import MemoryRecordsBuilder

from protocol import rewrite
from protocol.apis import API_FAMILIES, ApiKey
from protocol.errors import ProtocolError
from protocol.headers import encode_response_header
from protocol.messages import decode_response, encode_body
from protocol.records import FetchRecords
from protocol.share_scan import scan_share_acknowledge, scan_share_fetch, scan_share_fetch_steps, scan_share_response
from proxy.cluster.leaders import LeaderCache, PartitionLeader
from proxy.dataplane.filters.api_versions import default_caps
from proxy.dataplane.filters.endpoints import EndpointRewriteFilter
from proxy.dataplane.filters.leaders import LeaderHintFilter
from tests.support.filter_context import filter_context
from tests.support.steps import one_piece, run_steps

VERSIONS = (0, 1, 2)
TOPIC_ID = uuid.UUID("5f0c8d6e-1b2a-4c3d-9e8f-0a1b2c3d4e5f")
MOVED = 6  # NOT_LEADER_OR_FOLLOWER
LOCK_TIMEOUT_MS = 30_000


# -- the wire, field by field (Kafka's flexible encoding) ------------------------------------------

def uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def compact_string(s: str | None) -> bytes:
    if s is None:
        return b"\x00"
    data = s.encode()
    return uvarint(len(data) + 1) + data


def compact_bytes(b: bytes | None) -> bytes:
    return b"\x00" if b is None else uvarint(len(b) + 1) + b


def compact_array(items: list[bytes]) -> bytes:
    return uvarint(len(items) + 1) + b"".join(items)


NO_TAGS = b"\x00"


def int16(v: int) -> bytes:
    return struct.pack(">h", v)


def int32(v: int) -> bytes:
    return struct.pack(">i", v)


def int64(v: int) -> bytes:
    return struct.pack(">q", v)


def records(base_offset: int, count: int) -> bytes:
    builder = MemoryRecordsBuilder(2, 0, 1 << 20, offset=base_offset)
    for i in range(count):
        builder.append(timestamp=1_700_000_000_000 + i, key=None, value=b"v%d" % i, headers=[])
    builder.close()
    return bytes(builder.buffer())


def endpoints_field(endpoints) -> bytes:
    return compact_array([int32(node) + compact_string(host) + int32(port) + compact_string(rack) + NO_TAGS
                          for node, host, port, rack in endpoints])


def share_fetch_body(version: int, partitions, endpoints=(), error: int = 0) -> tuple[bytes, int]:
    """(body, where NodeEndpoints starts). ``partitions``: (index, error code, leader id, leader
    epoch, records or None, acquired ranges as (first, last, delivery count))."""
    head = int32(0) + int16(error) + compact_string(None)
    if version >= 1:
        head += int32(LOCK_TIMEOUT_MS)
    parts = []
    for index, code, leader, epoch, data, acquired in partitions:
        parts.append(int32(index) + int16(code) + compact_string(None) + int16(0) + compact_string(None)
                     + int32(leader) + int32(epoch) + NO_TAGS  # CurrentLeader, a struct with its own tags
                     + compact_bytes(data)
                     + compact_array([int64(f) + int64(last) + int16(n) + NO_TAGS for f, last, n in acquired])
                     + NO_TAGS)
    head += compact_array([TOPIC_ID.bytes + compact_array(parts) + NO_TAGS])
    return head + endpoints_field(endpoints) + NO_TAGS, len(head)


def share_acknowledge_body(version: int, partitions, endpoints=()) -> tuple[bytes, int]:
    """``partitions``: (index, error code, leader id, leader epoch)."""
    parts = [int32(index) + int16(code) + compact_string(None) + int32(leader) + int32(epoch) + NO_TAGS + NO_TAGS
             for index, code, leader, epoch in partitions]
    head = int32(0) + int16(0) + compact_string(None)
    if version >= 2:
        head += int32(LOCK_TIMEOUT_MS)  # KIP-1222: AcquisitionLockTimeoutMs, after the error message
    head += compact_array([TOPIC_ID.bytes + compact_array(parts) + NO_TAGS])
    return head + endpoints_field(endpoints) + NO_TAGS, len(head)


DATA = records(100, 3)
B3 = (3, "b3.internal", 9094, None)
OK_PARTITION = (0, 0, 1, 4, DATA, [(100, 101, 1)])  # 3 records sent, 2 acquired
MOVED_PARTITION = (1, MOVED, 3, 5, None, [])


# -- decoding ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("version", VERSIONS)
def test_share_fetch_golden_body_decodes_field_by_field_and_encodes_back(version):
    body, _ = share_fetch_body(version, [OK_PARTITION, MOVED_PARTITION], [B3])
    resp = decode_response(ApiKey.SHARE_FETCH, version, body)
    assert (resp.throttle_time_ms, resp.error_code, resp.error_message) == (0, 0, None)
    if version >= 1:
        assert resp.acquisition_lock_timeout_ms == LOCK_TIMEOUT_MS
    [topic] = resp.responses
    assert topic.topic_id == TOPIC_ID
    first, second = topic.partitions
    assert (first.partition_index, first.error_code, first.acknowledge_error_code) == (0, 0, 0)
    assert (first.current_leader.leader_id, first.current_leader.leader_epoch) == (1, 4)
    assert bytes(first.records) == DATA
    assert [(a.first_offset, a.last_offset, a.delivery_count) for a in first.acquired_records] == [(100, 101, 1)]
    assert (second.error_code, second.current_leader.leader_id, second.records) == (MOVED, 3, None)
    assert [(e.node_id, e.host, e.port, e.rack) for e in resp.node_endpoints] == [B3]
    assert encode_body(resp) == body


@pytest.mark.parametrize("version", VERSIONS)
def test_share_acknowledge_golden_body_decodes_field_by_field_and_encodes_back(version):
    body, _ = share_acknowledge_body(version, [(0, 0, 1, 4), (1, MOVED, 3, 5)], [B3])
    resp = decode_response(ApiKey.SHARE_ACKNOWLEDGE, version, body)
    assert (resp.throttle_time_ms, resp.error_code, resp.error_message) == (0, 0, None)
    if version >= 2:
        assert resp.acquisition_lock_timeout_ms == LOCK_TIMEOUT_MS
    [topic] = resp.responses
    assert topic.topic_id == TOPIC_ID
    assert [(p.partition_index, p.error_code, p.current_leader.leader_id, p.current_leader.leader_epoch)
            for p in topic.partitions] == [(0, 0, 1, 4), (1, MOVED, 3, 5)]
    assert [(e.node_id, e.host, e.port, e.rack) for e in resp.node_endpoints] == [B3]
    assert encode_body(resp) == body


# -- scanning ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("version", VERSIONS)
def test_the_scanner_reads_errors_endpoints_and_what_is_delivered(version):
    body, _ = share_fetch_body(version, [OK_PARTITION, MOVED_PARTITION], [B3])
    scanned = scan_share_fetch(body, version)
    assert scanned.scan.error_codes == {0, MOVED} and scanned.scan.node_endpoints == 1
    # Three records in the batch, two acquired: the consumer is handed two.
    assert scanned.delivered == FetchRecords(batches=1, records=2)
    quiet, _ = share_fetch_body(version, [OK_PARTITION])
    assert scan_share_response(quiet, version, ApiKey.SHARE_FETCH).node_endpoints == 0
    ack, _ = share_acknowledge_body(version, [(0, 0, 1, 4)])
    assert scan_share_acknowledge(ack, version).error_codes == {0}


@pytest.mark.parametrize("api_key", [ApiKey.SHARE_FETCH, ApiKey.SHARE_ACKNOWLEDGE])
@pytest.mark.parametrize("version", VERSIONS)
def test_every_truncation_and_garbage_is_a_protocol_error(api_key, version):
    if api_key == ApiKey.SHARE_FETCH:
        body, _ = share_fetch_body(version, [OK_PARTITION, MOVED_PARTITION], [B3])
    else:
        body, _ = share_acknowledge_body(version, [(0, 0, 1, 4), (1, MOVED, 3, 5)], [B3])
    for cut in range(len(body)):
        with pytest.raises(ProtocolError):
            scan_share_response(body[:cut], version, api_key)
    with pytest.raises(ProtocolError):
        scan_share_response(body + b"\x00", version, api_key)  # a byte past the end
    rng = random.Random(f"{api_key}-{version}")
    for _ in range(2000):
        garbage = bytearray(body)
        for _ in range(rng.randint(1, 4)):
            garbage[rng.randrange(len(garbage))] = rng.randrange(256)
        try:
            scan_share_response(bytes(garbage), version, api_key)
        except ProtocolError:
            pass  # anything else raised fails the test


# -- the filters ---------------------------------------------------------------------------------------

def _advertising_context():
    seen = []

    def advertise(node_id, host, port):
        seen.append((node_id, host, port))
        return "proxy.example", 19000 + node_id

    return SimpleNamespace(cluster=SimpleNamespace(advertise=advertise)), seen


@pytest.mark.parametrize("api_key", [ApiKey.SHARE_FETCH, ApiKey.SHARE_ACKNOWLEDGE])
@pytest.mark.parametrize("version", VERSIONS)
def test_node_endpoints_are_rewritten_and_every_other_byte_kept(api_key, version):
    if api_key == ApiKey.SHARE_FETCH:
        body, at = share_fetch_body(version, [OK_PARTITION, MOVED_PARTITION], [B3, (4, "b4.internal", 9095, "r1")])
    else:
        body, at = share_acknowledge_body(version, [(1, MOVED, 3, 5)], [B3, (4, "b4.internal", 9095, "r1")])
    header = encode_response_header(9, True)
    ctx, seen = _advertising_context()
    entry = SimpleNamespace(api_key=api_key, api_version=version, scan=None)
    out = bytes(EndpointRewriteFilter().on_response(ctx, entry, header + body))
    expected = endpoints_field([(3, "proxy.example", 19003, None), (4, "proxy.example", 19004, "r1")])
    assert out == header + body[:at] + expected + NO_TAGS
    assert seen == [(3, "b3.internal", 9094), (4, "b4.internal", 9095)]


@pytest.mark.parametrize("api_key", [ApiKey.SHARE_FETCH, ApiKey.SHARE_ACKNOWLEDGE])
@pytest.mark.parametrize("version", VERSIONS)
def test_a_response_without_endpoints_is_the_very_frame(api_key, version):
    body = (share_fetch_body(version, [OK_PARTITION])[0] if api_key == ApiKey.SHARE_FETCH
            else share_acknowledge_body(version, [(0, 0, 1, 4)])[0])
    frame = encode_response_header(9, True) + body
    ctx, seen = _advertising_context()
    entry = SimpleNamespace(api_key=api_key, api_version=version, scan=None)
    assert EndpointRewriteFilter().on_response(ctx, entry, frame) is frame and seen == []


@pytest.mark.parametrize("api_key", [ApiKey.SHARE_FETCH, ApiKey.SHARE_ACKNOWLEDGE])
@pytest.mark.parametrize("version", VERSIONS)
def test_a_moved_partitions_current_leader_is_learned(api_key, version):
    cache = LeaderCache()
    cache.observe_topic("orders", TOPIC_ID.bytes, array("i", [0, 0, 1, 4, 0, 1, 1, 4]), 1.0)
    if api_key == ApiKey.SHARE_FETCH:
        body, _ = share_fetch_body(version, [OK_PARTITION, MOVED_PARTITION], [B3])
    else:
        body, _ = share_acknowledge_body(version, [(0, 0, 1, 4), (1, MOVED, 3, 5)], [B3])
    frame = encode_response_header(9, True) + body
    ctx = filter_context(leaders=cache, node_id=1)
    entry = SimpleNamespace(api_key=api_key, api_version=version, scan=None)
    out = LeaderHintFilter(cache, refresher=None).on_response(ctx, entry, frame)
    assert out is frame  # the broker named the leader: nothing to fill in
    assert cache.leader("orders", 1) == PartitionLeader(3, 5)
    assert cache.leader("orders", 0) == PartitionLeader(1, 4)
    assert ctx.stats.leader_hints["broker"] == 1


@pytest.mark.parametrize("api_key", [ApiKey.SHARE_FETCH, ApiKey.SHARE_ACKNOWLEDGE])
def test_a_version_past_what_the_proxy_knows_is_refused_not_guessed(api_key):
    body = (share_fetch_body(2, [OK_PARTITION])[0] if api_key == ApiKey.SHARE_FETCH
            else share_acknowledge_body(2, [(0, 0, 1, 4)])[0])
    with pytest.raises(ProtocolError, match="not a version the proxy knows"):
        scan_share_response(body, 3, api_key)


def test_share_acknowledge_v2_has_four_more_bytes_where_v1_has_responses():
    """KIP-1222's AcquisitionLockTimeoutMs moves everything after the error message: a v1 body
    read as v2 (or the reverse) does not scan as the same response."""
    v1, _ = share_acknowledge_body(1, [(1, MOVED, 3, 5)], [B3])
    v2, _ = share_acknowledge_body(2, [(1, MOVED, 3, 5)], [B3])
    assert v2 == v1[:7] + int32(LOCK_TIMEOUT_MS) + v1[7:]  # throttle, error code, null message: 7 bytes
    assert scan_share_acknowledge(v2, 2) == scan_share_acknowledge(v1, 1)
    for body, version in ((v1, 2), (v2, 1)):
        with pytest.raises(ProtocolError):
            scan_share_acknowledge(body, version)


# -- what ApiVersions offers -----------------------------------------------------------------------------

def _listed(ranges: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    R = ApiVersionsResponse[3]
    resp = R(error_code=0, throttle_time_ms=0, api_keys=[R.ApiVersion(api_key=k, min_version=lo, max_version=hi)
                                                          for k, (lo, hi) in ranges.items()])
    rewrite.cap_api_versions(resp, default_caps(), API_FAMILIES)
    return {e.api_key: (e.min_version, e.max_version) for e in resp.api_keys}


def test_share_fetch_and_acknowledge_are_offered_up_to_v2_and_never_past_it():
    assert (default_caps()[ApiKey.SHARE_FETCH], default_caps()[ApiKey.SHARE_ACKNOWLEDGE]) == (2, 2)
    kafka_4_2 = {76: (1, 1), 77: (1, 1), 78: (1, 2), 79: (1, 2)}
    assert _listed(kafka_4_2) == kafka_4_2
    later = {76: (1, 1), 77: (1, 1), 78: (1, 3), 79: (2, 4)}  # a version past 2 is not guessed at
    assert _listed(later) == {76: (1, 1), 77: (1, 1), 78: (1, 2), 79: (2, 2)}
    only_v3 = {76: (1, 1), 77: (1, 1), 78: (1, 2), 79: (3, 3), 3: (0, 12)}  # hidden whole
    assert _listed(only_v3) == {3: (0, 12)}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("step", [1, 2, 3])
def test_a_share_fetch_scan_in_steps_gives_the_one_piece_scan_and_errors(version, step):
    body, _ = share_fetch_body(version, [OK_PARTITION, MOVED_PARTITION, OK_PARTITION], [B3])
    for cut in range(len(body), 0, -3):
        data = body[:cut]
        whole = one_piece(scan_share_fetch, data, version)
        pauses, stepped = run_steps(scan_share_fetch_steps(data, version, step))
        assert stepped == whole
        if cut == len(body):
            assert pauses == (3 + 2 - 1) // step  # three partitions, two batches
