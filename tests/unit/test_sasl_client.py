"""proxy/sasl_client.py: the mechanisms against RFC 7677's example and hostile server messages,
then whole exchanges against tests/support/sasl_broker.py's SaslScript (a real server side of
PLAIN, SCRAM-SHA-256/512 and OAUTHBEARER) through Kafka frames; credentials() from files and
the environment. No error message ever contains the password or the token."""

from __future__ import annotations

import asyncio
import base64
import itertools

import pytest
from kafka.protocol.metadata import ApiVersionsRequest
from kafka.protocol.sasl import SaslAuthenticateResponse, SaslHandshakeResponse

from config import ConfigError
from config.model import UpstreamSaslConfig
from protocol.headers import response_body_offset
from protocol.messages import decode_response
from proxy.identity.sasl_client import (
    SaslAuthenticationError,
    SaslCredentials,
    SaslRefused,
    ScramClient,
    authenticate,
    credentials,
    oauthbearer_initial_response,
    plain_initial_response,
    scram_sasl_name,
)
from tests.support.sasl_broker import SaslScript

# RFC 7677 §3, the SCRAM-SHA-256 example exchange (user "user", password "pencil"), as the RFC
# prints it (other SCRAM implementations' test suites carry the same strings).
RFC_NONCE = "rOprNGfwEbeRWgbNEkqO"
RFC_SERVER_FIRST = b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
RFC_CLIENT_FINAL = (
    b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="
)
RFC_SERVER_FINAL = b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="

PASSWORD = "s3cret-Pa55word"
TOKEN = "eyJhbGciOiJub25lIn0.eyJzdWIiOiJwcm94eSJ9."
USERS = {"proxy": PASSWORD}


def _rfc_client() -> ScramClient:
    return ScramClient("SCRAM-SHA-256", "user", "pencil", nonce=RFC_NONCE)


# --- mechanisms, no I/O ---------------------------------------------------------------------


def test_scram_sha_256_rfc_7677_example():
    client = _rfc_client()
    assert client.client_first() == b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO"
    assert client.client_final(RFC_SERVER_FIRST) == RFC_CLIENT_FINAL
    client.verify_server_final(RFC_SERVER_FINAL)  # no exception: the server proved it knows the password


def test_scram_wrong_server_signature_is_refused():
    client = _rfc_client()
    client.client_final(RFC_SERVER_FIRST)
    forged = b"v=" + base64.b64encode(b"\x00" * 32)
    with pytest.raises(SaslAuthenticationError, match="invalid server signature") as exc:
        client.verify_server_final(forged)
    assert "pencil" not in str(exc.value)


def test_scram_server_nonce_must_extend_the_client_nonce():
    client = _rfc_client()
    other = RFC_SERVER_FIRST.replace(b"r=rOprNG", b"r=XOprNG")
    with pytest.raises(SaslAuthenticationError, match="does not start with client nonce"):
        client.client_final(other)


def test_scram_server_final_error_is_reported():
    client = _rfc_client()
    client.client_final(RFC_SERVER_FIRST)
    with pytest.raises(SaslAuthenticationError, match="failed with error: invalid-proof") as exc:
        client.verify_server_final(b"e=invalid-proof")
    assert "pencil" not in str(exc.value)
    assert isinstance(exc.value, SaslRefused) and exc.value.broker_message == "server-final error invalid-proof"


@pytest.mark.parametrize("iterations, ok", [(4095, False), (1, False), (4096, True), (8192, True), (10**7, False)])
def test_scram_iteration_count_bounds(iterations, ok):
    client = _rfc_client()
    server_first = RFC_SERVER_FIRST.replace(b"i=4096", f"i={iterations}".encode())
    if ok:
        assert client.client_final(server_first).startswith(b"c=biws,r=")
        return
    with pytest.raises(SaslAuthenticationError, match=f"requested iterations {iterations} is"):
        client.client_final(server_first)


@pytest.mark.parametrize("message", [b"", b"garbage", b"r=rOprNGfwEbeRWgbNEkqOxx,s=!!!,i=4096",
                                     b"s=W22ZaJ0SNY7soEsUEjb6gQ==,r=rOprNGfwEbeRWgbNEkqOxx,i=4096", b"\xff\xfe"])
