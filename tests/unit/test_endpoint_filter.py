"""EndpointRewriteFilter: Produce/Fetch frames pass untouched unless NodeEndpoints has entries."""

from __future__ import annotations

import struct
from types import SimpleNamespace

import pytest

from protocol.headers import encode_response_header
from protocol.messages import decode_response
from proxy.dataplane.filters.endpoints import EndpointRewriteFilter
from tests.unit.test_scan import fetch_body, produce_body


def _conn():
    seen = []

    def advertise(node_id, host, port):
        seen.append((node_id, host, port))
        return "proxy.example", 19000 + node_id

    return SimpleNamespace(cluster=SimpleNamespace(advertise=advertise)), seen


@pytest.mark.parametrize("api_key, build, version", [(0, produce_body, 10), (1, fetch_body, 16), (1, fetch_body, 18)])
def test_frame_with_empty_node_endpoints_tag_is_the_same_object(api_key, build, version):
    conn, seen = _conn()
    body = build(version, endpoints=False)
    frame = encode_response_header(5, True) + body[:-1] + b"\x01\x00\x01\x01"  # Tansu's empty tag
    entry = SimpleNamespace(api_key=api_key, api_version=version, scan=None)
    assert EndpointRewriteFilter().on_response(conn, entry, frame) is frame
    assert seen == []


@pytest.mark.parametrize("api_key, build, version", [(0, produce_body, 10), (1, fetch_body, 16)])
def test_node_endpoints_are_rewritten_and_header_kept(api_key, build, version):
    conn, seen = _conn()
    header = encode_response_header(5, True)
    entry = SimpleNamespace(api_key=api_key, api_version=version, scan=None)
    out = EndpointRewriteFilter().on_response(conn, entry, header + build(version, endpoints=True))
    assert out[: len(header)] == header and struct.unpack(">i", out[:4])[0] == 5
    resp = decode_response(api_key, version, memoryview(out)[len(header):])
    assert [(e.node_id, e.host, e.port) for e in resp.node_endpoints] == [(3, "proxy.example", 19003)]
    assert seen == [(3, "b3.internal", 9094)]


@pytest.mark.parametrize("api_key, build, version", [(0, produce_body, 9), (1, fetch_body, 15)])
def test_versions_before_kip_951_are_not_scanned(api_key, build, version):
    conn, _ = _conn()
    frame = encode_response_header(5, True) + build(version, endpoints=False)
    entry = SimpleNamespace(api_key=api_key, api_version=version, scan=None)
    assert EndpointRewriteFilter().on_response(conn, entry, frame) is frame
