"""Round trips of every message the proxy decodes and re-encodes, over every version.

Each message (built by ``tests.support.kafka_messages`` with every field of its version set
to a non-default value, tagged fields included so they are actually written) is encoded with
``protocol.messages.encode_body``, decoded back with ``decode_request`` / ``decode_response``
and compared, then re-encoded to the same bytes. Versions run from 0 to kafka-python's max:
kafka-python 3.0.12 lowers every schema's minimum to 0 (``ApiMessageData.__init__``), so even ProduceResponse v0-2 and
FetchResponse v0-3 — below the schemas' ``validVersions`` "3-13" / "4-18" — encode and decode;
``test_kafka_python_accepts_every_version_from_zero`` pins that, so no version is skipped.
"""

from __future__ import annotations

import pytest
from kafka.protocol.admin import DescribeClusterRequest, DescribeClusterResponse
from kafka.protocol.consumer import FetchResponse
from kafka.protocol.metadata import (
    ApiVersionsRequest,
    ApiVersionsResponse,
    FindCoordinatorRequest,
    FindCoordinatorResponse,
    MetadataRequest,
    MetadataResponse,
)
from kafka.protocol.producer import ProduceResponse
from kafka.protocol.sasl import (
    SaslAuthenticateRequest,
    SaslAuthenticateResponse,
    SaslHandshakeRequest,
    SaslHandshakeResponse,
)

from protocol.apis import SPECS
from protocol.messages import DecodeError, decode_request, decode_response, encode_body
from tests.support.kafka_messages import (
    api_versions_request,
    api_versions_response,
    describe_cluster_request,
    describe_cluster_response,
    fetch_response,
    find_coordinator_request,
    find_coordinator_response,
    metadata_request,
    metadata_response,
    produce_response,
    sasl_authenticate_request,
    sasl_authenticate_response,
    sasl_handshake_request,
    sasl_handshake_response,
)

# (kind, kafka-python class, builder)
MESSAGES = [
    ("request", ApiVersionsRequest, api_versions_request),
    ("response", ApiVersionsResponse, api_versions_response),
    ("request", MetadataRequest, metadata_request),
    ("response", MetadataResponse, metadata_response),
    ("request", FindCoordinatorRequest, find_coordinator_request),
    ("response", FindCoordinatorResponse, find_coordinator_response),
    ("request", DescribeClusterRequest, describe_cluster_request),
    ("response", DescribeClusterResponse, describe_cluster_response),
    ("response", ProduceResponse, produce_response),
    ("response", FetchResponse, fetch_response),
    ("request", SaslHandshakeRequest, sasl_handshake_request),
    ("response", SaslHandshakeResponse, sasl_handshake_response),
    ("request", SaslAuthenticateRequest, sasl_authenticate_request),
    ("response", SaslAuthenticateResponse, sasl_authenticate_response),
]

CASES = [
    pytest.param(kind, cls, build, v, id=f"{cls.__name__}-v{v}")
    for kind, cls, build in MESSAGES
    for v in range(0, cls.max_version + 1)
]


def _decode(kind, api_key, version, body):
    return (decode_request if kind == "request" else decode_response)(api_key, version, body)


def test_kafka_python_accepts_every_version_from_zero():
    for _, cls, _ in MESSAGES:
        assert cls.min_version == 0
        for v in range(cls.max_version + 1):
            cls[v]()  # raises ValueError for a version kafka-python refuses


def test_every_rewritten_api_is_covered_up_to_the_proxy_max():
    for _, cls, _ in MESSAGES:
        assert cls.max_version == SPECS[cls.API_KEY].max_version


@pytest.mark.parametrize("kind, cls, build, version", CASES)
def test_round_trip(kind, cls, build, version):
    msg = build(version)
    body = encode_body(msg)
    assert isinstance(body, bytes)
    decoded = _decode(kind, cls.API_KEY, version, body)
    assert decoded.version == version
    assert decoded == msg
    assert encode_body(decoded) == body


