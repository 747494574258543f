"""Sockets read into the proxy's own buffers, large frames that filters must see whole into
theirs (proxy.dataplane.reads), and nothing else changes: the bytes each side gets, their order
and the counts are those of the same frames handed over chunk by chunk (``data_received``).

With a quota of every kind on every client (never reached), a Produce request and a Fetch
response are assembled for their filters. The connection is driven in process with recording
transports (tests.unit.test_connection_paths.Wire, whose ``deliver`` reads into the buffer the
protocol gives, as an event loop does); the broker is played by the test.
"""

from __future__ import annotations

import asyncio
import random
import struct

import pytest
import yaml
from kafka.protocol.consumer import FetchRequest, FetchResponse
from kafka.protocol.producer import ProduceRequest, ProduceResponse
from kafka.record.memory_records import MemoryRecordsBuilder

from bench.run import QUOTAS_NOT_EXCEEDED
from protocol.frames import CONTIGUOUS_MIN_BYTES
from protocol.messages import encode_body
from proxy.dataplane.connection import ClientConnection, UpstreamConnection
from proxy.dataplane.requests import RequestSide
from tests.support.kafka_messages import make
from tests.unit.test_connection_paths import BASE, Pair, Wire, outcome, request

QUOTAS = {**BASE, **yaml.safe_load(QUOTAS_NOT_EXCEEDED)}
FETCH_VERSION = 12


def _records(n: int, value_bytes: int, base_offset: int = 0) -> bytes:
    builder = MemoryRecordsBuilder(magic=2, compression_type=0, batch_size=1 << 24, offset=base_offset)
    for _ in range(n):
        builder.append(0, None, b"v" * value_bytes)
    builder.close()
    return bytes(builder.buffer())


RECORDS = _records(2_000, 150)  # one batch of about 330 KB


def produce_request(correlation_id: int) -> bytes:
    R = ProduceRequest[9]
    data = R.TopicProduceData(name="t", partition_data=[R.TopicProduceData.PartitionProduceData(index=0,
                                                                                                records=RECORDS)])
    return request(R(acks=-1, timeout_ms=1000, transactional_id=None, topic_data=[data]), correlation_id, "app")


def produce_response(correlation_id: int) -> bytes:
    R = ProduceResponse
    P = R.TopicProduceResponse.PartitionProduceResponse
    part = make(P, 9, index=0, error_code=0, base_offset=0, log_append_time_ms=-1, log_start_offset=0,
                record_errors=[], error_message=None)
    body = encode_body(make(R, 9, responses=[make(R.TopicProduceResponse, 9, name="t", partition_responses=[part])],
                            throttle_time_ms=0))
    payload = struct.pack(">i", correlation_id) + b"\x00" + body
    return struct.pack(">i", len(payload)) + payload


def fetch_request(correlation_id: int) -> bytes:
    R = FetchRequest
    P = R.FetchTopic.FetchPartition
    topic = make(R.FetchTopic, FETCH_VERSION, topic="t", partitions=[
        make(P, FETCH_VERSION, partition=0, current_leader_epoch=-1, fetch_offset=0, last_fetched_epoch=-1,
             log_start_offset=-1, partition_max_bytes=1 << 20)])
    req = make(R, FETCH_VERSION, replica_id=-1, max_wait_ms=500, min_bytes=1, max_bytes=50 << 20,
               isolation_level=0, session_id=0, session_epoch=-1, topics=[topic], forgotten_topics_data=[],
               rack_id="")
    return request(req, correlation_id, "app")


