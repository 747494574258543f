"""The connection's hot paths give exactly what the general path gives.

A request that is one whole chunk, from the client id already seen, at a version no filter looks
at, is forwarded as the very bytes that came in, and its response goes back the same way. These
tests drive a ClientConnection and its UpstreamConnection in process, with transports that
record what is written (no sockets: the point is which path each frame takes and that the
bytes, order and counts are the same whatever the chunking). The broker is played by the test.
"""

from __future__ import annotations

import asyncio
import struct

import pytest
from kafka.protocol.consumer import FetchRequest, FetchResponse, ListOffsetsRequest, ListOffsetsResponse
from kafka.protocol.metadata import ApiVersionsRequest, ApiVersionsResponse
from kafka.protocol.producer import ProduceRequest

from config import parse_config
from protocol.apis import SPECS, ApiKey
from protocol.frames import FrameReader
from proxy.app.server import ProxyServer
from proxy.dataplane.connection import ClientConnection, UpstreamConnection
from proxy.dataplane.filters.api import Defer, FilterSpec
from proxy.dataplane.filters.chain import FilterChain
from proxy.dataplane.inflight import InFlight
from proxy.dataplane.routes import AS_READ, plan_route
from proxy.observability.stats import SLOT_VERSIONS

LIST_OFFSETS = 2

BASE = {
    "upstream": {"bootstrap_servers": ["127.0.0.1:1"]},
    "listen": {"bootstrap_port": 0, "broker_port_base": 0},
    "metrics": {"enabled": False},
}


class Wire:
    """A transport that keeps every object written to it."""

    def __init__(self) -> None:
        self.writes: list = []
        self.paused = False
        self.closed = False

    def write(self, data) -> None:
        self.writes.append(data)

    def writelines(self, buffers) -> None:
        self.writes.append(b"".join(bytes(b) for b in buffers))

    def get_extra_info(self, name):
        return ("127.0.0.1", 40000) if name == "peername" else None

    def set_write_buffer_limits(self, **_) -> None:
        pass

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def is_closing(self) -> bool:
        return self.closed

    def set_protocol(self, protocol) -> None:
        self.protocol = protocol

    def deliver(self, owner, data: bytes) -> None:
        """Hands ``data`` to whichever protocol reads this transport now, as a loop does: a
        BufferedProtocol (proxy.dataplane.reads) gets what each buffer it gives takes."""
        pos = 0
        while pos < len(data):
            protocol = getattr(self, "protocol", None) or owner
            if not isinstance(protocol, asyncio.BufferedProtocol):
                protocol.data_received(data[pos:])
                return
            view = protocol.get_buffer(-1)
            n = min(len(view), len(data) - pos)
            view[:n] = data[pos : pos + n]
            pos += n
            protocol.buffer_updated(n)

    def close(self) -> None:
        self.closed = True

    def bytes(self) -> bytes:
        return b"".join(bytes(w) for w in self.writes)


class Pair:
    """A client connection whose broker connection is already up (as _connect_upstream leaves it)."""

    def __init__(self, raw: dict | None = None, server: ProxyServer | None = None) -> None:
        self.server = server or ProxyServer(parse_config(raw or BASE))
        self.conn = ClientConnection(self.server.env, None)
        self.client = Wire()
        self.conn.connection_made(self.client)
        assert self.conn._connect_task is None  # opened with the first request forwarded
        self.up = UpstreamConnection(self.conn)
        self.broker = Wire()
        self.up.connection_made(self.broker)
        self.conn.upstream = self.up

    def requests_seen_by_broker(self) -> list[bytes]:
        return [bytes(f) for f in FrameReader(1 << 30).feed(self.broker.bytes())]

    def exchange(self, request: bytes) -> None:
        """The client sends ``request``; the broker answers it."""
        self.conn.data_received(request)
        self.up.data_received(answer(request[4:]))

    def answered(self) -> list[int]:
        """The correlation ids of every response the client got, in order."""
        return [struct.unpack_from(">i", f)[0] for f in FrameReader(1 << 30).feed(self.client.bytes())]


def armed_pair() -> Pair:
    """A pair whose connection parsed one request from client id "app" in full (its answer
    sent): the hot paths are on for "app"."""
    pair = Pair()
    pair.exchange(list_offsets(1, "app"))
    return pair


def request(req, correlation_id: int, client_id: str | None) -> bytes:
    req.with_header(correlation_id=correlation_id, client_id=client_id)
    return bytes(req.encode(header=True, framed=True))


def produce(version: int, acks: int, correlation_id: int, client_id: str | None, transactional_id=None) -> bytes:
    R = ProduceRequest[version]
    fields = {"acks": acks, "timeout_ms": 1000, "topic_data": []}
    if version >= 3:
        fields["transactional_id"] = transactional_id
    return request(R(**fields), correlation_id, client_id)


def list_offsets(correlation_id: int, client_id: str | None) -> bytes:
    return request(ListOffsetsRequest[1](replica_id=-1, topics=[]), correlation_id, client_id)


