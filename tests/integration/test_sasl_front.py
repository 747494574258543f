"""Two SASL users producing to a real broker through the proxy.

Tansu cannot authenticate, so :class:`tests.support.sasl_front.SaslFront` stands in front of
it and answers SaslHandshake / SaslAuthenticate itself (PLAIN and SCRAM against ``USERS``),
relaying everything else; Tansu advertises the front, so every connection the proxy makes
upstream goes through it. Real clients talk only to the proxy, which forwards their SASL
exchange upstream and believes the user name only once the front answers success.

Who authenticated is read on both sides: the front records the user of each connection, and
the proxy logs ``authenticated <connection> as <user> via <mechanism>`` and charges that user's
quota (``kqp_quota_rate{user=...}``, with a quota per user too generous to throttle anything).
"""

from __future__ import annotations

import logging
import re
import socket
import struct
import time
import uuid

import pytest
from kafka.protocol.metadata import ApiVersionsRequest, ApiVersionsResponse, MetadataRequest, MetadataResponse
from kafka.protocol.sasl import (
    SaslAuthenticateRequest,
    SaslAuthenticateResponse,
    SaslHandshakeRequest,
    SaslHandshakeResponse,
)

from protocol.apis import ApiKey
from protocol.headers import response_body_offset
from protocol.messages import decode_response, encode_body
from tests.support.proxy_process import sum_samples
from tests.support.sasl_front import FrontConnection, tansu_behind_sasl_front, with_sasl_apis
from tests.support.tansu import TansuBroker
from tests.support.wire import api_versions, is_closed, read_frame, request_bytes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

USERS = {"alice": "alice-secret", "bob": "bob-secret"}
RECORDS = 200  # per producer
PARTITIONS = 2
GENEROUS = 1 << 30  # bytes/s: a per-user quota that never throttles, only makes the user visible
QUOTAS = [{"user": user, "producer_byte_rate": GENEROUS, "consumer_byte_rate": GENEROUS} for user in USERS]


@pytest.fixture
def stack(proxy):
    """(Tansu behind the SASL front, the proxy process whose upstream is the front)."""
    with tansu_behind_sasl_front(USERS) as behind:
        p = proxy([behind.bootstrap], extra_config={"quotas": QUOTAS})
        yield behind, p
        exit_code = p.stop()
        log = p.log_text()
        assert exit_code == 0, log[-5000:]
        assert "Traceback" not in log and "level=ERROR" not in log, log[-5000:]


