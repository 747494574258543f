"""proxy.app.quotas_cli without a proxy: argument checks, --command-config, the YAML both ways."""

from __future__ import annotations

import pytest
import yaml

from proxy.app.cli import main
from proxy.app.quotas_cli import (
    CliError,
    jaas_options,
    quotas_document,
    read_properties,
    read_quotas_file,
    rule_entity,
    security,
)


def test_properties_are_read_as_java_writes_them(tmp_path):
    f = tmp_path / "admin.properties"
    f.write_text("# comment\n! also\nsecurity.protocol = SASL_SSL\nsasl.mechanism: SCRAM-SHA-512\n"
                 "sasl.password=a=b:c\n\nflag\n  spaced  value\\\n    continued\nsasl.username=x\\u00e9\\:\\\\\n")
    assert read_properties(str(f)) == {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
                                       "sasl.password": "a=b:c", "flag": "", "spaced": "valuecontinued",
                                       "sasl.username": "x\u00e9:\\"}


@pytest.mark.parametrize("text, message", [
    ("security.protocol=TLS\n", "security.protocol must be one of"),
    ("security.protocol=SASL_PLAINTEXT\nsasl.mechanism=GSSAPI\nsasl.username=u\nsasl.password=p\n",
     "sasl.mechanism must be one of"),
    ("security.protocol=SASL_PLAINTEXT\nsasl.username=u\n", "with PLAIN needs username and password in "
     "sasl.jaas.config"),
    ("security.protocol=SASL_SSL\nsasl.mechanism=SCRAM-SHA-256\nsasl.jaas.config=org.apache.kafka.common."
     "security.scram.ScramLoginModule required username=\"u\";\n", "needs username and password"),
    ("security.protocol=SASL_PLAINTEXT\nsasl.mechanism=OAUTHBEARER\n", "needs sasl.oauthbearer.token.file"),
    ("security.protocol=SASL_PLAINTEXT\nsasl.mechanism=OAUTHBEARER\nsasl.oauthbearer.token.file=/nonexistent/t\n",
     "sasl.oauthbearer.token.file: cannot read /nonexistent/t"),
    ("security.protocol=SSL\nssl.ca.location=/nonexistent/ca.pem\n", "no such file: /nonexistent/ca.pem"),
    ("security.protocol=SSL\nssl.certificate.location=/x.pem\n", "go together"),
])
def test_bad_command_configs_are_refused(tmp_path, text, message):
    f = tmp_path / "c.properties"
    f.write_text(text)
    with pytest.raises(CliError, match=message) as caught:
        security(str(f))
    assert caught.value.status == 2


def test_sasl_secrets_stay_out_of_repr(tmp_path):
    f = tmp_path / "c.properties"
    f.write_text("security.protocol=SASL_PLAINTEXT\nsasl.username=u\nsasl.password=hunter2\n")
    sec = security(str(f))
    assert sec.tls is None and sec.sasl is not None and sec.sasl.mechanism == "PLAIN"
    assert "hunter2" not in repr(sec)


def test_credentials_from_the_jaas_config_kafka_configs_reads(tmp_path):
    f = tmp_path / "admin.properties"
    f.write_text("security.protocol=SASL_PLAINTEXT\nsasl.mechanism=SCRAM-SHA-512\n"
                 "sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required \\\n"
                 "  username=\"ops-admin\" password=\"a \\\\\"quoted\\\\\" ;secret\";\n")
    sec = security(str(f))
    assert sec.sasl is not None
    assert (sec.sasl.mechanism, sec.sasl.username, sec.sasl.secret) == ("SCRAM-SHA-512", "ops-admin",
                                                                        'a "quoted" ;secret')
    assert jaas_options("org.apache.kafka.common.security.plain.PlainLoginModule required username=alice "
                        "password=s3cret;") == {"username": "alice", "password": "s3cret"}


def test_an_oauthbearer_token_is_read_from_its_file(tmp_path):
    token = tmp_path / "token.jwt"
    token.write_text("eyJhbGciOiJub25lIn0.eyJzdWIiOiJvcHMifQ.\n")
    f = tmp_path / "c.properties"
    f.write_text(f"security.protocol=SASL_SSL\nsasl.mechanism=OAUTHBEARER\nsasl.oauthbearer.token.file={token}\n")
    sec = security(str(f))
    assert sec.tls is not None and sec.sasl is not None
    assert (sec.sasl.mechanism, sec.sasl.username, sec.sasl.secret) == (
        "OAUTHBEARER", None, "eyJhbGciOiJub25lIn0.eyJzdWIiOiJvcHMifQ.")
    assert "eyJ" not in repr(sec)


def test_document_reads_back_as_the_same_rules(tmp_path):
    described = [((("client-id", None), ("user", "alice")), {"request_rate": 2.5, "producer_byte_rate": 1024.0}),
                 ((("client-id", "app"),), {"consumer_byte_rate": 2048.0})]
    text = quotas_document(described)
    assert yaml.safe_load(text) == {"quotas": [
        {"client_id": "app", "consumer_byte_rate": 2048},
        {"user": "alice", "client_id": "<default>", "producer_byte_rate": 1024, "request_rate": 2.5}]}
    f = tmp_path / "q.yaml"
    f.write_text(text)
    rules = read_quotas_file(str(f))
    assert {rule_entity(r): dict(r.values) for r in rules} == {
        (("client-id", "app"),): {"consumer_byte_rate": 2048.0},
        (("user", "alice"), ("client-id", None)): {"producer_byte_rate": 1024.0, "request_rate": 2.5}}


@pytest.mark.parametrize("argv, message", [
    (["set", "--add", "request_rate=1"], "name the entity"),
    (["set", "--user", "a", "--add", "request_rate"], "expected KEY=VALUE"),
    (["set", "--user", "<default>", "--add", "request_rate=1"], "--user-default"),
    (["delete", "--client-id", "c", "--keys", ","], "no keys given"),
    (["apply", "/nonexistent.yaml"], "cannot read"),
])
def test_bad_arguments_exit_2_before_connecting(capsys, argv, message):
    # Port 1: nothing listens; exit 2 (not 1) shows nothing was attempted.
    assert main(["quotas", *argv, "--bootstrap-server", "127.0.0.1:1"]) == 2
    assert message in capsys.readouterr().err


def test_apply_refuses_a_mode_the_admin_api_cannot_carry(tmp_path, capsys):
    f = tmp_path / "q.yaml"
    f.write_text("quotas:\n  - user: alice\n    producer_byte_rate: 1024\n  - user: bob\n    request_rate: 2\n"
                 "    mode: shadow\n")
    assert main(["quotas", "apply", str(f), "--bootstrap-server", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "quotas[1].mode: the admin API carries quota values only" in err
