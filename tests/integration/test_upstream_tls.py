"""TLS from the proxy to the brokers (``upstream.tls``), against a real broker that speaks TLS:
Tansu behind stunnel4 (tests.support.tls_broker), with certificates made here
(tests.support.certs).

- a plaintext client produces and consumes through the proxy to the TLS broker, and its metadata
  shows only the proxy's addresses;
- TLS on both sides (listen.tls and upstream.tls) with confluent-kafka;
- the broker's certificate is checked: one naming another host is refused (hostname_mismatch)
  unless ``verify_hostname: false``; one from another CA is refused (certificate_refused); both
  are counted and logged, and the client gets no service;
- mTLS to the brokers: without upstream.tls certificate/key the broker refuses the proxy, with
  them it serves;
- check-config names upstream.tls.ca / upstream.tls.certificate for a missing file or a key that
  is not the certificate's.

The proxy runs as a real process (uvloop, as operators run it) unless said otherwise.
"""

from __future__ import annotations

import socket
import time
import uuid

import pytest
import yaml

from config.loader import split_host_port
from proxy.app import procnet
from proxy.app.cli import main
from tests.support.certs import Pem, TestPki
from tests.support.kafka_python import produce_and_read_back
from tests.support.polling import wait_for
from tests.support.tls_broker import TlsTansu
from tests.support.wire import api_versions_round_trip

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

RECORDS = 100
AUTH_FAILURES = "kqp_upstream_authentication_failures_total"


def _upstream(broker: TlsTansu, **tls) -> dict:
    """The proxy's extra configuration for TLS to ``broker``; a short connect timeout, so a
    refused client is closed quickly."""
    return {"upstream": {"connect_timeout_s": 3, "tls": tls}}


def _ask(address: tuple[str, int], timeout_s: float = 10.0) -> int | None:
    """Sends ApiVersions v0 in plaintext to the proxy; the answer's correlation id, or None when
    the proxy closed the connection without answering."""
    with socket.create_connection(address, timeout=timeout_s) as s:
        try:
            return api_versions_round_trip(s)
        except ConnectionError:  # closed, or reset, before an answer
            return None


def _auth_failures(p) -> dict[tuple[str, str], float]:
    return {(dict(labels)["kind"], dict(labels)["reason"]): v for (name, labels), v in p.metrics().items()
            if name == AUTH_FAILURES}




def _assert_only_proxy_addresses(p, advertised: set[tuple[str, int]], broker: TlsTansu) -> None:
    """What a client's metadata shows: ports the proxy process listens on, never stunnel's or
    Tansu's."""
    assert advertised and all(host == "127.0.0.1" for host, _ in advertised), advertised
    ports = {port for _, port in advertised}
    assert not ports & {broker.port, split_host_port(broker.plain_bootstrap)[1]}, advertised
    proxy_inodes = procnet.socket_inodes(p.pid)
    for port in ports:
        assert procnet.listening_inodes(port) & proxy_inodes, f"port {port} is not the proxy's"


def _issue(pki: TestPki, name: str, *identities: str, other_ca: bool = False) -> Pem:
    ca = pki.other_ca if other_ca else pki.ca
    return pki._pem(name, ca.issue_cert(*identities, common_name=name))


def _assert_refused(p, reason: str) -> None:
    """The proxy cannot serve: a client is closed without an answer; the TLS refusal is counted
    with ``reason`` (and as a connect failure) and logged."""
    assert _ask(p.address) is None
    failures = wait_for(lambda: _auth_failures(p).get(("tls", reason)), what=f"a TLS {reason} counted")
    assert failures > 0, _auth_failures(p)
    assert set(_auth_failures(p)) == {("tls", reason)}, _auth_failures(p)
    assert p.metric_sum("kqp_upstream_connect_failures_total") > 0
    log = p.log_text()
    lines = [line for line in log.splitlines() if "TLS handshake with broker" in line]
    assert lines and reason in lines[0] and "level=ERROR" in lines[0], log[-3000:]
    assert "metadata refresh from" in log, log[-3000:]  # the proxy's own refresh failed as well


# -- produce and consume through the proxy ----------------------------------------------------