def _create_topic(p, prefix: str) -> str:
    """A fresh topic, created through the proxy by an unauthenticated admin client."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=p.bootstrap, client_id="sasl-front-admin",
                             request_timeout_ms=10000, bootstrap_timeout_ms=10000)
    try:
        admin.create_topics([NewTopic(name, num_partitions=PARTITIONS, replication_factor=1)])
    finally:
        admin.close()
    return name


def _believed(p) -> set[tuple[str, str]]:
    """(user, mechanism) of every connection the proxy logged as authenticated."""
    return set(re.findall(r"authenticated \S+ as ([^\s\"]+) via ([^\s\"]+)", p.log_text()))


def _wait_believed(p, expected: set[tuple[str, str]], timeout_s: float = 5.0) -> set[tuple[str, str]]:
    deadline = time.monotonic() + timeout_s
    while not expected <= (believed := _believed(p)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return believed


def _sasl_kwargs(user: str, password: str, mechanism: str = "PLAIN") -> dict:
    return {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": mechanism,
            "sasl_plain_username": user, "sasl_plain_password": password}


def _confluent_config(p, user: str, password: str, **extra) -> dict:
    return {"bootstrap.servers": p.bootstrap, "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": "PLAIN", "sasl.username": user, "sasl.password": password, **extra}


def _produce_kafka_python(p, topic: str, user: str) -> None:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=p.bootstrap, client_id=f"kp-{user}", acks="all",
                             bootstrap_timeout_ms=10000, request_timeout_ms=10000,
                             **_sasl_kwargs(user, USERS[user]))
    try:
        futures = [producer.send(topic, key=f"{user}-{i}".encode(), value=f"from {user} #{i}".encode())
                   for i in range(RECORDS)]
        producer.flush(30)
        offsets = [f.get(timeout=10).offset for f in futures]
        assert len(offsets) == RECORDS
    finally:
        producer.close(timeout=10)


def _produce_confluent(p, topic: str, user: str) -> None:
    from confluent_kafka import Producer

    delivered, errors = [], []

    def on_delivery(err, msg):
        (errors if err is not None else delivered).append(err or msg.offset())

    producer = Producer(_confluent_config(p, user, USERS[user], **{
        "client.id": f"ck-{user}", "acks": "all", "message.timeout.ms": 20000,
    }))
    try:
        for i in range(RECORDS):
            producer.produce(topic, key=f"{user}-{i}".encode(), value=f"from {user} #{i}".encode(),
                             on_delivery=on_delivery)
            producer.poll(0)
        assert producer.flush(30) == 0
    finally:
        _close(producer)
    assert errors == []
    assert len(delivered) == RECORDS


def _close(producer) -> None:
    """Stops a confluent-kafka producer now: nothing left to deliver, no more reconnecting."""
    producer.purge()
    producer.close()


def _consume_all(p, topic: str, expected: int, **sasl) -> dict[bytes, bytes]:
    from kafka import KafkaConsumer
    from kafka.structs import TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=p.bootstrap, client_id="sasl-front-reader",
                             enable_auto_commit=False, auto_offset_reset="earliest",
                             bootstrap_timeout_ms=10000, request_timeout_ms=10000, **sasl)
    try:
        consumer.assign([TopicPartition(topic, i) for i in range(PARTITIONS)])
        received: dict[bytes, bytes] = {}
        deadline = time.monotonic() + 30
        while len(received) < expected and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=200).values():
                received.update((r.key, r.value) for r in records)
        return received
    finally:
        consumer.close()


def _expected(user: str) -> dict[bytes, bytes]:
    return {f"{user}-{i}".encode(): f"from {user} #{i}".encode() for i in range(RECORDS)}


def test_two_users_produce_through_the_proxy(stack):
    """alice (kafka-python, PLAIN) and bob (confluent-kafka, PLAIN) produce; a reader
    authenticated as alice with SCRAM-SHA-256 reads every record back."""
    behind, p = stack
    topic = _create_topic(p, "sasl-front")

    _produce_kafka_python(p, topic, "alice")
    _produce_confluent(p, topic, "bob")
    received = _consume_all(p, topic, 2 * RECORDS, **_sasl_kwargs("alice", USERS["alice"], "SCRAM-SHA-256"))

    assert received == {**_expected("alice"), **_expected("bob")}

    # The front: who authenticated, with what; nobody failed; the unauthenticated connections
    # (the proxy's own metadata refresh, the admin client) were relayed too.
    front = behind.front.connections
    assert {(c.user, c.mechanism) for c in front if c.user} == {
        ("alice", "PLAIN"), ("bob", "PLAIN"), ("alice", "SCRAM-SHA-256"),
    }
    assert behind.front.rejected_users == []
    assert any(c.user is None and c.relayed for c in front)
    assert all(c.relayed for c in front if c.user), "an authenticated connection never sent a request"

    # The proxy: it believed the same users, and charged each its own quota.
    believed = _wait_believed(p, {("alice", "PLAIN"), ("bob", "PLAIN"), ("alice", "SCRAM-SHA-256")})
    assert believed == {("alice", "PLAIN"), ("bob", "PLAIN"), ("alice", "SCRAM-SHA-256")}
    metrics = p.metrics()
    for user in USERS:
        assert sum_samples(metrics, "kqp_quota_bound", kind="producer_byte_rate", user=user) == GENEROUS
        assert sum_samples(metrics, "kqp_quota_rate", kind="producer_byte_rate", user=user) > 0, user
    assert sum_samples(metrics, "kqp_quota_bound", kind="consumer_byte_rate", user="alice") == GENEROUS
    assert sum_samples(metrics, "kqp_quota_rate", kind="consumer_byte_rate", user="alice") > 0


def test_wrong_password_kafka_python(stack, caplog):
    """kafka-python logs the broker's SASL error and retries until its bootstrap times out."""
    from kafka import KafkaProducer
    from kafka.errors import KafkaTimeoutError

    behind, p = stack
    caplog.set_level(logging.ERROR, logger="kafka")
    start = time.monotonic()
    with pytest.raises(KafkaTimeoutError, match="Unable to bootstrap"):
        KafkaProducer(bootstrap_servers=p.bootstrap, client_id="kp-intruder",
                      bootstrap_timeout_ms=3000, request_timeout_ms=3000,
                      **_sasl_kwargs("alice", "wrong"))
    assert time.monotonic() - start < 10
    assert "Invalid username or password" in caplog.text
    assert "SaslAuthenticationFailedError" in caplog.text

    _assert_rejected_everywhere(behind, p, "alice")


