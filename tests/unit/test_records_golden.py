"""The record-batch header scanner on frames real producers and the real broker sent
(tests/golden/frames: kafka-python and librdkafka, idempotent or not, every codec, plus legacy
magic 1 sets and Fetch responses), fed whole and cut short at every byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protocol.records import RecordsError, batch_headers, count_fetch_records, scan_produce_request

FRAMES = Path(__file__).resolve().parents[1] / "golden" / "frames"
MANIFEST = json.loads((FRAMES / "manifest.json").read_text())["frames"]
PRODUCE = [e for e in MANIFEST if e["kind"] == "produce_request"]
FETCH = [e for e in MANIFEST if e["kind"] == "fetch_response"]


def frame_of(entry) -> bytes:
    return (FRAMES / entry["file"]).read_bytes()


def test_the_golden_set_covers_every_client_codec_and_idempotence():
    cases = {(e["client"], e["idempotent"], e["compression"]) for e in PRODUCE if e["magic"] == 2}
    assert cases == {(c, i, z) for c in ("kafka-python", "confluent-kafka") for i in (False, True) for z in range(5)}
    assert {e["magic"] for e in PRODUCE} == {1, 2}
    assert {e["compression"] for e in FETCH} >= {0, 4}


@pytest.mark.parametrize("entry", PRODUCE, ids=[e["name"] for e in PRODUCE])
def test_produce_requests_from_real_producers(entry):
    frame = frame_of(entry)
    scan = scan_produce_request(frame, entry["body_offset"], entry["api_version"])
    assert scan.acks == entry["acks"]
    assert scan.topics == ((entry["topic"], (entry["partition"],)),)
    assert scan.batches == entry["batches"]
    # A compressed legacy (magic 1) set is one wrapper message: its records are inside the
    # compressed value, which the scanner does not open.
    legacy_compressed = entry["magic"] < 2 and entry["compression"] != 0
    assert scan.records == (1 if legacy_compressed else entry["records"])
    assert scan.producer_ids == ((entry["producer_id"],) if entry["producer_id"] >= 0 else ())
    body = memoryview(frame)[entry["body_offset"]:]
    start = bytes(body).index(_first_batch(entry, frame))
    headers = list(batch_headers(body, start, start + len(_first_batch(entry, frame))))
    assert {h.compression for h in headers} == {entry["compression"]}
    assert {h.magic for h in headers} == {entry["magic"]}
    if entry["magic"] == 2:
        (h,) = headers
        assert (h.producer_id, h.producer_epoch, h.base_sequence) == (
            entry["producer_id"], entry["producer_epoch"], entry["base_sequence"])


def _first_batch(entry, frame: bytes) -> bytes:
    """The partition's record set, as kafka-python decodes it (independent of the scanner)."""
    from kafka.protocol.producer import ProduceRequest

    req = ProduceRequest[entry["api_version"]].decode(frame[entry["body_offset"]:], version=entry["api_version"])
    return bytes(req.topic_data[0].partition_data[0].records)


@pytest.mark.parametrize("entry", PRODUCE, ids=[e["name"] for e in PRODUCE])
def test_produce_requests_cut_short_are_reported(entry):
    frame = frame_of(entry)
    for cut in range(entry["body_offset"], len(frame)):
        with pytest.raises(RecordsError):
            scan_produce_request(frame[:cut], entry["body_offset"], entry["api_version"])


@pytest.mark.parametrize("entry", FETCH, ids=[e["name"] for e in FETCH])
def test_fetch_responses_from_the_real_broker(entry):
    body = memoryview(frame_of(entry))[entry["body_offset"]:]
    counted = count_fetch_records(body, entry["api_version"])
    assert (counted.batches, counted.records) == (entry["batches"], entry["records"])


@pytest.mark.parametrize("entry", FETCH, ids=[e["name"] for e in FETCH])
def test_fetch_responses_cut_short_are_reported(entry):
    body = frame_of(entry)[entry["body_offset"]:]
    for cut in range(len(body)):
        with pytest.raises(RecordsError):
            count_fetch_records(body[:cut], entry["api_version"])