def test_a_plaintext_client_produces_and_consumes_through_tls_to_the_broker(tls_tansu, proxy, pki):
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    p = proxy([tls_tansu.bootstrap], extra_config=_upstream(tls_tansu, ca=pki.ca_file))
    topic = f"up-tls-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=p.bootstrap, client_id="up-tls-admin")
    try:
        admin.create_topics([NewTopic(topic, 1, 1)])
        brokers = admin.describe_cluster()["brokers"]
    finally:
        admin.close()
    _assert_only_proxy_addresses(p, {(b["host"], b["port"]) for b in brokers}, tls_tansu)

    sent = [f"record-{i}".encode() for i in range(RECORDS)]
    assert produce_and_read_back(p.bootstrap, topic, sent, {"client_id": "up-tls-kp"},
                                 {"client_id": "up-tls-consumer"}) == sent
    assert _auth_failures(p) == {}
    assert p.metric_sum("kqp_upstream_connect_failures_total") == 0
    assert p.stop() == 0
    log = p.log_text()
    assert "Traceback" not in log and "level=ERROR" not in log, log[-3000:]


def test_tls_on_both_sides_with_confluent_kafka(tls_tansu, proxy, pki):
    from confluent_kafka import Consumer, Producer, TopicPartition

    listen_tls = {"tls": {"certificate": pki.server.cert, "key": pki.server.key}}
    p = proxy([tls_tansu.bootstrap], extra_config={**_upstream(tls_tansu, ca=pki.ca_file), "listen": listen_tls})
    topic = f"both-tls-{uuid.uuid4().hex[:8]}"
    settings = {"bootstrap.servers": p.bootstrap, "security.protocol": "SSL", "ssl.ca.location": pki.ca_file,
                "ssl.endpoint.identification.algorithm": "https", "client.id": "both-tls"}
    producer = Producer({**settings, "acks": "all", "allow.auto.create.topics": True})
    delivered = []
    for i in range(RECORDS):
        producer.produce(topic, value=f"ck-{i}".encode(), partition=0,
                         on_delivery=lambda err, msg: delivered.append(err))
    assert producer.flush(30) == 0
    assert delivered == [None] * RECORDS, delivered[:5]
    metadata = producer.list_topics(timeout=10)
    _assert_only_proxy_addresses(p, {(b.host, b.port) for b in metadata.brokers.values()}, tls_tansu)

    consumer = Consumer({**settings, "group.id": f"g-{topic}", "enable.auto.commit": False,
                         "auto.offset.reset": "earliest"})
    consumer.assign([TopicPartition(topic, 0, 0)])
    received = []
    deadline = time.monotonic() + 30
    while len(received) < RECORDS and time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is not None and msg.error() is None:
            received.append(msg.value())
    consumer.close()
    assert received == [f"ck-{i}".encode() for i in range(RECORDS)]
    assert _auth_failures(p) == {}
    # librdkafka closing its client drops connections still in their handshake: "closed" only.
    refused = p.metric_sum("kqp_tls_handshake_failures_total") - p.metric_sum("kqp_tls_handshake_failures_total",
                                                                                reason="closed")
    assert refused == 0
    assert p.stop() == 0
    log = p.log_text()
    assert "Traceback" not in log and "level=ERROR" not in log, log[-3000:]


# -- the broker's certificate is checked ------------------------------------------------------


@pytest.mark.parametrize("host, openssl_says", [("127.0.0.1", "IP address mismatch"),
                                                 ("localhost", "Hostname mismatch")])
def test_a_broker_certificate_for_another_host_is_refused_unless_verify_hostname_is_off(proxy, pki, host,
                                                                                          openssl_says):
    elsewhere = _issue(pki, "broker-elsewhere", "broker.example")
    with TlsTansu(elsewhere) as broker:
        bootstrap = f"{host}:{broker.port}"
        refused = proxy([bootstrap], extra_config=_upstream(broker, ca=pki.ca_file))
        _assert_refused(refused, "hostname_mismatch")
        assert openssl_says in refused.log_text(), refused.log_text()[-3000:]

        # The same broker, the same CA, without the host check: served.
        served = proxy([bootstrap], extra_config=_upstream(broker, ca=pki.ca_file, verify_hostname=False))
        assert _ask(served.address) == 7
        _assert_metadata_through(served)
        assert _auth_failures(served) == {}


def test_a_broker_certificate_from_another_ca_is_refused(proxy, pki):
    stranger = _issue(pki, "broker-stranger", "127.0.0.1", "localhost", other_ca=True)
    with TlsTansu(stranger) as broker:
        p = proxy([broker.bootstrap], extra_config=_upstream(broker, ca=pki.ca_file))
        _assert_refused(p, "certificate_refused")
        # verify_hostname off does not skip the trust check.
        p2 = proxy([broker.bootstrap], extra_config=_upstream(broker, ca=pki.ca_file, verify_hostname=False))
        _assert_refused(p2, "certificate_refused")


