"""The golden wire captures in tests/golden/frames/ decode, with kafka-python's own classes, to
exactly what their manifest says: a sanity check of the fixtures, not of the proxy.

Batch headers and CRCs are read without decompressing; the records inside are decoded with
kafka-python's codecs (the lz4, zstandard and python-snappy packages of the test extra).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from kafka import codec as kafka_codec
from kafka.protocol.consumer import FetchResponse
from kafka.protocol.producer import ProduceRequest
from kafka.record import MemoryRecords
from kafka.record.default_records import DefaultRecordBatch

from protocol.headers import parse_request_header, response_body_offset

FRAMES = Path(__file__).resolve().parents[1] / "golden" / "frames"
MANIFEST = json.loads((FRAMES / "manifest.json").read_text())
ENTRIES = MANIFEST["frames"]
BY_NAME = {e["name"]: e for e in ENTRIES}
MAX_FRAME_BYTES = 8192

CODEC_AVAILABLE = {
    0: True,
    1: kafka_codec.has_gzip(),
    2: kafka_codec.has_snappy(),
    3: kafka_codec.has_lz4(),
    4: kafka_codec.has_zstd(),
}

frame_entries = pytest.mark.parametrize("entry", ENTRIES, ids=[e["name"] for e in ENTRIES])


def frame(entry: dict) -> bytes:
    return (FRAMES / entry["file"]).read_bytes()


def sent_records(entry: dict) -> list[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
    legacy = entry["magic"] < 2  # message format v1 has no headers
    return [
        (r["key"].encode(), r["value"].encode(), [] if legacy else [(k, v.encode()) for k, v in r["headers"]])
        for r in MANIFEST["records_sent"]
    ]


def record_set(entry: dict) -> bytes:
    """The record set of the one topic partition the frame carries data for."""
    data = frame(entry)
    version, offset = entry["api_version"], entry["body_offset"]
    if entry["kind"] == "produce_request":
        message = ProduceRequest.decode(data[offset:], version=version)
        assert [t.name for t in message.topic_data] == [entry["topic"]]
        (partition,) = message.topic_data[0].partition_data
        assert partition.index == entry["partition"]
        return bytes(partition.records)
    message = FetchResponse.decode(data[offset:], version=version)
    with_records = [(t, p) for t in message.responses for p in t.partitions if p.records]
    assert len(with_records) == 1
    topic, partition = with_records[0]
    if version >= 13:
        assert str(topic.topic_id) == entry["topic_id"]
    else:
        assert topic.topic == entry["topic"]
    assert partition.partition_index == entry["partition"]
    assert partition.error_code == 0
    return bytes(partition.records)


def batches(entry: dict) -> list:
    records = MemoryRecords(record_set(entry))
    out = []
    while (batch := records.next_batch()) is not None:
        out.append(batch)
    return out


# -- the set as a whole ---------------------------------------------------------------------


def test_manifest_lists_exactly_the_files_present():
    assert sorted(e["file"] for e in ENTRIES) == sorted(p.name for p in FRAMES.glob("*.bin"))
    assert len(BY_NAME) == len(ENTRIES)


def test_every_case_is_captured_or_explained():
    skipped = {s["case"] for s in MANIFEST["skipped"]}
    for client in ("kafka-python", "confluent"):
        for idem in ("plain", "idem"):
            for codec in ("none", "gzip", "lz4", "zstd", "snappy"):
                case = f"{client}-{idem}-{codec}"
                assert f"produce_{case}" in BY_NAME or case in skipped, case
    kinds = {e["kind"] for e in ENTRIES}
    assert kinds == {"produce_request", "fetch_response"}
    fetched = [e for e in ENTRIES if e["kind"] == "fetch_response"]
    assert {e["compression"] == 0 for e in fetched} == {True, False}


@frame_entries
def test_frame_is_small(entry):
    assert 0 < len(frame(entry)) <= MAX_FRAME_BYTES


# -- headers --------------------------------------------------------------------------------


@frame_entries
def test_header_matches_manifest(entry):
    data = frame(entry)
    api_key, api_version = entry["api_key"], entry["api_version"]
    if entry["kind"] == "produce_request":
        assert api_key == 0
        stream = io.BytesIO(data)
        header = ProduceRequest.parse_header(stream, version=api_version)
        assert (header.request_api_key, header.request_api_version) == (api_key, api_version)
        assert stream.tell() == entry["body_offset"]
        assert entry["header_version"] == (2 if ProduceRequest.flexible_version_q(api_version) else 1)
    else:
        assert api_key == 1
        stream = io.BytesIO(data)
        FetchResponse.parse_header(stream, version=api_version)
        assert stream.tell() == entry["body_offset"]
        assert entry["header_version"] == (1 if FetchResponse.flexible_version_q(api_version) else 0)


@frame_entries
def test_body_offset_agrees_with_protocol_headers(entry):
    data = frame(entry)
    if entry["kind"] == "produce_request":
        header = parse_request_header(data)
        assert (header.api_key, header.api_version) == (entry["api_key"], entry["api_version"])
        assert header.body_offset == entry["body_offset"]
    else:
        assert response_body_offset(data, entry["api_key"], entry["api_version"]) == entry["body_offset"]


def decode_whole(cls, body: bytes, version: int):
    """kafka-python's decode of a whole body: (message, offset where decoding stopped)."""
    flexible = cls.flexible_version_q(version)
    decode_from = cls._struct.compiled_decode_from(version, compact=flexible, tagged=flexible, data_class=cls[None])
    return decode_from(memoryview(body), 0)


