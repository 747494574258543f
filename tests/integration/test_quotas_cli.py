"""``kafka-quota-proxy quotas``: the CLI against a proxy with ``quota_admin`` on (store: memory),
in front of a real Tansu: set / describe / delete of one entity, apply of the pipeline's
recommended-quotas.yaml and an export that reads back the same, a failing entry, a dry run, an
unauthorized principal, and a quotas file with an error named by its YAML path.
"""

from __future__ import annotations

import base64
import json

import pytest
import yaml

from pipeline.recommend import quota_entries, quotas_yaml
from proxy.app.cli import main
from tests.support.inproc import InProcessProxy
from tests.support.sasl_front import tansu_behind_sasl_front

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# Recommendation rows as pipeline.recommend.recommendations returns them (report's "recommend" step).
RECOMMENDED_ROWS = [
    {"user": "alice", "client_id": "app", "kind": "producer_byte_rate", "recommended": 1048576.0},
    {"user": "alice", "client_id": "app", "kind": "request_rate", "recommended": 37.5},
    {"user": "alice", "client_id": "", "kind": "consumer_byte_rate", "recommended": 524288.0},
    {"user": "ANONYMOUS", "client_id": "batch-job", "kind": "consumer_byte_rate", "recommended": 2097152.0},
    {"user": "ANONYMOUS", "client_id": "", "kind": "request_rate", "recommended": 10.0},  # not expressible
    {"user": "bob", "client_id": "", "kind": "producer_ids_rate", "recommended": 12.0},
]


def admin_proxy(tansu, principals=("ANONYMOUS",)) -> InProcessProxy:
    return InProcessProxy([tansu.bootstrap], quotas=[{"user": "<default>", "request_rate": 500}],
                          quota_admin={"enabled": True, "store": "memory", "principals": list(principals)})