def test_wrong_password_confluent_kafka(stack):
    """librdkafka reports _AUTHENTICATION (with the broker's message) to error_cb at once and
    fails the queued record when message.timeout.ms runs out."""
    from confluent_kafka import KafkaError, Producer

    behind, p = stack
    topic = _create_topic(p, "sasl-front-denied")
    errors: list[KafkaError] = []
    failed: list[KafkaError] = []
    producer = Producer(_confluent_config(p, "bob", "wrong", **{
        "client.id": "ck-intruder", "message.timeout.ms": 3000, "error_cb": errors.append,
    }))
    try:
        producer.produce(topic, b"never", on_delivery=lambda err, msg: failed.append(err))
        deadline = time.monotonic() + 10
        while not errors and time.monotonic() < deadline:
            producer.poll(0.1)
        assert errors, "no error reached error_cb"
        assert errors[0].code() == KafkaError._AUTHENTICATION
        assert "Invalid username or password" in errors[0].str()
        assert producer.flush(10) == 0
    finally:
        _close(producer)
    assert len(failed) == 1 and failed[0] is not None and failed[0].code() == KafkaError._MSG_TIMED_OUT

    _assert_rejected_everywhere(behind, p, "bob")


def _assert_rejected_everywhere(behind, p, user: str) -> None:
    connections = behind.front.connections
    assert user in behind.front.rejected_users
    assert [c for c in connections if c.user is not None] == []
    assert all(not c.relayed for c in connections if c.rejected_user), "a rejected connection was relayed"
    assert _believed(p) == set()
    assert sum_samples(p.metrics(), "kqp_quota_rate", user=user) == 0


def test_sasl_apis_added_to_an_api_versions_answer_without_them():
    """The front's ApiVersions rewrite, on Tansu's real answer with the SASL APIs taken out."""
    with TansuBroker() as broker:
        for version in (0, 3):
            with socket.create_connection((broker.host, broker.port), timeout=10) as s:
                s.sendall(request_bytes(ApiVersionsRequest[version](), 11))
                frame = read_frame(s)
            assert struct.unpack(">i", frame[:4])[0] == 11
            resp = decode_response(ApiKey.API_VERSIONS, version, frame[4:])
            original = {e.api_key: (e.min_version, e.max_version) for e in resp.api_keys}
            resp.api_keys = [e for e in resp.api_keys if e.api_key not in (17, 36)]
            stripped = encode_body(resp)

            rewritten = ApiVersionsResponse.decode(with_sasl_apis(stripped, version), version=version)
            keys = {e.api_key: (e.min_version, e.max_version) for e in rewritten.api_keys}
            assert keys == {**original, 17: (0, 1), 36: (0, 2)}
            # Nothing missing: the same keys come back.
            assert with_sasl_apis(frame[4:], version) == encode_body(
                decode_response(ApiKey.API_VERSIONS, version, frame[4:])
            )


def test_front_records_unauthenticated_connections_without_a_proxy():
    """A connection that never authenticates is relayed, and recorded with user None."""
    with tansu_behind_sasl_front(USERS) as behind:
        resp = api_versions(behind.front.address)
        assert resp.error_code == 0
        assert {17, 36} <= {e.api_key for e in resp.api_keys}
        connections = behind.front.wait_for(lambda cs: len(cs) == 1)
        assert connections == [FrontConnection(peer=connections[0].peer)]


