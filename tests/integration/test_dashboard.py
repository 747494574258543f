"""The Grafana dashboard (deploy/grafana/dashboards/kafka-quota-proxy.json) cannot rot: every
metric its PromQL names is a family a running proxy really exports (scraped here, with a quota,
the usage log and the quota store on so that their families exist), and the compose stack
provisions it. Nothing is rendered: no Grafana runs here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.support.inproc import InProcessProxy

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/dashboards/kafka-quota-proxy.json"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def exported(text: str) -> set[str]:
    """Every sample name a scrape may have: each family's name with its type's suffixes."""
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        names.add(name)
        names.update(name + suffix for suffix in _SUFFIXES.get(kind, ()))
    return names


def expressions() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]


def test_every_metric_the_dashboard_queries_is_exported(tansu, tmp_path):
    with InProcessProxy([tansu.bootstrap], quotas=[{"user": "<default>", "producer_byte_rate": 1 << 20,
                                                    "producer_ids_rate": 100}],
                        usage_log={"directory": str(tmp_path / "usage"), "interval_seconds": 1},
                        quota_admin={"enabled": True, "principals": ["ANONYMOUS"]}) as proxy:
        scraped = exported(proxy.metrics_text())
    queried = {(title, name) for title, expr in expressions() for name in re.findall(r"\bkqp_[a-z0-9_]+", expr)}
    assert len({name for _, name in queried}) >= 20
    missing = sorted((title, name) for title, name in queried if name not in scraped)
    assert not missing, f"the dashboard queries metrics the proxy does not export: {missing}"


def test_the_panels_cover_what_an_operator_watches_and_compose_provisions_them():
    titles = " | ".join(title for title, _ in expressions()).lower()
    for topic in ("throughput per principal", "throttle time", "refused", "top talkers", "muted",
                  "latency", "leader hints", "usage log"):
        assert topic in titles, topic
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    grafana = compose["services"]["grafana"]
    assert grafana["image"].startswith("grafana/grafana")
    mounts = {v.split(":")[0]: v.split(":")[1] for v in grafana["volumes"]}
    assert mounts["./deploy/grafana/dashboards"] == "/var/lib/grafana/dashboards"
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/kafka-quota-proxy.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    source = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert source["datasources"][0]["uid"] == json.loads(DASHBOARD.read_text())["panels"][0]["datasource"]["uid"]
