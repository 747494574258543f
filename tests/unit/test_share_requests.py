"""ShareFetch and ShareAcknowledge requests (KIP-932), v0 to v2: golden bodies written field by
field from Kafka's message definitions (ShareFetchRequest.json, ShareAcknowledgeRequest.json),
without kafka-python's encoder. v0 as Kafka 4.0 shipped it (PartitionMaxBytes per partition);
v1 (Kafka 4.1+, librdkafka 2.16) drops it and adds MaxRecords and BatchSize; v2 (Kafka 4.2)
adds ShareAcquireMode (KIP-1206) and IsRenewAck (KIP-1222) after BatchSize, and IsRenewAck
after ShareAcknowledgeRequest's ShareSessionEpoch.

They decode to the fields written and encode back to the same bytes; the MaxBytes cap finds
MinBytes and MaxBytes in every version, changes those 8 bytes only, and leaves a renew
acknowledgement's zeros (Kafka refuses one with anything else) as they are.
"""

from __future__ import annotations

import pytest

from protocol.apis import ApiKey
from protocol.errors import ProtocolError
from protocol.messages import decode_request, encode_body
from protocol.share_fetch import cap_share_fetch_bytes
from tests.unit.test_share_responses import NO_TAGS, TOPIC_ID, compact_array, compact_string, int32, int64

VERSIONS = (0, 1, 2)
FORGOTTEN_ID = TOPIC_ID.bytes[::-1]
RECORD_LIMIT = 1  # ShareAcquireMode (KIP-1206): 0 batch-optimized, 1 record-limit
ACCEPT, RENEW = 1, 4  # AcknowledgeTypes: 0 gap, 1 accept, 2 release, 3 reject, 4 renew (KIP-1222)


def int8(v: int) -> bytes:
    return v.to_bytes(1, "big", signed=True)


def acknowledgement_batches(batches) -> bytes:
    return compact_array([int64(first) + int64(last) + compact_array([int8(t) for t in types]) + NO_TAGS
                          for first, last, types in batches])


def share_fetch_request_body(version: int, max_wait_ms: int = 500, min_bytes: int = 1, max_bytes: int = 1 << 20,
                             max_records: int = 500, renew: bool = False,
                             batches=((100, 101, (ACCEPT,)),)) -> tuple[bytes, int]:
    """(body, where MinBytes is)."""
    head = compact_string("share-group") + compact_string("m-1") + int32(3) + int32(max_wait_ms)
    at = len(head)
    head += int32(min_bytes) + int32(max_bytes)
    if version >= 1:
        head += int32(max_records) + int32(250)  # MaxRecords, BatchSize
    if version >= 2:
        head += int8(RECORD_LIMIT) + int8(1 if renew else 0)  # ShareAcquireMode (KIP-1206), IsRenewAck (KIP-1222)
    partition = int32(0) + (int32(1 << 20) if version == 0 else b"")  # PartitionMaxBytes: v0 only
    partition += acknowledgement_batches(batches) + NO_TAGS
    topics = compact_array([TOPIC_ID.bytes + compact_array([partition]) + NO_TAGS])
    forgotten = compact_array([FORGOTTEN_ID + compact_array([int32(2), int32(5)]) + NO_TAGS])
    return head + topics + forgotten + NO_TAGS, at


def share_acknowledge_request_body(version: int, renew: bool = False) -> bytes:
    head = compact_string("share-group") + compact_string("m-1") + int32(4)
    if version >= 2:
        head += int8(1 if renew else 0)  # IsRenewAck (KIP-1222)
    partition = int32(0) + acknowledgement_batches([(100, 102, (ACCEPT, RENEW if renew else ACCEPT, 0))]) + NO_TAGS
    return head + compact_array([TOPIC_ID.bytes + compact_array([partition]) + NO_TAGS]) + NO_TAGS


def _batches(partition) -> list[tuple[int, int, list[int]]]:
    return [(b.first_offset, b.last_offset, list(b.acknowledge_types)) for b in partition.acknowledgement_batches]


