"""Request and response headers, checked against the bytes kafka-python itself encodes."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kafka.protocol.admin import CreateTopicsRequest, DescribeClusterRequest
from kafka.protocol.consumer import FetchRequest
from kafka.protocol.metadata import (
    ApiVersionsRequest,
    ApiVersionsResponse,
    FindCoordinatorRequest,
    FindCoordinatorResponse,
    MetadataRequest,
    MetadataResponse,
)
from kafka.protocol.producer import ProduceRequest, ProduceResponse
from kafka.protocol.sasl import (
    SaslAuthenticateRequest,
    SaslAuthenticateResponse,
    SaslHandshakeRequest,
    SaslHandshakeResponse,
)

from protocol.apis import SPECS, ApiKey, api_name
from protocol.headers import (
    HeaderError,
    encode_response_header,
    parse_request_header,
    read_uvarint,
    request_header_is_flexible,
    response_body_offset,
    response_correlation_id,
    response_header_is_flexible,
    skip_tagged_fields,
)

# (request class, version, fields): non-flexible (header v1) and flexible (header v2) versions.
REQUESTS = [
    (ProduceRequest, 3, {"acks": 1, "timeout_ms": 100, "topic_data": []}),
    (ProduceRequest, 8, {"acks": -1, "timeout_ms": 100, "topic_data": []}),
    (ProduceRequest, 9, {"acks": -1, "timeout_ms": 100, "topic_data": []}),
    (ProduceRequest, 13, {"acks": 0, "timeout_ms": 100, "topic_data": []}),
    (FetchRequest, 11, {"max_wait_ms": 500, "topics": []}),
    (FetchRequest, 12, {"max_wait_ms": 500, "topics": []}),
    (FetchRequest, 18, {"max_wait_ms": 500, "topics": []}),
    (MetadataRequest, 0, {"topics": []}),
    (MetadataRequest, 8, {"topics": None}),
    (MetadataRequest, 9, {"topics": None}),
    (MetadataRequest, 13, {"topics": None}),
    (FindCoordinatorRequest, 2, {"key": "g"}),
    (FindCoordinatorRequest, 3, {"key": "g"}),
    (FindCoordinatorRequest, 6, {"coordinator_keys": ["g", "h"]}),
    (ApiVersionsRequest, 0, {}),
    (ApiVersionsRequest, 2, {}),
    (ApiVersionsRequest, 3, {"client_software_name": "t", "client_software_version": "1"}),
    (ApiVersionsRequest, 4, {"client_software_name": "t", "client_software_version": "1"}),
    (SaslHandshakeRequest, 1, {"mechanism": "PLAIN"}),
    (SaslAuthenticateRequest, 1, {"auth_bytes": b"\x00u\x00p"}),
    (SaslAuthenticateRequest, 2, {"auth_bytes": b"\x00u\x00p"}),
    (DescribeClusterRequest, 0, {}),
    (CreateTopicsRequest, 4, {"topics": []}),
    (CreateTopicsRequest, 5, {"topics": []}),
]


def _kp_frame(cls, version, fields, correlation_id, client_id) -> tuple[bytes, bytes]:
    """(header + body, body) as kafka-python encodes them."""
    req = cls[version](**fields)
    req.with_header(correlation_id=correlation_id, client_id=client_id)
    return bytes(req.encode(header=True)), bytes(req.encode())


def _id(case) -> str:
    cls, version, _ = case
    return f"{cls.__name__}-v{version}"


@pytest.mark.parametrize("case", REQUESTS, ids=_id)
@pytest.mark.parametrize(
    "client_id", ["client-1", "", "ünïcode-id", None], ids=["id", "empty-id", "utf8-id", "null-id"]
)
def test_parse_request_header_matches_kafka_python(case, client_id):
    cls, version, fields = case
    data, body = _kp_frame(cls, version, fields, correlation_id=0x01020304, client_id=client_id)
    h = parse_request_header(data)
    assert (h.api_key, h.api_version, h.correlation_id) == (cls.API_KEY, version, 0x01020304)
    assert h.client_id == client_id
    assert data[h.body_offset :] == body
    flexible = cls.flexible_version_q(version)
    assert request_header_is_flexible(cls.API_KEY, version) is flexible
    # Header v2 ends with an (empty) tagged-field section: one byte more than header v1.
    id_len = 0 if client_id is None else len(client_id.encode())
    assert h.body_offset == 10 + id_len + (1 if flexible else 0)


@pytest.mark.parametrize("case", REQUESTS, ids=_id)
def test_parse_request_header_from_memoryview(case):
    cls, version, fields = case
    data, body = _kp_frame(cls, version, fields, correlation_id=-7, client_id="mv")
    h = parse_request_header(memoryview(data))
    assert h.correlation_id == -7 and h.client_id == "mv"
    assert bytes(memoryview(data)[h.body_offset :]) == body


def _with_header_tags(cls, version, fields, tags: bytes) -> tuple[bytes, bytes]:
    """A flexible request whose header carries the tagged-field section ``tags``."""
    data, body = _kp_frame(cls, version, fields, correlation_id=42, client_id="tagger")
    header = data[: len(data) - len(body)]
    assert header.endswith(b"\x00")  # kafka-python writes an empty section
    return header[:-1] + tags + body, body


# count=2: tag 0 with 3 bytes, tag 300 (2-byte varint) with 0 bytes.
HEADER_TAGS = b"\x02" + b"\x00\x03abc" + b"\xac\x02\x00"


@pytest.mark.parametrize(
    "case", [c for c in REQUESTS if c[0].flexible_version_q(c[1])], ids=_id
)
def test_flexible_header_with_tagged_fields(case):
    cls, version, fields = case
    data, body = _with_header_tags(cls, version, fields, HEADER_TAGS)
    # kafka-python accepts these bytes as a valid request too.
    decoded = cls.decode(data, version=version, header=True)
    assert decoded.header.correlation_id == 42
    h = parse_request_header(data)
    assert h.client_id == "tagger"
    assert h.body_offset == 10 + len("tagger") + len(HEADER_TAGS)
    assert data[h.body_offset :] == body


def test_header_with_large_tagged_field():
    # A tagged field whose size needs a 2-byte varint (200 bytes).
    tags = b"\x01" + b"\x05" + b"\xc8\x01" + b"t" * 200
    data, body = _with_header_tags(MetadataRequest, 12, {"topics": None}, tags)
    assert data[parse_request_header(data).body_offset :] == body


def test_unknown_api_key_has_no_body_offset():
    data = struct.pack(">hhih", 9999, 3, 11, 5) + b"hello" + b"\x00\x01\x02"
    h = parse_request_header(data)
    assert h == (9999, 3, 11, "hello", -1)
    assert request_header_is_flexible(9999, 3) is None
    assert api_name(9999) == "Unknown9999"


def test_unknown_api_key_with_null_client_id():
    data = struct.pack(">hhih", 1000, 0, 1, -1)
    assert parse_request_header(data) == (1000, 0, 1, None, -1)


def test_api_names():
    assert api_name(ApiKey.PRODUCE) == "Produce"
    assert api_name(ApiKey.API_VERSIONS) == "ApiVersions"
    assert api_name(ApiKey.DESCRIBE_CLUSTER) == "DescribeCluster"


def test_known_key_with_version_above_max_is_still_parsed():
    # The proxy must still read the header of an ApiVersions request newer than it knows
    # (to answer UNSUPPORTED_VERSION); v127 is flexible like every version from 3.
    data = struct.pack(">hhih", ApiKey.API_VERSIONS, 127, 3, 1) + b"c" + b"\x00" + b"body"
    h = parse_request_header(data)
    assert (h.api_version, h.client_id, h.body_offset) == (127, "c", 12)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "at least 10 bytes"),
        (b"\x00\x03\x00\x09\x00\x00\x00\x05\xff", "at least 10 bytes"),
        (struct.pack(">hhih", 3, 1, 1, 10) + b"short", "runs past the frame"),
        (struct.pack(">hhih", 3, 1, 1, 32767), "runs past the frame"),
        (struct.pack(">hhih", 3, 1, 1, -2), "invalid client_id length"),
        (struct.pack(">hhih", 3, 1, 1, -32768), "invalid client_id length"),
        (struct.pack(">hhih", -1, 1, 1, 0), "invalid api_key"),
        (struct.pack(">hhih", 3, -1, 1, 0), "invalid api_key"),
        (struct.pack(">hhih", 3, 1, 1, 2) + b"\xff\xfe", "not UTF-8"),
        # Flexible header (Metadata v9) whose tagged-field section is broken:
        (struct.pack(">hhih", 3, 9, 1, 0), "truncated varint"),
        (struct.pack(">hhih", 3, 9, 1, 0) + b"\x80", "truncated varint"),
        (struct.pack(">hhih", 3, 9, 1, 0) + b"\xff\xff\xff\xff\xff\x01", "longer than 5 bytes"),
        (struct.pack(">hhih", 3, 9, 1, 0) + b"\x01\x00", "truncated varint"),
        (struct.pack(">hhih", 3, 9, 1, 0) + b"\x01\x00\x05abc", "truncated tagged field"),
        (struct.pack(">hhih", 3, 9, 1, 0) + b"\x02\x00\x00", "truncated varint"),
    ],
    ids=[
        "empty",
        "9-bytes",
        "client-id-past-frame",
        "client-id-max-length",
        "client-id-length-minus-2",
        "client-id-length-min",
        "negative-api-key",
        "negative-version",
        "client-id-not-utf8",
        "no-tag-section",
        "truncated-tag-count",
        "tag-count-6-byte-varint",
        "tag-without-size",
        "tag-size-past-frame",
        "second-tag-missing",
    ],
)
def test_malformed_headers_raise_header_error(data, message):
    with pytest.raises(HeaderError, match=message):
        parse_request_header(data)


def test_header_error_is_a_value_error():
    assert issubclass(HeaderError, ValueError)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_parse_or_raise_header_error(data):
    try:
        h = parse_request_header(data)
    except HeaderError:
        return
    assert h.body_offset == -1 or 10 <= h.body_offset <= len(data)


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(REQUESTS), cut=st.integers(0, 40))
def test_truncated_kafka_python_headers_never_read_past_the_frame(case, cut):
    cls, version, fields = case
    data, body = _kp_frame(cls, version, fields, correlation_id=1, client_id="truncate-me")
    header_len = len(data) - len(body)
    prefix = data[: min(cut, header_len)]
    try:
        h = parse_request_header(prefix)
    except HeaderError:
        assert len(prefix) < header_len
        return
    assert h.body_offset <= len(prefix)


# --- varints ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, value",
    [(b"\x00", 0), (b"\x7f", 127), (b"\x80\x01", 128), (b"\xac\x02", 300), (b"\xff\xff\xff\xff\x0f", 2**32 - 1)],
)
def test_read_uvarint(data, value):
    assert read_uvarint(data + b"rest", 0) == (value, len(data))


def test_skip_tagged_fields():
    assert skip_tagged_fields(b"\x00", 0) == 1
    assert skip_tagged_fields(b"xx" + HEADER_TAGS + b"body", 2) == 2 + len(HEADER_TAGS)


# --- response headers ---------------------------------------------------------------------

RESPONSES = [
    (ProduceResponse, [3, 8, 9, 13]),
    (MetadataResponse, [0, 8, 9, 13]),
    (FindCoordinatorResponse, [0, 2, 3, 6]),
    (ApiVersionsResponse, [0, 1, 2, 3, 4]),
    (SaslHandshakeResponse, [0, 1]),
    (SaslAuthenticateResponse, [0, 1, 2]),
]


@pytest.mark.parametrize(
    "cls, version",
    [(cls, v) for cls, versions in RESPONSES for v in versions],
    ids=[f"{cls.__name__}-v{v}" for cls, versions in RESPONSES for v in versions],
)
def test_response_header_matches_kafka_python(cls, version):
    resp = cls[version]()
    resp.with_header(correlation_id=77)
    data = bytes(resp.encode(header=True))
    body = bytes(resp.encode())
    header_len = len(data) - len(body)
    flexible = response_header_is_flexible(cls.API_KEY, version)
    assert header_len == (5 if flexible else 4)
    assert data[:header_len] == encode_response_header(77, flexible)
    assert response_body_offset(data, cls.API_KEY, version) == header_len
    assert response_correlation_id(data) == 77


@pytest.mark.parametrize("version", range(SPECS[ApiKey.API_VERSIONS].max_version + 1))
def test_api_versions_response_header_is_never_flexible(version):
    # KIP-511: ApiVersionsResponse keeps header v0 even on flexible body versions.
    assert response_header_is_flexible(ApiKey.API_VERSIONS, version) is False
    assert response_body_offset(b"\x00\x00\x00\x01\x00\x00", ApiKey.API_VERSIONS, version) == 4


@pytest.mark.parametrize(
    "api_key, version, flexible",
    [
        (ApiKey.METADATA, 8, False),
        (ApiKey.METADATA, 9, True),
        (ApiKey.PRODUCE, 9, True),
        (ApiKey.FETCH, 11, False),
        (ApiKey.FETCH, 12, True),
        (ApiKey.SASL_HANDSHAKE, 1, False),
        (ApiKey.SASL_AUTHENTICATE, 2, True),
        (ApiKey.DESCRIBE_CLUSTER, 0, True),
        (9999, 5, False),
    ],
)
def test_response_header_flexibility(api_key, version, flexible):
    assert response_header_is_flexible(api_key, version) is flexible


def test_flexible_response_header_with_tags():
    data = struct.pack(">i", 5) + b"\x01\x00\x02zz" + b"body"
    assert response_body_offset(data, ApiKey.METADATA, 9) == 4 + 5
    with pytest.raises(HeaderError):
        response_body_offset(struct.pack(">i", 5) + b"\x01\x00\x09zz", ApiKey.METADATA, 9)


def test_response_without_correlation_id():
    with pytest.raises(HeaderError):
        response_correlation_id(b"\x00\x01\x02")
