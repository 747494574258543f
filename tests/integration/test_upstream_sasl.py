"""upstream.sasl: the proxy's own connections (the metadata refresh) authenticate to a broker
that, like a Kafka SASL listener, answers nothing but ApiVersions and the SASL exchange before
authentication; client connections keep passing their own SASL through.

The broker is :class:`tests.support.sasl_broker.SaslScript` (the server side of PLAIN,
SCRAM-SHA-256/512 and OAUTHBEARER, for real), extended here by :class:`StrictSasl`: it closes a
connection that asks for anything else before it authenticated (SaslScript answers Metadata
to anyone), records per connection the client id and who authenticated with what, and checks
an OAUTHBEARER token against the tokens it knows (SaslScript takes any). A proxy that learns
the brokers from it has therefore authenticated; who as is in the records.
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import pytest
from kafka.protocol.metadata import ApiVersionsRequest, MetadataRequest

from protocol.headers import parse_request_header
from tests.support.proxy_process import ProxyProcess
from tests.support.raw_broker import RawBroker, _recv_exact
from tests.support.sasl_broker import SASL_AUTHENTICATION_FAILED, SaslScript
from tests.support.wire import read_frame, request_bytes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

PROXY_CLIENT_ID = "kafka-quota-proxy"  # what the proxy's own connections call themselves
SERVICE_USER = "svc-proxy"
SERVICE_PASSWORD = "svc-right-pw-7f3a91"
WRONG_PASSWORD = "svc-wrong-pw-c0ffee"
CLIENT_USER, CLIENT_PASSWORD = "alice", "alice-client-pw-5e2b"
USERS = {SERVICE_USER: SERVICE_PASSWORD, CLIENT_USER: CLIENT_PASSWORD}
SECRET_ENV = "KQP_TEST_UPSTREAM_SASL_SECRET"
SASL_APIS = (17, 18, 36)  # SaslHandshake, ApiVersions, SaslAuthenticate
METADATA = 3
GUARD_S = 10  # waiting longer than this for a state the proxy must reach is a failure


def _unsecured_jwt(sub: str) -> str:
    """An unsigned JWT as Kafka's OAuthBearerUnsecuredLoginCallbackHandler makes them."""
    def part(obj: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")
    return f"{part({'alg': 'none'})}.{part({'sub': sub, 'iat': 0, 'exp': 4102444800})}."


SERVICE_TOKEN = _unsecured_jwt(SERVICE_USER)
OTHER_USER = "svc-proxy-2"
OTHER_TOKEN = _unsecured_jwt(OTHER_USER)  # the proxy's token once rotated to another principal
TOKENS = {SERVICE_TOKEN: SERVICE_USER, OTHER_TOKEN: OTHER_USER}  # the tokens the broker accepts, to their principal

_CLOSE = b""  # StrictSasl's answer meaning: close the connection, as Kafka does


@dataclass
class ConnectionRecord:
    client_id: str | None = None
    mechanism: str | None = None
    user: str | None = None  # set once the broker answered the last SASL step with success
    served: list[int] = field(default_factory=list)  # API keys answered after authentication
    refused: list[int] = field(default_factory=list)  # API keys that closed the connection


class StrictSasl(SaslScript):
    """One connection's server side (see the module docstring)."""

    def __init__(self, records: list[ConnectionRecord], node_id: int, port: int) -> None:
        super().__init__(USERS, node_id, port)
        self.record = ConnectionRecord()
        records.append(self.record)
        self._scram_user: str | None = None

    def __call__(self, frame: bytes) -> bytes | None:
        header = parse_request_header(frame)
        rec = self.record
        rec.client_id = header.client_id
        if header.api_key not in SASL_APIS and rec.user is None:
            # Kafka's SaslServerAuthenticator: "Unexpected Kafka request of type ... during SASL
            # handshake", and the connection is closed.
            rec.refused.append(header.api_key)
            return _CLOSE
        answer = super().__call__(frame)
        if rec.user is not None and header.api_key not in SASL_APIS and answer is not None:
            rec.served.append(header.api_key)
        return answer

    def _authenticate(self, token: bytes) -> tuple[int, bytes]:
        mechanism = self.mechanism
        if mechanism == "OAUTHBEARER":
            m = re.search(rb"auth=Bearer ([^\x01]*)\x01", token)
            principal = TOKENS.get(m[1].decode()) if m else None
            if principal is None:
                return SASL_AUTHENTICATION_FAILED, b""
            self._authenticated(principal)
            return 0, b""
        first_scram = mechanism is not None and mechanism.startswith("SCRAM") and not self._scram
        if first_scram:
            attrs = dict(a.split("=", 1) for a in token.decode().split(",", 2)[2].split(","))
            self._scram_user = attrs.get("n")
        error, answer = super()._authenticate(token)
        if error == 0 and mechanism == "PLAIN":
            self._authenticated(token.split(b"\x00")[1].decode())
        elif error == 0 and not first_scram and mechanism is not None and mechanism.startswith("SCRAM"):
            self._authenticated(self._scram_user)  # the client's proof checked out
        return error, answer

    def _authenticated(self, user: str | None) -> None:
        self.record.mechanism, self.record.user = self.mechanism, user


class StrictSaslBroker(RawBroker):
    """RawBroker serving a StrictSasl per connection, closing it when the script says so."""

    def __init__(self) -> None:
        self.records: list[ConnectionRecord] = []
        super().__init__(script_factory=lambda: StrictSasl(self.records, node_id=1, port=self.port))
        self._records_lock = threading.Lock()

    def _serve(self, conn: socket.socket) -> None:
        script = self.script_factory()
        with conn:
            while (head := _recv_exact(conn, 4)) is not None:
                frame = _recv_exact(conn, struct.unpack(">i", head)[0])
                if frame is None:
                    break
                self.frames.append(frame)
                answer = script(frame)
                if answer == _CLOSE:
                    break
                if answer is not None:
                    conn.sendall(answer)
        self.closed.set()

    def proxy_logins(self) -> list[tuple[str | None, str | None]]:
        """(mechanism, user) of each of the proxy's own connections that authenticated and then
        had its Metadata answered."""
        return [(r.mechanism, r.user) for r in list(self.records)
                if r.client_id == PROXY_CLIENT_ID and r.user is not None and METADATA in r.served]


@pytest.fixture
def broker():
    with StrictSaslBroker() as b:
        yield b


def _readyz(p) -> tuple[int, str]:
    url = p.healthz_url.replace("/healthz", "/readyz")
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _wait(what: str, predicate, timeout_s: float = GUARD_S, log=None):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}" + (f"\n--- proxy log ---\n{log()[-5000:]}" if log else ""))
        time.sleep(0.05)
    return value


