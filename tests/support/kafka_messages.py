"""Kafka messages with every field of a version set, for round-trip and rewrite tests.

Builders take a version and set each field that version has to a non-default value (tagged
fields included, so they are actually written). Broker hosts all end in ``.internal`` so a
test can check none survives a rewrite.
"""

from __future__ import annotations

import uuid

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

TOPIC_ID = uuid.UUID("6c9b2c1e-3d5f-4a8e-9b0c-1d2e3f405162")


def make(cls, version: int, **fields):
    """``cls`` with only the fields that exist at ``version`` (others would not round-trip)."""
    unknown = set(fields) - set(cls.fields)
    assert not unknown, f"{cls.__name__} has no fields {unknown}"
    present = {k: v for k, v in fields.items() if cls.fields[k].for_version_q(version)}
    if getattr(cls, "API_KEY", None) is not None:
        return cls[version](**present)
    return cls(**present)


def api_versions_request(v):
    return make(ApiVersionsRequest, v, client_software_name="kqp-test", client_software_version="1.2.3")


def api_versions_response(v):
    R = ApiVersionsResponse
    return make(
        R,
        v,
        error_code=0,
        api_keys=[
            make(R.ApiVersion, v, api_key=0, min_version=3, max_version=13),
            make(R.ApiVersion, v, api_key=18, min_version=0, max_version=4),
            make(R.ApiVersion, v, api_key=60, min_version=0, max_version=2),
        ],
        throttle_time_ms=17,
        supported_features=[make(R.SupportedFeatureKey, v, name="metadata.version", min_version=1, max_version=25)],
        finalized_features_epoch=99,
        finalized_features=[
            make(R.FinalizedFeatureKey, v, name="metadata.version", max_version_level=25, min_version_level=1)
        ],
        zk_migration_ready=True,
    )


def metadata_request(v):
    R = MetadataRequest
    return make(
        R,
        v,
        topics=[make(R.MetadataRequestTopic, v, topic_id=TOPIC_ID, name="orders")],
        allow_auto_topic_creation=False,
        include_cluster_authorized_operations=True,
        include_topic_authorized_operations=True,
    )


def metadata_response(v):
    R = MetadataResponse
    T = R.MetadataResponseTopic
    return make(
        R,
        v,
        throttle_time_ms=11,
        brokers=[
            make(R.MetadataResponseBroker, v, node_id=1, host="b1.internal", port=9092, rack="rack-a"),
            make(R.MetadataResponseBroker, v, node_id=2, host="b2.internal", port=9093, rack=None),
        ],
        cluster_id="cluster-xyz",
        controller_id=2,
        topics=[
            make(
                T,
                v,
                error_code=0,
                name="orders",
                topic_id=TOPIC_ID,
                is_internal=True,
                partitions=[
                    make(
                        T.MetadataResponsePartition,
                        v,
                        error_code=0,
                        partition_index=p,
                        leader_id=1 + p,
                        leader_epoch=5,
                        replica_nodes=[1, 2],
                        isr_nodes=[1 + p],
                        offline_replicas=[2 - p],
                    )
                    for p in range(2)
                ],
                authorized_operations={3, 4, 8},  # kafka-python reads the bitfield as a set of bits
            )
        ],
        authorized_operations=None,  # INT32_MIN on the wire: "not requested"
        error_code=0,
    )


def find_coordinator_request(v):
    return make(FindCoordinatorRequest, v, key="group-a", key_type=1, coordinator_keys=["group-a", "group-b"])


def find_coordinator_response(v):
    R = FindCoordinatorResponse
    return make(
        R,
        v,
        throttle_time_ms=3,
        error_code=0,
        error_message="fine",
        node_id=2,
        host="b2.internal",
        port=9093,
        coordinators=[
            make(R.Coordinator, v, key="group-a", node_id=2, host="b2.internal", port=9093, error_code=0,
                 error_message=None),
            make(R.Coordinator, v, key="group-b", node_id=-1, host="", port=-1, error_code=15,
                 error_message="not available"),
        ],
    )


def describe_cluster_request(v):
    return make(
        DescribeClusterRequest,
        v,
        include_cluster_authorized_operations=True,
        endpoint_type=1,
        include_fenced_brokers=True,
    )


