"""upstream.tls and upstream.sasl: every mistake is a ConfigError naming its YAML path (and
never echoing a secret); check-config also reads the SASL secret, as a start does, so an
unreadable password file or an unset variable is found before the proxy runs."""

from __future__ import annotations

import pytest
import yaml

from config import ConfigError, parse_config
from config.model import UpstreamSaslConfig, UpstreamTlsConfig
from proxy.app.cli import main

SERVERS = ["127.0.0.1:1"]
SECRET = "hunter2-not-for-logs"
UNSET = "KQP_TEST_UPSTREAM_SECRET_THAT_IS_NEVER_SET"


def _cfg(**upstream):
    return parse_config({"upstream": {"bootstrap_servers": SERVERS, **upstream}})


def _error(**upstream) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        _cfg(**upstream)
    return err.value


@pytest.mark.parametrize("tls, path, words", [
    ({"key_password": SECRET}, "upstream.tls.key_password", "never inline"),
    ({"certificate": "c.pem"}, "upstream.tls.key", "both certificate and key"),
    ({"key": "k.pem"}, "upstream.tls.certificate", "both certificate and key"),
    ({"certificate": "c.pem", "key": "k.pem", "key_password_file": "p", "key_password_env": "P"},
     "upstream.tls.key_password_env", "not both"),
    ({"ca": ""}, "upstream.tls.ca", "non-empty string"),
    ({"ca": 5}, "upstream.tls.ca", "non-empty string"),
    ({"verify_hostname": "no"}, "upstream.tls.verify_hostname", "no"),
    ({"key_password_file": ""}, "upstream.tls.key_password_file", "non-empty string"),
    ({"ciphers": "ALL"}, "upstream.tls.ciphers", "unknown key"),
    ("yes", "upstream.tls", "yes"),
])
def test_a_bad_upstream_tls_section_names_its_path(tls, path, words):
    err = _error(tls=tls)
    assert err.path == path, str(err)
    assert words in str(err), str(err)
    assert SECRET not in str(err)


@pytest.mark.parametrize("sasl, path, words", [
    # Secrets are never inline, whatever else is wrong.
    ({"mechanism": "PLAIN", "username": "svc", "password": SECRET}, "upstream.sasl.password", "never inline"),
    ({"mechanism": "SCRAM-SHA-256", "username": "svc", "password_file": "p", "password": SECRET},
     "upstream.sasl.password", "never inline"),
    ({"mechanism": "OAUTHBEARER", "token": SECRET}, "upstream.sasl.token", "never inline"),
    # The mechanism: one of Kafka's names, spelt as Kafka spells them.
    ({"mechanism": "GSSAPI", "username": "svc", "password_file": "p"}, "upstream.sasl.mechanism", "GSSAPI"),
    ({"mechanism": "plain", "username": "svc", "password_file": "p"}, "upstream.sasl.mechanism", "plain"),
    ({"username": "svc", "password_file": "p"}, "upstream.sasl.mechanism", "must be one of"),
    # OAUTHBEARER takes a token, not a user and a password.
    ({"mechanism": "OAUTHBEARER", "password_file": "p"}, "upstream.sasl.password_file", "not a password"),
    ({"mechanism": "OAUTHBEARER", "password_env": "P", "token_env": "T"}, "upstream.sasl.password_env",
     "not a password"),
    ({"mechanism": "OAUTHBEARER", "username": "svc", "token_file": "t"}, "upstream.sasl.username", "not a password"),
    ({"mechanism": "OAUTHBEARER"}, "upstream.sasl.token_file", "required"),
    ({"mechanism": "OAUTHBEARER", "token_file": "t", "token_env": "T"}, "upstream.sasl.token_env", "not both"),
    # PLAIN and SCRAM take a user and a password, from exactly one source.
    ({"mechanism": "PLAIN", "password_file": "p"}, "upstream.sasl.username", "needs a username"),
    ({"mechanism": "SCRAM-SHA-512", "username": "svc"}, "upstream.sasl.password_file", "required"),
    ({"mechanism": "PLAIN", "username": "svc"}, "upstream.sasl.password_file", "password_env"),
    ({"mechanism": "PLAIN", "username": "svc", "password_file": "p", "password_env": "P"},
     "upstream.sasl.password_env", "not both"),
    ({"mechanism": "SCRAM-SHA-256", "username": "svc", "password_file": "p", "token_file": "t"},
     "upstream.sasl.token_file", "not a token"),
    ({"mechanism": "PLAIN", "username": "", "password_file": "p"}, "upstream.sasl.username", "non-empty string"),
    ({"mechanism": "PLAIN", "username": "svc", "password_file": 5}, "upstream.sasl.password_file",
     "non-empty string"),
    ({"mechanism": "PLAIN", "username": "svc", "password_env": ""}, "upstream.sasl.password_env",
     "non-empty string"),
    ({"mechanism": "PLAIN", "username": "svc", "password_file": "p", "authzid": "x"}, "upstream.sasl.authzid",
     "unknown key"),
    ("PLAIN", "upstream.sasl", "PLAIN"),
])
def test_a_bad_upstream_sasl_section_names_its_path(sasl, path, words):
    err = _error(sasl=sasl)
    assert err.path == path, str(err)
    assert words in str(err), str(err)
    assert SECRET not in str(err)


