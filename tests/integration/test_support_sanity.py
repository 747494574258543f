"""The test helpers themselves: Tansu behind the counting relay, used by kafka-python directly.

No proxy here. This shows the relay is the only way in (Tansu advertises the relay's port) and
that it attributes every connection to the process that opened it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.structs import TopicPartition

from proxy.app import procnet
from proxy.app.local_broker import TANSU_VERSION, tansu_version
from proxy.app.local_broker import api_versions_ping as api_versions_round_trip
from tests.support.relay import RelayedConnection

pytestmark = pytest.mark.integration


def test_tansu_is_the_pinned_version():
    assert tansu_version() == TANSU_VERSION


def test_tansu_owns_its_port(tansu):
    assert procnet.listening_inodes(tansu.port) & procnet.socket_inodes(tansu.pid)
    assert api_versions_round_trip(tansu.host, tansu.port)


def test_tansu_stop_frees_its_port(tansu):
    port = tansu.port
    tansu.stop()
    assert not procnet.listening_inodes(port)
    assert not api_versions_round_trip("127.0.0.1", port)


def test_kafka_python_through_the_relay(relay_tansu):
    relay = relay_tansu.relay
    topic = f"sanity-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=relay.bootstrap, client_id="sanity-admin")
    try:
        admin.create_topics({topic: {"num_partitions": 2, "replication_factor": 1}})
        brokers = admin.describe_cluster()["brokers"]
        # Tansu advertises the relay, not its real port.
        assert {(b["host"], b["port"]) for b in brokers} == {("127.0.0.1", relay.port)}

        producer = KafkaProducer(bootstrap_servers=relay.bootstrap, acks="all", linger_ms=5)
        sent = [(p, f"value-{p}-{i}".encode()) for p in (0, 1) for i in range(20)]
        for p, value in sent:
            producer.send(topic, value=value, partition=p)
        producer.flush(30)
        producer.close()

        consumer = KafkaConsumer(
            bootstrap_servers=relay.bootstrap, enable_auto_commit=False,
            auto_offset_reset="earliest", consumer_timeout_ms=10_000,
        )
        consumer.assign([TopicPartition(topic, 0), TopicPartition(topic, 1)])
        received = []
        for record in consumer:
            received.append((record.partition, record.value))
            if len(received) == len(sent):
                break
        consumer.close()
        assert sorted(received) == sorted(sent)
    finally:
        admin.delete_topics([topic])
        admin.close()

    assert relay.connections, "no connection went through the relay"
    assert relay.connections_not_from(os.getpid()) == []
    assert all(c.peer[0] == "127.0.0.1" for c in relay.connections)


def test_relay_attributes_other_processes(relay_tansu):
    relay = relay_tansu.relay
    # A child process connects; the relay must name the child, not this process.
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import socket,sys; s=socket.create_connection(('127.0.0.1', int(sys.argv[1]))); "
         "sys.stdout.write('ok\\n'); sys.stdout.flush(); sys.stdin.read()", str(relay.port)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout.readline() == "ok\n"
        # Connections are looked up in accept order before any await, so once a later
        # connection's round trip completes the child's connection has been recorded.
        assert api_versions_round_trip(*relay.address)
    finally:
        child.stdin.close()
        child.wait(10)
    pids = [c.pid for c in relay.connections]
    assert child.pid in pids
    assert os.getpid() in pids
    assert relay.connections_not_from(os.getpid()) == [c for c in relay.connections if c.pid == child.pid]


def test_relay_counts_an_unattributed_connection_as_an_escape_only_if_the_broker_answered(relay_tansu):
    relay = relay_tansu.relay
    assert api_versions_round_trip(*relay.address)  # answered, from this process
    # Owners the relay could not find (sockets closed before it looked): one the broker
    # answered, one it never did.
    with relay._lock:
        relay._connections.append(RelayedConnection(peer=("127.0.0.1", 1), pid=None, answered_bytes=10))
        relay._connections.append(RelayedConnection(peer=("127.0.0.1", 2), pid=None))
    (ours,) = [c for c in relay.connections if c.pid == os.getpid()]
    assert ours.answered_bytes > 0
    assert [c.peer for c in relay.escapes(os.getpid())] == [("127.0.0.1", 1)]
    assert [c.peer for c in relay.escapes(-1)] == [ours.peer, ("127.0.0.1", 1)]