@pytest.mark.parametrize("version", VERSIONS)
def test_share_fetch_request_golden_body_decodes_field_by_field_and_encodes_back(version):
    body, _ = share_fetch_request_body(version, renew=False)
    req = decode_request(ApiKey.SHARE_FETCH, version, body)
    assert (req.group_id, req.member_id, req.share_session_epoch) == ("share-group", "m-1", 3)
    assert (req.max_wait_ms, req.min_bytes, req.max_bytes) == (500, 1, 1 << 20)
    if version >= 1:
        assert (req.max_records, req.batch_size) == (500, 250)
    if version >= 2:
        assert (req.share_acquire_mode, req.is_renew_ack) == (RECORD_LIMIT, False)
    [topic] = req.topics
    [partition] = topic.partitions
    assert (topic.topic_id, partition.partition_index) == (TOPIC_ID, 0)
    if version == 0:
        assert partition.partition_max_bytes == 1 << 20
    assert _batches(partition) == [(100, 101, [ACCEPT])]
    [forgotten] = req.forgotten_topics_data
    assert (forgotten.topic_id.bytes, list(forgotten.partitions)) == (FORGOTTEN_ID, [2, 5])
    assert encode_body(req) == body


@pytest.mark.parametrize("version", VERSIONS)
def test_share_acknowledge_request_golden_body_decodes_field_by_field_and_encodes_back(version):
    body = share_acknowledge_request_body(version, renew=version >= 2)
    req = decode_request(ApiKey.SHARE_ACKNOWLEDGE, version, body)
    assert (req.group_id, req.member_id, req.share_session_epoch) == ("share-group", "m-1", 4)
    if version >= 2:
        assert req.is_renew_ack is True
    [topic] = req.topics
    [partition] = topic.partitions
    assert (topic.topic_id, partition.partition_index) == (TOPIC_ID, 0)
    assert _batches(partition) == [(100, 102, [ACCEPT, RENEW if version >= 2 else ACCEPT, 0])]
    assert encode_body(req) == body


def test_a_renew_acknowledgement_share_fetch_decodes_with_its_zeros():
    body, _ = share_fetch_request_body(2, max_wait_ms=0, min_bytes=0, max_bytes=0, max_records=0, renew=True,
                                       batches=[(100, 101, (RENEW,))])
    req = decode_request(ApiKey.SHARE_FETCH, 2, body)
    assert (req.is_renew_ack, req.max_wait_ms, req.min_bytes, req.max_bytes, req.max_records) == (True, 0, 0, 0, 0)
    assert encode_body(req) == body


@pytest.mark.parametrize("version", VERSIONS)
def test_the_max_bytes_cap_changes_min_and_max_bytes_and_nothing_else(version):
    body, at = share_fetch_request_body(version, min_bytes=5000, max_bytes=1 << 20)
    header = b"HDR"  # the cap is given where the body starts; what is before it is not read
    capped = bytes(cap_share_fetch_bytes(header + body, len(header), version, 4096))
    assert capped == header + body[:at] + int32(4096) + int32(4096) + body[at + 8:]
    req = decode_request(ApiKey.SHARE_FETCH, version, capped[len(header):])
    assert (req.min_bytes, req.max_bytes) == (4096, 4096)
    if version >= 2:
        assert (req.share_acquire_mode, req.is_renew_ack) == (RECORD_LIMIT, False)


@pytest.mark.parametrize("cap_bytes", [1, 4096, 2**31 - 1])
def test_the_cap_leaves_a_renew_acknowledgements_zeros_as_they_are(cap_bytes):
    """KIP-1222: Kafka answers INVALID_REQUEST to an IsRenewAck ShareFetch whose MaxBytes,
    MinBytes, MaxRecords or MaxWaitMs is not 0; the cap only ever lowers."""
    body, _ = share_fetch_request_body(2, max_wait_ms=0, min_bytes=0, max_bytes=0, max_records=0, renew=True,
                                       batches=[(100, 101, (RENEW,))])
    assert cap_share_fetch_bytes(body, 0, 2, cap_bytes) is body


@pytest.mark.parametrize("version", VERSIONS)
def test_a_body_ending_before_max_bytes_is_a_protocol_error(version):
    body, at = share_fetch_request_body(version)
    for cut in range(at + 8):
        with pytest.raises(ProtocolError):
            cap_share_fetch_bytes(body[:cut], 0, version, 4096)