def test_scram_malformed_server_first(message):
    with pytest.raises(SaslAuthenticationError, match="server-first"):
        _rfc_client().client_final(message)


@pytest.mark.parametrize("message", [b"", b"x=1", b"v=abc", b"v=!!!!"])
def test_scram_malformed_server_final(message):
    client = _rfc_client()
    client.client_final(RFC_SERVER_FIRST)
    with pytest.raises(SaslAuthenticationError, match="server-final"):
        client.verify_server_final(message)


def test_scram_server_final_before_client_final_is_refused():
    with pytest.raises(SaslAuthenticationError, match="before client-final"):
        _rfc_client().verify_server_final(RFC_SERVER_FINAL)


def test_scram_username_escaping():
    assert scram_sasl_name("a=b,c") == "a=3Db=2Cc"
    assert scram_sasl_name("=2C") == "=3D2C"  # '=' escaped first, so "=2C" is not read back as ','
    client = ScramClient("SCRAM-SHA-512", "a=b,c", "pw", nonce="N")
    assert client.client_first() == b"n,,n=a=3Db=2Cc,r=N"


def test_scram_random_nonce_is_fresh_and_has_no_comma():
    firsts = {ScramClient("SCRAM-SHA-256", "u", "p").client_first() for _ in range(20)}
    assert len(firsts) == 20
    assert all(f.count(b",") == 3 for f in firsts)


def test_scram_repr_has_no_password():
    assert "pencil" not in repr(_rfc_client())


def test_plain_and_oauthbearer_initial_responses():
    assert plain_initial_response("user", "pencil") == b"\x00user\x00pencil"
    assert oauthbearer_initial_response("abc.def.ghi") == b"n,,\x01auth=Bearer abc.def.ghi\x01\x01"


# --- whole exchanges against SaslScript -----------------------------------------------------


class _Broker:
    """A SaslScript reached through encoded Kafka frames, as over a socket."""

    def __init__(self, script: SaslScript) -> None:
        self.script = script
        self.requests: list[object] = []
        self._ids = itertools.count(1)

    async def round_trip(self, request):
        self.requests.append(request)
        request.with_header(correlation_id=next(self._ids), client_id="kafka-quota-proxy")
        answer = self.script(bytes(request.encode(header=True, framed=False)))
        assert answer is not None
        frame = answer[4:]  # the script's answer carries its size prefix
        key, version = request.API_KEY, request.API_VERSION
        return decode_response(key, version, memoryview(frame)[response_body_offset(frame, key, version):])

    async def api_versions(self) -> dict[int, tuple[int, int]]:
        resp = await self.round_trip(ApiVersionsRequest[0]())
        return {e.api_key: (e.min_version, e.max_version) for e in resp.api_keys}


class _StrictOAuthScript(SaslScript):
    """SaslScript accepts any bearer token; this one checks it, and rejects a wrong one as
    Kafka's OAuthBearerSaslServer does (RFC 7628 §3.2.2): an error JSON as the challenge, then,
    once the client answered %x01, SASL_AUTHENTICATION_FAILED."""

    def __init__(self, token: str) -> None:
        super().__init__(USERS, node_id=1, port=9092)
        self.token = token
        self.rejected = False

    def _authenticate(self, token: bytes) -> tuple[int, bytes]:
        if self.rejected:
            return (58 if token == b"\x01" else 34), b""
        if token == oauthbearer_initial_response(self.token):
            return 0, b""
        self.rejected = True
        return 0, b'{"status":"invalid_token"}'