def test_good_sections_parse_into_the_model():
    cfg = _cfg(
        tls={"ca": "ca.pem", "verify_hostname": False, "certificate": "c.pem", "key": "k.pem",
             "key_password_env": "KEY_PW"},
        sasl={"mechanism": "SCRAM-SHA-512", "username": "svc", "password_file": "/run/secrets/pw"},
    ).upstream
    assert cfg.tls == UpstreamTlsConfig(ca="ca.pem", verify_hostname=False, certificate="c.pem", key="k.pem",
                                        key_password_env="KEY_PW")
    assert cfg.sasl == UpstreamSaslConfig(mechanism="SCRAM-SHA-512", username="svc", password_file="/run/secrets/pw")
    oauth = _cfg(sasl={"mechanism": "OAUTHBEARER", "token_env": "TOKEN"}).upstream.sasl
    assert oauth == UpstreamSaslConfig(mechanism="OAUTHBEARER", token_env="TOKEN")
    plain = _cfg().upstream
    assert plain.tls is None and plain.sasl is None
    # An explicit null is no section at all.
    assert _cfg(tls=None, sasl=None).upstream == plain


# -- check-config reads the secret, as a start does --------------------------------------------


def _write_config(tmp_path, sasl: dict) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"upstream": {"bootstrap_servers": SERVERS, "sasl": sasl}}))
    return str(path)


@pytest.mark.parametrize("case", ["missing file", "directory", "empty file", "unset env", "empty env",
                                  "unset token env", "missing token file"])
def test_check_config_finds_an_unreadable_secret(case, tmp_path, monkeypatch, capsys):
    plain = {"mechanism": "PLAIN", "username": "svc"}
    sasl, path = {
        "missing file": ({**plain, "password_file": str(tmp_path / "nope")}, "upstream.sasl.password_file"),
        "directory": ({**plain, "password_file": str(tmp_path)}, "upstream.sasl.password_file"),
        "empty file": ({**plain, "password_file": str(tmp_path / "empty")}, "upstream.sasl.password_file"),
        "unset env": ({**plain, "password_env": UNSET}, "upstream.sasl.password_env"),
        "empty env": ({**plain, "password_env": UNSET}, "upstream.sasl.password_env"),
        "unset token env": ({"mechanism": "OAUTHBEARER", "token_env": UNSET}, "upstream.sasl.token_env"),
        "missing token file": ({"mechanism": "OAUTHBEARER", "token_file": str(tmp_path / "nope")},
                               "upstream.sasl.token_file"),
    }[case]
    (tmp_path / "empty").write_text("\n")  # a trailing newline is dropped: nothing is left
    monkeypatch.delenv(UNSET, raising=False)
    if case == "empty env":
        monkeypatch.setenv(UNSET, "")
    assert main(["check-config", _write_config(tmp_path, sasl)]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith("invalid configuration: ") and path in out.err, out.err


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"])
@pytest.mark.parametrize("source", ["file", "env"])
def test_check_config_accepts_a_readable_secret_and_prints_it_nowhere(mechanism, source, tmp_path, monkeypatch,
                                                                      capsys):
    kind = "token" if mechanism == "OAUTHBEARER" else "password"
    sasl: dict = {"mechanism": mechanism} if kind == "token" else {"mechanism": mechanism, "username": "svc"}
    if source == "file":
        secret_file = tmp_path / "secret"
        secret_file.write_text(SECRET + "\n")
        sasl[f"{kind}_file"] = str(secret_file)
    else:
        monkeypatch.setenv(UNSET, SECRET)
        sasl[f"{kind}_env"] = UNSET
    config = _write_config(tmp_path, sasl)
    assert main(["check-config", config]) == 0
    out = capsys.readouterr()
    assert out.out == f"{config}: ok\n" and SECRET not in out.out + out.err


def test_check_config_finds_a_missing_upstream_ca(tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"upstream": {"bootstrap_servers": SERVERS,
                                                 "tls": {"ca": str(tmp_path / "no-ca.pem")}}}))
    assert main(["check-config", str(path)]) == 2
    assert "upstream.tls.ca" in capsys.readouterr().err


def test_check_config_names_the_inline_password_without_printing_it(tmp_path, capsys):
    config = _write_config(tmp_path, {"mechanism": "PLAIN", "username": "svc", "password": SECRET})
    assert main(["check-config", config]) == 2
    err = capsys.readouterr().err
    assert "upstream.sasl.password" in err and SECRET not in err
