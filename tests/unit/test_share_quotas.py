"""ShareFetch under quota (KIP-932 through the proxy): consumer_byte_rate caps what a ShareFetch
may ask for and charges its response, consumer_record_rate counts the records it delivers, and
a ShareFetch response over quota is delivered with throttle_time_ms and a mute, never emptied
(the broker has acquired its records for the member). Then the same through a whole client
connection driven in process: a response split at every byte boundary comes out as one
rewritten response (NodeEndpoints at proxy addresses), and a throttled one carries its
throttle_time_ms.
"""

from __future__ import annotations

import asyncio
import struct

import pytest

from protocol.apis import ApiKey
from protocol.headers import parse_request_header
from protocol.messages import decode_response
from protocol.share_fetch import cap_share_fetch_bytes
from protocol.share_messages import ShareFetchRequest
from proxy.dataplane.filters.api import Forward
from proxy.dataplane.filters.limiters import RateLimiterFilter
from proxy.dataplane.filters.quotas import RateQuotaFilter
from proxy.dataplane.inflight import InFlight
from quotas import QuotaManager, QuotaRule
from quotas.limiters import LimiterContext, RecordRateLimiter
from tests.support.filter_context import filter_context
from tests.unit.test_connection_paths import BASE, Pair, armed_pair, request
from tests.unit.test_records import batch
from tests.unit.test_share_responses import B3, NO_TAGS, TOPIC_ID, endpoints_field, share_fetch_body

VERSIONS = (0, 1, 2)
QUOTA = 1000  # bytes/s
WINDOW_S = 1.0  # (quota_window_num - 1) x window size


class Clock:
    def __init__(self) -> None:
        self.ms = 1_000_000

    def __call__(self) -> int:
        return self.ms


def share_fetch_request(version: int, correlation_id: int = 7, max_bytes: int = 52_428_800,
                        min_bytes: int = 1, client_id: str = "golden", renew: bool = False) -> bytes:
    """A ShareFetchRequest, framed. ``renew`` (v2): a renew acknowledgement (KIP-1222), which
    Kafka accepts only with MaxWaitMs, MinBytes, MaxBytes and MaxRecords all 0."""
    R = ShareFetchRequest[version]
    T = R.FetchTopic
    P = T.FetchPartition
    part = {"partition_index": 0, "acknowledgement_batches": [
        P.AcknowledgementBatch(first_offset=0, last_offset=1, acknowledge_types=[4 if renew else 1])]}
    if version == 0:
        part["partition_max_bytes"] = 1 << 20
    fields = {"group_id": "share-group", "member_id": "m-1", "share_session_epoch": 1,
              "max_wait_ms": 0 if renew else 500, "min_bytes": min_bytes, "max_bytes": max_bytes,
              "topics": [T(topic_id=TOPIC_ID, partitions=[P(**part)])], "forgotten_topics_data": []}
    if version >= 1:
        fields.update(max_records=0 if renew else 500, batch_size=500)
    if version >= 2:
        fields.update(share_acquire_mode=1, is_renew_ack=renew)  # KIP-1206 record-limit, KIP-1222
    return request(R(**fields), correlation_id, client_id)


def share_fetch_response_frame(version: int, correlation_id: int, records: bytes, acquired, endpoints=()) -> bytes:
    body, _ = share_fetch_body(version, [(0, 0, 1, 4, records, acquired)], endpoints)
    payload = struct.pack(">i", correlation_id) + b"\x00" + body  # response header v1
    return struct.pack(">i", len(payload)) + payload


def in_flight(framed: bytes):
    """(header, entry, frame as filters see it: no size prefix)."""
    frame = framed[4:]
    header = parse_request_header(frame)
    return header, InFlight(header.correlation_id, header.api_key, header.api_version, 0.0), frame