# -- the front on its own, over raw sockets: the paths no client above takes --------------------


def _connect(behind):
    return socket.create_connection(behind.front.address, timeout=10)


def _metadata_relayed(s) -> None:
    """A Metadata request on ``s`` is answered by Tansu, which names the front as its broker."""
    s.sendall(request_bytes(MetadataRequest[1](topics=None), 99))
    frame = read_frame(s)
    assert frame is not None and frame[:4] == (99).to_bytes(4, "big")
    brokers = MetadataResponse[1].decode(frame[4:], version=1).brokers
    assert [(b.host, b.port) for b in brokers] == [s.getpeername()[:2]]


def test_front_sasl_handshake_v0_raw_plain_token():
    """SaslHandshake v0: the PLAIN token is a bare frame and success is an empty frame."""
    with tansu_behind_sasl_front(USERS) as behind, _connect(behind) as s:
        s.sendall(request_bytes(SaslHandshakeRequest[0](mechanism="PLAIN"), 1))
        frame = read_frame(s)
        assert SaslHandshakeResponse[0].decode(frame[4:], version=0).error_code == 0
        token = b"\x00bob\x00" + USERS["bob"].encode()
        s.sendall(len(token).to_bytes(4, "big") + token)
        assert read_frame(s) == b""
        _metadata_relayed(s)
        assert behind.front.connections[0].user == "bob"


def test_front_sasl_handshake_v0_wrong_password_closes():
    with tansu_behind_sasl_front(USERS) as behind, _connect(behind) as s:
        s.sendall(request_bytes(SaslHandshakeRequest[0](mechanism="PLAIN"), 1))
        assert read_frame(s) is not None
        token = b"\x00bob\x00nope"
        s.sendall(len(token).to_bytes(4, "big") + token)
        assert is_closed(s)
        assert behind.front.wait_for(lambda cs: cs and cs[0].rejected_user == "bob")[0].user is None


@pytest.mark.parametrize("version", [0, 1, 2])
def test_front_sasl_authenticate_versions(version):
    """SaslAuthenticate v0-2 (v2 has flexible headers); a wrong password gets error 58 with a
    message and the connection closed."""
    def authenticate(s, password: str):
        s.sendall(request_bytes(SaslHandshakeRequest[1](mechanism="PLAIN"), 1))
        assert SaslHandshakeResponse[1].decode(read_frame(s)[4:], version=1).error_code == 0
        s.sendall(request_bytes(SaslAuthenticateRequest[version](auth_bytes=f"\x00alice\x00{password}".encode()), 2))
        frame = read_frame(s)
        assert frame[:4] == (2).to_bytes(4, "big")
        offset = response_body_offset(frame, ApiKey.SASL_AUTHENTICATE, version)
        return SaslAuthenticateResponse[version].decode(frame[offset:], version=version)

    with tansu_behind_sasl_front(USERS) as behind:
        with _connect(behind) as s:
            assert authenticate(s, USERS["alice"]).error_code == 0
            _metadata_relayed(s)
        with _connect(behind) as s:
            resp = authenticate(s, "wrong")
            assert resp.error_code == 58
            assert resp.error_message == "Authentication failed: Invalid username or password"
            assert is_closed(s)
        connections = behind.front.wait_for(lambda cs: len(cs) == 2 and cs[1].rejected_user)
        assert [(c.user, c.rejected_user, c.relayed) for c in connections] == [
            ("alice", None, True), (None, "alice", False),
        ]


def test_front_unsupported_mechanism_is_refused():
    with tansu_behind_sasl_front(USERS) as behind, _connect(behind) as s:
        s.sendall(request_bytes(SaslHandshakeRequest[1](mechanism="GSSAPI"), 1))
        resp = SaslHandshakeResponse[1].decode(read_frame(s)[4:], version=1)
        assert resp.error_code == 33
        assert resp.mechanisms == ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]
        assert is_closed(s)
