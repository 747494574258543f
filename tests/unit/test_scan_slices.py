"""A Produce's batches are read, and a Fetch response's records counted, 2,000 partitions and
batches at a time (ProduceScanFilter, FetchCountFilter): a big one is deferred (held) and read
between turns of the event loop, and nothing else changes.

The connection is driven in process with recording transports, with a quota of every kind on
every client (never reached): the record and batch limiters and the producer-id filter read
every Produce's batches, the record limiter counts every Fetch response's records. The broker is played by the test.
"""

from __future__ import annotations

import asyncio
import struct

import pytest
import yaml
from kafka.protocol.consumer import FetchResponse
from kafka.protocol.producer import ProduceRequest
from kafka.record.memory_records import MemoryRecordsBuilder

from bench.run import QUOTAS_NOT_EXCEEDED
from protocol.apis import ApiKey
from protocol.messages import encode_body
from proxy.dataplane.filters.api import Hold
from proxy.dataplane.filters.records import SCAN_SLICE_ENTRIES, FetchCountFilter, ProduceScanFilter
from tests.support.kafka_messages import make
from tests.unit.test_connection_paths import BASE, Pair, list_offsets, request
from tests.unit.test_fill_paths import fetch_request

QUOTAS = {**BASE, **yaml.safe_load(QUOTAS_NOT_EXCEEDED)}


def _batch(records: int) -> bytes:
    builder = MemoryRecordsBuilder(magic=2, compression_type=0, batch_size=1 << 20)
    for _ in range(records):
        builder.append(0, None, b"v")
    builder.close()
    return bytes(builder.buffer())


BATCH = _batch(3)


def produce(correlation_id: int, partitions: int, corrupt_at: int | None = None) -> bytes:
    R = ProduceRequest[9]
    P = R.TopicProduceData.PartitionProduceData
    bad = BATCH[:16] + b"\x07" + BATCH[17:]  # magic 7: unreadable
    parts = [P(index=i, records=BATCH if i != corrupt_at else bad) for i in range(partitions)]
    return request(R(acks=-1, timeout_ms=1000, transactional_id=None,
                     topic_data=[R.TopicProduceData(name="t", partition_data=parts)]), correlation_id, "app")


async def _send(pair: Pair, data: bytes) -> int:
    """The client sends ``data``; returns how many turns of the loop passed until nothing was
    deferred any more."""
    turns = 0
    pair.conn.data_received(data)
    while pair.conn.requests.deferred is not None:
        await asyncio.sleep(0)
        turns += 1
    return turns