def fetch_response(correlation_id: int) -> bytes:
    R = FetchResponse
    P = R.FetchableTopicResponse.PartitionData
    part = make(P, FETCH_VERSION, partition_index=0, error_code=0, high_watermark=2_000, last_stable_offset=2_000,
                log_start_offset=0, aborted_transactions=[], preferred_read_replica=-1, records=RECORDS)
    topic = make(R.FetchableTopicResponse, FETCH_VERSION, topic="t", partitions=[part])
    body = encode_body(make(R, FETCH_VERSION, throttle_time_ms=0, error_code=0, session_id=0, responses=[topic]))
    payload = struct.pack(">i", correlation_id) + b"\x00" + body
    return struct.pack(">i", len(payload)) + payload


def _cuts(data: bytes, rng: random.Random) -> list[bytes]:
    out, pos = [], 0
    while pos < len(data):
        n = rng.choice((7, 1000, 65536, 256_000, 300_000))
        out.append(data[pos : pos + n])
        pos += n
    return out


def exchange(own_reads: bool, seed: int, monkeypatch: pytest.MonkeyPatch) -> tuple[Pair, int]:
    """Five Produce requests and five Fetches, pipelined in chunks cut at random; the broker's
    answers likewise. Returns the pair and how many frames were completed by a read into their
    own buffer."""
    if not own_reads:
        monkeypatch.setattr(Wire, "deliver", lambda self, owner, data: owner.data_received(bytes(data)))
    filled = 0
    for cls in (ClientConnection, UpstreamConnection):
        plain = cls.filled

        def counting(self, nbytes, frame, plain=plain) -> None:
            nonlocal filled
            filled += frame is not None
            plain(self, nbytes, frame)

        monkeypatch.setattr(cls, "filled", counting)

    async def go() -> Pair:
        pair = Pair(QUOTAS)
        rng = random.Random(seed)
        requests = [produce_request(i) if i % 2 else fetch_request(i) for i in range(1, 11)]
        for chunk in _cuts(b"".join(requests), rng):
            pair.client.deliver(pair.conn, chunk)
        answers = [produce_response(i) if i % 2 else fetch_response(i) for i in range(1, 11)]
        for chunk in _cuts(b"".join(answers), rng):
            pair.broker.deliver(pair.up, chunk)
        return pair

    pair = asyncio.run(go())
    monkeypatch.undo()
    return pair, filled


def _outcome(pair: Pair) -> dict:
    return {**outcome(pair), "scan_failures": dict(pair.server.stats.records_scan_failures),
            "pool": pair.server.env.guard.pool.held_bytes}


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_own_reads_give_the_same_bytes_order_and_counts(seed, monkeypatch):
    assert len(RECORDS) > 4 * CONTIGUOUS_MIN_BYTES
    reference, filled_before = exchange(False, seed, monkeypatch)
    filled, filled_frames = exchange(True, seed, monkeypatch)
    assert filled_before == 0 and filled_frames >= 5  # requests and responses were read into their buffers
    expected = _outcome(reference)
    assert expected["owed"] == 0 and not expected["closed"] and not expected["scan_failures"]
    assert expected["to_broker"].count(RECORDS) == 5 and expected["to_client"].count(RECORDS) == 5
    assert _outcome(filled) == expected


def test_a_request_filled_while_a_throttle_holds_the_connection_waits_its_turn(monkeypatch):
    """A frame completed by a fill while the connection is held is held too, then forwarded in order."""
    async def go() -> tuple[list[bytes], list[bytes]]:
        pair = Pair(QUOTAS)
        first, second = produce_request(1), produce_request(2)
        pair.client.deliver(pair.conn, first)
        seen_after_first = pair.requests_seen_by_broker()
        monkeypatch.setattr(RequestSide, "wait", lambda self: True)  # as while a throttle holds it
        pair.client.deliver(pair.conn, second[:200_000])
        assert pair.conn._reader.filling
        pair.client.deliver(pair.conn, second[200_000:])
        held = len(pair.requests_seen_by_broker())
        monkeypatch.undo()
        pair.conn.requests.process_held()
        return [bytes(f) for f in seen_after_first], [bytes(f) for f in pair.requests_seen_by_broker()][held:]

    seen_after_first, released = asyncio.run(go())
    assert [f[4:8] for f in seen_after_first] == [struct.pack(">i", 1)]
    assert [f[4:8] for f in released] == [struct.pack(">i", 2)]


