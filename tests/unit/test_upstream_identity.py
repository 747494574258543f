"""proxy/upstream_identity.py: the line saying how the proxy authenticates to the brokers and what
it trusts, for every form of upstream.sasl and upstream.tls, with certificates made here; the
log that says it at start and once per change, never per connection; and the dialer's refusal
line naming the mechanism and the user. No line ever contains a password, a token or a key."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from pathlib import Path

import pytest

from config import ConfigError, parse_config
from config.model import UpstreamConfig, UpstreamSaslConfig, UpstreamTlsConfig
from proxy.app.server import ProxyServer
from proxy.cluster.dialer import BrokerDialer
from proxy.identity.sasl_client import SaslAuthenticationError, SaslCredentials, SaslRefused, credentials
from proxy.identity.upstream_identity import IdentityLog, describe_upstream_identity
from proxy.observability.stats import ProxyStats
from tests.support.certs import chain_pem, replace_file

PASSWORD = "pw-never-logged-5e1f"
KEY_PASSWORD = "key-pw-never-logged-77aa"
SERVERS = ("127.0.0.1:9",)
LOGGER = "proxy.identity.upstream_identity"


def _jwt(claims: dict) -> str:
    """An unsigned JWT as Kafka's OAuthBearerUnsecuredLoginCallbackHandler makes them."""
    def part(obj: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")
    return f"{part({'alg': 'none'})}.{part(claims)}."


TOKEN = _jwt({"sub": "svc-proxy", "iat": 0, "exp": 4102444800})
OPAQUE_TOKEN = "opaque-token-never-logged-0b9c"


def _secrets_of(*texts: str) -> list[str]:
    """Every secret a line must not contain, and the parts of the JWT (its payload would give
    the token away as surely as the whole)."""
    return [PASSWORD, KEY_PASSWORD, TOKEN, *TOKEN.split(".")[:2], OPAQUE_TOKEN, *texts]


def _assert_no_secret(line: str, *more: str) -> None:
    for secret in _secrets_of(*more):
        if secret:
            assert secret not in line, f"{secret!r} in {line!r}"


def _sasl(mechanism: str, username: str | None = "kqp") -> UpstreamSaslConfig:
    if mechanism == "OAUTHBEARER":
        return UpstreamSaslConfig(mechanism, token_env="KQP_TEST_TOKEN")
    return UpstreamSaslConfig(mechanism, username=username, password_env="KQP_TEST_PASSWORD")


# --- the line, one form at a time ------------------------------------------------------------


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN"])
def test_a_password_mechanism_names_the_mechanism_and_the_user(mechanism):
    creds = SaslCredentials(mechanism, "kqp", PASSWORD)
    line = describe_upstream_identity(UpstreamConfig(SERVERS, sasl=_sasl(mechanism)), creds)
    assert line == f"SASL/{mechanism} as user kqp on the proxy's own connections; plaintext (no TLS)"
    _assert_no_secret(line)


def test_oauthbearer_names_the_sub_claim_of_a_jwt_and_never_the_token():
    cfg = UpstreamConfig(SERVERS, sasl=_sasl("OAUTHBEARER"))
    line = describe_upstream_identity(cfg, SaslCredentials("OAUTHBEARER", None, TOKEN))
    assert line == ("SASL/OAUTHBEARER as principal svc-proxy (the token's sub claim) on the proxy's own "
                    "connections; plaintext (no TLS)")
    _assert_no_secret(line)


def test_oauthbearer_with_an_opaque_token_says_the_principal_is_not_readable():
    cfg = UpstreamConfig(SERVERS, sasl=_sasl("OAUTHBEARER"))
    for token in (OPAQUE_TOKEN, _jwt({"iss": "no-sub"}), "a.!!not-base64!!.c"):
        line = describe_upstream_identity(cfg, SaslCredentials("OAUTHBEARER", None, token))
        assert line.startswith("SASL/OAUTHBEARER with a token that is not a JWT with a sub claim"), line
        _assert_no_secret(line, token)


def test_a_name_with_a_line_break_cannot_forge_a_log_line():
    cfg = UpstreamConfig(SERVERS, sasl=_sasl("OAUTHBEARER"))
    line = describe_upstream_identity(cfg, SaslCredentials("OAUTHBEARER", None, _jwt({"sub": "x\nlevel=ERROR"})))
    assert "\n" not in line and "'x\\nlevel=ERROR'" in line, line


def test_no_authentication_and_no_tls():
    line = describe_upstream_identity(UpstreamConfig(SERVERS))
    assert line == "no authentication (neither upstream.sasl nor a client certificate); plaintext (no TLS)"


def test_tls_against_the_system_trust_store_with_hostnames_verified():
    line = describe_upstream_identity(UpstreamConfig(SERVERS, tls=UpstreamTlsConfig()))
    assert line == ("no authentication (neither upstream.sasl nor a client certificate); TLS with hostname "
                    "verification, brokers' certificates verified against the system trust store")


def test_verify_hostname_false_is_said(pki):
    line = describe_upstream_identity(UpstreamConfig(SERVERS, tls=UpstreamTlsConfig(ca=pki.ca_file,
                                                                                     verify_hostname=False)))
    assert "TLS WITHOUT hostname verification (verify_hostname: false)" in line, line
    assert "with hostname verification" not in line


def test_mtls_names_the_certificate_subject_issuer_and_the_ca(pki, tmp_path):
    client = pki.client("kqp", common_name="kqp-proxy", organization_unit="platform")
    key_password_file = tmp_path / "key-password"
    key_password_file.write_text(KEY_PASSWORD)
    tls = UpstreamTlsConfig(ca=pki.ca_file, certificate=client.cert, key=client.key,
                            key_password_file=str(key_password_file))
    line = describe_upstream_identity(UpstreamConfig(SERVERS, tls=tls))
    assert line.startswith("client certificate CN=kqp-proxy,OU=platform,O=Acme (issuer OU="), line
    assert ",O=kqp test CA, valid until " in line, line
    assert "on every connection; TLS with hostname verification, brokers' certificates verified against " \
           f"upstream.tls.ca {pki.ca_file} (CA OU=" in line, line
    assert line.endswith(",O=kqp test CA)"), line
    key_pem = Path(client.key).read_text()
    _assert_no_secret(line, *key_pem.splitlines()[1:-1])  # not a line of the key's base64


def test_sasl_and_a_client_certificate_are_both_named(pki):
    client = pki.client("kqp", common_name="kqp-proxy")
    cfg = UpstreamConfig(SERVERS, sasl=_sasl("SCRAM-SHA-512"),
                         tls=UpstreamTlsConfig(ca=pki.ca_file, certificate=client.cert, key=client.key))
    line = describe_upstream_identity(cfg, SaslCredentials("SCRAM-SHA-512", "kqp", PASSWORD))
    assert line.startswith("SASL/SCRAM-SHA-512 as user kqp on the proxy's own connections; "
                           "client certificate CN=kqp-proxy,"), line
    _assert_no_secret(line)


def test_a_bundle_of_cas_is_counted_and_a_pinned_leaf_still_named(pki, tmp_path):
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(pki.ca.cert_pem.bytes() + pki.other_ca.cert_pem.bytes())
    line = describe_upstream_identity(UpstreamConfig(SERVERS, tls=UpstreamTlsConfig(ca=str(bundle))))
    assert "(2 CAs: " in line and "O=kqp test CA" in line and "O=another CA" in line, line
    # A broker's own (non-CA) certificate as the trust anchor: named all the same.
    line = describe_upstream_identity(UpstreamConfig(SERVERS, tls=UpstreamTlsConfig(ca=pki.server.cert)))
    assert f"upstream.tls.ca {pki.server.cert} (CA CN=proxy," in line, line


def test_an_unreadable_certificate_is_said_not_raised(tmp_path):
    garbage = tmp_path / "cert.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\ngarbage\n-----END CERTIFICATE-----\n")
    tls = UpstreamTlsConfig(ca=str(garbage), certificate=str(garbage), key=str(garbage))
    line = describe_upstream_identity(UpstreamConfig(SERVERS, tls=tls))
    assert line.startswith(f"client certificate in {garbage} (subject not readable: "), line
    assert f"upstream.tls.ca {garbage} (subject not readable: " in line, line