def api_versions(version: int, correlation_id: int, client_id: str | None) -> bytes:
    if version >= 3:
        return request(ApiVersionsRequest[version](client_software_name="t", client_software_version="1"),
                       correlation_id, client_id)
    return request(ApiVersionsRequest[version](), correlation_id, client_id)


def raw_request(api_key: int, version: int, correlation_id: int, client_id: bytes | None, tail: bytes = b"") -> bytes:
    id_field = struct.pack(">h", -1) if client_id is None else struct.pack(">h", len(client_id)) + client_id
    body = struct.pack(">hhi", api_key, version, correlation_id) + id_field + tail
    return struct.pack(">i", len(body)) + body


API_VERSIONS_BODY = bytes(ApiVersionsResponse[3](
    error_code=0, throttle_time_ms=0,
    api_keys=[ApiVersionsResponse[3].ApiVersion(api_key=k, min_version=0, max_version=SPECS[k].max_version)
              for k in (0, 1, 2, 3, 12, 18)],
).encode())


def answer(frame: bytes) -> bytes | None:
    """The broker's response to one request frame (no size prefix); None for acks=0."""
    key, version, correlation_id = struct.unpack_from(">hhi", frame)
    if key == ApiKey.PRODUCE and _acks(frame, version) == 0:
        return None
    if key == ApiKey.API_VERSIONS:
        body = API_VERSIONS_BODY
    elif len(frame) > 200:  # a long request gets a long answer (streamed when split into chunks)
        body = b"long-body-%d-" % correlation_id + b"y" * 300
    else:
        body = b"body-%d" % correlation_id
    payload = struct.pack(">i", correlation_id) + body
    return struct.pack(">i", len(payload)) + payload


def _acks(frame: bytes, version: int) -> int:
    (id_len,) = struct.unpack_from(">h", frame, 8)
    pos = 10 + max(id_len, 0)
    if version >= 9:
        pos += 1  # empty header tagged fields
        n = frame[pos]
        pos += 1 + max(n - 1, 0)  # compact nullable string
    elif version >= 3:
        (n,) = struct.unpack_from(">h", frame, pos)
        pos += 2 + max(n, 0)
    return struct.unpack_from(">h", frame, pos)[0]


def scenario() -> list[bytes]:
    """Requests a client might send, every path represented."""
    return [
        api_versions(3, 1, "app"),  # first request: parsed in full
        list_offsets(2, "app"),  # hot path
        produce(8, 1, 3, "app"),  # hot path (acks read from the frame)
        produce(8, 0, 4, "app"),  # acks=0: general path, never answered
        produce(3, -1, 5, "app", transactional_id="tx-1"),  # hot path past a transactional id
        produce(2, 0, 6, "app"),  # acks=0 before transactional ids existed
        produce(9, 1, 7, "app"),  # flexible header without tagged fields: hot path
        raw_request(ApiKey.API_VERSIONS, 99, 8, b"app", b"\x00"),  # answered by the proxy itself
        list_offsets(9, "app"),  # hot path, its answer must wait behind the broker's to 7
        raw_request(999, 0, 10, b"app"),  # unknown API: forwarded, counted as unknown
        list_offsets(11, "other"),  # another client id: parsed in full
        list_offsets(12, "other"),  # hot path again
        list_offsets(13, "otter"),  # same length, another id: parsed in full
        list_offsets(14, None),  # null client id
        list_offsets(15, None),
        api_versions(3, 16, None),
        list_offsets(17, None),  # hot path, with the proxy's own answer to 18 waiting behind it
        raw_request(ApiKey.API_VERSIONS, 99, 18, None, b"\x00"),
        produce(9, 0, 19, None),  # acks=0 behind a flexible header: never answered
        big_produce(20, None),  # longer than a header chunk: the rest passes through as it comes
        # Answered by the proxy itself, behind 20's long answer, streamed when split in chunks.
        raw_request(ApiKey.API_VERSIONS, 99, 21, None, b"\x00"),
    ]


def big_produce(correlation_id: int, client_id: str | None) -> bytes:
    """A Produce v8 (acks=1) of 244-odd bytes; its records are not a real batch (never read)."""
    R = ProduceRequest[8]
    data = R.TopicProduceData(name="t",
                              partition_data=[R.TopicProduceData.PartitionProduceData(index=0, records=b"x" * 200)])
    return request(R(acks=1, timeout_ms=1000, transactional_id=None, topic_data=[data]), correlation_id, client_id)


def run(chunks_of, requests: list[bytes], ping_pong: bool) -> tuple[Pair, list]:
    """Feeds the requests (chunked by ``chunks_of``) and the broker's answers; returns the pair
    and the client id the session held after each request chunk."""
    async def go():
        pair = Pair()
        seen_ids = []
        answered = 0

        def answer_new() -> None:
            nonlocal answered
            frames = pair.requests_seen_by_broker()
            for frame in frames[answered:]:
                response = answer(frame)
                if response is not None:
                    for chunk in chunks_of(response):
                        pair.up.data_received(chunk)
            answered = len(frames)

        for chunk in chunks_of(b"".join(requests)) if not ping_pong else [c for r in requests for c in chunks_of(r)]:
            pair.conn.data_received(chunk)
            seen_ids.append(pair.conn.ctx.session.client_id)
            if ping_pong:
                answer_new()
        answer_new()
        return pair, seen_ids

    return asyncio.run(go())


