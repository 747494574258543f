"""Principals from SASL passthrough, with real clients against a scripted SASL broker."""

from __future__ import annotations

import base64
import json
import time

import pytest
from kafka import KafkaAdminClient
from kafka.net.sasl.oauth import AbstractTokenProvider

from tests.support.inproc import InProcessProxy
from tests.support.raw_broker import RawBroker
from tests.support.sasl_broker import SaslScript

pytestmark = pytest.mark.integration

USERS = {"alice": "alice-secret", "bob": "bob-secret"}


@pytest.fixture
def sasl_proxy():
    holder = {}
    broker = RawBroker(script_factory=lambda: SaslScript(USERS, node_id=1, port=holder["port"]))
    holder["port"] = broker.port
    with broker, InProcessProxy([broker.bootstrap]) as proxy:
        yield proxy


def _sessions(proxy) -> list[tuple[str | None, str, bool]]:
    return proxy.run(lambda: [(s.client_id, s.principal, s.authenticated)
                              for s in (c.ctx.session for c in proxy.server.connections)])


def _wait_for(proxy, predicate, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sessions = _sessions(proxy)
        if predicate(sessions):
            return sessions
        time.sleep(0.02)
    raise AssertionError(f"sessions never matched: {_sessions(proxy)}")


class _Token(AbstractTokenProvider):
    def token(self):
        claims = base64.urlsafe_b64encode(json.dumps({"sub": "carol", "iat": 0}).encode()).decode().rstrip("=")
        return f"eyJhbGciOiJub25lIn0.{claims}."


@pytest.mark.parametrize(
    "mechanism, extra, principal",
    [
        ("PLAIN", {"sasl_plain_username": "alice", "sasl_plain_password": "alice-secret"}, "alice"),
        ("SCRAM-SHA-256", {"sasl_plain_username": "bob", "sasl_plain_password": "bob-secret"}, "bob"),
        ("SCRAM-SHA-512", {"sasl_plain_username": "alice", "sasl_plain_password": "alice-secret"}, "alice"),
        ("OAUTHBEARER", {"sasl_oauth_token_provider": _Token()}, "carol"),
    ],
)
def test_kafka_python_principal_believed_after_broker_success(sasl_proxy, mechanism, extra, principal):
    admin = KafkaAdminClient(
        bootstrap_servers=sasl_proxy.bootstrap, client_id=f"cid-{mechanism}",
        security_protocol="SASL_PLAINTEXT", sasl_mechanism=mechanism, **extra,
    )
    try:
        admin.list_topics()
        sessions = _wait_for(sasl_proxy, lambda ss: any(s[2] for s in ss))
        assert {(cid, p) for cid, p, auth in sessions if auth} == {(f"cid-{mechanism}", principal)}
    finally:
        admin.close()


def test_failed_authentication_leaves_anonymous(sasl_proxy, caplog):
    from kafka.errors import KafkaTimeoutError

    # kafka-python keeps retrying a failed login until bootstrap_timeout_ms, then times out;
    # the broker's refusal shows only in its log.
    with pytest.raises(KafkaTimeoutError):
        KafkaAdminClient(
            bootstrap_servers=sasl_proxy.bootstrap, client_id="intruder",
            security_protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-256",
            sasl_plain_username="alice", sasl_plain_password="wrong", request_timeout_ms=3000,
            bootstrap_timeout_ms=3000,
        )
    assert "Authentication failed" in caplog.text or "SaslAuthenticationFailed" in caplog.text, caplog.text[-2000:]
    # The broker closes a failed login, so only still-open connections can be looked at.
    for _cid, principal, authenticated in _sessions(sasl_proxy):
        assert principal == "ANONYMOUS" and not authenticated


def test_confluent_kafka_plain_principal(sasl_proxy):
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({
        "bootstrap.servers": sasl_proxy.bootstrap, "client.id": "rdkafka-alice",
        "security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN",
        "sasl.username": "alice", "sasl.password": "alice-secret",
    })
    admin.list_topics(timeout=10)
    sessions = _wait_for(sasl_proxy, lambda ss: any(s[2] for s in ss))
    assert {(cid, p) for cid, p, auth in sessions if auth} == {("rdkafka-alice", "alice")}


def test_no_sasl_is_anonymous(sasl_proxy):
    from tests.support.wire import api_versions

    assert api_versions(sasl_proxy.address).error_code == 0


def test_sasl_handshake_v0_raw_plain_token():
    """SaslHandshake v0: the token that follows is a raw frame, not a Kafka request."""
    import socket
    import struct

    from kafka.protocol.sasl import SaslHandshakeRequest, SaslHandshakeResponse

    from tests.support.wire import read_frame, request_bytes

    def script(frame: bytes) -> bytes | None:
        if frame[:2] == b"\x00\x11":  # SaslHandshake v0
            body = SaslHandshakeResponse[0](error_code=0, mechanisms=["PLAIN"]).encode()
            payload = frame[4:8] + bytes(body)
        elif frame == b"\x00dave\x00pw":  # the raw PLAIN token: success is an empty frame
            payload = b""
        else:  # the proxy's own metadata refresh: this broker does not answer it
            return None
        return struct.pack(">i", len(payload)) + payload

    with RawBroker(script) as broker, InProcessProxy([broker.bootstrap]) as proxy:
        with socket.create_connection(proxy.address) as s:
            s.sendall(request_bytes(SaslHandshakeRequest[0](mechanism="PLAIN"), 1))
            assert read_frame(s)[:4] == struct.pack(">i", 1)
            s.sendall(struct.pack(">i", 8) + b"\x00dave\x00pw")
            assert read_frame(s) == b""
            sessions = _wait_for(proxy, lambda ss: any(x[2] for x in ss))
            assert [p for _c, p, auth in sessions if auth] == ["dave"]
