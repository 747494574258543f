"""protocol.rewrite: no broker address survives a rewrite; ApiVersions capping and refusal."""

from __future__ import annotations

import struct
from types import SimpleNamespace

import pytest
from kafka.protocol.admin import DescribeClusterResponse
from kafka.protocol.consumer import FetchResponse
from kafka.protocol.metadata import ApiVersionsResponse, FindCoordinatorResponse, MetadataResponse
from kafka.protocol.producer import ProduceResponse

from protocol import errors, rewrite
from protocol.apis import ApiKey
from protocol.messages import decode_response, encode_body
from protocol.metadata_scan import rewrite_metadata_body
from proxy.dataplane.filters.api import Close
from proxy.dataplane.filters.api_versions import ApiVersionsFilter
from tests.support.kafka_messages import (
    describe_cluster_response,
    fetch_response,
    find_coordinator_response,
    make,
    metadata_response,
    produce_response,
)

PROXY_HOST = "proxy.example"
# node id -> the broker address the builders use
UPSTREAM = {1: ("b1.internal", 9092), 2: ("b2.internal", 9093), 3: ("b3.internal", 9094)}


class Advertise:
    """Maps node N to PROXY_HOST:20000+N and records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, int]] = []

    def __call__(self, node_id: int, host: str, port: int) -> tuple[str, int]:
        self.calls.append((node_id, host, port))
        return PROXY_HOST, 20000 + node_id


def _rewrite_and_reencode(api_key, resp):
    """Rewrites ``resp`` as the proxy does; returns (advertise, re-encoded body, decoded again)."""
    advertise = Advertise()
    rewrite.ENDPOINT_REWRITERS[api_key](resp, advertise)
    body = encode_body(resp)
    assert b".internal" not in body
    return advertise, body, decode_response(api_key, resp.version, body)


def _assert_advertised(advertise, endpoints):
    """Every (node_id, host, port) is the proxy's; advertise saw each upstream address."""
    for node_id, host, port in endpoints:
        assert (host, port) == (PROXY_HOST, 20000 + node_id)
    assert sorted(advertise.calls) == sorted((n, *UPSTREAM[n]) for n, _, _ in endpoints)


def test_rewriters_cover_every_api_with_broker_addresses():
    # Metadata's brokers are rewritten without decoding (tests/unit/test_metadata_scan.py).
    assert set(rewrite.ENDPOINT_REWRITERS) == {
        ApiKey.FIND_COORDINATOR,
        ApiKey.DESCRIBE_CLUSTER,
        ApiKey.PRODUCE,
        ApiKey.FETCH,
        ApiKey.SHARE_FETCH,
        ApiKey.SHARE_ACKNOWLEDGE,
    }


@pytest.mark.parametrize("version", range(MetadataResponse.max_version + 1))
def test_metadata(version):
    advertise = Advertise()
    body, _ = rewrite_metadata_body(encode_body(metadata_response(version)), version, advertise)
    assert b".internal" not in body
    after = decode_response(ApiKey.METADATA, version, body)
    _assert_advertised(advertise, [(b.node_id, b.host, b.port) for b in after.brokers])
    assert [b.node_id for b in after.brokers] == [1, 2]
    # Leaders and replicas are node ids and stay the broker's.
    parts = after.topics[0].partitions
    assert [(p.leader_id, p.replica_nodes) for p in parts] == [(1, [1, 2]), (2, [1, 2])]
    if version >= 1:
        assert [b.rack for b in after.brokers] == ["rack-a", None]


@pytest.mark.parametrize("version", range(4))
def test_find_coordinator_single_form(version):
    resp = find_coordinator_response(version)
    advertise, _, after = _rewrite_and_reencode(ApiKey.FIND_COORDINATOR, resp)
    assert (after.node_id, after.host, after.port) == (2, PROXY_HOST, 20002)
    assert advertise.calls == [(2, "b2.internal", 9093)]


@pytest.mark.parametrize("version", range(4))
def test_find_coordinator_single_form_error_left_alone(version):
    resp = make(
        FindCoordinatorResponse,
        version,
        throttle_time_ms=0,
        error_code=15,  # COORDINATOR_NOT_AVAILABLE
        error_message="not yet",
        node_id=-1,
        host="",
        port=-1,
    )
    before = encode_body(resp)
    advertise = Advertise()
    rewrite.rewrite_find_coordinator(resp, advertise)
    assert advertise.calls == []
    assert encode_body(resp) == before