def whole(data: bytes) -> list[bytes]:
    """Frame by frame, each frame its own chunk (what the hot paths see)."""
    return [bytes(f) for f in _frames_with_prefix(data)]


def _frames_with_prefix(data: bytes):
    pos = 0
    while pos < len(data):
        (size,) = struct.unpack_from(">i", data, pos)
        yield data[pos : pos + 4 + size]
        pos += 4 + size


def one_chunk(data: bytes) -> list[bytes]:
    return [data]


def split_after_header(data: bytes) -> list[bytes]:
    """Every frame in two chunks: its first 30 bytes (the header, and a Produce's acks), then
    the rest (what the hot path passes through as it comes)."""
    return [part for f in _frames_with_prefix(data) for part in (f[:30], f[30:]) if part]


def fifty_byte_chunks(data: bytes) -> list[bytes]:
    """Chunks that end inside frames and hold the tail of one and the head of the next."""
    return [data[i : i + 50] for i in range(0, len(data), 50)]


def byte_by_byte(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


def outcome(pair: Pair) -> dict:
    s = pair.server.stats
    return {
        "to_broker": pair.broker.bytes(),
        "to_client": pair.client.bytes(),
        "requests": dict(s.requests),
        "responses": dict(s.responses),
        "unknown": s.unknown_api_requests,
        "bytes": (s.bytes_client_to_upstream, s.bytes_upstream_to_client),
        "latency_counts": {k: sum(h.counts) for k, h in s.latency.items()},
        "owed": len(pair.conn.queue.pending),
        "closed": pair.client.closed,
    }


@pytest.mark.parametrize("ping_pong", [True, False], ids=["ping-pong", "pipelined"])
def test_every_chunking_gives_the_same_bytes_order_and_counts(ping_pong):
    requests = scenario()
    fast, _ = run(whole, requests, ping_pong)
    reference = outcome(fast)
    assert not reference["closed"] and reference["owed"] == 0
    for chunking in (one_chunk, byte_by_byte, split_after_header, fifty_byte_chunks):
        assert outcome(run(chunking, requests, ping_pong)[0]) == reference, chunking.__name__


def test_responses_reach_the_client_in_request_order_with_every_answer():
    pair, _ = run(whole, scenario(), ping_pong=False)
    assert pair.answered() == [1, 2, 3, 5, *range(7, 19), 20, 21]  # 4, 6 and 19 were acks=0


def test_the_client_id_is_always_the_one_of_the_last_request():
    requests = scenario()
    _, ids = run(whole, requests, ping_pong=True)
    expected = ["app"] * 10 + ["other", "other", "otter"] + [None] * 8
    assert ids == expected


def test_a_long_response_nothing_changes_goes_back_as_it_comes():
    async def go():
        pair = armed_pair()
        long_request = big_produce(2, "app")
        pair.conn.data_received(long_request)
        pair.conn.data_received(raw_request(ApiKey.API_VERSIONS, 99, 3, b"app", b"\x00"))  # the proxy answers
        pair.conn.data_received(list_offsets(4, "app"))
        response = answer(long_request[4:])
        chunks = [response[:40], response[40:200], response[200:] + answer(list_offsets(4, "app")[4:])]
        written = len(pair.client.writes)
        pair.up.data_received(chunks[0])
        pair.up.data_received(chunks[1])
        assert pair.client.writes[written:] == [chunks[0], chunks[1]]  # as they came, unassembled
        assert pair.client.writes[written] is chunks[0]
        assert pair.conn.queue.pending[0].correlation_id == 2  # counted once its last byte is out
        pair.up.data_received(chunks[2])  # its end, and the next response whole
        frames = FrameReader(1 << 30).feed(pair.client.bytes())
        assert [struct.unpack_from(">i", f)[0] for f in frames] == [1, 2, 3, 4]  # 3 waited behind 2
        assert bytes(frames[1]) == response[4:]
        assert pair.server.stats.responses[(ApiKey.PRODUCE, 8)] == 1
        assert pair.server.stats.bytes_upstream_to_client == len(pair.client.bytes())
        assert not pair.conn.queue.pending and not pair.client.closed

    asyncio.run(go())


def test_an_undecodable_response_closes_its_connection_counted_once():
    async def go():
        pair = Pair()
        pair.conn.data_received(raw_request(ApiKey.METADATA, 1, 1, b"app", b"\xff\xff\xff\xff"))
        pair.up.data_received(struct.pack(">ii", 8, 1) + b"\x00\x00\x00\x05")  # no such Metadata body
        assert pair.client.closed and pair.server.stats.decode_failures == 1

    asyncio.run(go())


def test_broker_bytes_after_the_client_closed_mid_stream_are_dropped():
    async def go():
        pair = armed_pair()
        long_request = big_produce(2, "app")
        pair.conn.data_received(long_request)
        response = answer(long_request[4:])
        pair.up.data_received(response[:40])  # streaming
        pair.conn.close()
        pair.up.data_received(response[40:60])  # the broker's bytes still on their way
        pair.up.data_received(b"LLLL" + response[64:])  # were this read as a frame: a 1.28 GB size
        assert pair.up._reader.idle and pair.up._reader.buffered_bytes == 0

    asyncio.run(go())


def test_hot_paths_forward_the_very_bytes_that_came_in():
    async def go():
        pair = Pair()
        first, second = list_offsets(1, "app"), list_offsets(2, "app")
        pair.conn.data_received(first)
        pair.conn.data_received(second)
        assert pair.broker.writes[-1] is second  # not parsed, not copied
        assert pair.broker.writes[0] is not first  # the first request is parsed in full
        r1, r2 = answer(first[4:]), answer(second[4:])
        pair.up.data_received(r1)
        pair.up.data_received(r2)
        assert pair.client.writes == [r1, r2] and pair.client.writes[0] is r1 and pair.client.writes[1] is r2
        assert pair.conn.ctx.session.client_id == "app"

    asyncio.run(go())


def test_an_answer_waiting_behind_a_hot_path_response_goes_out_with_it():
    async def go():
        pair = armed_pair()
        pair.conn.data_received(list_offsets(2, "app"))  # hot path
        pair.conn.data_received(raw_request(ApiKey.API_VERSIONS, 99, 3, b"app", b"\x00"))  # the proxy answers
        assert len(pair.client.writes) == 1  # the answer to 3 waits for the broker's to 2
        pair.up.data_received(answer(list_offsets(2, "app")[4:]))
        assert pair.answered() == [1, 2, 3] and not pair.conn.queue.pending

    asyncio.run(go())


def test_a_version_a_filter_looks_at_is_not_forwarded_untouched():
    async def go():
        pair = armed_pair()
        # ApiVersions above what the proxy knows: its filter answers it, the broker never sees it.
        pair.conn.data_received(raw_request(ApiKey.API_VERSIONS, 99, 2, b"app", b"\x00"))
        assert len(pair.requests_seen_by_broker()) == 1
        (key_err,) = struct.unpack_from(">h", pair.client.writes[-1], 8)
        assert key_err == 35  # UNSUPPORTED_VERSION

    asyncio.run(go())


def test_a_reload_that_adds_a_quota_puts_its_filter_back_on_every_request():
    async def go():
        pair = Pair()
        for i in range(3):
            pair.exchange(list_offsets(i, "app"))
        assert not pair.client.paused
        assert pair.server.quotas.rules == ()
        raw = {**BASE, "quotas": [{"client_id": "app", "request_rate": 0.01}]}
        pair.server.reload(parse_config(raw))
        seen = len(pair.requests_seen_by_broker())
        pair.conn.data_received(request(ListOffsetsRequest[2](replica_id=-1, isolation_level=0, topics=[]), 3, "app"))
        throttle = pair.conn.queue.pending[-1].throttle_ms
        body = struct.pack(">i", 3) + bytes(ListOffsetsResponse[2](throttle_time_ms=0, topics=[]).encode())
        pair.up.data_received(struct.pack(">i", len(body)) + body)
        # The quota is recorded on every request again: the throttle is written into the
        # response and mutes the connection (KIP-219).
        assert throttle > 0
        (throttle_in_response,) = struct.unpack_from(">i", pair.client.writes[-1], 8)
        assert throttle_in_response == throttle
        assert pair.client.paused
        assert len(pair.requests_seen_by_broker()) == seen + 1
        pair.conn._teardown()

    asyncio.run(go())


def test_idle_filters_are_left_out_until_a_refresh_finds_them_busy():
    class Quota:
        idle = True

        @property
        def spec(self):
            return FilterSpec(request_keys=None, idle=self.idle)

        def on_request(self, conn, header, frame, entry):
            return None

    class Versions:
        spec = FilterSpec(request_keys=frozenset({ApiKey.API_VERSIONS}), request_since={ApiKey.API_VERSIONS: 5})

        def on_request(self, conn, header, frame, entry):
            return None

    quota, versions = Quota(), Versions()
    chain = FilterChain([quota, versions], [])
    assert set(chain.request) == set(SPECS)  # every known API has an entry; a miss is unknown
    assert chain.request[ApiKey.API_VERSIONS] == (5, (versions,))
    assert chain.request[ApiKey.METADATA][0] > 2**14  # nothing looks at Metadata requests
    assert chain.request_all[1] == ()
    quota.idle = False
    chain.refresh()
    assert chain.request[ApiKey.API_VERSIONS] == (0, (quota, versions))
    assert chain.request[ApiKey.METADATA] == (0, (quota,))
    assert chain.request_all == (0, (quota,))


def test_api_versions_responses_after_the_first_are_rewritten_from_the_chunk(monkeypatch):
    async def go():
        pair = Pair()
        decoded = []
        (versions_filter,) = pair.server.chain.response[ApiKey.API_VERSIONS][1]
        on_response = versions_filter.on_response
        monkeypatch.setattr(versions_filter, "on_response", lambda *a: decoded.append(1) or on_response(*a))
        # A broker that offers a Produce version beyond what the proxy can decode.
        body = bytes(ApiVersionsResponse[3](error_code=0, throttle_time_ms=0, api_keys=[
            ApiVersionsResponse[3].ApiVersion(api_key=ApiKey.PRODUCE, min_version=0, max_version=99)]).encode())
        for correlation_id in (1, 2, 3):
            pair.conn.data_received(api_versions(3, correlation_id, "app"))
            response = struct.pack(">i", correlation_id) + body
            pair.up.data_received(struct.pack(">i", len(response)) + response)
        assert len(decoded) == 1  # only the first response went through on_response
        responses = list(FrameReader(1 << 30).feed(pair.client.bytes()))
        assert [struct.unpack_from(">i", r)[0] for r in responses] == [1, 2, 3]
        assert len({bytes(r[4:]) for r in responses}) == 1  # the same rewrite every time
        capped = ApiVersionsResponse[3].decode(bytes(responses[2][4:]))
        assert [k.max_version for k in capped.api_keys] == [SPECS[ApiKey.PRODUCE].max_version]
        assert pair.server.stats.responses[(ApiKey.API_VERSIONS, 3)] == 3
        assert pair.server.stats.bytes_upstream_to_client == len(pair.client.bytes())

    asyncio.run(go())


def test_an_api_versions_answer_that_changes_is_rewritten_again():
    async def go():
        pair = Pair()

        def body(metadata_max: int) -> bytes:  # the same length whatever the version
            return bytes(ApiVersionsResponse[3](error_code=0, throttle_time_ms=0, api_keys=[
                ApiVersionsResponse[3].ApiVersion(api_key=ApiKey.METADATA, min_version=0, max_version=metadata_max),
                # beyond what the proxy decodes: every answer is rewritten
                ApiVersionsResponse[3].ApiVersion(api_key=ApiKey.PRODUCE, min_version=0, max_version=99),
            ]).encode())

        # A broker rolled from Metadata v7 to v8 and back, between a connection's ApiVersions.
        for correlation_id, metadata_max in ((1, 7), (2, 7), (3, 8), (4, 8), (5, 7)):
            pair.conn.data_received(api_versions(3, correlation_id, "app"))
            response = struct.pack(">i", correlation_id) + body(metadata_max)
            pair.up.data_received(struct.pack(">i", len(response)) + response)
        responses = list(FrameReader(1 << 30).feed(pair.client.bytes()))
        assert [struct.unpack_from(">i", r)[0] for r in responses] == [1, 2, 3, 4, 5]
        offered = [[k.max_version for k in ApiVersionsResponse[3].decode(bytes(r[4:])).api_keys] for r in responses]
        produce_max = SPECS[ApiKey.PRODUCE].max_version
        assert offered == [[7, produce_max], [7, produce_max], [8, produce_max], [8, produce_max], [7, produce_max]]

    asyncio.run(go())


# Tansu's answer to ApiVersions v3: its tagged fields (supported and finalized features, their
# epoch, ZkMigrationReady) are written out at their defaults, which Kafka's writers omit; the
# librdkafka 2.0 in Debian's kcat cannot read them.
TANSU_API_VERSIONS_BODY = bytes.fromhex(
    "00002500130000000700001c000000040000000000000b0000160000000500002e0000000000002c0000000100"
    "0014000000060000110000000100000d000000050000180000000500000f0000000500000e0000000500001a00"
    "000004000012000000040000320000000000000a00000006000019000000040000030000000c00002000000004"
    "00004500000000000001000000110000330000000000001000000005000002000000090000240000000200002a"
    "0000000200003c00000001000015000000020000470000000000001d0000000300000c00000004000008000000"
    "090000090000000900000b0000000900004b0000000000001e000000030000000000040001010108ffffffffff"
    "ffffff020101030100"
)


def test_an_api_versions_answer_the_proxy_would_write_alike_goes_back_as_the_broker_wrote_it():
    async def go():
        pair = Pair()
        sent = []
        for correlation_id in (1, 2, 3):  # the first through on_response, then from the chunk
            pair.conn.data_received(api_versions(3, correlation_id, "app"))
            payload = struct.pack(">i", correlation_id) + API_VERSIONS_BODY
            sent.append(struct.pack(">i", len(payload)) + payload)
            pair.up.data_received(sent[-1])
        assert pair.client.bytes() == b"".join(sent)
        assert pair.client.writes[-1] is sent[-1]  # not even copied
        assert pair.conn.ctx.uplift == {}

    asyncio.run(go())


def test_an_api_versions_answer_with_default_tagged_fields_is_written_as_kafka_writes_it():
    async def go():
        pair = Pair()
        for correlation_id in (1, 2):  # the first through on_response, then from the chunk
            pair.conn.data_received(api_versions(3, correlation_id, "app"))
            payload = struct.pack(">i", correlation_id) + TANSU_API_VERSIONS_BODY
            pair.up.data_received(struct.pack(">i", len(payload)) + payload)
        responses = [bytes(r) for r in FrameReader(1 << 30).feed(pair.client.bytes())]
        assert [struct.unpack_from(">i", r)[0] for r in responses] == [1, 2]
        broker = ApiVersionsResponse[3].decode(TANSU_API_VERSIONS_BODY)
        for r in responses:
            assert r[4:].endswith(b"\x00\x00\x00\x00\x00")  # throttle time 0, no tagged fields
            sent = ApiVersionsResponse[3].decode(r[4:])
            assert sent.api_keys == broker.api_keys and sent.supported_features == broker.supported_features == []
            assert sent.finalized_features_epoch == broker.finalized_features_epoch == -1

    asyncio.run(go())


def test_a_hot_path_entry_is_the_one_init_and_route_make():
    async def go():
        pair = armed_pair()
        for key, frame in ((LIST_OFFSETS, list_offsets(7, "app")), (ApiKey.API_VERSIONS, api_versions(3, 8, "app"))):
            pair.conn.data_received(frame)
            entry = pair.conn.queue.pending[-1]
            assert pair.conn.queue.awaiting[-1] is entry
            made = InFlight(struct.unpack_from(">i", frame, 8)[0], key, struct.unpack_from(">h", frame, 6)[0],
                            entry.received_at, len(frame) - 4)
            made.route = plan_route(pair.conn.chain.response_route, made)
            # Stamped when it goes to the broker, for the broker's share of its latency.
            assert entry.forwarded_at == entry.received_at > 0
            made.forwarded_at = entry.received_at
            for field in InFlight.__slots__:
                if field != "__dict__":
                    assert getattr(entry, field) == getattr(made, field), field
            assert entry.__dict__ == {} and entry.throttle_ms == 0 and entry.on_response is None
        assert pair.conn.queue.pending[0].route is AS_READ  # ListOffsets: nothing looks at its response
        assert pair.conn.queue.pending[1].route is not AS_READ  # ApiVersions: its filter's chunk rewrite

    asyncio.run(go())


def test_apis_and_versions_past_the_count_slots_are_counted_too():
    async def go():
        pair = armed_pair()
        # An unknown API key (forwarded untouched) and a known API at a version beyond the
        # count slots (no filter looks at ListOffsets at any version).
        pair.exchange(raw_request(200, 0, 5, b"app"))
        pair.exchange(raw_request(LIST_OFFSETS, SLOT_VERSIONS + 6, 6, b"app", tail=b"\x00"))  # a flexible header
        stats = pair.server.stats
        assert pair.answered() == [1, 5, 6]
        for key, version in ((200, 0), (LIST_OFFSETS, SLOT_VERSIONS + 6)):
            assert stats.requests[(key, version)] == 1
            assert stats.responses[(key, version)] == 1
        assert stats.latency[200].count == 1
        assert stats.requests[(LIST_OFFSETS, 1)] == 1 and stats.latency[LIST_OFFSETS].count == 2
        assert stats.unknown_api_requests == 1
        assert sorted(stats.requests) == sorted([(LIST_OFFSETS, 1), (LIST_OFFSETS, SLOT_VERSIONS + 6), (200, 0)])
        assert sum(stats.requests.slots) == 1 == sum(stats.responses.slots)

    asyncio.run(go())

    asyncio.run(go())


def test_a_reload_sends_responses_still_awaited_through_the_filters_then_in_force():
    async def go():
        pair = armed_pair()
        fetch = request(FetchRequest[4](max_wait_ms=500, topics=[]), 2, "app")
        pair.conn.data_received(fetch)
        assert pair.conn.queue.pending[-1].route is AS_READ  # no filter looks at a Fetch v4 response now
        # While the fetch is in flight, a consumer byte quota arrives: its response is charged
        # under it (Kafka records a fetch response when it is sent) and answered throttled.
        pair.server.reload(parse_config({**BASE, "quotas": [{"client_id": "app", "consumer_byte_rate": 1}]}))
        body = struct.pack(">i", 2) + bytes(FetchResponse[4](throttle_time_ms=0, responses=[]).encode())
        pair.up.data_received(struct.pack(">i", len(body)) + body)
        (throttle_ms,) = struct.unpack_from(">i", pair.client.writes[-1], 8)
        assert throttle_ms > 0 and pair.client.paused
        pair.conn._teardown()

    asyncio.run(go())


def test_a_response_chunk_filter_is_used_only_where_it_is_the_only_filter():
    class Chunked:
        spec = FilterSpec(response_keys=frozenset({ApiKey.API_VERSIONS, ApiKey.METADATA}), chunk=True)

        def on_response(self, conn, entry, frame):
            return frame

        def on_response_chunk(self, conn, entry, chunk):
            return chunk

    class Plain:
        spec = FilterSpec(response_keys=frozenset({ApiKey.METADATA}))

        def on_response(self, conn, entry, frame):
            return frame

    chunked = Chunked()
    chain = FilterChain([], [chunked, Plain()])
    assert chain.response_route == {ApiKey.API_VERSIONS: (0, chunked.on_response_chunk), ApiKey.METADATA: (0, None)}


def test_the_hot_path_reads_acks_behind_a_flexible_header_only_without_tagged_fields():
    from protocol.produce import framed_acks_not_zero as _acks_not_zero

    end = 12 + 2 + 3  # where a request header with client id "app" ends (before v2's tagged fields)
    acks1, acks0 = produce(9, 1, 1, "app"), produce(9, 0, 2, "app")
    assert _acks_not_zero(acks1, end, 9) and not _acks_not_zero(acks0, end, 9)
    # One header tagged field (tag 0, one byte): acks is not where the hot path would look.
    tagged = acks1[: end] + b"\x01\x00\x01\x07" + acks1[end + 1 :]
    assert not _acks_not_zero(struct.pack(">i", len(tagged) - 4) + tagged[4:], end, 9)
    assert not _acks_not_zero(acks1[: end + 2], end, 9)  # cut short
    assert _acks_not_zero(produce(8, 1, 3, "app"), end, 8) and not _acks_not_zero(produce(8, 0, 4, "app"), end, 8)


@pytest.mark.parametrize("version", range(ProduceRequest.max_version + 1))
def test_the_hot_path_reads_acks_with_and_without_a_transactional_id(version):
    from protocol.produce import framed_acks_not_zero as _acks_not_zero

    end = 12 + 2 + 3  # where a request header with client id "app" ends (before v2's tagged fields)
    for transactional_id in (None, "", "tx-1", "t" * 200):
        for acks in (-1, 0, 1):
            frame = produce(version, acks, 7, "app", transactional_id if version >= 3 else None)
            assert _acks_not_zero(frame, end, version) == (acks != 0), (transactional_id, acks)


def test_a_raw_sasl_token_that_looks_like_a_request_is_not_taken_by_the_hot_path():
    async def go():
        pair = armed_pair()
        pair.conn.start_raw_sasl("PLAIN")  # SaslHandshake v0 succeeded (its filter calls this)
        # A PLAIN token whose bytes read like a ListOffsets v1 request from "app".
        token = list_offsets(2, "app")
        pair.conn.data_received(token)
        entry = pair.conn.queue.pending[-1]
        assert entry.raw and entry.api_key == ApiKey.SASL_AUTHENTICATE
        assert pair.server.stats.requests[(2, 1)] == 1  # the first request only
        assert pair.requests_seen_by_broker()[-1] == token[4:]
        pair.up.data_received(struct.pack(">i", 0))  # the broker's (empty) raw answer
        pair.conn.data_received(list_offsets(3, "app"))  # the hot path again
        pair.up.data_received(answer(list_offsets(3, "app")[4:]))
        assert pair.server.stats.requests[(2, 1)] == 2
        last = FrameReader(1 << 30).feed(pair.client.bytes())[-1]
        assert struct.unpack_from(">i", last)[0] == 3 and not pair.client.closed

    asyncio.run(go())


def test_a_request_behind_a_deferred_one_waits_for_it_even_on_the_hot_path():
    async def go():
        pair = Pair()
        decided = asyncio.get_running_loop().create_future()

        class Deferring:  # decides CreateTopics later, as the controller mutation quota may
            spec = FilterSpec(request_keys=frozenset({ApiKey.CREATE_TOPICS}))

            def on_request(self, conn, header, frame, entry):
                async def later():
                    return await decided  # None: forward it

                return Defer(later())

        pair.conn.chain = FilterChain([Deferring()], [])
        pair.conn.chain_changed()
        first, behind = list_offsets(1, "app"), list_offsets(3, "app")
        deferred = raw_request(ApiKey.CREATE_TOPICS, 4, 2, b"app")
        pair.exchange(first)  # the client id is known: the hot path is armed
        pair.conn.data_received(deferred)
        pair.conn.data_received(behind)  # already read when the decision is still pending
        assert pair.requests_seen_by_broker() == [first[4:]]
        decided.set_result(None)
        for _ in range(3):
            await asyncio.sleep(0)
        assert not pair.client.closed, pair.server.stats.frames_rejected
        assert pair.requests_seen_by_broker() == [first[4:], deferred[4:], behind[4:]]

    asyncio.run(go())


def test_requests_before_the_broker_connection_is_up_wait_for_it_in_order():
    async def go():
        server = ProxyServer(parse_config(BASE))
        conn = ClientConnection(server.env, None)
        client = Wire()
        conn.connection_made(client)  # its broker (127.0.0.1:1) is not there: no connection yet
        try:
            requests = [list_offsets(1, "app"), list_offsets(2, "app"), list_offsets(3, "app")]
            for r in requests:  # the client id is known after the first: still no hot path
                conn.data_received(r)
            assert conn.upstream is None and b"".join(conn._unsent) == b"".join(requests)
        finally:
            conn._connect_task.cancel()
            conn._teardown()

    asyncio.run(go())


def test_a_flexible_produce_cut_inside_its_transactional_id_is_rejected_not_raised():
    async def go():
        pair = armed_pair()
        # Produce v9 from the known client id, no header tags, then a varint that never ends.
        body = struct.pack(">hhih", ApiKey.PRODUCE, 9, 2, 3) + b"app" + b"\x00" + b"\x80"
        pair.conn.data_received(struct.pack(">i", len(body)) + body)  # must not raise
        assert pair.client.closed
        assert pair.server.stats.frames_rejected["bad_header"] == 1
        assert len(pair.requests_seen_by_broker()) == 1  # never forwarded

    asyncio.run(go())


@pytest.mark.parametrize("ping_pong", [True, False], ids=["ping-pong", "pipelined"])
def test_a_broker_that_answers_acks0_does_not_disturb_the_hot_paths(ping_pong):
    async def go():
        pair = armed_pair()
        acks0, hot = produce(8, 0, 2, "app"), list_offsets(3, "app")

        def tansu_answer(frame: bytes) -> bytes:  # Tansu 0.6 answers acks=0 too
            payload = frame[8:12] + b"produce-answer"
            return struct.pack(">i", len(payload)) + payload

        pair.conn.data_received(acks0)
        if ping_pong:
            pair.up.data_received(tansu_answer(acks0))
        pair.conn.data_received(hot)
        if not ping_pong:
            pair.up.data_received(tansu_answer(acks0))
        pair.up.data_received(answer(hot[4:]))
        assert pair.answered() == [1, 3] and not pair.client.closed
        assert pair.client.writes[-1] is not None and not pair.conn.queue.pending

    asyncio.run(go())


def test_a_chunk_filter_that_raises_closes_only_its_connection():
    async def go():
        pair = Pair()

        def broken(conn, entry, chunk):
            raise ValueError("broken filter")

        pair.server.chain.response_route[ApiKey.API_VERSIONS] = (0, broken)
        pair.exchange(api_versions(3, 1, "app"))  # must not raise out of data_received
        assert pair.client.closed and pair.client.writes == []

    asyncio.run(go())


def test_a_connection_closing_after_its_answers_closes_after_a_hot_path_answer():
    async def go():
        pair = armed_pair()
        pair.conn.data_received(list_offsets(2, "app"))  # hot path, awaiting the broker
        pair.conn.data_received(struct.pack(">i", -5))  # a bad frame: close once 2 is answered
        assert not pair.client.closed
        pair.up.data_received(answer(list_offsets(2, "app")[4:]))
        assert pair.answered() == [1, 2] and pair.client.closed

    asyncio.run(go())


def test_a_failure_while_sending_a_hot_path_answer_closes_only_its_connection():
    async def go():
        pair = armed_pair()

        def write(data):
            raise RuntimeError("transport failed")

        pair.client.write = write
        pair.exchange(list_offsets(2, "app"))  # must not raise out of data_received
        assert pair.client.closed

    asyncio.run(go())


def test_a_hot_path_request_longer_than_its_first_chunk_passes_through_unassembled():
    async def go():
        pair = armed_pair()
        big = big_produce(2, "app")
        first, second, third = big[:30], big[30:140], big[140:] + list_offsets(3, "app")
        pair.conn.data_received(first)
        pair.conn.data_received(second)
        assert pair.broker.writes[-2] is first and pair.broker.writes[-1] is second  # as they came
        assert pair.conn._reader.idle  # nothing buffered in the proxy
        pair.conn.data_received(third)  # the tail of 2, then all of 3 (hot path again)
        assert pair.requests_seen_by_broker()[1:] == [big[4:], list_offsets(3, "app")[4:]]
        for r in pair.requests_seen_by_broker()[1:]:
            pair.up.data_received(answer(r))
        assert pair.answered() == [1, 2, 3]
        assert pair.server.stats.bytes_client_to_upstream == len(pair.broker.bytes())

    asyncio.run(go())


def test_produce_v10_takes_the_hot_path_unless_its_connection_uplifts():
    async def go():
        pair = armed_pair()
        plain = produce(10, 1, 2, "app")
        pair.conn.data_received(plain)
        assert pair.broker.writes[-1] is plain  # the uplift filter is not asked: nothing to do
        # A broker that only has Produce v9 (the ApiVersions answer set the uplift): the
        # client's v10 goes to the broker as v9 (KIP-951 uplift, proxy.dataplane.filters.leaders).
        pair.conn.ctx.set_uplift({ApiKey.PRODUCE: 9})
        pair.conn.data_received(produce(10, 1, 3, "app"))
        (version,) = struct.unpack_from(">h", pair.requests_seen_by_broker()[-1], 2)
        assert version == 9 and pair.server.stats.uplifted_requests["Produce"] == 1
        pair.server.reload(parse_config(BASE))  # a reload keeps the connection's uplift
        pair.conn.data_received(produce(10, 1, 4, "app"))
        assert struct.unpack_from(">h", pair.requests_seen_by_broker()[-1], 2)[0] == 9
        pair.conn._teardown()

    asyncio.run(go())