def test_a_frame_kept_past_its_callback_is_copied_only_when_it_is_not_immutable_or_the_proxys_own_or_small():
    """A request deferred or held keeps its frame: a 100 MB copy would hold the loop tens of ms."""
    from array import array

    from proxy.dataplane.requests import _kept

    whole, view, own = b"abc", memoryview(b"xyz")[1:], memoryview(bytearray(b"own"))
    assert _kept(whole) is whole and _kept(view) is view and _kept(own) is own
    foreign = memoryview(array("b", [1, 2]))  # another object's buffer, which it may change
    assert type(_kept(foreign)) is bytes and _kept(foreign) == b"\x01\x02"
    read = bytearray(b"r" * 1000)  # a long read's buffer: a small frame in it is copied, not kept with it
    assert _kept(memoryview(read)[:250]) == b"r" * 250 and type(_kept(memoryview(read)[:249])) is bytes
    assert _kept(memoryview(read)[:250]).obj is read


def test_after_a_large_response_is_filled_the_next_ones_size_is_read_first(monkeypatch):
    """A broker connection that just read a large response into its buffer reads the next one's
    size prefix alone, so a large next one goes straight into a buffer of its size (a broker's
    announced size is honoured at once); a small one puts reads back to normal. What the client
    gets is what it gets without any of this (every response handed over in one chunk)."""
    filled = []
    plain = UpstreamConnection.filled

    def counting(self, nbytes, frame) -> None:
        filled.append(frame is not None)
        plain(self, nbytes, frame)

    def run(peeking: bool) -> tuple[dict, list[int]]:
        async def go() -> tuple[Pair, list[int]]:
            pair = Pair(QUOTAS)
            for i in (1, 2, 3):
                pair.client.deliver(pair.conn, fetch_request(i) if i < 3 else produce_request(i))
            first, second, third = fetch_response(1), fetch_response(2), produce_response(3)
            sizes = []
            if peeking:
                pair.broker.deliver(pair.up, first[:100_000])  # over two reads: filled
                pair.broker.deliver(pair.up, first[100_000:])
                sizes.append(len(pair.up.get_buffer(-1)))
                pair.broker.deliver(pair.up, second)
                sizes.append(len(pair.up.get_buffer(-1)))
                pair.broker.deliver(pair.up, third)
                sizes.append(len(pair.up.get_buffer(-1)))
            else:
                for response in (first, second, third):
                    pair.up.data_received(response)
            return pair, sizes

        pair, sizes = asyncio.run(go())
        return _outcome(pair), sizes

    reference, _ = run(False)
    monkeypatch.setattr(UpstreamConnection, "filled", counting)
    peeked, sizes = run(True)
    assert sizes[0] == 4  # after a filled response: the next size first
    assert sizes[1] == 4  # the next, large too, was read into its own buffer after its size
    assert sizes[2] > 4  # a small one: reads as usual again
    assert filled.count(True) == 2
    assert reference["owed"] == 0 and not reference["closed"]
    assert peeked == reference


def test_a_sized_peers_large_frame_gets_its_buffer_at_once():
    """A broker's announced size is honoured as soon as it is read; a client's only once a
    quarter of the frame has arrived."""
    from protocol.frames import FrameReader

    head = struct.pack(">i", 1 << 20) + b"x" * 10
    broker, client = FrameReader(1 << 30, sized_peer=True), FrameReader(1 << 30)
    assert broker.feed(head) == [] and client.feed(head) == []
    assert broker.filling and broker.buffered_bytes == (1 << 20) + 4
    assert not client.filling and client.buffered_bytes == 14
    fill = broker.fill_buffer()
    assert fill is not None and len(fill) == (1 << 20) - 10
