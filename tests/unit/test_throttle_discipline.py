"""Kafka's per-connection discipline for throttled work, in process.

Kafka reads one request per connection and keeps a throttled channel muted until its throttle
ends (SocketServer's Processor, ClientQuotaManager.throttle), so pipelining buys a client
nothing once it is throttled. The proxy pipelines, but once a request of a connection is given
a throttle, the connection's later requests (already read or not) are neither charged nor
forwarded until that response is sent and the mute after it ends; then each is charged when it
is processed. The broker and the client are played by the test (see test_connection_paths).
"""

from __future__ import annotations

import asyncio
import struct

from kafka.protocol.consumer import ListOffsetsRequest, ListOffsetsResponse
from kafka.protocol.producer import ProduceRequest, ProduceResponse

from config import parse_config
from proxy.dataplane.filters.quotas import now_ms
from quotas import PRODUCER_BYTE_RATE, REQUEST_RATE

from .test_connection_paths import BASE, Pair, request

QUOTA_BYTES = 10_000


def _pair(**quota) -> Pair:
    return Pair({**BASE, "quotas": [{"client_id": "app", **quota}]})


def _produce(correlation_id: int, acks: int = 1, value_bytes: int = 4_000) -> bytes:
    """A Produce v7 whose size is mostly ``value_bytes`` of opaque records."""
    req = ProduceRequest[7](transactional_id=None, acks=acks, timeout_ms=1000, topic_data=[
        ("t", [(0, b"\0" * value_bytes)]),
    ])
    return request(req, correlation_id, "app")


def _produce_answer(correlation_id: int) -> bytes:
    body = struct.pack(">i", correlation_id) + bytes(ProduceResponse[7](responses=[], throttle_time_ms=0).encode())
    return struct.pack(">i", len(body)) + body


def _charged(pair: Pair, kind: str) -> float:
    """What the quota of client id "app" has recorded in its window."""
    now = now_ms()
    return pair.server.quotas._entity("ANONYMOUS", "app", kind, now).rate.total_at(now)


def _correlation_ids(frames: list[bytes]) -> list[int]:
    return [struct.unpack_from(">i", f, 4)[0] for f in frames]


def _end_mute(pair: Pair) -> None:
    """The mute's timer fires now (instead of after the throttle)."""
    pair.conn.channel_mute.cancel()
    pair.conn.channel_mute.end()


def test_requests_pipelined_behind_a_throttled_one_are_neither_charged_nor_forwarded():
    async def go():
        pair = _pair(producer_byte_rate=QUOTA_BYTES / 10)
        # Ten window samples of quota admit 10 kB: the third 4 kB request crosses it.
        chunk = b"".join(_produce(i) for i in range(1, 9))
        pair.conn.data_received(chunk)
        assert _correlation_ids(pair.requests_seen_by_broker()) == [1, 2, 3]
        assert pair.conn.queue.pending[-1].throttle_ms > 0
        charged = _charged(pair, PRODUCER_BYTE_RATE)
        assert charged == 3 * len(_produce(1)) - 3 * 4  # request sizes, without size prefixes
        assert pair.client.paused  # not read while a throttled request is in progress
        # More pipelined bytes that were already in flight are held too, and cost nothing.
        pair.conn.data_received(_produce(9))
        assert _correlation_ids(pair.requests_seen_by_broker()) == [1, 2, 3]
        assert _charged(pair, PRODUCER_BYTE_RATE) == charged
        pair.conn._teardown()

    asyncio.run(go())


def test_held_requests_wait_for_the_response_and_the_mute_then_are_charged_one_by_one():
    async def go():
        pair = _pair(producer_byte_rate=QUOTA_BYTES / 10)
        pair.conn.data_received(b"".join(_produce(i) for i in range(1, 7)))
        throttled = pair.conn.queue.pending[-1]
        for i in (1, 2, 3):
            pair.up.data_received(_produce_answer(i))
        # KIP-219: the throttled response goes back at once, carrying the throttle; the mute
        # follows it, and the held requests still wait.
        (throttle_in_response,) = struct.unpack_from(">i", pair.client.writes[-1], 4 + 4 + 4)
        assert throttle_in_response == throttled.throttle_ms > 0
        assert pair.conn.channel_mute.timer is not None and pair.client.paused
        assert _correlation_ids(pair.requests_seen_by_broker()) == [1, 2, 3]
        charged = _charged(pair, PRODUCER_BYTE_RATE)
        _end_mute(pair)
        # The mute ended: the next held request is charged now, and (still over the quota) it
        # is throttled and forwarded alone; the others stay held behind it.
        assert _correlation_ids(pair.requests_seen_by_broker()) == [1, 2, 3, 4]
        assert _charged(pair, PRODUCER_BYTE_RATE) == charged + len(_produce(4)) - 4
        assert pair.conn.queue.pending[-1].throttle_ms > 0 and pair.client.paused
        assert len(pair.conn.requests.held) == 2
        pair.conn._teardown()

    asyncio.run(go())


