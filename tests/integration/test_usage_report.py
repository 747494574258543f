"""End to end: the proxy writes its usage log in front of the real broker while two tenants
produce (one over its byte quota), then ``kafka-quota-proxy report`` names the throttled
tenant, and its recommended configuration passes ``check-config``."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest
from kafka import KafkaProducer

from tests.support.proxy_process import REPO_ROOT

pytestmark = pytest.mark.integration

NOISY_QUOTA_BYTES = 10_000


def _produce(bootstrap: str, client_id: str, records: int) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, client_id=client_id, linger_ms=5, batch_size=16_384)
    try:
        for _ in range(records):
            producer.send("usage-e2e", b"x" * 1000)
        producer.flush(60)
    finally:
        producer.close(10)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "proxy", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_report_names_the_throttled_tenant(tansu, proxy, tmp_path):
    usage = tmp_path / "usage"
    p = proxy(tansu.bootstrap, extra_config={
        "usage_log": {"directory": str(usage), "interval_seconds": 1, "proxy_name": "e2e"},
        "quotas": [{"client_id": "noisy", "producer_byte_rate": NOISY_QUOTA_BYTES}],
    })
    bootstrap = "{}:{}".format(*p.ready["bootstrap"])
    _produce(bootstrap, "calm", 20)
    # Kafka measures a new rate over at least (samples - 1) windows: 150 kB in a few seconds is
    # 15 kB/s over those 10 s, above the 10 kB/s quota.
    _produce(bootstrap, "noisy", 150)
    p.stop()  # a clean stop writes the partial interval
    assert list(usage.rglob("*.parquet")), p.log_text()

    out = tmp_path / "report"
    done = _cli("report", "--usage", str(usage), "--out", str(out), "--config", str(p.config_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[7/7]" in done.stderr  # progress lines while Spark ran
    assert f"html: {out / 'report.html'}" in done.stdout

    with open(out / "throttling.csv", newline="") as f:
        throttling = {r["client_id"]: r for r in csv.DictReader(f)}
    assert int(throttling["noisy"]["throttled"]) > 0
    assert int(throttling["noisy"]["throttle_time_ms"]) > 0
    assert int(throttling["calm"]["throttled"]) == 0
    page = (out / "report.html").read_text()
    assert "most throttled: ANONYMOUS / noisy" in page

    recommended = out / "recommended-quotas.yaml"
    checked = _cli("check-config", str(recommended))
    assert checked.returncode == 0, checked.stderr
    text = recommended.read_text()
    assert "client_id: noisy" in text and "client_id: calm" in text
    # The base configuration was carried over: the proxy would run against the same broker.
    assert tansu.bootstrap in text