def _sasl_config(mechanism: str, source: str, secret_file) -> dict:
    """upstream.sasl for SERVICE_USER (or its token), the secret in ``secret_file`` or SECRET_ENV."""
    if mechanism == "OAUTHBEARER":
        kind, cfg = "token", {"mechanism": mechanism}
    else:
        kind, cfg = "password", {"mechanism": mechanism, "username": SERVICE_USER}
    cfg[f"{kind}_file" if source == "file" else f"{kind}_env"] = str(secret_file) if source == "file" else SECRET_ENV
    return cfg


def _start(proxy, broker, sasl: dict, **upstream):
    return proxy([broker.bootstrap], log_level="debug", extra_config={
        "upstream": {"connect_timeout_s": 3, "sasl": sasl, **upstream},
    })


def _assert_no_secret_logged(p) -> None:
    log = p.log_text()
    for secret in (SERVICE_PASSWORD, WRONG_PASSWORD, CLIENT_PASSWORD, SERVICE_TOKEN):
        assert secret not in log, f"{secret!r} in the proxy's log"
    assert "Traceback" not in log, log[-5000:]


def test_the_script_refuses_metadata_before_authentication(broker):
    """What makes the other tests mean something: no Metadata without a login."""
    with socket.create_connection(("127.0.0.1", broker.port), timeout=5) as s:
        s.sendall(request_bytes(ApiVersionsRequest[0](), 1, client_id=PROXY_CLIENT_ID))
        assert read_frame(s) is not None
        s.sendall(request_bytes(MetadataRequest[1](topics=[]), 2, client_id=PROXY_CLIENT_ID))
        assert s.recv(1) == b""  # closed, nothing answered
    assert [(r.user, r.refused) for r in broker.records] == [(None, [METADATA])]