def _run(broker: _Broker, creds: SaslCredentials) -> None:
    async def go():
        await authenticate(broker.round_trip, await broker.api_versions(), creds)

    asyncio.run(go())


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_password_mechanisms_succeed_with_the_right_password(mechanism):
    broker = _Broker(SaslScript(USERS, node_id=1, port=9092))
    _run(broker, SaslCredentials(mechanism, "proxy", PASSWORD))
    kinds = [type(r).__name__ for r in broker.requests]
    rounds = 1 if mechanism == "PLAIN" else 2
    assert kinds == ["ApiVersionsRequest", "SaslHandshakeRequest"] + ["SaslAuthenticateRequest"] * rounds
    assert broker.requests[1].API_VERSION == 1
    assert broker.requests[2].API_VERSION == 2  # the script offers SaslAuthenticate v0-v2


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
@pytest.mark.parametrize("user, password", [("proxy", "wrong-Pa55word"), ("nobody", PASSWORD)])
def test_password_mechanisms_fail_with_wrong_credentials(mechanism, user, password):
    broker = _Broker(SaslScript(USERS, node_id=1, port=9092))
    with pytest.raises(SaslAuthenticationError, match=r"SASL_AUTHENTICATION_FAILED \(58\)") as exc:
        _run(broker, SaslCredentials(mechanism, user, password))
    assert "Authentication failed" in str(exc.value)  # the broker's error_message
    assert password not in str(exc.value) and PASSWORD not in str(exc.value)
    assert isinstance(exc.value, ConnectionError)
    # A refusal, in the broker's own words (what the dialer's refusal line quotes).
    assert isinstance(exc.value, SaslRefused)
    assert exc.value.broker_message == "SASL_AUTHENTICATION_FAILED (58): Authentication failed"


def test_oauthbearer_sends_the_token_as_kafka_does():
    broker = _Broker(SaslScript(USERS, node_id=1, port=9092))  # accepts any "auth=Bearer " token
    _run(broker, SaslCredentials("OAUTHBEARER", None, TOKEN))
    assert broker.requests[-1].auth_bytes == b"n,,\x01auth=Bearer " + TOKEN.encode() + b"\x01\x01"


def test_oauthbearer_succeeds_with_the_right_token():
    _run(_Broker(_StrictOAuthScript(TOKEN)), SaslCredentials("OAUTHBEARER", None, TOKEN))


def test_oauthbearer_wrong_token_fails_after_the_rfc_7628_error_round():
    broker = _Broker(_StrictOAuthScript(TOKEN))
    wrong = "eyJhbGciOiJub25lIn0.eyJzdWIiOiJ3cm9uZyJ9."
    with pytest.raises(SaslAuthenticationError, match="SASL_AUTHENTICATION_FAILED") as exc:
        _run(broker, SaslCredentials("OAUTHBEARER", None, wrong))
    assert "invalid_token" in str(exc.value)
    assert wrong not in str(exc.value) and TOKEN not in str(exc.value)
    assert isinstance(exc.value, SaslRefused) and "invalid_token" in exc.value.broker_message
    assert wrong not in exc.value.broker_message
    assert broker.requests[-1].auth_bytes == b"\x01"  # the client's answer to the error challenge


def test_broker_without_sasl_handshake_is_refused():
    broker = _Broker(SaslScript(USERS, node_id=1, port=9092))

    async def go():
        await authenticate(broker.round_trip, {18: (0, 3), 3: (0, 8)}, SaslCredentials("PLAIN", "proxy", PASSWORD))

    with pytest.raises(SaslAuthenticationError, match="broker does not offer SASL"):
        asyncio.run(go())
    assert broker.requests == []


def test_handshake_v0_only_broker_is_refused():
    async def go():
        await authenticate(_unused, {17: (0, 0), 36: (0, 2)}, SaslCredentials("PLAIN", "u", PASSWORD))

    with pytest.raises(SaslAuthenticationError, match="needs v1"):
        asyncio.run(go())


async def _unused(request):
    raise AssertionError("no request expected")


def _stub(*responses):
    """A round_trip answering with ``responses`` in turn, recording the requests."""
    sent: list = []
    answers = iter(responses)

    async def round_trip(request):
        sent.append(request)
        return next(answers)

    return round_trip, sent