def describe_cluster_response(v):
    R = DescribeClusterResponse
    return make(
        R,
        v,
        throttle_time_ms=4,
        error_code=0,
        error_message=None,
        endpoint_type=1,
        cluster_id="cluster-xyz",
        controller_id=1,
        brokers=[
            make(R.DescribeClusterBroker, v, broker_id=1, host="b1.internal", port=9092, rack="rack-a",
                 is_fenced=False),
            make(R.DescribeClusterBroker, v, broker_id=3, host="b3.internal", port=9094, rack=None, is_fenced=True),
        ],
        authorized_operations={2, 3, 31},
    )


def produce_response(v):
    R = ProduceResponse
    T = R.TopicProduceResponse
    P = T.PartitionProduceResponse
    return make(
        R,
        v,
        responses=[
            make(
                T,
                v,
                name="orders",
                topic_id=TOPIC_ID,
                partition_responses=[
                    make(P, v, index=0, error_code=0, base_offset=1000, log_append_time_ms=1_700_000_000_000,
                         log_start_offset=10, record_errors=[], error_message=None),
                    make(
                        P,
                        v,
                        index=1,
                        error_code=6,  # NOT_LEADER_OR_FOLLOWER
                        base_offset=-1,
                        log_append_time_ms=-1,
                        log_start_offset=-1,
                        record_errors=[
                            make(P.BatchIndexAndErrorMessage, v, batch_index=3, batch_index_error_message="bad")
                        ],
                        error_message="moved",
                        current_leader=make(P.LeaderIdAndEpoch, v, leader_id=2, leader_epoch=8),
                    ),
                ],
            )
        ],
        throttle_time_ms=250,
        node_endpoints=[make(R.NodeEndpoint, v, node_id=2, host="b2.internal", port=9093, rack="rack-b")],
    )


def fetch_response(v):
    R = FetchResponse
    T = R.FetchableTopicResponse
    P = T.PartitionData
    return make(
        R,
        v,
        throttle_time_ms=125,
        error_code=0,
        session_id=77,
        responses=[
            make(
                T,
                v,
                topic="orders",
                topic_id=TOPIC_ID,
                partitions=[
                    make(
                        P,
                        v,
                        partition_index=0,
                        error_code=0,
                        high_watermark=50,
                        last_stable_offset=48,
                        log_start_offset=1,
                        aborted_transactions=[make(P.AbortedTransaction, v, producer_id=4000, first_offset=12)],
                        preferred_read_replica=-1,
                        records=b"\x00" * 12 + b"opaque-record-batch-bytes",
                        diverging_epoch=make(P.EpochEndOffset, v, epoch=3, end_offset=40),
                        snapshot_id=make(P.SnapshotId, v, end_offset=30, epoch=2),
                    ),
                    make(
                        P,
                        v,
                        partition_index=1,
                        error_code=74,  # FENCED_LEADER_EPOCH
                        high_watermark=-1,
                        last_stable_offset=-1,
                        log_start_offset=-1,
                        aborted_transactions=None,
                        preferred_read_replica=-1,
                        records=None,
                        current_leader=make(P.LeaderIdAndEpoch, v, leader_id=3, leader_epoch=9),
                    ),
                ],
            )
        ],
        node_endpoints=[make(R.NodeEndpoint, v, node_id=3, host="b3.internal", port=9094, rack=None)],
    )


def sasl_handshake_request(v):
    return make(SaslHandshakeRequest, v, mechanism="SCRAM-SHA-512")


def sasl_handshake_response(v):
    return make(SaslHandshakeResponse, v, error_code=0, mechanisms=["PLAIN", "SCRAM-SHA-512", "OAUTHBEARER"])


def sasl_authenticate_request(v):
    return make(SaslAuthenticateRequest, v, auth_bytes=b"\x00alice\x00secret")


def sasl_authenticate_response(v):
    return make(
        SaslAuthenticateResponse,
        v,
        error_code=0,
        error_message=None,
        auth_bytes=b"v=signature",
        session_lifetime_ms=3_600_000,
    )