@pytest.mark.parametrize("version", VERSIONS)
def test_share_fetch_asks_for_no_more_than_the_quota_admits_in_a_window(version):
    manager = QuotaManager([QuotaRule("alice", None, {"consumer_byte_rate": QUOTA})], quota_window_num=2)
    f = RateQuotaFilter(manager, WINDOW_S, Clock())
    header, entry, frame = in_flight(share_fetch_request(version))
    decision = f.on_request(filter_context("alice"), header, frame, entry)
    assert isinstance(decision, Forward) and decision.frame is not None
    sent = decoded_request(decision.frame, version)
    assert (sent.min_bytes, sent.max_bytes) == (1, QUOTA)  # KafkaApis: min(max_bytes, quota x window)
    untouched = decoded_request(frame, version)
    assert (sent.topics, sent.group_id, sent.member_id) == (untouched.topics, untouched.group_id, untouched.member_id)
    # Only MaxBytes changed: every other byte (v2's ShareAcquireMode and IsRenewAck among them) kept.
    changed = [i for i, (a, b) in enumerate(zip(bytes(decision.frame), frame)) if a != b]
    assert len(decision.frame) == len(frame) and changed and changed[-1] - changed[0] < 4
    if version >= 2:
        assert (sent.share_acquire_mode, sent.is_renew_ack) == (1, False)
    # Within the cap already: the very frame.
    small = share_fetch_request(version, max_bytes=500)[4:]
    assert cap_share_fetch_bytes(small, parse_request_header(small).body_offset, version, QUOTA) is small


def test_a_renew_acknowledgement_keeps_its_zero_max_and_min_bytes():
    """KIP-1222: a ShareFetch v2 with IsRenewAck must carry MaxBytes, MinBytes, MaxRecords and
    MaxWaitMs 0, or Kafka answers INVALID_REQUEST: the byte cap never makes a 0 anything else."""
    manager = QuotaManager([QuotaRule("alice", None, {"consumer_byte_rate": QUOTA})], quota_window_num=2)
    f = RateQuotaFilter(manager, WINDOW_S, Clock())
    header, entry, frame = in_flight(share_fetch_request(2, max_bytes=0, min_bytes=0, renew=True))
    assert f.on_request(filter_context("alice"), header, frame, entry) is None  # forwarded as it came
    for cap in (1, QUOTA, 2**31 - 1):
        assert cap_share_fetch_bytes(frame, header.body_offset, 2, cap) is frame
    sent = decoded_request(frame, 2)
    assert (sent.is_renew_ack, sent.max_wait_ms, sent.min_bytes, sent.max_bytes, sent.max_records) == (True, 0, 0, 0, 0)


def decoded_request(frame, version: int):
    """The ShareFetchRequest in a frame without its size prefix."""
    frame = bytes(frame)
    return ShareFetchRequest.decode(frame[parse_request_header(frame).body_offset:], version=version)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_share_fetch_response_over_the_byte_quota_is_delivered_with_a_throttle(version):
    manager = QuotaManager([QuotaRule("alice", None, {"consumer_byte_rate": QUOTA})], quota_window_num=2)
    clock = Clock()
    f = RateQuotaFilter(manager, WINDOW_S, clock)
    records = batch(100)
    frame = share_fetch_response_frame(version, 7, records, [(0, 99, 1)])[4:]
    assert len(frame) > 2 * QUOTA
    entry = InFlight(7, ApiKey.SHARE_FETCH, version, 0.0)
    decision = f.on_response(filter_context("alice"), entry, frame)
    assert isinstance(decision, Forward) and decision.frame is frame  # not emptied, unlike a Fetch
    assert decision.throttle_ms > 0
    # The bytes stay recorded (they were delivered): the next response is throttled too.
    again = f.on_response(filter_context("alice"), InFlight(8, ApiKey.SHARE_FETCH, version, 0.0), frame)
    assert isinstance(again, Forward) and again.throttle_ms > decision.throttle_ms


def test_consumer_record_rate_counts_the_records_a_share_fetch_delivers():
    manager = QuotaManager([QuotaRule(None, "golden", {"consumer_record_rate": 4})], quota_window_num=2)
    limiter = RecordRateLimiter()
    limiter.configure(LimiterContext(manager.rules, 2, 1, manager))
    f = RateLimiterFilter([limiter], Clock())
    assert ApiKey.SHARE_FETCH in f.spec.response_keys
    # 20 records sent, 12 acquired: 12 delivered against 4/s over a 1 s window: (12 - 4) / 4 s.
    frame = share_fetch_response_frame(1, 5, batch(20), [(0, 11, 1)])[4:]
    ctx = filter_context()
    ctx.session.client_id = "golden"
    decision = f.on_response(ctx, InFlight(5, ApiKey.SHARE_FETCH, 1, 0.0), frame)
    assert decision.frame is frame and decision.throttle_ms == 2000