def run(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def entries(text: str) -> dict[tuple, dict]:
    """{(user, client_id): {key: value}} of a quotas: YAML."""
    return {(e.get("user"), e.get("client_id")): {k: float(v) for k, v in e.items() if k not in ("user", "client_id")}
            for e in yaml.safe_load(text)["quotas"]}


def test_set_describe_delete(tansu, capsys):
    with admin_proxy(tansu) as p:
        b = ("--bootstrap-server", p.bootstrap)
        status, out, _ = run(capsys, "quotas", "set", *b, "--user", "alice", "--client-id-default",
                             "--add", "producer_byte_rate=1048576,request_rate=20.5")
        assert (status, out) == (0, "user=alice client-id=<default>: ok\n")
        # request_rate is the proxy's own key: kafka-configs.sh would refuse it, the CLI sends it.
        status, out, _ = run(capsys, "quotas", "describe", *b, "--user", "alice")
        assert status == 0
        assert yaml.safe_load(out) == {"quotas": [
            {"user": "alice", "client_id": "<default>", "producer_byte_rate": 1048576, "request_rate": 20.5}]}
        assert run(capsys, "quotas", "describe", *b, "--user", "alice", "--strict")[1] == "quotas: []\n"
        status, out, _ = run(capsys, "quotas", "describe", *b, "--user-default")
        assert entries(out) == {("<default>", None): {"request_rate": 500.0}}
        status, out, _ = run(capsys, "quotas", "delete", *b, "--user", "alice", "--client-id-default",
                             "--keys", "request_rate")
        assert (status, out) == (0, "user=alice client-id=<default>: ok\n")
        assert entries(run(capsys, "quotas", "describe", *b, "--user", "alice")[1]) == {
            ("alice", "<default>"): {"producer_byte_rate": 1048576.0}}
        assert entries(run(capsys, "quotas", "export", *b)[1]) == {
            ("alice", "<default>"): {"producer_byte_rate": 1048576.0}, ("<default>", None): {"request_rate": 500.0}}


def test_apply_recommended_quotas_then_export_round_trips(tansu, capsys, tmp_path):
    recommended, notes = quota_entries(RECOMMENDED_ROWS)
    path = tmp_path / "recommended-quotas.yaml"
    path.write_text(quotas_yaml(recommended, notes, 0.99, 0.2, None, None))
    wanted = entries(path.read_text())
    assert len(wanted) == 4
    with admin_proxy(tansu) as p:
        b = ("--bootstrap-server", p.bootstrap)
        status, out, _ = run(capsys, "quotas", "apply", str(path), *b, "--dry-run")
        assert status == 0 and out.count("valid (dry run, nothing changed)") == 4
        assert entries(run(capsys, "quotas", "export", *b)[1]) == {("<default>", None): {"request_rate": 500.0}}
        status, out, _ = run(capsys, "quotas", "apply", str(path), *b)
        assert status == 0
        assert sorted(out.splitlines()) == ["client-id=batch-job: ok", "user=alice client-id=app: ok",
                                            "user=alice: ok", "user=bob: ok"]
        status, exported, _ = run(capsys, "quotas", "export", *b)
        assert status == 0
        assert entries(exported) == {**wanted, ("<default>", None): {"request_rate": 500.0}}
        # The export is itself a file apply takes: applying it changes nothing.
        again = tmp_path / "exported.yaml"
        again.write_text(exported)
        assert run(capsys, "quotas", "apply", str(again), *b)[0] == 0
        assert run(capsys, "quotas", "export", *b)[1] == exported


def test_a_failing_entry_exits_1_with_kafkas_message(tansu, capsys, tmp_path):
    with admin_proxy(tansu) as p:
        b = ("--bootstrap-server", p.bootstrap)
        status, out, err = run(capsys, "quotas", "set", *b, "--user", "erin", "--add", "producer_byte_rate=1.5")
        assert status == 1
        assert out == "user=erin: INVALID_REQUEST (42): producer_byte_rate cannot be a fractional value.\n"
        assert "1 of 1 entries failed" in err
        status, out, _ = run(capsys, "quotas", "set", *b, "--user", "dave", "--add", "bogus=1")
        assert (status, out) == (1, "user=dave: INVALID_REQUEST (42): Invalid configuration key bogus\n")
        # A file the config loader refuses is refused before anything is sent, by its YAML path.
        bad = tmp_path / "bad.yaml"
        bad.write_text("quotas:\n  - user: carol\n    request_rate: 5\n  - user: dave\n    request_rate: -1\n")
        status, out, err = run(capsys, "quotas", "apply", str(bad), *b)
        assert (status, out) == (2, "")
        assert "quotas[1].request_rate: must be a positive number, got -1" in err
        assert entries(run(capsys, "quotas", "export", *b)[1]) == {("<default>", None): {"request_rate": 500.0}}


def test_an_unauthorized_principal_exits_1_with_cluster_authorization_failed(tansu, capsys):
    with admin_proxy(tansu, principals=["ops-admin"]) as p:
        b = ("--bootstrap-server", p.bootstrap)
        status, out, _ = run(capsys, "quotas", "set", *b, "--user", "alice", "--add", "request_rate=5")
        assert status == 1
        assert out == "user=alice: CLUSTER_AUTHORIZATION_FAILED (31): Cluster authorization failed.\n"
        status, out, err = run(capsys, "quotas", "describe", *b)
        assert (status, out) == (1, "")
        assert "CLUSTER_AUTHORIZATION_FAILED (31)" in err


def test_nothing_listening_exits_1(capsys):
    status, out, err = run(capsys, "quotas", "export", "--bootstrap-server", "127.0.0.1:1")
    assert (status, out) == (1, "")
    assert err.startswith("error: cannot connect: 127.0.0.1:1:")


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_sasl_command_config_authenticates_as_the_admin(capsys, tmp_path, mechanism):
    users = {"ops-admin": "admin-secret", "bob": "bob-secret"}
    with tansu_behind_sasl_front(users) as behind, \
            InProcessProxy([behind.bootstrap], quota_admin={"enabled": True, "store": "memory",
                                                            "principals": ["ops-admin"]}) as p:
        b = ("--bootstrap-server", p.bootstrap)
        for user in users:
            config = tmp_path / f"{user}.properties"
            config.write_text(f"# as kafka-configs.sh reads it\nsecurity.protocol=SASL_PLAINTEXT\n"
                              f"sasl.mechanism={mechanism}\nsasl.username={user}\nsasl.password={users[user]}\n")
            status, out, _ = run(capsys, "quotas", "set", *b, "--command-config", str(config),
                                 "--user", "carol", "--add", "request_rate=7")
            if user == "ops-admin":
                assert (status, out) == (0, "user=carol: ok\n")
            else:
                assert (status, out) == (1, "user=carol: CLUSTER_AUTHORIZATION_FAILED (31): Cluster authorization "
                                            "failed.\n")
        wrong = tmp_path / "wrong.properties"
        wrong.write_text(f"security.protocol=SASL_PLAINTEXT\nsasl.mechanism={mechanism}\n"
                         "sasl.username=ops-admin\nsasl.password=nope\n")
        status, out, err = run(capsys, "quotas", "export", *b, "--command-config", str(wrong))
        assert (status, out) == (1, "") and "SASL authentication failed" in err
        assert "nope" not in err


def test_ssl_command_config_with_a_client_certificate(tansu, capsys, tmp_path, pki):
    tls = {"certificate": pki.server.cert, "key": pki.server.key, "client_auth": "required", "ca": pki.ca_file,
           "principal_mapping_rules": "RULE:^CN=([^,]*),.*$/$1/,DEFAULT"}  # CN=ops,... -> ops
    with InProcessProxy([tansu.bootstrap], listen={"tls": tls},
                        quota_admin={"enabled": True, "store": "memory", "principals": ["ops"]}) as p:
        b = ("--bootstrap-server", p.bootstrap)
        for name in ("ops", "bob"):
            cert = pki.client(name, name)
            config = tmp_path / f"{name}.properties"
            config.write_text(f"security.protocol=SSL\nssl.ca.location={pki.ca_file}\n"
                              f"ssl.certificate.location={cert.cert}\nssl.key.location={cert.key}\n")
            status, out, _ = run(capsys, "quotas", "set", *b, "--command-config", str(config),
                                 "--user", "carol", "--add", "request_rate=7")
            assert status == (0 if name == "ops" else 1), out
        # PLAINTEXT to a TLS listener: no answer, a connection error, exit 1.
        status, out, err = run(capsys, "quotas", "export", *b)
        assert (status, out) == (1, "") and "closed the connection without answering" in err


def _unsecured_jwt(sub: str) -> str:
    """An unsigned JWT as Kafka's OAuthBearerUnsecuredLoginCallbackHandler makes them."""
    def part(obj: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")
    return f"{part({'alg': 'none'})}.{part({'sub': sub, 'iat': 0, 'exp': 4102444800})}."


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-512", "OAUTHBEARER"])
def test_sasl_ssl_command_config_as_kafka_configs_writes_it(capsys, tmp_path, pki, mechanism):
    """SASL over TLS to the proxy; SCRAM's credentials from Java's sasl.jaas.config (the file
    kafka-configs.sh reads), OAUTHBEARER's token from sasl.oauthbearer.token.file."""
    users = {"ops-admin": "admin-secret", "bob": "bob-secret"}
    tokens = {_unsecured_jwt(user): user for user in users}
    tls = {"certificate": pki.server.cert, "key": pki.server.key}
    with tansu_behind_sasl_front(users, tokens=tokens, mechanisms=(mechanism,)) as behind, \
            InProcessProxy([behind.bootstrap], listen={"tls": tls},
                           quota_admin={"enabled": True, "store": "memory", "principals": ["ops-admin"]}) as p:
        b = ("--bootstrap-server", p.bootstrap)

        def command_config(user: str, token: str | None = None) -> str:
            config = tmp_path / f"{user}.properties"
            text = (f"security.protocol=SASL_SSL\nssl.truststore.type=PEM\nssl.truststore.location={pki.ca_file}\n"
                    f"sasl.mechanism={mechanism}\n")
            if mechanism == "OAUTHBEARER":
                token_file = tmp_path / f"{user}.jwt"
                token_file.write_text((token or _unsecured_jwt(user)) + "\n")
                text += ("sasl.jaas.config=org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule "
                         f"required;\nsasl.oauthbearer.token.file={token_file}\n")
            else:
                text += ("sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required \\\n"
                         f"    username=\"{user}\" password=\"{token or users[user]}\";\n")
            config.write_text(text)
            return str(config)

        status, out, _ = run(capsys, "quotas", "set", *b, "--command-config", command_config("ops-admin"),
                             "--user", "carol", "--add", "request_rate=7")
        assert (status, out) == (0, "user=carol: ok\n")
        status, out, _ = run(capsys, "quotas", "set", *b, "--command-config", command_config("bob"),
                             "--user", "carol", "--add", "request_rate=8")
        assert (status, out) == (1, "user=carol: CLUSTER_AUTHORIZATION_FAILED (31): Cluster authorization failed.\n")
        status, out, _ = run(capsys, "quotas", "describe", *b, "--command-config", command_config("ops-admin"),
                             "--user", "carol")
        assert (status, out) == (0, "quotas:\n- user: carol\n  request_rate: 7\n")
        bad = "not-a-known-token" if mechanism == "OAUTHBEARER" else "wrong-password"
        status, out, err = run(capsys, "quotas", "export", *b, "--command-config", command_config("eve", bad))
        assert (status, out) == (1, "") and "SASL authentication failed" in err
        assert bad not in err
        assert {c.mechanism for c in behind.front.connections if c.user} == {mechanism}