def test_a_connection_under_its_quota_is_not_held():
    async def go():
        pair = _pair(producer_byte_rate=1e9, request_rate=1e6)
        pair.conn.data_received(b"".join(_produce(i) for i in range(1, 21)))
        assert _correlation_ids(pair.requests_seen_by_broker()) == list(range(1, 21))
        assert not pair.client.paused and not pair.conn.requests.held
        for i in range(1, 21):
            pair.up.data_received(_produce_answer(i))
        assert pair.conn.channel_mute is None and not pair.client.paused  # never muted
        pair.conn._teardown()

    asyncio.run(go())


def test_a_throttled_acks0_produce_mutes_at_once_and_holds_what_follows():
    async def go():
        pair = _pair(producer_byte_rate=QUOTA_BYTES / 10)
        pair.conn.data_received(b"".join(_produce(i, acks=0) for i in range(1, 6)))
        # acks=0 has no response to carry the throttle: the mute starts with the request.
        assert _correlation_ids(pair.requests_seen_by_broker()) == [1, 2, 3]
        assert pair.conn.channel_mute.timer is not None and pair.client.paused
        assert not pair.conn.queue.pending  # nothing is registered or invented for acks=0
        _end_mute(pair)
        assert _correlation_ids(pair.requests_seen_by_broker()) == [1, 2, 3, 4]
        assert pair.conn.channel_mute.timer is not None  # throttled again, muted again
        pair.conn._teardown()

    asyncio.run(go())


def test_a_request_rate_throttle_holds_every_api():
    async def go():
        pair = _pair(request_rate=0.01)
        offsets = [request(ListOffsetsRequest[2](replica_id=-1, isolation_level=0, topics=[]), i, "app")
                   for i in range(1, 4)]
        pair.conn.data_received(b"".join(offsets))
        assert _correlation_ids(pair.requests_seen_by_broker()) == [1]
        assert _charged(pair, REQUEST_RATE) == 1
        body = struct.pack(">i", 1) + bytes(ListOffsetsResponse[2](throttle_time_ms=0, topics=[]).encode())
        pair.up.data_received(struct.pack(">i", len(body)) + body)
        assert _correlation_ids(pair.requests_seen_by_broker()) == [1]
        _end_mute(pair)
        assert _correlation_ids(pair.requests_seen_by_broker()) == [1, 2]
        assert _charged(pair, REQUEST_RATE) == 2
        pair.conn._teardown()

    asyncio.run(go())


def test_a_reload_that_removes_the_quota_lets_held_requests_through_uncharged_once_the_mute_ends():
    async def go():
        pair = _pair(producer_byte_rate=QUOTA_BYTES / 10)
        pair.conn.data_received(b"".join(_produce(i) for i in range(1, 7)))
        for i in (1, 2, 3):
            pair.up.data_received(_produce_answer(i))
        pair.server.reload(parse_config(BASE))
        _end_mute(pair)
        # Charged (by nobody) when processed, under the configuration in force then.
        assert _correlation_ids(pair.requests_seen_by_broker()) == [1, 2, 3, 4, 5, 6]
        assert not pair.client.paused and not pair.conn.requests.held
        pair.conn._teardown()

    asyncio.run(go())


def test_garbage_after_the_request_that_gets_throttled_is_rejected_once_the_hold_ends():
    async def go():
        pair = _pair(producer_byte_rate=QUOTA_BYTES / 10)
        # The third request crosses the quota and is the last whole frame before a bad size.
        pair.conn.data_received(b"".join(_produce(i) for i in range(1, 4)) + struct.pack(">i", -5))
        assert pair.conn.requests.held_error is not None and not pair.client.closed
        for i in (1, 2, 3):
            pair.up.data_received(_produce_answer(i))
        _end_mute(pair)
        assert pair.client.closed
        assert pair.server.stats.frames_rejected["bad_frame"] == 1

    asyncio.run(go())
