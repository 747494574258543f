"""The Grafana dashboard (deploy/grafana/dashboards/kafka-quota-proxy.json) cannot rot: every
metric its PromQL names is a family a running proxy really exports (scraped here, with a quota
enforced and one in shadow mode, the usage log and the quota store on so that their families
exist), its shadow-vs-enforced panels are there, and the compose stack provisions it. Nothing is
rendered: no Grafana runs here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.inproc import InProcessProxy

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/dashboards/kafka-quota-proxy.json"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
SHADOW_ROW = "Shadow vs enforced"
# Each enforced counter and its shadow twin (the same labels: what would have happened).
SHADOW_PAIRS = {"kqp_quota_throttled_total": "kqp_quota_shadow_throttled_total",
                "kqp_quota_rejected_total": "kqp_quota_shadow_rejected_total",
                "kqp_producer_ids_rejected_total": "kqp_producer_ids_shadow_rejected_total"}


def exported(text: str) -> set[str]:
    """Every sample name a scrape may have: each family's name with its type's suffixes."""
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        names.add(name)
        names.update(name + suffix for suffix in _SUFFIXES.get(kind, ()))
    return names


def panels() -> list[dict]:
    """Every panel, a collapsed row's own panels included."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def expressions() -> list[tuple[str, str]]:
    return [(panel["title"], target["expr"]) for panel in panels() for target in panel.get("targets", [])]


def metrics_of(panel: dict) -> set[str]:
    return {name for target in panel.get("targets", []) for name in re.findall(r"\bkqp_[a-z0-9_]+", target["expr"])}


def test_every_metric_the_dashboard_queries_is_exported(tansu, tmp_path):
    with InProcessProxy([tansu.bootstrap], quotas=[{"user": "<default>", "producer_byte_rate": 1 << 20,
                                                    "producer_ids_rate": 100},
                                                   {"user": "canary", "request_rate": 100,
                                                    "producer_ids_rate": 10, "mode": "shadow"}],
                        usage_log={"directory": str(tmp_path / "usage"), "interval_seconds": 1},
                        quota_admin={"enabled": True, "principals": ["ANONYMOUS"]},
                        fleet={"enabled": True}) as proxy:
        text = proxy.metrics_text()
    scraped = exported(text)
    queried = {(title, name) for title, expr in expressions() for name in re.findall(r"\bkqp_[a-z0-9_]+", expr)}
    assert len({name for _, name in queried}) >= 20
    missing = sorted((title, name) for title, name in queried if name not in scraped)
    assert not missing, f"the dashboard queries metrics the proxy does not export: {missing}"
    assert {*SHADOW_PAIRS, *SHADOW_PAIRS.values(), "kqp_mutes_total"} <= {name for _, name in queried}
    # A shadow counter has a sample for every label set its enforced twin has, before anything
    # is throttled: "{{kind}} enforced" and "{{kind}} shadow" pair up from the first scrape.
    samples: dict[str, set] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, set()).add(tuple(sorted(sample.labels.items())))
    for enforced, shadow in SHADOW_PAIRS.items():
        assert samples[enforced] and samples[shadow] == samples[enforced], (enforced, shadow)
    assert samples["kqp_mutes_total"] == {()}


def test_the_panels_cover_what_an_operator_watches_and_compose_provisions_them():
    titles = " | ".join(title for title, _ in expressions()).lower()
    for topic in ("throughput per principal", "throttle time", "refused", "top talkers", "muted", "mutes",
                  "latency", "leader hints", "usage log", "enforced vs shadow"):
        assert topic in titles, topic
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    grafana = compose["services"]["grafana"]
    assert grafana["image"].startswith("grafana/grafana")
    mounts = {v.split(":")[0]: v.split(":")[1] for v in grafana["volumes"]}
    assert mounts["./deploy/grafana/dashboards"] == "/var/lib/grafana/dashboards"
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/kafka-quota-proxy.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    source = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    uids = {target["datasource"]["uid"] for panel in panels() for target in panel.get("targets", [])}
    assert uids == {source["datasources"][0]["uid"]}


def test_the_shadow_row_sets_enforced_against_shadow():
    """Under the row "Shadow vs enforced", one panel has each kind's throttles enforced and in
    shadow, another its refusals (topics and producer ids), each series named for its mode."""
    top = json.loads(DASHBOARD.read_text())["panels"]
    row = next((p for p in top if p["type"] == "row" and p["title"] == SHADOW_ROW), None)
    assert row is not None, f"no row {SHADOW_ROW!r}"
    y = row["gridPos"]["y"]
    next_row = min((p["gridPos"]["y"] for p in top if p["type"] == "row" and p["gridPos"]["y"] > y), default=None)
    under = row.get("panels") or [p for p in top if p["type"] != "row" and p["gridPos"]["y"] > y
                                  and (next_row is None or p["gridPos"]["y"] < next_row)]
    wanted = [{"kqp_quota_throttled_total", "kqp_quota_shadow_throttled_total"},
              {"kqp_quota_rejected_total", "kqp_quota_shadow_rejected_total",
               "kqp_producer_ids_rejected_total", "kqp_producer_ids_shadow_rejected_total"}]
    for names in wanted:
        panel = next((p for p in under if names <= metrics_of(p)), None)
        assert panel is not None, f"no panel under {SHADOW_ROW!r} queries {sorted(names)}"
        assert panel["description"]
        for target in panel["targets"]:
            shadow = "_shadow_" in target["expr"]
            assert target["legendFormat"].endswith(" shadow" if shadow else (" enforced", " enforced (held)")), target
            assert "[$__rate_interval]" in target["expr"], target
    mutes = next((p for p in panels() if "kqp_mutes_total" in metrics_of(p)), None)
    assert mutes is not None and mutes["description"]


def test_panel_ids_are_unique_and_the_grid_has_no_overlap():
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids)), ids
    cells: dict[tuple[int, int], str] = {}
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[x, y] = p["title"]