@pytest.mark.parametrize("source", ["file", "env"])
@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"])
def test_the_proxy_authenticates_its_own_connections(broker, proxy, mechanism, source, tmp_path, monkeypatch):
    secret = SERVICE_TOKEN if mechanism == "OAUTHBEARER" else SERVICE_PASSWORD
    secret_file = tmp_path / "secret"
    if source == "file":
        secret_file.write_text(secret + "\n")  # as `kubectl create secret --from-file` often has it
    else:
        monkeypatch.setenv(SECRET_ENV, secret)  # the proxy process inherits it

    p = _start(proxy, broker, _sasl_config(mechanism, source, secret_file))

    # The refresh at start (done before the ready file is written) learnt the broker.
    assert p.metric_sum("kqp_metadata_refreshes_total", outcome="success") >= 1, p.log_text()[-5000:]
    assert p.metric_sum("kqp_broker_listeners") == 1
    status, detail = _readyz(p)
    assert status == 200 and "brokers known: [1]" in detail, detail
    assert p.metric_sum("kqp_upstream_authentication_failures_total") == 0
    assert broker.proxy_logins() == [(mechanism, SERVICE_USER)]
    assert not any(r.refused for r in broker.records)
    # Said once at start: who the broker sees the proxy as, and over what.
    who = f"as principal {SERVICE_USER} (the token's sub claim)" if mechanism == "OAUTHBEARER" else \
        f"as user {SERVICE_USER}"
    assert _identity_lines(p) == [f"upstream identity: SASL/{mechanism} {who} on the proxy's own connections; "
                                  "plaintext (no TLS)"]
    _assert_no_secret_logged(p)


def _identity_lines(p) -> list[str]:
    """The messages of the proxy's lines about its upstream identity or credentials."""
    return [m[1] for line in p.log_text().splitlines()
            if "logger=proxy.identity.upstream_identity" in line and (m := re.search(r'msg="(.*)"$', line))]


def _failures(p) -> float:
    return p.metric_sum("kqp_upstream_authentication_failures_total", kind="sasl")


def test_a_refused_password_is_retried_logged_once_and_clients_still_pass_their_own_sasl(broker, proxy, tmp_path):
    from confluent_kafka.admin import AdminClient

    secret_file = tmp_path / "password"
    secret_file.write_text(WRONG_PASSWORD)
    # The back-off (1 s, 2 s, 4 s, ...) is capped at the refresh interval: retries 1 s, 3 s,
    # 5 s, 7 s ... after the refused login at start.
    p = _start(proxy, broker, _sasl_config("PLAIN", "file", secret_file), metadata_refresh_interval_s=2)

    # Refused at start, then again after 1 s and 3 s: three within ~3 s.
    _wait("three refused logins", lambda: _failures(p) >= 3, log=p.log_text)
    assert p.metric_sum("kqp_upstream_authentication_failures_total", kind="sasl", reason="refused") == _failures(p)
    assert p.metric_sum("kqp_metadata_refreshes_total", outcome="success") == 0
    status, detail = _readyz(p)
    assert status == 503 and "no metadata refresh has succeeded" in detail, detail
    # Every refused connection authenticated nothing and asked nothing else.
    own = [r for r in broker.records if r.client_id == PROXY_CLIENT_ID]
    assert len(own) >= 3 and all(r.user is None and not r.refused for r in own), own

    log = p.log_text()
    lines = [line for line in log.splitlines() if "SASL/PLAIN authentication as user" in line and "ERROR" in line]
    assert len(lines) == 1, "\n".join(lines)  # at most once a minute
    assert (f"SASL/PLAIN authentication as user {SERVICE_USER} refused by broker 127.0.0.1:{broker.port}: "
            "SASL_AUTHENTICATION_FAILED (58): Authentication failed; retried with back-off") in lines[0], lines[0]
    # The identity was said once at start, and not at each refused retry.
    assert _identity_lines(p) == [f"upstream identity: SASL/PLAIN as user {SERVICE_USER} on the proxy's own "
                                  "connections; plaintext (no TLS)"]

    # A client's own SASL still passes through to the broker, which serves it as alice.
    admin = AdminClient({
        "bootstrap.servers": p.bootstrap, "client.id": "rdkafka-alice",
        "security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN",
        "sasl.username": CLIENT_USER, "sasl.password": CLIENT_PASSWORD,
    })
    metadata = admin.list_topics(timeout=10)
    assert [(b.id, b.host) for b in metadata.brokers.values()] == [(1, "127.0.0.1")]
    assert metadata.brokers[1].port != broker.port  # the proxy's listener for broker 1
    clients = [r for r in broker.records if r.client_id == "rdkafka-alice"]
    assert any(r.user == CLIENT_USER and r.mechanism == "PLAIN" and METADATA in r.served for r in clients), clients

    # The refusals go on (the next retry is due 5 s after the start), still logged once.
    count = _failures(p)
    _wait("one more refused login", lambda: _failures(p) > count, log=p.log_text)
    assert sum("SASL/PLAIN authentication as user" in line and "ERROR" in line
               for line in p.log_text().splitlines()) == 1
    assert len(_identity_lines(p)) == 1
    assert broker.proxy_logins() == []
    _assert_no_secret_logged(p)


