"""Bad input closes or answers only the affected connection; everyone else keeps working."""

from __future__ import annotations

import logging
import socket
import struct
import time

import pytest

from protocol import errors
from tests.support.inproc import InProcessProxy
from tests.support.raw_broker import RawBroker
from tests.support.tansu import TansuBroker as LocalTansu
from tests.support.wire import api_versions, is_closed, read_frame, request_bytes

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tansu():
    with LocalTansu() as broker:
        yield broker


@pytest.fixture
def proxy(tansu):
    with InProcessProxy([tansu.bootstrap]) as p:
        yield p


def _bystander_ok(proxy) -> None:
    resp = api_versions(proxy.address)
    assert resp.error_code == 0 and resp.api_keys


@pytest.mark.parametrize(
    "payload, reason, log_fragment",
    [
        (struct.pack(">i", 5) + b"\x00\x03\x00\x01\x00", "bad_header", "request header needs at least 10 bytes"),
        (struct.pack(">i", 12) + struct.pack(">hhih", 18, 3, 1, 500) + b"ab", "bad_header", "client_id length 500"),
        (struct.pack(">i", -7), "bad_frame", "negative frame size -7"),
        (struct.pack(">i", 2**31 - 1), "bad_frame", "exceeds max_frame_bytes"),
        (struct.pack(">i", 12) + struct.pack(">hhih", -1, 0, 1, 0) + b"xx", "bad_header", "invalid api_key -1"),
    ],
    ids=["short-header", "client-id-past-frame", "negative-size", "oversized", "negative-api-key"],
)
def test_malformed_frames_close_only_that_connection(proxy, caplog, payload, reason, log_fragment):
    bystander = socket.create_connection(proxy.address)
    before = proxy.metric("kqp_frames_rejected_total", reason=reason)
    with caplog.at_level(logging.WARNING, logger="proxy.dataplane.connection"):
        with socket.create_connection(proxy.address) as bad:
            bad.sendall(payload)
            assert is_closed(bad)
    assert proxy.metric("kqp_frames_rejected_total", reason=reason) == before + 1
    assert any(log_fragment in r.getMessage() for r in caplog.records), caplog.text
    bystander.sendall(request_bytes(__import__("kafka").protocol.metadata.ApiVersionsRequest[0](), 3))
    assert read_frame(bystander) is not None
    bystander.close()
    _bystander_ok(proxy)


def test_truncated_frame_then_disconnect(proxy):
    with socket.create_connection(proxy.address) as s:
        s.sendall(struct.pack(">i", 100) + b"\x00\x12\x00\x03" + b"\x00" * 20)
    _bystander_ok(proxy)
    deadline = time.monotonic() + 5
    while proxy.metric("kqp_open_connections") != 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proxy.metric("kqp_open_connections") == 0


def test_garbage_after_valid_frame_answers_the_frame_then_closes(proxy):
    from kafka.protocol.metadata import ApiVersionsRequest

    with socket.create_connection(proxy.address) as s:
        s.sendall(request_bytes(ApiVersionsRequest[0](), 41) + struct.pack(">i", -99) + b"garbage")
        frame = read_frame(s)
        assert frame is not None and struct.unpack(">i", frame[:4])[0] == 41
        assert is_closed(s)
    _bystander_ok(proxy)


def test_api_versions_newer_than_the_proxy_knows_is_answered_like_a_broker(proxy):
    from kafka.protocol.metadata import ApiVersionsResponse

    # Hand-built v99 request: header v2 (api_key, version, correlation id, client id, no tags).
    body = struct.pack(">hhih", 18, 99, 5, 4) + b"test" + b"\x00" + b"\x00"
    with socket.create_connection(proxy.address) as s:
        s.sendall(struct.pack(">i", len(body)) + body)
        frame = read_frame(s)
    assert struct.unpack(">i", frame[:4])[0] == 5
    resp = ApiVersionsResponse.decode(frame[4:], version=0)
    assert resp.error_code == errors.UNSUPPORTED_VERSION
    assert [(k.api_key, k.min_version, k.max_version) for k in resp.api_keys] == [(18, 0, 4)]
    assert proxy.metric("kqp_local_responses_total", api="ApiVersions") == 1


def test_api_versions_caps_rewritten_apis(proxy):
    resp = api_versions(proxy.address)
    ranges = {k.api_key: k.max_version for k in resp.api_keys}
    # Tansu offers Fetch v17 and Metadata v12; kafka-python decodes Fetch up to v18.
    assert ranges[1] <= 18 and ranges[3] <= 13 and ranges[18] <= 4
    assert 78 not in ranges and 79 not in ranges


def test_unknown_api_key_is_forwarded_byte_for_byte():
    with RawBroker() as broker, InProcessProxy([broker.bootstrap]) as proxy:
        frame = struct.pack(">hhih", 999, 3, 77, 2) + b"id" + b"opaque body \x00\xff"
        with socket.create_connection(proxy.address) as s:
            s.sendall(struct.pack(">i", len(frame)) + frame)
            answer = read_frame(s)
        assert answer == struct.pack(">i", 77) + b"\xca\xfe\xba\xbe"
        assert frame in broker.frames
        assert proxy.metric("kqp_unknown_api_requests_total") == 1


def test_unreachable_upstream_is_reported_and_retried(caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: refused
    with caplog.at_level(logging.WARNING), InProcessProxy([dead], upstream={"connect_attempts": 2}) as proxy:
        with socket.create_connection(proxy.address) as c:
            # The broker connection is opened for the first request, not on accept.
            time.sleep(0.2)
            assert proxy.metric("kqp_upstream_connect_failures_total") == 0
            c.sendall(request_bytes(__import__("kafka").protocol.metadata.ApiVersionsRequest[0](), 1))
            assert is_closed(c, timeout_s=10)
        assert proxy.metric("kqp_upstream_connect_failures_total") >= 2
        assert any("cannot reach broker" in r.getMessage() for r in caplog.records)
        assert any("giving up" in r.getMessage() for r in caplog.records)
        assert proxy.server.health()[0]  # the proxy itself is still serving


def test_upstream_closing_mid_response_closes_only_that_client(caplog):
    def half_answer(frame: bytes) -> bytes:
        return struct.pack(">i", 100) + frame[4:8] + b"partial"

    with RawBroker(half_answer, close_after_answer=True) as broker, InProcessProxy([broker.bootstrap]) as proxy:
        with caplog.at_level(logging.WARNING), socket.create_connection(proxy.address) as c:
            c.sendall(struct.pack(">i", 12) + struct.pack(">hhih", 999, 0, 1, 2) + b"id")
            assert is_closed(c)
        assert any("requests in flight" in r.getMessage() for r in caplog.records)
        assert proxy.server.health()[0]


def test_client_disconnect_with_requests_in_flight_closes_upstream():
    with RawBroker(lambda frame: None) as broker, InProcessProxy([broker.bootstrap]) as proxy:
        with socket.create_connection(proxy.address) as c:
            for corr in range(3):
                c.sendall(struct.pack(">i", 12) + struct.pack(">hhih", 999, 0, corr, 2) + b"id")
            deadline = time.monotonic() + 5
            while len(broker.frames) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
        assert broker.closed.wait(5), "the proxy did not close the upstream connection"
        assert proxy.metric("kqp_open_connections") == 0