@pytest.mark.parametrize("version", range(4, FindCoordinatorResponse.max_version + 1))
def test_find_coordinator_batched_with_an_errored_coordinator(version):
    resp = find_coordinator_response(version)
    advertise, _, after = _rewrite_and_reencode(ApiKey.FIND_COORDINATOR, resp)
    ok, errored = after.coordinators
    assert (ok.key, ok.node_id, ok.host, ok.port) == ("group-a", 2, PROXY_HOST, 20002)
    # node_id -1: nothing to advertise, the error stays as the broker sent it.
    assert (errored.key, errored.node_id, errored.host, errored.port) == ("group-b", -1, "", -1)
    assert errored.error_code == 15
    assert advertise.calls == [(2, "b2.internal", 9093)]


@pytest.mark.parametrize("version", range(DescribeClusterResponse.max_version + 1))
def test_describe_cluster(version):
    resp = describe_cluster_response(version)
    advertise, _, after = _rewrite_and_reencode(ApiKey.DESCRIBE_CLUSTER, resp)
    _assert_advertised(advertise, [(b.broker_id, b.host, b.port) for b in after.brokers])
    assert [b.broker_id for b in after.brokers] == [1, 3]
    assert after.controller_id == 1


@pytest.mark.parametrize("version", range(10, ProduceResponse.max_version + 1))
def test_produce_node_endpoints(version):
    resp = produce_response(version)
    advertise, _, after = _rewrite_and_reencode(ApiKey.PRODUCE, resp)
    _assert_advertised(advertise, [(e.node_id, e.host, e.port) for e in after.node_endpoints])
    assert [e.rack for e in after.node_endpoints] == ["rack-b"]
    leader = after.responses[0].partition_responses[1].current_leader
    assert (leader.leader_id, leader.leader_epoch) == (2, 8)


@pytest.mark.parametrize("version", range(16, FetchResponse.max_version + 1))
def test_fetch_node_endpoints(version):
    resp = fetch_response(version)
    advertise, _, after = _rewrite_and_reencode(ApiKey.FETCH, resp)
    _assert_advertised(advertise, [(e.node_id, e.host, e.port) for e in after.node_endpoints])
    assert after.responses[0].partitions[0].records == resp.responses[0].partitions[0].records


@pytest.mark.parametrize(
    "api_key, build, version",
    [(ApiKey.PRODUCE, produce_response, v) for v in (3, 9)]
    + [(ApiKey.FETCH, fetch_response, v) for v in (4, 12, 15)],
)
def test_node_endpoints_rewrite_is_a_no_op_before_kip_951(api_key, build, version):
    resp = build(version)
    before = encode_body(resp)
    advertise = Advertise()
    rewrite.ENDPOINT_REWRITERS[api_key](resp, advertise)
    assert advertise.calls == []
    assert encode_body(resp) == before


def test_node_endpoints_empty():
    resp = make(ProduceResponse, 11, responses=[], throttle_time_ms=0, node_endpoints=[])
    advertise = Advertise()
    rewrite.rewrite_node_endpoints(resp, advertise)
    assert advertise.calls == []


# --- ApiVersions --------------------------------------------------------------------------


def _api_versions(version, ranges):
    R = ApiVersionsResponse
    keys = [make(R.ApiVersion, version, api_key=k, min_version=lo, max_version=hi) for k, (lo, hi) in ranges.items()]
    return make(R, version, error_code=0, api_keys=keys, throttle_time_ms=0)


@pytest.mark.parametrize("version", range(ApiVersionsResponse.max_version + 1))
def test_cap_api_versions(version):
    resp = _api_versions(
        version,
        {
            ApiKey.PRODUCE: (3, 13),  # capped to 11
            ApiKey.FETCH: (4, 12),  # cap 17 above the broker's max: unchanged
            ApiKey.METADATA: (0, 13),  # not in caps: unchanged
            ApiKey.SHARE_FETCH: (0, 1),  # cap None: removed
            ApiKey.DESCRIBE_QUORUM: (2, 2),  # broker min above the cap: removed
            ApiKey.DESCRIBE_CLUSTER: (0, 2),  # cap equals the max
        },
    )
    rewrite.cap_api_versions(
        resp,
        {
            ApiKey.PRODUCE: 11,
            ApiKey.FETCH: 17,
            ApiKey.SHARE_FETCH: None,
            ApiKey.DESCRIBE_QUORUM: 1,
            ApiKey.DESCRIBE_CLUSTER: 2,
            ApiKey.CREATE_TOPICS: 3,  # absent from the response: nothing to do
        },
    )
    after = decode_response(ApiKey.API_VERSIONS, version, encode_body(resp))
    assert [(k.api_key, k.min_version, k.max_version) for k in after.api_keys] == [
        (ApiKey.PRODUCE, 3, 11),
        (ApiKey.FETCH, 4, 12),
        (ApiKey.METADATA, 0, 13),
        (ApiKey.DESCRIBE_CLUSTER, 0, 2),
    ]