def test_a_secret_that_cannot_be_read_stops_the_start(broker, tmp_path):
    missing = tmp_path / "no-such-password"
    p = ProxyProcess([broker.bootstrap], extra_config={
        "upstream": {"sasl": _sasl_config("SCRAM-SHA-512", "file", missing)},
    })
    try:
        with pytest.raises(RuntimeError) as err:
            p.start(timeout_s=GUARD_S)
        assert "exited with code 2" in str(err.value)
        assert "upstream.sasl.password_file" in p.log_text() and str(missing) in p.log_text()
    finally:
        p.close()
    assert broker.records == []  # it never tried


def test_a_rotated_password_file_is_picked_up_by_the_next_retry(broker, proxy, tmp_path):
    secret_file = tmp_path / "password"
    secret_file.write_text(WRONG_PASSWORD)
    p = _start(proxy, broker, _sasl_config("SCRAM-SHA-256", "file", secret_file))
    assert _failures(p) >= 1 and p.metric_sum("kqp_metadata_refreshes_total", outcome="success") == 0
    assert _readyz(p)[0] == 503

    # Mid-rotation the file is briefly gone: the retry 1 s after the start cannot read it.
    secret_file.unlink()
    _wait("an unreadable password counted",
          lambda: p.metric_sum("kqp_upstream_authentication_failures_total", kind="sasl",
                               reason="credentials_unreadable") >= 1, log=p.log_text)
    assert p.process.poll() is None  # a running proxy does not stop for it

    # Rotated as Kubernetes does it: the new file renamed over the old one.
    fresh = tmp_path / "password.new"
    fresh.write_text(SERVICE_PASSWORD + "\n")
    os.replace(fresh, secret_file)

    _wait("a refresh succeeding", lambda: p.metric_sum("kqp_metadata_refreshes_total", outcome="success") >= 1,
          log=p.log_text)
    failures = _failures(p)
    assert broker.proxy_logins() == [("SCRAM-SHA-256", SERVICE_USER)]
    assert p.metric_sum("kqp_broker_listeners") == 1
    status, detail = _readyz(p)
    assert status == 200 and "brokers known: [1]" in detail, detail
    assert p.process.poll() is None  # no restart
    assert _failures(p) == failures  # nothing retried once it succeeded
    # The new password was said once (never the password), the identity itself not again.
    assert _identity_lines(p) == [
        f"upstream identity: SASL/SCRAM-SHA-256 as user {SERVICE_USER} on the proxy's own connections; "
        "plaintext (no TLS)",
        f"upstream SASL credentials changed (password re-read), still SASL/SCRAM-SHA-256 as user {SERVICE_USER}",
    ]
    _assert_no_secret_logged(p)


def test_a_token_for_another_principal_logs_the_new_identity_once(broker, proxy, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(SERVICE_TOKEN)
    p = _start(proxy, broker, _sasl_config("OAUTHBEARER", "file", token_file), metadata_refresh_interval_s=1)
    assert broker.proxy_logins()[0] == ("OAUTHBEARER", SERVICE_USER)

    fresh = tmp_path / "token.new"
    fresh.write_text(OTHER_TOKEN)
    os.replace(fresh, token_file)
    _wait("a login as the token's new principal", lambda: ("OAUTHBEARER", OTHER_USER) in broker.proxy_logins(),
          log=p.log_text)
    logins = len(broker.proxy_logins())
    _wait("another login with the same token", lambda: len(broker.proxy_logins()) > logins, log=p.log_text)
    assert _identity_lines(p) == [
        f"upstream identity: SASL/OAUTHBEARER as principal {SERVICE_USER} (the token's sub claim) on the proxy's "
        "own connections; plaintext (no TLS)",
        f"upstream identity changed (SASL credentials re-read): SASL/OAUTHBEARER as principal {OTHER_USER} (the "
        "token's sub claim) on the proxy's own connections; plaintext (no TLS)",
    ]
    log = p.log_text()
    assert OTHER_TOKEN not in log and OTHER_TOKEN.split(".")[1] not in log  # nor its payload alone
    _assert_no_secret_logged(p)