@frame_entries
def test_body_decodes_whole(entry):
    data = frame(entry)
    cls = ProduceRequest if entry["kind"] == "produce_request" else FetchResponse
    body = data[entry["body_offset"]:]
    _message, end = decode_whole(cls, body, entry["api_version"])
    assert end == len(body)


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e["kind"] == "produce_request"],
                         ids=[e["name"] for e in ENTRIES if e["kind"] == "produce_request"])
def test_produce_body_reencodes_to_the_same_bytes(entry):
    """Not for the Fetch responses: Tansu writes an empty NodeEndpoints tagged field from
    Fetch v16 on, which kafka-python leaves out when it encodes."""
    body = frame(entry)[entry["body_offset"]:]
    message = ProduceRequest.decode(body, version=entry["api_version"])
    message._header = None  # a decoded message has no header slot; encode() reads it
    assert bytes(message.encode(version=entry["api_version"])) == body


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e["kind"] == "produce_request"],
                         ids=[e["name"] for e in ENTRIES if e["kind"] == "produce_request"])
def test_produce_acks_and_transactional_id(entry):
    data = frame(entry)
    message = ProduceRequest.decode(data[entry["body_offset"]:], version=entry["api_version"])
    assert message.acks == entry["acks"]
    if entry["api_version"] >= 3:
        assert message.transactional_id is None


# -- record batches -------------------------------------------------------------------------


@frame_entries
def test_batch_headers_match_manifest(entry):
    """Read from the batch headers only: no decompression needed."""
    found = batches(entry)
    assert len(found) == entry["batches"]
    for batch in found:
        assert batch.magic == entry["magic"]
        assert batch.compression_type == entry["compression"]
    if entry["magic"] < 2:
        return
    assert sum(b.records_count for b in found) == entry["records"]
    for batch in found:
        assert batch.validate_crc()
        assert batch.producer_id == entry["producer_id"]
        assert batch.producer_epoch == entry["producer_epoch"]
        assert not batch.is_transactional and not batch.is_control_batch
    assert found[0].base_sequence == entry["base_sequence"]


@frame_entries
def test_records_match_what_was_sent(entry):
    if not CODEC_AVAILABLE[entry["compression"]]:
        pytest.fail(f"kafka-python has no {entry['compression_name']} codec: install the test extra")
    decoded = []
    for batch in batches(entry):
        if isinstance(batch, DefaultRecordBatch):
            assert batch.validate_crc()  # must come before iterating
        for record in batch:
            if entry["magic"] < 2:
                assert record.validate_crc()
            decoded.append((record.key, record.value, [(k, bytes(v)) for k, v in record.headers or ()]))
    assert len(decoded) == entry["records"]
    assert decoded == sent_records(entry)


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e["kind"] == "fetch_response"],
                         ids=[e["name"] for e in ENTRIES if e["kind"] == "fetch_response"])
def test_fetched_batch_is_the_produced_batch(entry):
    """The broker hands the consumer the producer's batch byte for byte."""
    assert record_set(entry) == record_set(BY_NAME[entry["produced_by"]])