def _assert_metadata_through(p) -> None:
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=p.bootstrap, client_id="check")
    try:
        brokers = admin.describe_cluster()["brokers"]
    finally:
        admin.close()
    assert brokers and all(b["host"] == "127.0.0.1" for b in brokers), brokers


# -- mTLS to the brokers ----------------------------------------------------------------------


@pytest.fixture
def mtls_tansu(pki):
    """A TLS broker that requires a client certificate signed by the test CA."""
    with TlsTansu(pki.server, verify_client_ca=pki.ca_file, probe_client=pki.client("probe", "probe")) as broker:
        yield broker


def test_mtls_to_the_broker_needs_the_proxy_certificate(mtls_tansu, proxy, pki):
    # Without a client certificate the broker refuses the proxy: no service, the refresh fails.
    anonymous = proxy([mtls_tansu.bootstrap], extra_config=_upstream(mtls_tansu, ca=pki.ca_file))
    assert _ask(anonymous.address) is None
    assert anonymous.metric_sum("kqp_metadata_refreshes_total", outcome="failure") > 0
    assert anonymous.metric_sum("kqp_metadata_refreshes_total", outcome="success") == 0
    assert "peer did not return a certificate" in mtls_tansu.log_tail(max_bytes=100_000)
    assert "certificate required" in anonymous.log_text(), anonymous.log_text()[-3000:]

    # With upstream.tls certificate/key: served, nothing refused.
    me = pki.client("kqp", "kafka-quota-proxy")
    served = proxy([mtls_tansu.bootstrap], extra_config=_upstream(mtls_tansu, ca=pki.ca_file, certificate=me.cert,
                                                                  key=me.key))
    assert _ask(served.address) == 7
    _assert_metadata_through(served)
    assert _auth_failures(served) == {}
    assert served.metric_sum("kqp_metadata_refreshes_total", outcome="failure") == 0


def test_a_broker_refusing_the_proxy_without_certificate_is_counted_as_tls(mtls_tansu, proxy, pki):
    anonymous = proxy([mtls_tansu.bootstrap], extra_config=_upstream(mtls_tansu, ca=pki.ca_file))
    assert _ask(anonymous.address) is None
    failures = wait_for(lambda: _auth_failures(anonymous), what="the refused handshake counted")
    # With TLS 1.3 the broker's refusal comes after the proxy's side of the handshake is done,
    # on the first read: still a TLS failure, by its own reason.
    assert set(failures) == {("tls", "certificate_required")}, failures
    assert "TLS handshake with broker" in anonymous.log_text()


# -- check-config -----------------------------------------------------------------------------


def _check(tmp_path, capsys, tls: dict) -> tuple[int, str]:
    path = tmp_path / f"check-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump({"upstream": {"bootstrap_servers": ["127.0.0.1:9093"], "tls": tls}}))
    code = main(["check-config", str(path)])
    return code, capsys.readouterr().err


def test_check_config_names_upstream_tls_files(tmp_path, capsys, pki):
    assert _check(tmp_path, capsys, {"ca": pki.ca_file})[0] == 0
    me = pki.client("kqp", "kafka-quota-proxy")
    assert _check(tmp_path, capsys, {"ca": pki.ca_file, "certificate": me.cert, "key": me.key})[0] == 0

    missing = str(tmp_path / "nope-ca.pem")
    code, err = _check(tmp_path, capsys, {"ca": missing})
    assert code == 2 and "upstream.tls.ca" in err and missing in err, err

    missing = str(tmp_path / "nope-cert.pem")
    code, err = _check(tmp_path, capsys, {"ca": pki.ca_file, "certificate": missing, "key": me.key})
    assert code == 2 and "upstream.tls.certificate" in err and missing in err, err

    other = pki.client("other", "other")
    code, err = _check(tmp_path, capsys, {"ca": pki.ca_file, "certificate": me.cert, "key": other.key})
    assert code == 2 and "upstream.tls.certificate" in err and me.cert in err and other.key in err, err

    not_pem = tmp_path / "garbage.pem"
    not_pem.write_text("not a certificate\n")
    code, err = _check(tmp_path, capsys, {"ca": str(not_pem)})
    assert code == 2 and "upstream.tls.ca" in err and str(not_pem) in err, err
