"""The TLS broker helper itself (tests.support.tls_broker): Tansu behind stunnel4, used directly by
kafka-python over TLS, no proxy. Shows that Tansu advertises only stunnel's TLS address, that the
TLS port does not speak plaintext Kafka, and that with ``verify_client_ca`` a client certificate
is required."""

from __future__ import annotations

import socket
import ssl
import uuid

import pytest
from kafka import KafkaAdminClient
from kafka.admin import NewTopic

from config.loader import split_host_port
from proxy.app import procnet
from proxy.app.local_broker import api_versions_ping
from tests.support.kafka_python import produce_and_read_back
from tests.support.tls_broker import TlsTansu
from tests.support.wire import api_versions_round_trip, api_versions_v0

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

RECORDS = 50


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

    sent = [f"record-{i}".encode() for i in range(RECORDS)]
    assert produce_and_read_back(tls_tansu.bootstrap, topic, sent, ssl_args, ssl_args) == sent


def test_the_tls_port_does_not_speak_plaintext(tls_tansu):
    # A plaintext ApiVersions on the TLS port: closed, at most a TLS alert, never a Kafka answer.
    with socket.create_connection(split_host_port(tls_tansu.bootstrap), timeout=5) as s:
        s.sendall(api_versions_v0(1))
        try:
            answer = s.recv(100)
        except ConnectionResetError:
            answer = b""
        assert answer == b"" or answer[0] == 0x15, answer
    assert not api_versions_ping(*split_host_port(tls_tansu.bootstrap))
    # Tansu's own port is plaintext.
    assert api_versions_ping(*split_host_port(tls_tansu.plain_bootstrap))


def test_verify_client_ca_requires_a_client_certificate(pki):
    with TlsTansu(pki.server, verify_client_ca=pki.ca_file, probe_client=pki.client("probe", "probe")) as broker:
        address = split_host_port(broker.bootstrap)
        # No certificate, and one from another CA: refused.
        for cert in (None, pki.client("stranger", "mallory", other_ca=True)):
            with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
                with socket.create_connection(address, timeout=5) as raw:
                    with pki.client_context(cert).wrap_socket(raw, server_hostname="127.0.0.1") as s:
                        api_versions_round_trip(s)
        # A certificate from the CA: answered.
        alice = pki.client("alice", "alice")
        with socket.create_connection(address, timeout=5) as raw:
            with pki.client_context(alice).wrap_socket(raw, server_hostname="127.0.0.1") as s:
                assert api_versions_round_trip(s) == 7
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
    tls_port, plain_port, pid = broker.port, split_host_port(broker.plain_bootstrap)[1], broker.stunnel_pid
    assert procnet.listening_inodes(tls_port) & procnet.socket_inodes(pid)
    process = broker.process
    broker.stop()
    assert process is not None and process.poll() is not None
    assert not procnet.listening_inodes(tls_port)
    assert not procnet.listening_inodes(plain_port)
    assert not broker.log_path.parent.exists()