@pytest.mark.parametrize("kind, cls, build, version", CASES)
def test_decode_from_memoryview_inside_a_frame(kind, cls, build, version):
    # The proxy decodes ``memoryview(frame)[body_offset:]``, never a copied body.
    body = encode_body(build(version))
    frame = b"\x00\x00\x00\x07\x00" + body
    decoded = _decode(kind, cls.API_KEY, version, memoryview(frame)[5:])
    assert encode_body(decoded) == body


@pytest.mark.parametrize("version", range(ProduceResponse.max_version + 1))
def test_produce_node_endpoints_only_from_v10(version):
    decoded = decode_response(0, version, encode_body(produce_response(version)))
    part = decoded.responses[0].partition_responses[1]
    if version >= 10:
        endpoints = [(e.node_id, e.host, e.port, e.rack) for e in decoded.node_endpoints]
        assert endpoints == [(2, "b2.internal", 9093, "rack-b")]
        assert (part.current_leader.leader_id, part.current_leader.leader_epoch) == (2, 8)
    else:
        assert not decoded.node_endpoints


@pytest.mark.parametrize("version", range(FetchResponse.max_version + 1))
def test_fetch_node_endpoints_only_from_v16(version):
    decoded = decode_response(1, version, encode_body(fetch_response(version)))
    if version >= 16:
        assert [(e.node_id, e.host, e.port) for e in decoded.node_endpoints] == [(3, "b3.internal", 9094)]
    else:
        assert not decoded.node_endpoints
    if version >= 12:
        leader = decoded.responses[0].partitions[1].current_leader
        assert (leader.leader_id, leader.leader_epoch) == (3, 9)


@pytest.mark.parametrize("version", [4, 6])
def test_find_coordinator_batched_keeps_errored_coordinator(version):
    decoded = decode_response(10, version, encode_body(find_coordinator_response(version)))
    coordinators = [(c.key, c.node_id, c.error_code) for c in decoded.coordinators]
    assert coordinators == [("group-a", 2, 0), ("group-b", -1, 15)]


# kafka-python slices a trailing string short without checking its length; protocol.messages
# requires the decoder to end exactly at the end of the body, so every cut must be refused.
@pytest.mark.parametrize("kind, cls, build, version", CASES)
def test_every_truncation_raises_decode_error(kind, cls, build, version):
    body = encode_body(build(version))
    silently_decoded = []
    for cut in range(len(body)):
        try:
            _decode(kind, cls.API_KEY, version, body[:cut])
        except DecodeError as exc:
            assert cls.__name__ in str(exc)
        else:
            silently_decoded.append(cut)
    assert silently_decoded == [], f"{len(body)}-byte body decoded when cut to {silently_decoded}"


@pytest.mark.parametrize(
    "kind, cls, build, version", [c for c in CASES if c.values[3] == c.values[1].max_version]
)
def test_trailing_bytes_raise_decode_error(kind, cls, build, version):
    body = encode_body(build(version))
    with pytest.raises(DecodeError):
        _decode(kind, cls.API_KEY, version, body + b"\x00junk")


def test_decode_error_names_the_version():
    with pytest.raises(DecodeError, match="v9"):
        decode_response(3, 9, b"\x05")


@pytest.mark.xfail(
    strict=True,
    reason="known limit (docs/limits.md): kafka-python keeps tagged fields it has no schema for in "
    "msg.unknown_tags but never encodes them, so a rewritten response loses a tag that a newer "
    "broker adds to a version the proxy already knows",
)
@pytest.mark.parametrize("version", [9, 12, 13])
def test_unknown_tagged_fields_survive_a_round_trip(version):
    body = encode_body(metadata_response(version))
    assert body.endswith(b"\x00")  # the empty top-level tagged-field section
    with_unknown_tag = body[:-1] + b"\x01" + b"\x07\x03xyz"  # one field: tag 7, 3 bytes
    decoded = decode_response(3, version, with_unknown_tag)
    assert encode_body(decoded) == with_unknown_tag
