"""The route planner's invariant (proxy.dataplane.routes): a fast route never carries a throttle, a mute or
a response filter that must see the response whole.

Checked two ways: over every API and version of the real chain under several configurations
(the planner's answer against the filters' declared specs), and through a real connection (a
throttled request whose response would otherwise take each fast route gets its throttle written
into the response and mutes the connection)."""

from __future__ import annotations

import asyncio
import struct

import pytest
from kafka.protocol.metadata import ApiVersionsResponse

from config import parse_config
from protocol.apis import SPECS, ApiKey
from proxy.app.server import ProxyServer
from proxy.dataplane.filters.api import FilterSpec, Forward
from proxy.dataplane.filters.chain import UNFILTERED, FilterChain
from proxy.dataplane.inflight import InFlight
from proxy.dataplane.routes import AS_READ, ASSEMBLED, STREAM_SCANS, ChunkChain, StreamRoute, plan_route

from .test_connection_paths import BASE, LIST_OFFSETS, Pair, api_versions, list_offsets
from .test_fetch_stream import fetch_request, fetch_response

CONFIGS = {
    "no quota": BASE,
    "every quota": {**BASE, "quotas": [{"client_id": "app", "request_rate": 100, "producer_byte_rate": 1e6,
                                        "consumer_byte_rate": 1e6, "controller_mutation_rate": 10}],
                    "producer_id_quota": {}},
    "usage log": {**BASE, "usage_log": {"directory": "{tmp}"}},
}


def _server(name: str, tmp_path) -> ProxyServer:
    raw = CONFIGS[name]
    if "usage_log" in raw:
        raw = {**raw, "usage_log": {**raw["usage_log"], "directory": str(tmp_path)}}
    return ProxyServer(parse_config(raw))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_planner_gives_a_fast_route_only_where_the_specs_allow_it(name, tmp_path):
    chain = _server(name, tmp_path).chain
    seen = set()
    for key, spec in SPECS.items():
        since, filters = chain.response.get(key, UNFILTERED)
        for version in range(spec.max_version + 2):
            for throttle_ms in (0, 250):
                for rewrite in (None, bytes):
                    entry = InFlight(1, key, version, 0.0)
                    entry.throttle_ms = throttle_ms
                    entry.on_response = rewrite
                    route = plan_route(chain.response_route, entry)
                    if throttle_ms or rewrite is not None:
                        assert route is ASSEMBLED, (key, version)  # the invariant
                        continue
                    if route is AS_READ:
                        seen.add("as read")
                        assert version < since, (key, version)  # no response filter looks at it
                    elif type(route) is StreamRoute:
                        seen.add("stream")
                        assert key in STREAM_SCANS and version >= since
                        assert route.filters == filters and all(f.spec.stream for f in filters)
                    elif route is not ASSEMBLED:
                        # A chunk route only where every filter of the API has the chunk role.
                        assert filters and all(f.spec.chunk for f in filters) and version >= since
                        if type(route) is ChunkChain:
                            seen.add("chunk chain")
                            assert route.chunks == tuple(f.on_response_chunk for f in filters)
                            assert len(filters) > 1
                        else:
                            seen.add("chunk")
                            (only,) = filters
                            assert route == only.on_response_chunk
                    else:
                        seen.add("assembled")
                        assert version >= since and filters
    # Not vacuous: each kind of route occurs (the byte quota and the usage log's record count
    # see a Fetch response whole, so it streams only without them).
    assert seen >= {"as read", "chunk", "chunk chain", "assembled"} | ({"stream"} if name == "no quota" else set())


def test_a_reload_sends_every_awaited_response_through_the_filters():
    async def go():
        pair = Pair()
        pair.conn.data_received(list_offsets(1, "app"))
        assert pair.conn.queue.awaiting[-1].route is AS_READ
        pair.server.reload(parse_config(BASE))
        assert pair.conn.queue.awaiting[-1].route is ASSEMBLED
        pair.conn._teardown()

    asyncio.run(go())