# --- the log: at start, then once per change -------------------------------------------------


def _lines(caplog, level: int = logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_announced_once_and_not_again_for_the_same_credentials(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    cfg = UpstreamConfig(SERVERS, sasl=_sasl("SCRAM-SHA-512"))
    identity = IdentityLog(cfg, SaslCredentials("SCRAM-SHA-512", "kqp", PASSWORD))
    identity.announce()
    for _ in range(100):  # a hundred connections, the same password each time
        identity.credentials_read(SaslCredentials("SCRAM-SHA-512", "kqp", PASSWORD))
    identity.announce()
    assert _lines(caplog) == ["upstream identity: SASL/SCRAM-SHA-512 as user kqp on the proxy's own connections; "
                              "plaintext (no TLS)"]
    assert _lines(caplog, logging.DEBUG) == []


def test_a_rotated_password_is_said_once_per_change_without_the_secret(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    identity = IdentityLog(UpstreamConfig(SERVERS, sasl=_sasl("SCRAM-SHA-512")),
                           SaslCredentials("SCRAM-SHA-512", "kqp", PASSWORD))
    identity.announce()
    rotated = "rotated-pw-never-logged-91d2"
    for _ in range(5):
        identity.credentials_read(SaslCredentials("SCRAM-SHA-512", "kqp", rotated))
    lines = _lines(caplog)
    assert lines[1:] == ["upstream SASL credentials changed (password re-read), still SASL/SCRAM-SHA-512 as user kqp"]
    identity.credentials_read(SaslCredentials("SCRAM-SHA-512", "kqp", PASSWORD))  # and back: another change
    assert len(_lines(caplog)) == 3
    for record in caplog.records:
        _assert_no_secret(record.getMessage(), rotated)


def test_a_token_with_another_sub_logs_the_new_identity_once(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    identity = IdentityLog(UpstreamConfig(SERVERS, sasl=_sasl("OAUTHBEARER")),
                           SaslCredentials("OAUTHBEARER", None, TOKEN))
    identity.announce()
    other = _jwt({"sub": "svc-other", "iat": 1})
    for _ in range(3):
        identity.credentials_read(SaslCredentials("OAUTHBEARER", None, other))
    assert _lines(caplog) == [
        "upstream identity: SASL/OAUTHBEARER as principal svc-proxy (the token's sub claim) on the proxy's own "
        "connections; plaintext (no TLS)",
        "upstream identity changed (SASL credentials re-read): SASL/OAUTHBEARER as principal svc-other (the "
        "token's sub claim) on the proxy's own connections; plaintext (no TLS)",
    ]
    # A refreshed token for the same principal is routine: DEBUG, once, not INFO.
    refreshed = _jwt({"sub": "svc-other", "iat": 2})
    for _ in range(3):
        identity.credentials_read(SaslCredentials("OAUTHBEARER", None, refreshed))
    assert len(_lines(caplog)) == 2
    assert _lines(caplog, logging.DEBUG) == ["upstream SASL credentials changed (token re-read), still "
                                             "SASL/OAUTHBEARER as principal svc-other (the token's sub claim)"]
    for record in caplog.records:
        _assert_no_secret(record.getMessage(), other, refreshed, *other.split(".")[:2], *refreshed.split(".")[:2])


def test_a_reloaded_client_certificate_logs_the_new_subject_once(pki, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    cert, key = tmp_path / "client.crt", tmp_path / "client.key"

    def install(common_name: str) -> None:
        leaf = pki.ca.issue_cert(f"{common_name}.clients.test", common_name=common_name)
        replace_file(cert, chain_pem(leaf))
        replace_file(key, leaf.private_key_pem.bytes())

    install("kqp-gen-1")
    identity = IdentityLog(UpstreamConfig(SERVERS, tls=UpstreamTlsConfig(ca=pki.ca_file, certificate=str(cert),
                                                                         key=str(key))))
    identity.announce()
    identity.tls_reloaded()  # the same files read again (SIGHUP, or the listener's files changed)
    assert len(_lines(caplog)) == 1 and "CN=kqp-gen-1," in _lines(caplog)[0]
    install("kqp-gen-2")
    identity.tls_reloaded()
    identity.tls_reloaded()
    lines = _lines(caplog)
    assert len(lines) == 2, lines
    assert lines[1].startswith("upstream identity changed (upstream TLS files reloaded): client certificate "
                               "CN=kqp-gen-2,"), lines[1]


# --- the dialer: the announcement and the refusal line -----------------------------------------


def _dialer(monkeypatch, mechanism: str, secret: str) -> BrokerDialer:
    monkeypatch.setenv("KQP_TEST_PASSWORD", secret)
    monkeypatch.setenv("KQP_TEST_TOKEN", secret)
    return BrokerDialer(UpstreamConfig(SERVERS, sasl=_sasl(mechanism)), ProxyStats())


@pytest.mark.parametrize("mechanism, secret, who", [
    ("SCRAM-SHA-512", PASSWORD, "as user kqp"),
    ("PLAIN", PASSWORD, "as user kqp"),
    ("OAUTHBEARER", TOKEN, "as principal svc-proxy (the token's sub claim)"),
])
def test_a_refusal_names_the_mechanism_the_user_and_the_brokers_words(monkeypatch, caplog, mechanism, secret, who):
    dialer = _dialer(monkeypatch, mechanism, secret)
    refusal = SaslRefused(f"{mechanism} authentication failed: SASL_AUTHENTICATION_FAILED (58): Authentication "
                          "failed", "SASL_AUTHENTICATION_FAILED (58): Authentication failed")
    creds = SaslCredentials(mechanism, None if mechanism == "OAUTHBEARER" else "kqp", secret)
    with caplog.at_level(logging.ERROR, logger="proxy.cluster.dialer"):
        error = dialer.failed("sasl", ("broker", 9093), refusal, creds)
    expected = (f"SASL/{mechanism} authentication {who} refused by broker broker:9093: "
                "SASL_AUTHENTICATION_FAILED (58): Authentication failed")
    assert str(error) == expected
    assert [r.getMessage() for r in caplog.records] == [f"{expected}; retried with back-off"]
    assert dict(dialer._stats.upstream_auth_failures) == {("sasl", "refused"): 1}
    _assert_no_secret(caplog.text)


def test_an_exchange_that_fails_on_the_brokers_side_is_not_called_a_refusal(monkeypatch):
    dialer = _dialer(monkeypatch, "SCRAM-SHA-256", PASSWORD)
    creds = SaslCredentials("SCRAM-SHA-256", "kqp", PASSWORD)
    error = dialer.failed("sasl", ("b1", 9093), SaslAuthenticationError("SCRAM-SHA-256: invalid server signature "
                                                                        "in server-final message"), creds)
    assert str(error) == ("SASL/SCRAM-SHA-256 authentication as user kqp with broker b1:9093 failed: SCRAM-SHA-256: "
                          "invalid server signature in server-final message")


def test_credentials_that_cannot_be_read_are_named_with_their_yaml_path(monkeypatch, tmp_path):
    dialer = _dialer(monkeypatch, "SCRAM-SHA-512", PASSWORD)
    dialer.sasl = UpstreamSaslConfig("SCRAM-SHA-512", username="kqp", password_file=str(tmp_path / "gone"))
    with pytest.raises(ConfigError) as exc:
        credentials(dialer.sasl)
    error = dialer.failed("sasl", ("b1", 9093), exc.value)
    assert str(error).startswith("SASL/SCRAM-SHA-512 credentials of user kqp for broker b1:9093 cannot be read "
                                 "(credentials_unreadable): upstream.sasl.password_file"), str(error)
    assert dict(dialer._stats.upstream_auth_failures) == {("sasl", "credentials_unreadable"): 1}


def test_a_started_server_announces_its_identity_once_before_its_first_broker_connection(caplog):
    # Port 9 (discard) on loopback: nothing listens, the refresh at start fails at once.
    server = ProxyServer(parse_config({
        "upstream": {"bootstrap_servers": list(SERVERS), "connect_timeout_s": 2},
        "listen": {"bootstrap_port": 0, "broker_port_base": 0},
        "metrics": {"enabled": False},
    }))
    caplog.set_level(logging.INFO)

    async def start_and_stop() -> None:
        await server.start()
        await server.stop()

    asyncio.run(start_and_stop())
    messages = [r.getMessage() for r in caplog.records]
    identity = [i for i, m in enumerate(messages) if m.startswith("upstream identity")]
    assert [messages[i] for i in identity] == ["upstream identity: no authentication (neither upstream.sasl nor a "
                                               "client certificate); plaintext (no TLS)"]
    refresh = [i for i, m in enumerate(messages) if "127.0.0.1:9" in m]
    assert refresh and identity[0] < refresh[0], messages  # said before the first connection was tried