def test_cap_equal_to_broker_min_keeps_the_api():
    resp = _api_versions(3, {ApiKey.DESCRIBE_QUORUM: (1, 2)})
    rewrite.cap_api_versions(resp, {ApiKey.DESCRIBE_QUORUM: 1})
    assert [(k.api_key, k.min_version, k.max_version) for k in resp.api_keys] == [(ApiKey.DESCRIBE_QUORUM, 1, 1)]


SHARE_FAMILY = frozenset({76, 77, 78, 79})  # ShareGroupHeartbeat, ShareGroupDescribe, ShareFetch, ShareAcknowledge
SHARE_STATE = {83: (0, 1), 84: (0, 1), 85: (0, 1), 86: (0, 1), 87: (0, 1)}  # broker to broker: not a family


@pytest.mark.parametrize("version", range(ApiVersionsResponse.max_version + 1))
def test_a_family_capped_in_part_is_removed_whole(version):
    resp = _api_versions(version, {0: (3, 11), 76: (1, 1), 77: (1, 1), 78: (1, 1), 79: (1, 1), **SHARE_STATE})
    rewrite.cap_api_versions(resp, {ApiKey.SHARE_FETCH: None, ApiKey.SHARE_ACKNOWLEDGE: None}, [SHARE_FAMILY])
    after = decode_response(ApiKey.API_VERSIONS, version, encode_body(resp))
    assert [k.api_key for k in after.api_keys] == [0, 83, 84, 85, 86, 87]


def test_a_family_the_broker_lists_in_part_is_removed_whole_and_a_whole_one_kept():
    resp = _api_versions(3, {76: (1, 1), 77: (1, 1), 3: (0, 12)})  # a broker without ShareFetch
    rewrite.cap_api_versions(resp, {}, [SHARE_FAMILY])
    assert [k.api_key for k in resp.api_keys] == [3]
    whole = _api_versions(3, {76: (1, 1), 77: (1, 1), 78: (1, 1), 79: (1, 1)})
    before = encode_body(whole)
    rewrite.cap_api_versions(whole, {}, [SHARE_FAMILY])
    assert encode_body(whole) == before


def test_the_filter_closes_a_connection_sending_an_api_of_a_family_it_hides():
    f = ApiVersionsFilter(caps={ApiKey.SHARE_FETCH: None})
    assert f.hidden == SHARE_FAMILY and SHARE_FAMILY <= f.spec.request_keys
    header = SimpleNamespace(api_key=76, api_version=1, correlation_id=3)
    decision = f.on_request(None, header, b"", None)
    assert isinstance(decision, Close) and "ShareGroupHeartbeat (api key 76) v1 is not offered" in decision.reason
    assert ApiVersionsFilter().hidden == frozenset()  # the proxy carries every share API


def test_cap_with_no_caps_changes_nothing():
    resp = _api_versions(3, {0: (3, 13), 1: (4, 18)})
    before = encode_body(resp)
    rewrite.cap_api_versions(resp, {})
    assert encode_body(resp) == before


@pytest.mark.parametrize("max_version", [3, 4])
def test_unsupported_api_versions_response_bytes(max_version):
    # What Kafka's ApiVersionsRequest.getErrorResponse sends: a v0 body, UNSUPPORTED_VERSION (35),
    # one entry [ApiVersions (18), min 0, max].
    body = encode_body(rewrite.unsupported_api_versions_response(max_version))
    assert body == struct.pack(">hi" + "hhh", 35, 1, 18, 0, max_version)
    assert body.hex() == "0023" + "00000001" + "0012" + "0000" + f"{max_version:04x}"


@pytest.mark.parametrize("client_version", range(ApiVersionsResponse.max_version + 1))
def test_clients_read_the_unsupported_response_at_any_version(client_version):
    # A client decodes with the version it sent; on an error kafka-python (like Kafka's client)
    # falls back to v0, which is why the body must be v0.
    body = encode_body(rewrite.unsupported_api_versions_response(4))
    resp = ApiVersionsResponse.decode(body, version=client_version)
    assert resp.error_code == errors.UNSUPPORTED_VERSION
    assert [(k.api_key, k.min_version, k.max_version) for k in resp.api_keys] == [(18, 0, 4)]