def _throttled_pair() -> Pair:
    """A connection whose every request is given a throttle (request_rate 0.01/s)."""
    return Pair(raw={**BASE, "quotas": [{"client_id": "app", "request_rate": 0.01}]})


def _written_throttle(pair: Pair, offset: int = 8) -> int:
    return struct.unpack_from(">i", pair.client.writes[-1], offset)[0]


def test_a_throttled_request_whose_response_would_go_back_as_read_is_rewritten_and_mutes():
    async def go():
        pair = _throttled_pair()
        pair.conn.data_received(list_offsets(2, "app"))
        entry = pair.conn.queue.pending[-1]
        assert entry.throttle_ms > 0 and entry.route is ASSEMBLED
        assert pair.server.chain.response_route.get(LIST_OFFSETS) is None  # unthrottled: AS_READ
        pair.up.data_received(struct.pack(">i", 8) + struct.pack(">ii", 2, 0))  # ListOffsets v1: no topics
        assert pair.client.writes[-1][4:8] == struct.pack(">i", 2)
        assert pair.client.paused and pair.conn.channel_mute.timer is not None
        pair.conn._teardown()

    asyncio.run(go())


def test_a_throttled_request_whose_response_has_a_chunk_filter_gets_its_throttle():
    async def go():
        pair = _throttled_pair()
        pair.conn.data_received(api_versions(3, 2, "app"))
        entry = pair.conn.queue.pending[-1]
        assert entry.throttle_ms > 0 and entry.route is ASSEMBLED
        body = bytes(ApiVersionsResponse[3](error_code=0, throttle_time_ms=0, api_keys=[]).encode())
        payload = struct.pack(">i", 2) + body
        pair.up.data_received(struct.pack(">i", len(payload)) + payload)  # exactly one chunk
        # ApiVersions v3: error code (2 bytes), the api keys (a compact array, 1 byte), then the throttle.
        assert _written_throttle(pair, 8 + 2 + 1) == entry.throttle_ms
        assert pair.client.paused and pair.conn.channel_mute.timer is not None
        pair.conn._teardown()

    asyncio.run(go())


class ThrottleFetch:
    """Gives every Fetch a throttle, as a request-side quota or limiter would, while Fetch's
    response filters (leader hints, endpoints) all have the stream role."""

    spec = FilterSpec(request_keys=frozenset({ApiKey.FETCH}))

    def on_request(self, ctx, header, frame, entry):
        return Forward(throttle_ms=700)


def test_a_throttled_fetch_is_never_streamed_even_where_its_filters_would_stream_it():
    async def go():
        server = ProxyServer(parse_config(BASE))
        server.chain = FilterChain([ThrottleFetch()], server.chain._response_filters)
        assert type(server.chain.response_route[ApiKey.FETCH][1]) is StreamRoute
        pair = Pair(server=server)
        pair.exchange(list_offsets(1, "app"))
        pair.conn.data_received(fetch_request(2))
        entry = pair.conn.queue.pending[-1]
        assert entry.throttle_ms == 700 and entry.route is ASSEMBLED
        response = fetch_response(2)
        for chunk in (response[:200], response[200:-2], response[-2:]):  # as the streaming test sends it
            pair.up.data_received(chunk)
        assert pair.server.stats.responses_streamed.get(ApiKey.FETCH, 0) == 0
        # Response header v1 (a tagged-fields byte), then throttle_time_ms.
        assert _written_throttle(pair, 9) == 700 and len(pair.client.writes[-1]) == len(response)
        assert pair.client.paused and pair.conn.channel_mute.timer is not None
        pair.conn._teardown()

    asyncio.run(go())


