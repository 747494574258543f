"""The example of docs/secured-cluster.md (Running in front of a secured cluster), as written: its YAML block and
the certificates deploy/tls/make-certs.sh makes pass check-config; the proxy started with that
block (only the broker address and ports changed, and without the proxy's own SASL, which
Tansu cannot check) serves a client with alice's certificate over TLS through TLS to a real
broker (Tansu behind stunnel), and that client is the user "alice" of the example's quotas.
The Docker variant's proxy configuration passes check-config with the same certificates."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from kafka import KafkaProducer

from proxy.app.cli import main as cli_main
from tests.support.certs import Pem
from tests.support.proxy_process import ProxyProcess
from tests.support.tls_broker import TlsTansu

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- secured-example:"


def _readme_example() -> str:
    text = (ROOT / "docs/secured-cluster.md").read_text(encoding="utf-8")
    after = text[text.index(MARKER):]
    match = re.search(r"```yaml\n(.*?)```", after, re.DOTALL)
    assert match is not None, "the secured example's YAML block follows its marker"
    return match.group(1)


@pytest.fixture
def example_dir(tmp_path, monkeypatch):
    """A directory laid out as docs/secured-cluster.md says: certs/ from make-certs.sh, secrets/kqp-password."""
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed by deploy/tls/make-certs.sh (Debian: openssl)")
    subprocess.run([str(ROOT / "deploy/tls/make-certs.sh"), "certs"], cwd=tmp_path, check=True,
                   capture_output=True, timeout=60)
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets/kqp-password").write_text("s3cret\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_readme_example_passes_check_config(example_dir, capsys):
    (example_dir / "secured.yaml").write_text(_readme_example())
    assert cli_main(["check-config", "secured.yaml"]) == 0, capsys.readouterr().err
    # The same block with the proxy's password file missing names its YAML path.
    (example_dir / "secrets/kqp-password").unlink()
    assert cli_main(["check-config", "secured.yaml"]) == 2
    assert "upstream.sasl.password_file" in capsys.readouterr().err


def test_the_docker_tls_variant_passes_check_config(example_dir, capsys):
    text = (ROOT / "deploy/tls/proxy-config-tls.yaml").read_text()
    (example_dir / "docker-tls.yaml").write_text(text.replace("/etc/kafka-quota-proxy/tls", str(example_dir / "certs")))
    assert cli_main(["check-config", "docker-tls.yaml"]) == 0, capsys.readouterr().err


def test_the_readme_example_serves_alice_over_tls_to_a_tls_broker(example_dir):
    certs = example_dir / "certs"
    config = yaml.safe_load(_readme_example())
    del config["upstream"]["sasl"]  # Tansu 0.6.0 cannot authenticate (see docs/limits.md)
    for section in ("upstream", "listen"):
        for key, value in config[section]["tls"].items():
            if isinstance(value, str) and value.startswith("certs/"):
                config[section]["tls"][key] = str(example_dir / value)
    with TlsTansu(Pem(str(certs / "proxy.pem"), str(certs / "proxy.key"))) as broker:
        config["upstream"]["bootstrap_servers"] = [broker.bootstrap]
        with ProxyProcess([broker.bootstrap], extra_config={
            "upstream": config["upstream"], "listen": config["listen"] | {"host": "127.0.0.1", "bootstrap_port": 0,
                                                                          "broker_port_base": 0,
                                                                          "advertised_host": "127.0.0.1"},
            "quotas": config["quotas"],
        }) as proxy:
            producer = KafkaProducer(bootstrap_servers=proxy.bootstrap, security_protocol="SSL",
                                     ssl_cafile=str(certs / "ca.pem"), ssl_certfile=str(certs / "alice.pem"),
                                     ssl_keyfile=str(certs / "alice.key"), request_timeout_ms=10_000)
            try:
                for i in range(20):
                    producer.send("readme-secured", b"x" * 1000, key=b"%d" % i)
                producer.flush(10)
            finally:
                producer.close()
            # alice's certificate maps to "alice", whose quota from the example is in force.
            assert proxy.metric_sum("kqp_quota_bound", user="alice", kind="producer_byte_rate") == 1048576
            assert proxy.metric_sum("kqp_quota_rate", user="alice", kind="producer_byte_rate") > 0
