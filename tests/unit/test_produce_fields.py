"""produce_acks reads acks from the frame for every ProduceRequest version kafka-python has."""

from __future__ import annotations

import pytest
from kafka.protocol.producer import ProduceRequest

from protocol.headers import parse_request_header
from protocol.produce import produce_acks


@pytest.mark.parametrize("version", range(0, ProduceRequest.max_version + 1))
@pytest.mark.parametrize("acks", [0, 1, -1])
@pytest.mark.parametrize("txn", [None, "", "transactional-producer-é"])
def test_acks_read_without_decoding(version, acks, txn):
    T = ProduceRequest[version].TopicProduceData
    topic = T(partition_data=[T.PartitionProduceData(index=0, records=b"r" * 50)])
    if version >= 13:
        topic.topic_id = __import__("uuid").uuid4()
    else:
        topic.name = "t"
    req = ProduceRequest[version](transactional_id=txn, acks=acks, timeout_ms=100, topic_data=[topic])
    req.with_header(correlation_id=9, client_id="c")
    frame = bytes(req.encode(header=True))
    header = parse_request_header(frame)
    assert produce_acks(frame, header.body_offset, version) == acks