@pytest.mark.parametrize("case", ["nothing moved", "endpoints", "moved"])
def test_a_produce_response_in_one_chunk_goes_back_as_its_filters_send_it_assembled(case):
    """Produce v10+ responses have two filters with the chunk role (KIP-951's leader hints and
    the endpoint rewrite): one that arrives in one chunk takes their chunk chain, and the client
    gets what the assembled path sends (the same response split over two chunks), the cache
    learns the same leaders. Nothing to change: the broker's very chunk goes back."""
    from protocol.frames import frame
    from protocol.headers import encode_response_header
    from protocol.messages import decode_response, encode_body

    from .test_connection_paths import produce
    from .test_scan import produce_body

    body = {"nothing moved": produce_body(10, errors_by_topic=((0,),), endpoints=False),
            "endpoints": produce_body(10, errors_by_topic=((0,),), endpoints=True),
            "moved": produce_body(10, errors_by_topic=((0, 6),), endpoints=True)}[case]
    response = frame(encode_response_header(7, True) + body)

    def run(split: bool) -> tuple[object, list, object, list]:
        async def go() -> tuple[object, list, object, list]:
            pair = Pair()
            pair.conn.data_received(produce(10, 1, 7, "app"))
            route = pair.conn.queue.awaiting[-1].route
            if split:
                pair.up.data_received(response[:9])
                pair.up.data_received(response[9:])
            else:
                pair.up.data_received(response)
            leader = pair.conn.ctx.leaders.leader("topic-0", 1)
            writes = list(pair.client.writes)
            sent = b"".join(bytes(w) for w in writes)
            resp = decode_response(0, 10, memoryview(sent)[9:])  # size, correlation id, tagged fields
            # The broker's endpoints are the proxy's now (its listener for node 3): the same
            # response apart from that port, which each proxy picks.
            advertised = [pair.conn.ctx.cluster.advertise(3, "b3.internal", 9094)] if case != "nothing moved" else []
            assert [(e.host, e.port) for e in resp.node_endpoints] == advertised
            resp.node_endpoints = []
            pair.conn._teardown()
            return route, writes, leader, [sent[:9], encode_body(resp)]

        return asyncio.run(go())

    route, chunked, leader, chunked_parts = run(split=False)
    _, assembled, leader_assembled, assembled_parts = run(split=True)
    assert type(route) is ChunkChain
    assert chunked_parts[1] == assembled_parts[1] and chunked_parts[0][4:] == assembled_parts[0][4:]
    assert leader == leader_assembled
    if case == "nothing moved":
        assert chunked == [response] and chunked[0] is response  # the broker's very chunk
        assert b"".join(bytes(w) for w in assembled) == response
        assert leader is None
    if case == "moved":
        assert leader is not None and leader.leader == 3


def test_acks_a_later_filter_rewrote_decide_whether_the_broker_answers():
    """The batch scan reads a Produce before the operator's filters; one that rewrites the
    request to acks=0 makes the proxy await no answer (the broker sends none), and the next
    request's answer is matched to it, not taken for the Produce's."""
    from proxy.dataplane.filters.chain import FilterChain
    from proxy.dataplane.filters.records import ProduceScanFilter, produce_scan

    from .test_connection_paths import _acks, produce

    class Reader:  # reads the batches, so the scan runs first
        spec = FilterSpec(request_keys=frozenset({ApiKey.PRODUCE}))

        def on_request(self, ctx, header, frame, entry):
            produce_scan(ctx, header, frame, entry)

    class FireAndForget:  # an operator's filter: acks=0 for every Produce
        spec = FilterSpec(request_keys=frozenset({ApiKey.PRODUCE}))

        def on_request(self, ctx, header, frame, entry):
            rewritten = bytearray(frame)
            pos = 10 + struct.unpack_from(">h", rewritten, 8)[0] + 2  # v8, no transactional id
            rewritten[pos : pos + 2] = struct.pack(">h", 0)
            return Forward(bytes(rewritten))

    async def go() -> Pair:
        pair = Pair()
        reader = Reader()
        pair.conn.chain = pair.conn.requests.chain = FilterChain([ProduceScanFilter([reader]), reader,
                                                                   FireAndForget()], [])
        pair.conn.requests.table = pair.conn.chain.request
        pair.conn.data_received(produce(8, 1, 1, "app"))
        [sent] = pair.requests_seen_by_broker()
        assert _acks(sent, 8) == 0 and not pair.conn.queue.awaiting  # no answer awaited
        pair.exchange(list_offsets(2, "app"))
        return pair

    pair = asyncio.run(go())
    assert not pair.conn.closed and pair.answered() == [2]
