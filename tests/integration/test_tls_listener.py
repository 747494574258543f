"""TLS termination on the proxy's listeners, with certificates made here (tests.support.certs):
real clients produce and consume over TLS through the proxy process to a real broker (Tansu,
plaintext behind the proxy); bad handshakes close their own connection only, each counted by
reason; a client certificate gives the connection its principal by the mapping rules."""

from __future__ import annotations

import socket
import ssl
import time
import uuid

import pytest

from tests.support.certs import TestPki
from tests.support.inproc import InProcessProxy
from tests.support.polling import wait_for
from tests.support.wire import api_versions_round_trip, api_versions_v0

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

RECORDS = 200


def _tls(pki: TestPki, **extra) -> dict:
    return {"listen": {"tls": {"certificate": pki.server.cert, "key": pki.server.key, **extra}}}


def _failures(proxy_proc) -> dict[str, float]:
    return {dict(labels)["reason"]: v for (name, labels), v in proxy_proc.metrics().items()
            if name == "kqp_tls_handshake_failures_total"}




def test_kafka_python_and_confluent_kafka_produce_and_consume_over_tls(tansu, proxy, pki):
    from confluent_kafka import Consumer, Producer, TopicPartition
    from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
    from kafka.admin import NewTopic

    p = proxy([tansu.bootstrap], extra_config=_tls(pki))
    ssl_args = {"security_protocol": "SSL", "ssl_cafile": pki.ca_file, "ssl_check_hostname": True}
    topic = f"tls-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=p.bootstrap, client_id="tls-admin", **ssl_args)
    try:
        admin.create_topics([NewTopic(topic, 1, 1)])
    finally:
        admin.close()
    producer = KafkaProducer(bootstrap_servers=p.bootstrap, client_id="tls-kp", acks="all", **ssl_args)
    for i in range(RECORDS):
        producer.send(topic, key=b"kp", value=f"kp-{i}".encode())
    producer.flush(30)
    producer.close()

    ck = {"bootstrap.servers": p.bootstrap, "security.protocol": "SSL", "ssl.ca.location": pki.ca_file,
          "client.id": "tls-ck"}
    cp = Producer({**ck, "acks": "all"})
    for i in range(RECORDS):
        cp.produce(topic, key=b"ck", value=f"ck-{i}".encode())
    assert cp.flush(30) == 0

    consumer = KafkaConsumer(bootstrap_servers=p.bootstrap, client_id="tls-kp-consumer", auto_offset_reset="earliest",
                             consumer_timeout_ms=10_000, **ssl_args)
    from kafka import TopicPartition as KpPartition
    consumer.assign([KpPartition(topic, 0)])
    got = [m.value for m in consumer]
    consumer.close()
    sent = [f"{who}-{i}".encode() for who in ("kp", "ck") for i in range(RECORDS)]
    assert sorted(got) == sorted(sent)

    cc = Consumer({**ck, "group.id": f"g-{topic}", "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    cc.assign([TopicPartition(topic, 0, 0)])
    seen = 0
    deadline = time.monotonic() + 30
    while seen < 2 * RECORDS and time.monotonic() < deadline:
        msg = cc.poll(1.0)
        if msg is not None and msg.error() is None:
            seen += 1
    cc.close()
    assert seen == 2 * RECORDS
    # librdkafka closing its client drops connections still in their handshake (to a
    # coordinator, say): counted as "closed", never as a refusal.
    assert set(_failures(p)) <= {"closed"}, _failures(p)
    assert p.stop() == 0
    log = p.log_text()
    assert "Traceback" not in log and "level=ERROR" not in log, log[-3000:]


def test_bad_handshakes_close_only_their_connection_each_counted(tansu, proxy, pki):
    p = proxy([tansu.bootstrap], extra_config=_tls(pki, client_auth="required", ca=pki.ca_file,
                                                    handshake_timeout_ms=500))
    address = p.address
    good = pki.client("good", "alice")

    # Plaintext Kafka on the TLS port: closed at once, nothing answered.
    with socket.create_connection(address, timeout=5) as s:
        s.sendall(api_versions_v0(1))
        answer = s.recv(100)
        assert answer == b"" or answer[0] == 0x15, answer  # at most a TLS alert record, never a Kafka answer
    # A client certificate from another CA, and an expired one.
    for cert in (pki.client("stranger", "mallory", other_ca=True), pki.client("old", "alice", expired=True)):
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            with socket.create_connection(address, timeout=5) as raw:
                with pki.client_context(cert).wrap_socket(raw, server_hostname="127.0.0.1") as s:
                    api_versions_round_trip(s)
    # No certificate at all, with client_auth required.
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        with socket.create_connection(address, timeout=5) as raw:
            with pki.client_context().wrap_socket(raw, server_hostname="127.0.0.1") as s:
                api_versions_round_trip(s)
    # A handshake that never starts: the proxy gives up after handshake_timeout_ms.
    stalled = socket.create_connection(address, timeout=5)
    try:
        try:
            failures = wait_for(lambda: (f := _failures(p)) and sum(f.values()) >= 5 and f)
        except AssertionError:
            raise AssertionError(f"{_failures(p)}\n" + "\n".join(
                line for line in p.log_text().splitlines() if "TLS" in line)) from None
    finally:
        stalled.close()
    assert failures == {"not_tls": 1, "unknown_ca": 1, "certificate_expired": 1, "no_certificate": 1,
                        "timeout": 1}, failures
    # Everyone else keeps working.
    with socket.create_connection(address, timeout=5) as raw:
        with pki.client_context(good).wrap_socket(raw, server_hostname="127.0.0.1") as s:
            assert api_versions_round_trip(s) == 7
    assert p.metric_sum("kqp_connections_closed_total", reason="tls_handshake") == 5
    assert p.stop() == 0


def test_a_client_certificate_gives_the_principal_and_sasl_is_not_needed(tansu, pki):
    rules = "RULE:^CN=([^,]*),OU=Payments,.*$/$1@payments/L,DEFAULT"
    tls = _tls(pki, client_auth="requested", ca=pki.ca_file, principal_mapping_rules=rules)["listen"]["tls"]
    with InProcessProxy([tansu.bootstrap], listen={"tls": tls}) as proxy:
        address = proxy.server.bootstrap_address
        certs = {"Alice": pki.client("alice", "Alice", organization_unit="Payments"),
                 "bob": pki.client("bob", "bob")}
        socks = []
        try:
            for cert in (*certs.values(), None):
                raw = socket.create_connection(address, timeout=5)
                s = pki.client_context(cert).wrap_socket(raw, server_hostname="127.0.0.1")
                socks.append(s)
                assert api_versions_round_trip(s) == 7
            principals = proxy.run(lambda: sorted(c.ctx.session.principal for c in proxy.server.connections))
        finally:
            for s in socks:
                s.close()
    # Alice matches the rule (lower-cased); bob falls to DEFAULT (the whole DN, Kafka's form);
    # a connection without a certificate is ANONYMOUS.
    assert principals[0] == "ANONYMOUS"
    assert "alice@payments" in principals
    assert any(p.startswith("CN=bob,") and "O=Acme" in p for p in principals), principals


def test_clients_that_close_right_after_their_handshake_hold_nothing(tansu, proxy, pki):
    # A client gone between its handshake and the proxy taking the connection must not stay
    # counted open (it would hold a slot of max_connections until the idle timeout).
    p = proxy([tansu.bootstrap], extra_config=_tls(pki))
    for _ in range(30):
        with socket.create_connection(p.address, timeout=5) as raw:
            pki.client_context().wrap_socket(raw, server_hostname="127.0.0.1").close()
    wait_for(lambda: p.metric_sum("kqp_open_connections") == 0, timeout_s=5)
    assert _failures(p).get("timeout", 0) == 0
