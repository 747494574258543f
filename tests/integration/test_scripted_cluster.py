"""Several brokers behind one proxy: every address a client sees is a proxy address.

Uses the scripted cluster (tests/support/scripted_broker.py) because Tansu runs a single node
and cannot send KIP-951 NodeEndpoints on demand.
"""

from __future__ import annotations

import socket

import pytest
from kafka.protocol.admin import DescribeClusterRequest
from kafka.protocol.metadata import FindCoordinatorRequest, MetadataRequest
from kafka.protocol.producer import ProduceRequest

from protocol import errors
from protocol.apis import ApiKey
from protocol.headers import response_body_offset
from protocol.messages import decode_response
from tests.support.inproc import InProcessProxy
from tests.support.scripted_broker import Script, ScriptedCluster
from tests.support.wire import read_frame, request_bytes

pytestmark = pytest.mark.integration

NODE_IDS = [1, 5, 9]


@pytest.fixture
def stack():
    script = Script(coordinators={"group-a": 5, "txn-b": 9})
    with ScriptedCluster(node_ids=NODE_IDS, script=script).threaded() as cluster:
        cluster.call(cluster.add_topic, "orders", 3, NODE_IDS)
        with InProcessProxy(cluster.bootstrap_servers) as proxy:
            yield cluster, proxy


def _round_trip(address, request, correlation_id=11):
    with socket.create_connection(address, timeout=10) as s:
        s.sendall(request_bytes(request, correlation_id))
        frame = read_frame(s)
    key, version = request.API_KEY, request.API_VERSION
    return decode_response(key, version, memoryview(frame)[response_body_offset(frame, key, version):])


def _proxy_map(proxy) -> dict[int, tuple[str, int]]:
    """node id -> the proxy address serving it, as a client learns it from Metadata."""
    resp = _round_trip(proxy.address, MetadataRequest[12](topics=None, allow_auto_topic_creation=False))
    return {b.node_id: (b.host, b.port) for b in resp.brokers}


def _broker_ports(cluster) -> set[int]:
    return {cluster.broker(n).address[1] for n in NODE_IDS}


def _assert_proxy_address(proxy, host, port):
    assert host == "127.0.0.1"
    served = proxy.run(lambda: set(proxy.server.cluster.node_ports.values()))
    assert port in served, f"{host}:{port} is not a proxy listener ({served})"


@pytest.mark.parametrize("version", [0, 1, 4, 9, 12])
def test_metadata_lists_every_broker_at_a_proxy_port(stack, version):
    cluster, proxy = stack
    resp = _round_trip(proxy.address, MetadataRequest[version](topics=[] if version == 0 else None))
    assert sorted(b.node_id for b in resp.brokers) == NODE_IDS
    ports = {b.port for b in resp.brokers}
    assert len(ports) == len(NODE_IDS) and not ports & _broker_ports(cluster)
    for b in resp.brokers:
        _assert_proxy_address(proxy, b.host, b.port)
    if version >= 1:
        leaders = sorted(p.leader_id for t in resp.topics for p in t.partitions)
        assert leaders == NODE_IDS


def test_each_node_port_reaches_that_node(stack):
    cluster, proxy = stack
    for node_id, address in _proxy_map(proxy).items():
        before = len(cluster.requests_for(ApiKey.METADATA, node_id=node_id))
        _round_trip(address, MetadataRequest[9](topics=[]))
        assert len(cluster.requests_for(ApiKey.METADATA, node_id=node_id)) == before + 1


@pytest.mark.parametrize("version", [1, 3])
def test_find_coordinator_single_form(stack, version):
    _cluster, proxy = stack
    nodes = _proxy_map(proxy)
    resp = _round_trip(proxy.address, FindCoordinatorRequest[version](key="group-a", key_type=0))
    assert resp.error_code == 0 and resp.node_id == 5
    assert (resp.host, resp.port) == nodes[5]


@pytest.mark.parametrize("version", [4, 6])
def test_find_coordinator_batched_form(stack, version):
    cluster, proxy = stack
    cluster.script.coordinator_errors["broken"] = 15  # COORDINATOR_NOT_AVAILABLE
    nodes = _proxy_map(proxy)
    resp = _round_trip(
        proxy.address, FindCoordinatorRequest[version](key_type=0, coordinator_keys=["group-a", "txn-b", "broken"])
    )
    got = {c.key: (c.node_id, c.host, c.port, c.error_code) for c in resp.coordinators}
    assert got["group-a"] == (5, *nodes[5], 0)
    assert got["txn-b"] == (9, *nodes[9], 0)
    assert got["broken"] == (-1, "", -1, 15)  # an error names no address and is left alone


@pytest.mark.parametrize("version", [0, 1])
def test_describe_cluster(stack, version):
    _cluster, proxy = stack
    nodes = _proxy_map(proxy)
    resp = _round_trip(proxy.address, DescribeClusterRequest[version](include_cluster_authorized_operations=False))
    assert {b.broker_id: (b.host, b.port) for b in resp.brokers} == nodes


def test_produce_v10_node_endpoints_are_rewritten(stack):
    cluster, proxy = stack
    nodes = _proxy_map(proxy)
    cluster.call(cluster.move_leader, "orders", 0, 9)  # node 1 no longer leads orders-0
    T = ProduceRequest[10].TopicProduceData
    request = ProduceRequest[10](
        transactional_id=None, acks=1, timeout_ms=5000,
        topic_data=[T(name="orders", partition_data=[T.PartitionProduceData(index=0, records=None)])],
    )
    resp = _round_trip(nodes[1], request)
    part = resp.responses[0].partition_responses[0]
    assert part.error_code == errors.NOT_LEADER_OR_FOLLOWER
    assert part.current_leader.leader_id == 9
    assert [(e.node_id, e.host, e.port) for e in resp.node_endpoints] == [(9, *nodes[9])]


def test_kafka_python_producer_and_consumer_across_three_brokers(stack):
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    _cluster, proxy = stack
    producer = KafkaProducer(bootstrap_servers=proxy.bootstrap, linger_ms=5)
    for i in range(300):
        producer.send("orders", value=b"%d" % i, partition=i % 3)
    producer.flush(10)
    producer.close()
    consumer = KafkaConsumer(bootstrap_servers=proxy.bootstrap, auto_offset_reset="earliest",
                             consumer_timeout_ms=3000)
    consumer.assign([TopicPartition("orders", p) for p in range(3)])
    assert sorted(int(r.value) for r in consumer) == list(range(300))
    consumer.close()
