"""Fetch v16+ responses longer than their first chunk stream through the KIP-951 filters.

The leader hint and endpoint filters look at every Fetch v16+ response. When the head of a
response shows no partition that moved (NOT_LEADER_OR_FOLLOWER / FENCED_LEADER_EPOCH), KIP-951
says the broker sends no hint and no NodeEndpoints, so the proxy sends the response on as it
arrives and holds back only its tail (tagged fields), which the filters check before it goes.
The connection is driven in process with recording transports; the broker is played by the test.
"""

from __future__ import annotations

import asyncio
import logging
import struct

from kafka.protocol.consumer import FetchResponse

from config import parse_config
from protocol.apis import ApiKey
from protocol.messages import encode_body
from proxy.app.server import ProxyServer
from proxy.dataplane.routes import StreamRoute
from tests.support.kafka_messages import TOPIC_ID, make
from tests.unit.test_connection_paths import BASE, Pair, armed_pair, list_offsets, raw_request

MOVED = 6  # NOT_LEADER_OR_FOLLOWER
VERSION = 16


def fetch_response(correlation_id: int, partitions=((0, 5000),), endpoints: bool = False,
                   moved_hint: bool = True) -> bytes:
    """A framed FetchResponse v16 of one topic: (error code, bytes of records) per partition."""
    R = FetchResponse
    P = R.FetchableTopicResponse.PartitionData
    parts = []
    for i, (code, size) in enumerate(partitions):
        moved = code == MOVED
        parts.append(make(
            P, VERSION, partition_index=i, error_code=code, high_watermark=10, last_stable_offset=10,
            log_start_offset=0, aborted_transactions=[], preferred_read_replica=-1,
            records=bytes(range(256)) * (size // 256) + b"\x01" * (size % 256),
            current_leader=(make(P.LeaderIdAndEpoch, VERSION, leader_id=3, leader_epoch=4)
                            if moved and moved_hint else None),
        ))
    topic = make(R.FetchableTopicResponse, VERSION, topic="t", topic_id=TOPIC_ID, partitions=parts)
    nodes = [make(R.NodeEndpoint, VERSION, node_id=3, host="b3.internal", port=9094, rack=None)] if endpoints else []
    body = encode_body(make(R, VERSION, throttle_time_ms=0, error_code=0, session_id=0, responses=[topic],
                            node_endpoints=nodes))
    payload = struct.pack(">i", correlation_id) + b"\x00" + body  # response header v1: no tagged fields
    return struct.pack(">i", len(payload)) + payload


def fetch_request(correlation_id: int) -> bytes:
    return raw_request(ApiKey.FETCH, VERSION, correlation_id, b"app", b"\x00" * 40)


def sent_fetch(pair: Pair, correlation_id: int = 2) -> int:
    """The client sends a Fetch v16; returns how many writes the client had before its answer."""
    pair.conn.data_received(fetch_request(correlation_id))
    return len(pair.client.writes)


def sent_since(pair: Pair, before: int) -> bytes:
    """What the client got after its first ``before`` writes."""
    return b"".join(bytes(w) for w in pair.client.writes[before:])


def test_a_long_fetch_response_nothing_moved_in_streams_with_its_tail_held_back():
    async def go():
        pair = armed_pair()
        before = sent_fetch(pair)
        assert type(pair.conn.queue.pending[-1].route) is StreamRoute
        response = fetch_response(2)
        tail = 3  # the partition's, the topic's and the top-level tagged fields: empty
        chunks = [response[:200], response[200:-2], response[-2:]]
        pair.up.data_received(chunks[0])
        assert pair.client.writes[before:] == [chunks[0]]  # the very chunk, before the rest came
        pair.up.data_received(chunks[1])
        assert sent_since(pair, before) == response[:-tail]  # the tail waits
        assert pair.conn.queue.pending[0].correlation_id == 2  # counted once its last byte is out
        pair.up.data_received(chunks[2])
        assert sent_since(pair, before) == response
        assert pair.server.stats.responses[(ApiKey.FETCH, VERSION)] == 1
        assert pair.server.stats.responses_streamed == {ApiKey.FETCH: 1}
        assert pair.server.stats.bytes_upstream_to_client == len(pair.client.bytes())
        assert not pair.conn.queue.pending and not pair.client.closed and pair.up._reader.idle

    asyncio.run(go())


def test_a_streamed_fetch_response_is_followed_by_the_next_response_in_the_same_chunk():
    async def go():
        pair = armed_pair()
        before = sent_fetch(pair, 2)
        pair.conn.data_received(fetch_request(3))
        first, second = fetch_response(2, ((0, 3000),)), fetch_response(3, ((0, 10),))
        pair.up.data_received(first[:100])
        pair.up.data_received(first[100:] + second)  # its end (tail included) and the next whole
        assert sent_since(pair, before) == first + second
        assert pair.server.stats.responses[(ApiKey.FETCH, VERSION)] == 2
        assert not pair.conn.queue.pending

    asyncio.run(go())


def test_a_fetch_response_with_a_moved_partition_is_assembled_for_its_filters():
    async def go():
        pair = armed_pair()
        before = sent_fetch(pair)
        response = fetch_response(2, ((MOVED, 0), (0, 4000)), endpoints=True)
        pair.up.data_received(response[:300])  # the whole head, the moved partition in it
        assert pair.client.writes[before:] == []  # nothing goes before the filters saw it all
        pair.up.data_received(response[300:])
        got = sent_since(pair, before)
        assert struct.unpack_from(">i", got, 4)[0] == 2
        assert b"b3.internal" not in got  # the broker's hint address became a proxy address
        assert pair.server.stats.responses[(ApiKey.FETCH, VERSION)] == 1

    asyncio.run(go())


def test_a_fetch_response_whose_head_is_not_in_its_first_chunk_is_assembled():
    async def go():
        pair = armed_pair()
        before = sent_fetch(pair)
        response = fetch_response(2, ((0, 2000), (0, 2000)))
        # The first chunk ends inside the first partition's records: the second partition's
        # error code is not known yet.
        pair.up.data_received(response[:500])
        assert pair.client.writes[before:] == []
        pair.up.data_received(response[500:])
        assert sent_since(pair, before) == response
        assert not pair.server.stats.responses_streamed

    asyncio.run(go())


def test_node_endpoints_without_a_moved_partition_close_the_stream_and_stop_streaming(caplog):
    async def go():
        pair = armed_pair()
        before = sent_fetch(pair)
        response = fetch_response(2, endpoints=True)  # off KIP-951: no partition moved
        pair.up.data_received(response[:200])
        assert pair.client.writes[before:] == [response[:200]]
        with caplog.at_level(logging.ERROR, logger="proxy.dataplane.connection"):
            pair.up.data_received(response[200:])
        assert pair.client.closed  # the broker address never reached the client
        assert b"b3.internal" not in pair.client.bytes()
        assert "NodeEndpoints without a moved partition" in caplog.text
        # Another connection of the same proxy: such responses are assembled now, and their
        # endpoints rewritten.
        again = Pair(server=pair.server)
        again.exchange(list_offsets(1, "app"))
        before = sent_fetch(again)
        again.up.data_received(response[:200])
        assert again.client.writes[before:] == []
        again.up.data_received(response[200:])
        got = sent_since(again, before)
        assert struct.unpack_from(">i", got, 4)[0] == 2 and b"b3.internal" not in got
        assert not again.client.closed

    asyncio.run(go())


def test_fetch_responses_stream_only_where_every_fetch_filter_can_say_so():
    route = ProxyServer(parse_config(BASE)).chain.response_route[ApiKey.FETCH]
    assert route[0] == VERSION and type(route[1]) is StreamRoute
    with_quota = ProxyServer(parse_config({**BASE, "quotas": [{"client_id": "app", "consumer_byte_rate": 10**9}]}))
    assert with_quota.chain.response_route[ApiKey.FETCH][1] is None  # the quota counts every response's bytes