# -- through a client connection ----------------------------------------------------------------------

@pytest.mark.parametrize("version", VERSIONS)
def test_a_share_fetch_response_split_at_every_byte_boundary_comes_out_whole_and_rewritten(version):
    records = batch(3, offset=100)
    body, at = share_fetch_body(version, [(0, 0, 1, 4, records, [(100, 102, 1)])], [B3])
    payload = struct.pack(">i", 2) + b"\x00" + body
    response = struct.pack(">i", len(payload)) + payload

    async def through(chunks) -> None:
        pair = armed_pair()
        pair.conn.data_received(share_fetch_request(version, correlation_id=2, client_id="app"))
        before = len(pair.client.writes)
        for chunk in chunks:
            pair.up.data_received(chunk)
        got = b"".join(bytes(w) for w in pair.client.writes[before:])
        host, port = pair.server.cluster.advertise(3, "b3.internal", 9094)  # this pair's listener for node 3
        rewritten = body[:at] + endpoints_field([(3, host, port, None)]) + NO_TAGS
        expected = struct.pack(">i", 4 + 1 + len(rewritten)) + struct.pack(">i", 2) + b"\x00" + rewritten
        assert got == expected, f"split into {[len(c) for c in chunks]} bytes"
        assert b"b3.internal" not in got

    asyncio.run(through([response]))
    for cut in range(1, len(response)):
        asyncio.run(through([response[:cut], response[cut:]]))


def test_a_renew_acknowledgement_reaches_the_broker_with_its_zeros_through_a_client_connection():
    async def run() -> None:
        raw = {**BASE, "quotas": [{"user": "ANONYMOUS", "consumer_byte_rate": QUOTA}],
               "quota_windows": {"quota_window_num": 2, "quota_window_size_seconds": 1}}
        pair = Pair(raw)
        renew = share_fetch_request(2, correlation_id=4, max_bytes=0, min_bytes=0, client_id="app", renew=True)
        pair.conn.data_received(renew)
        assert bytes(pair.requests_seen_by_broker()[-1]) == renew[4:]

    asyncio.run(run())


def test_a_throttled_share_fetch_response_carries_its_throttle_time_and_mutes_the_client():
    asyncio.run(_throttled())


async def _throttled() -> None:
    raw = {**BASE, "quotas": [{"user": "ANONYMOUS", "consumer_byte_rate": QUOTA}],
           "quota_windows": {"quota_window_num": 2, "quota_window_size_seconds": 1}}
    pair = Pair(raw)
    pair.conn.data_received(share_fetch_request(1, correlation_id=3, client_id="app"))
    sent = pair.requests_seen_by_broker()[-1]
    assert decoded_request(sent, 1).max_bytes == QUOTA
    response = share_fetch_response_frame(1, 3, batch(100), [(0, 99, 1)])
    pair.up.data_received(response)
    got = b"".join(bytes(w) for w in pair.client.writes)
    body = got[4 + 4 + 1:]
    assert struct.unpack(">i", got[4:8])[0] == 3
    resp = decode_response(ApiKey.SHARE_FETCH, 1, body)
    assert resp.throttle_time_ms > 0
    assert bytes(resp.responses[0].partitions[0].records) == batch(100)  # delivered whole
    assert pair.client.paused  # muted for the throttle time (KIP-219)



def test_the_usage_log_counts_the_records_a_share_fetch_delivers():
    from proxy.dataplane.filters.usage import UsageFilter
    from quotas.producer_ids import ProducerIdObserver

    f = UsageFilter(ProducerIdObserver(), clock=Clock())
    assert ApiKey.SHARE_FETCH in f.spec.response_keys
    frame = share_fetch_response_frame(1, 5, batch(20), [(0, 11, 1)])[4:]
    entry = InFlight(5, ApiKey.SHARE_FETCH, 1, 0.0)
    assert f.on_response(filter_context(), entry, frame) is frame
    assert (entry.records, entry.batches) == (12, 1)
