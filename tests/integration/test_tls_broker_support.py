"""The TLS broker helper itself (tests.support.tls_broker): Tansu behind stunnel4, used directly by
kafka-python over TLS, no proxy. Shows that Tansu advertises only stunnel's TLS address, that the
TLS port does not speak plaintext Kafka, and that with ``verify_client_ca`` a client certificate
is required."""

from __future__ import annotations

import socket
import ssl
import struct
import uuid

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.admin import NewTopic
from kafka.structs import TopicPartition

from proxy import procnet
from proxy.local_broker import api_versions_ping
from tests.support.certs import TestPki
from tests.support.tls_broker import TlsTansu

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

RECORDS = 50


@pytest.fixture
def pki(tmp_path):
    return TestPki(tmp_path)


@pytest.fixture
def tls_tansu(pki):
    with TlsTansu(pki.server) as broker:
        yield broker


def _address(bootstrap: str) -> tuple[str, int]:
    host, port = bootstrap.rsplit(":", 1)
    return host, int(port)


def _api_versions(correlation_id: int) -> bytes:
    body = struct.pack(">hhih", 18, 0, correlation_id, 3) + b"kqp"  # ApiVersions v0, client id "kqp"
    return struct.pack(">i", len(body)) + body


def _round_trip(sock) -> int:
    """Sends ApiVersions v0 and returns the correlation id of the answer."""
    sock.sendall(_api_versions(7))
    head = b""
    while len(head) < 8:
        chunk = sock.recv(8 - len(head))
        if not chunk:
            raise ConnectionError("closed")
        head += chunk
    return struct.unpack(">ii", head)[1]


def _client_context(pki: TestPki, cert=None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=pki.ca_file)
    if cert is not None:
        ctx.load_cert_chain(cert.cert, cert.key)
    return ctx


def test_kafka_python_produces_and_consumes_over_tls_and_sees_only_the_tls_address(tls_tansu, pki):
    ssl_args = {"security_protocol": "SSL", "ssl_cafile": pki.ca_file, "ssl_check_hostname": True}
    topic = f"tls-broker-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=tls_tansu.bootstrap, client_id="tls-broker-admin", **ssl_args)
    try:
        admin.create_topics([NewTopic(topic, 1, 1)])
        brokers = admin.describe_cluster()["brokers"]
    finally:
        admin.close()
    # Tansu advertises stunnel's TLS address, never its real (plaintext) port.
    assert {(b["host"], b["port"]) for b in brokers} == {("127.0.0.1", tls_tansu.port)}
    assert tls_tansu.plain_bootstrap != tls_tansu.bootstrap

    producer = KafkaProducer(bootstrap_servers=tls_tansu.bootstrap, acks="all", **ssl_args)
    sent = [f"record-{i}".encode() for i in range(RECORDS)]
    for value in sent:
        producer.send(topic, value=value, partition=0)
    producer.flush(30)
    producer.close()

    consumer = KafkaConsumer(bootstrap_servers=tls_tansu.bootstrap, enable_auto_commit=False,
                             auto_offset_reset="earliest", consumer_timeout_ms=10_000, **ssl_args)
    consumer.assign([TopicPartition(topic, 0)])
    received = []
    for record in consumer:
        received.append(record.value)
        if len(received) == len(sent):
            break
    consumer.close()
    assert received == sent


def test_the_tls_port_does_not_speak_plaintext(tls_tansu):
    # A plaintext ApiVersions on the TLS port: closed, at most a TLS alert, never a Kafka answer.
    with socket.create_connection(_address(tls_tansu.bootstrap), timeout=5) as s:
        s.sendall(_api_versions(1))
        try:
            answer = s.recv(100)
        except ConnectionResetError:
            answer = b""
        assert answer == b"" or answer[0] == 0x15, answer
    assert not api_versions_ping(*_address(tls_tansu.bootstrap))
    # Tansu's own port is plaintext.
    assert api_versions_ping(*_address(tls_tansu.plain_bootstrap))


def test_verify_client_ca_requires_a_client_certificate(pki):
    with TlsTansu(pki.server, verify_client_ca=pki.ca_file, probe_client=pki.client("probe", "probe")) as broker:
        address = _address(broker.bootstrap)
        # No certificate, and one from another CA: refused.
        for cert in (None, pki.client("stranger", "mallory", other_ca=True)):
            with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
                with socket.create_connection(address, timeout=5) as raw:
                    with _client_context(pki, cert).wrap_socket(raw, server_hostname="127.0.0.1") as s:
                        _round_trip(s)
        # A certificate from the CA: answered.
        alice = pki.client("alice", "alice")
        with socket.create_connection(address, timeout=5) as raw:
            with _client_context(pki, alice).wrap_socket(raw, server_hostname="127.0.0.1") as s:
                assert _round_trip(s) == 7
        # And a real client with that certificate.
        admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap, client_id="tls-broker-mtls",
                                 security_protocol="SSL", ssl_cafile=pki.ca_file,
                                 ssl_certfile=alice.cert, ssl_keyfile=alice.key)
        try:
            brokers = admin.describe_cluster()["brokers"]
        finally:
            admin.close()
        assert {(b["host"], b["port"]) for b in brokers} == {("127.0.0.1", broker.port)}
        # stunnel's own reason (OpenSSL's message) for the connection without a certificate.
        assert "peer did not return a certificate" in broker.log_tail(max_bytes=100_000)


def test_verify_client_ca_needs_a_probe_certificate(pki):
    with pytest.raises(ValueError, match="probe_client"):
        TlsTansu(pki.server, verify_client_ca=pki.ca_file)


def test_stop_ends_stunnel_and_tansu_and_frees_both_ports(pki):
    broker = TlsTansu(pki.server).start()
    tls_port, plain_port, pid = broker.port, _address(broker.plain_bootstrap)[1], broker.stunnel_pid
    assert procnet.listening_inodes(tls_port) & procnet.socket_inodes(pid)
    process = broker.process
    broker.stop()
    assert process is not None and process.poll() is not None
    assert not procnet.listening_inodes(tls_port)
    assert not procnet.listening_inodes(plain_port)
    assert not broker.log_path.parent.exists()