@pytest.mark.parametrize("partitions", [1, SCAN_SLICE_ENTRIES // 2, 5 * SCAN_SLICE_ENTRIES // 2 + 1])
def test_a_produce_is_read_in_slices_and_forwarded_as_it_came_in_order(partitions):
    big, after = produce(1, partitions), list_offsets(2, "app")

    async def go() -> tuple[int, list[bytes], int | None, int]:
        pair = Pair(QUOTAS)
        turns = await _send(pair, big + after)
        entry = pair.conn.queue.pending[0]
        return turns, pair.requests_seen_by_broker(), entry.records, pair.server.stats.records_scan_failures["Produce"]

    turns, seen, records, failures = asyncio.run(go())
    slices = -(-2 * partitions // SCAN_SLICE_ENTRIES)  # a partition and its one batch each
    # The first slice at once (nothing deferred), then at least a turn of the loop between two.
    assert turns == 0 if slices == 1 else turns >= slices - 1
    assert seen == [big[4:], after[4:]]  # the very bytes, and the request behind it only after it
    assert records == 3 * partitions and failures == 0


def test_unreadable_batches_late_in_a_big_produce_are_counted_and_forwarded_uncharged():
    big = produce(1, 3 * SCAN_SLICE_ENTRIES, corrupt_at=5 * SCAN_SLICE_ENTRIES // 2 + 5)

    async def go() -> tuple[list[bytes], int | None, int]:
        pair = Pair(QUOTAS)
        await _send(pair, big)
        entry = pair.conn.queue.pending[0]
        return pair.requests_seen_by_broker(), entry.records, pair.server.stats.records_scan_failures["Produce"]

    seen, records, failures = asyncio.run(go())
    assert seen == [big[4:]] and failures == 1 and records is None


def test_other_connections_are_served_between_the_slices():
    """While a big Produce is read, another client's request on the same proxy is answered."""
    async def go() -> list[str]:
        events: list[str] = []
        server_pair = Pair(QUOTAS)
        other = Pair(server=server_pair.server)
        big = produce(1, 2 * SCAN_SLICE_ENTRIES)
        server_pair.conn.data_received(big)
        assert server_pair.conn.requests.deferred is not None
        await asyncio.sleep(0)
        other.conn.data_received(list_offsets(7, "other"))
        events.append("other forwarded" if other.requests_seen_by_broker() else "other waiting")
        while server_pair.conn.requests.deferred is not None:
            await asyncio.sleep(0)
        events.append("big forwarded" if server_pair.requests_seen_by_broker() else "big waiting")
        return events

    assert asyncio.run(go()) == ["other forwarded", "big forwarded"]


def test_the_slicer_is_idle_when_no_filter_reads_produce_batches():
    async def go() -> tuple[bool, bool]:
        def slicer(raw: dict) -> ProduceScanFilter:
            return next(f for f in Pair(raw).server.chain._request_filters if isinstance(f, ProduceScanFilter))

        return slicer(BASE).spec.idle, slicer(QUOTAS).spec.idle

    assert asyncio.run(go()) == (True, False)


def fetch_response(correlation_id: int, partitions: int, corrupt_at: int | None = None) -> bytes:
    """A FetchResponse v12 of ``partitions`` partitions of one topic, one batch of 3 records each."""
    R = FetchResponse
    P = R.FetchableTopicResponse.PartitionData
    bad = BATCH[:16] + b"\x07" + BATCH[17:]  # magic 7: unreadable
    parts = [make(P, 12, partition_index=i, error_code=0, high_watermark=3, last_stable_offset=3, log_start_offset=0,
                  aborted_transactions=[], preferred_read_replica=-1, records=BATCH if i != corrupt_at else bad)
             for i in range(partitions)]
    topic = make(R.FetchableTopicResponse, 12, topic="t", partitions=parts)
    body = encode_body(make(R, 12, throttle_time_ms=0, error_code=0, session_id=0, responses=[topic]))
    payload = struct.pack(">i", correlation_id) + b"\x00" + body
    return struct.pack(">i", len(payload)) + payload


async def _answer(pair: Pair, data: bytes) -> int:
    """The broker sends ``data``; returns how many turns of the loop passed until no response
    was held any more."""
    turns = 0
    pair.up.data_received(data)
    while pair.conn.queue._holding:
        await asyncio.sleep(0)
        turns += 1
    return turns


@pytest.mark.parametrize("partitions", [1, SCAN_SLICE_ENTRIES // 2, 5 * SCAN_SLICE_ENTRIES // 2 + 1])
def test_a_fetch_response_is_counted_in_slices_and_answered_as_it_came_in_order(partitions):
    response, behind = fetch_response(1, partitions), list_offsets_answer(2)

    async def go() -> tuple[int, bytes, int | None]:
        pair = Pair(QUOTAS)
        pair.conn.data_received(fetch_request(1) + list_offsets(2, "app"))
        entry = pair.conn.queue.pending[0]
        turns = await _answer(pair, response + behind)
        return turns, pair.client.bytes(), entry.records

    turns, to_client, records = asyncio.run(go())
    slices = -(-2 * partitions // SCAN_SLICE_ENTRIES)  # a partition and its one batch each
    assert turns == 0 if slices == 1 else turns >= slices - 1
    assert to_client == response + behind  # as the broker sent them, in order
    assert records == 3 * partitions


def test_unreadable_batches_late_in_a_big_fetch_response_are_counted_and_pass_uncharged():
    response = fetch_response(1, 3 * SCAN_SLICE_ENTRIES, corrupt_at=5 * SCAN_SLICE_ENTRIES // 2 + 5)

    async def go() -> tuple[bytes, bool, int]:
        pair = Pair(QUOTAS)
        pair.conn.data_received(fetch_request(1))
        entry = pair.conn.queue.pending[0]
        await _answer(pair, response)
        return pair.client.bytes(), entry.records_unreadable, pair.server.stats.records_scan_failures["Fetch"]

    assert asyncio.run(go()) == (response, True, 1)


def test_the_counter_takes_fetch_responses_only_while_a_filter_counts_them():
    """Every ShareFetch response is walked (the leader and endpoint filters read it); a Fetch
    response only while its records are counted, so that without quotas it still streams."""
    async def go() -> tuple[frozenset[int], frozenset[int]]:
        def counter(raw: dict) -> FetchCountFilter:
            return next(f for f in Pair(raw).server.chain._response_filters if isinstance(f, FetchCountFilter))

        return counter(BASE).spec.response_keys, counter(QUOTAS).spec.response_keys

    assert asyncio.run(go()) == ({ApiKey.SHARE_FETCH}, {ApiKey.FETCH, ApiKey.SHARE_FETCH})


def test_a_big_share_fetch_response_is_walked_in_slices_once_for_every_filter(monkeypatch):
    """A ShareFetch response of 3,000 partitions: walked 2,000 entries a turn of the loop, its
    records counted and its errors and NodeEndpoints noted for the leader filter, which does not
    walk it again."""
    from protocol.headers import encode_response_header
    from protocol.share_scan import scan_share_fetch
    from proxy.cluster.leaders import LeaderCache
    from proxy.dataplane.filters import leaders, records
    from proxy.dataplane.inflight import InFlight
    from tests.support.filter_context import filter_context
    from tests.unit.test_share_responses import OK_PARTITION, share_fetch_body

    body, _ = share_fetch_body(1, [(i, *OK_PARTITION[1:]) for i in range(3_000)])
    frame = encode_response_header(7, True) + body

    async def go() -> tuple[InFlight, int, object]:
        entry = InFlight(7, ApiKey.SHARE_FETCH, 1, 0.0)
        decision = FetchCountFilter([]).on_response(filter_context(), entry, frame)
        turns = 0
        if isinstance(decision, Hold):
            task = asyncio.ensure_future(decision.frame)
            while not task.done():
                await asyncio.sleep(0)
                turns += 1
            decision = task.result()
        monkeypatch.setitem(records._RESPONSE_SCANNERS, ApiKey.SHARE_FETCH, lambda *a: pytest.fail("walked again"))
        answer = leaders.LeaderHintFilter(LeaderCache(), None).on_response(filter_context(), entry, decision)
        return entry, turns, answer

    entry, turns, answer = asyncio.run(go())
    whole = scan_share_fetch(body, 1)
    assert turns >= 2 and answer == frame
    assert entry.scan == whole.scan and (entry.batches, entry.records) == tuple(whole.delivered)


def list_offsets_answer(correlation_id: int) -> bytes:
    payload = struct.pack(">i", correlation_id) + b"body"
    return struct.pack(">i", len(payload)) + payload
