"""listen.tls: every mistake is a ConfigError naming the YAML path and the value, found by
check-config as by a start; the files are real PEM files made here."""

from __future__ import annotations

import ssl

import pytest
import trustme
from cryptography.hazmat.primitives import serialization

from config import ConfigError, parse_config
from proxy.app.cli import main
from proxy.identity.tls import handshake_failure_reason, server_tls

BASE = {"upstream": {"bootstrap_servers": ["127.0.0.1:1"]}}


def _cfg(**tls):
    return parse_config({**BASE, "listen": {"tls": tls}})


@pytest.mark.parametrize("tls, path, words", [
    ({"key": "k.pem"}, "listen.tls.certificate", "PEM file path is required"),
    ({"certificate": "c.pem"}, "listen.tls.key", "PEM file path is required"),
    ({"certificate": "c.pem", "key": "k.pem", "key_password": "hunter2"}, "listen.tls.key_password", "never inline"),
    ({"certificate": "c.pem", "key": "k.pem", "client_auth": "sometimes"}, "listen.tls.client_auth", "sometimes"),
    ({"certificate": "c.pem", "key": "k.pem", "client_auth": "required"}, "listen.tls.ca", "CA bundle"),
    ({"certificate": "c.pem", "key": "k.pem", "key_password_file": "p", "key_password_env": "P"},
     "listen.tls.key_password_env", "not both"),
    ({"certificate": "c.pem", "key": "k.pem", "handshake_timeout_ms": 5}, "listen.tls.handshake_timeout_ms", "5"),
    ({"certificate": "c.pem", "key": "k.pem", "ciphers": "ALL"}, "listen.tls.ciphers", "unknown key"),
])
def test_a_bad_tls_section_names_its_path(tls, path, words):
    with pytest.raises(ConfigError) as err:
        _cfg(**tls)
    assert err.value.path == path and words in str(err.value)


def test_files_are_loaded_and_checked(pki, tmp_path):
    good = server_tls(_cfg(certificate=pki.server.cert, key=pki.server.key).listen.tls)
    assert good.context.minimum_version == ssl.TLSVersion.TLSv1_2 and good.context.verify_mode == ssl.CERT_NONE
    other = pki.client("other", "x")
    cases = [
        ({"certificate": str(tmp_path / "missing.pem"), "key": pki.server.key}, "listen.tls.certificate", "no such"),
        ({"certificate": pki.server.cert, "key": other.key}, "listen.tls.certificate", "cannot load"),  # not its key
        ({"certificate": pki.server.key, "key": pki.server.key}, "listen.tls.certificate", "cannot load"),  # not a cert
        ({"certificate": pki.server.cert, "key": pki.server.key, "client_auth": "required",
          "ca": str(tmp_path / "none.pem")}, "listen.tls.ca", "no such"),
        ({"certificate": pki.server.cert, "key": pki.server.key, "key_password_env": "KQP_TEST_UNSET_VARIABLE"},
         "listen.tls.key_password_env", "not set"),
        ({"certificate": pki.server.cert, "key": pki.server.key, "principal_mapping_rules": "RULE:^CN=(.*)$"},
         "listen.tls.principal_mapping_rules", "RULE"),
    ]
    for tls, path, words in cases:
        with pytest.raises(ConfigError) as err:
            server_tls(_cfg(**tls).listen.tls)
        assert err.value.path == path and words in str(err.value), (tls, str(err.value))


def test_an_encrypted_key_takes_its_password_from_a_file_or_the_environment(tmp_path, monkeypatch):
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    cert = tmp_path / "c.pem"
    cert.write_bytes(b"".join(b.bytes() for b in leaf.cert_chain_pems))
    key = serialization.load_pem_private_key(leaf.private_key_pem.bytes(), None)
    encrypted = tmp_path / "k.pem"
    encrypted.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.BestAvailableEncryption(b"s3cret")))
    (tmp_path / "pw").write_text("s3cret\n")
    server_tls(_cfg(certificate=str(cert), key=str(encrypted), key_password_file=str(tmp_path / "pw")).listen.tls)
    monkeypatch.setenv("KQP_TEST_KEY_PASSWORD", "s3cret")
    server_tls(_cfg(certificate=str(cert), key=str(encrypted), key_password_env="KQP_TEST_KEY_PASSWORD").listen.tls)
    monkeypatch.setenv("KQP_TEST_KEY_PASSWORD", "wrong")
    with pytest.raises(ConfigError) as err:
        server_tls(_cfg(certificate=str(cert), key=str(encrypted), key_password_env="KQP_TEST_KEY_PASSWORD").listen.tls)
    assert err.value.path == "listen.tls.certificate"
    assert "s3cret" not in str(err.value) and "wrong" not in str(err.value)  # never a secret in a message


def test_check_config_finds_a_key_that_is_not_the_certificates(pki, tmp_path, capsys):
    other = pki.client("other", "x")
    path = tmp_path / "config.yaml"
    path.write_text(f"upstream:\n  bootstrap_servers: ['127.0.0.1:1']\nlisten:\n  tls:\n"
                    f"    certificate: {pki.server.cert}\n    key: {other.key}\n")
    assert main(["check-config", str(path)]) == 2
    assert "listen.tls.certificate" in capsys.readouterr().err
    path.write_text(f"upstream:\n  bootstrap_servers: ['127.0.0.1:1']\nlisten:\n  tls:\n"
                    f"    certificate: {pki.server.cert}\n    key: {pki.server.key}\n")
    assert main(["check-config", str(path)]) == 0


def test_handshake_failure_reasons():
    expired = ssl.SSLCertVerificationError(1, "certificate verify failed")
    expired.verify_code = 10
    unknown = ssl.SSLCertVerificationError(1, "certificate verify failed")
    unknown.verify_code = 20
    plain = ssl.SSLError(1, "wrong version number")
    plain.reason = "WRONG_VERSION_NUMBER"
    assert handshake_failure_reason(expired) == "certificate_expired"
    assert handshake_failure_reason(unknown) == "unknown_ca"
    assert handshake_failure_reason(plain) == "not_tls"
    assert handshake_failure_reason(TimeoutError()) == "timeout"
    assert handshake_failure_reason(ConnectionAbortedError("SSL handshake is taking longer than 0.5 seconds")) == \
        "timeout"
    assert handshake_failure_reason(ConnectionResetError()) == "closed"


def test_early_bytes_of_a_client_gone_before_its_handshake_are_dropped():
    """A plaintext client that sends and closes at once: its transport has no protocol left when
    the bytes kept for the TLS layer would be handed over."""
    from proxy.identity.tls import EarlyBytes

    class GoneTransport:
        def get_protocol(self):
            return None

        def is_closing(self):
            return True

    early = EarlyBytes()
    early.data_received(b"\x00\x00\x00\x10not a ClientHello")
    early.connection_lost(None)
    early.hand_over(GoneTransport())  # raised AttributeError before
    assert early.lost and not early.data