def test_mechanism_not_enabled_names_the_offered_ones():
    rt, sent = _stub(SaslHandshakeResponse[1](error_code=33, mechanisms=["PLAIN", "SCRAM-SHA-512"]))
    with pytest.raises(SaslAuthenticationError) as exc:
        asyncio.run(authenticate(rt, {17: (0, 1), 36: (0, 2)}, SaslCredentials("SCRAM-SHA-256", "u", PASSWORD)))
    text = str(exc.value)
    assert "SCRAM-SHA-256 not enabled" in text and "PLAIN, SCRAM-SHA-512" in text
    assert "UNSUPPORTED_SASL_MECHANISM (33)" in text
    assert len(sent) == 1
    assert isinstance(exc.value, SaslRefused)
    assert exc.value.broker_message == ("mechanism not enabled (UNSUPPORTED_SASL_MECHANISM (33)); enabled mechanisms "
                                        "are PLAIN, SCRAM-SHA-512")


def test_illegal_sasl_state_is_named_and_older_authenticate_version_used():
    rt, sent = _stub(
        SaslHandshakeResponse[1](error_code=0, mechanisms=["PLAIN"]),
        SaslAuthenticateResponse[1](error_code=34, error_message="Unexpected request", auth_bytes=b"",
                                    session_lifetime_ms=0),
    )
    with pytest.raises(SaslAuthenticationError, match=r"ILLEGAL_SASL_STATE \(34\): Unexpected request"):
        asyncio.run(authenticate(rt, {17: (0, 1), 36: (0, 1)}, SaslCredentials("PLAIN", "u", PASSWORD)))
    assert sent[1].API_VERSION == 1


def test_scram_server_signature_is_checked_end_to_end():
    """A broker that accepts the proof but answers a signature it cannot have computed."""
    rt, _ = _stub(
        SaslHandshakeResponse[1](error_code=0, mechanisms=["SCRAM-SHA-256"]),
        None,  # replaced below, once the client nonce is known
        SaslAuthenticateResponse[2](error_code=0, error_message=None, auth_bytes=b"v=" + base64.b64encode(b"x" * 32),
                                    session_lifetime_ms=0),
    )

    async def round_trip(request):
        resp = await rt(request)
        if resp is None:  # server-first extending the client's nonce
            nonce = bytes(request.auth_bytes).split(b",r=")[1]
            first = b"r=" + nonce + b"srv,s=" + base64.b64encode(b"salt") + b",i=4096"
            return SaslAuthenticateResponse[2](error_code=0, error_message=None, auth_bytes=first,
                                               session_lifetime_ms=0)
        return resp

    with pytest.raises(SaslAuthenticationError, match="invalid server signature") as exc:
        asyncio.run(authenticate(round_trip, {17: (0, 1), 36: (0, 2)}, SaslCredentials("SCRAM-SHA-256", "u", PASSWORD)))
    assert PASSWORD not in str(exc.value)
    assert not isinstance(exc.value, SaslRefused)  # the broker accepted; it is the broker that failed the proof


# --- credentials() --------------------------------------------------------------------------


def test_credentials_from_a_file_drop_the_trailing_newline(tmp_path):
    secret = tmp_path / "pw"
    secret.write_text(PASSWORD + "\n")
    creds = credentials(UpstreamSaslConfig("SCRAM-SHA-512", username="proxy", password_file=str(secret)))
    assert creds == SaslCredentials("SCRAM-SHA-512", "proxy", PASSWORD)


def test_credentials_from_the_environment(monkeypatch):
    monkeypatch.setenv("KQP_TEST_TOKEN", TOKEN)
    creds = credentials(UpstreamSaslConfig("OAUTHBEARER", token_env="KQP_TEST_TOKEN"))
    assert creds == SaslCredentials("OAUTHBEARER", None, TOKEN)


def test_credentials_missing_file_names_the_yaml_path(tmp_path):
    cfg = UpstreamSaslConfig("PLAIN", username="proxy", password_file=str(tmp_path / "absent"))
    with pytest.raises(ConfigError) as exc:
        credentials(cfg)
    assert exc.value.path == "upstream.sasl.password_file"
    assert "upstream.sasl.password_file" in str(exc.value)


def test_credentials_repr_hides_the_secret():
    creds = SaslCredentials("PLAIN", "proxy", PASSWORD)
    assert PASSWORD not in repr(creds) and PASSWORD not in str(creds)
    assert "proxy" in repr(creds) and "PLAIN" in repr(creds)
