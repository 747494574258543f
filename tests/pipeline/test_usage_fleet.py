"""Proxies that enforced their quotas as one fleet (the usage log's ``fleet`` column, schema
version 3) through the report: a version 2 file reads with ``fleet`` "", the HTML summary, the
printed summary and the recommended file say which proxies ran a fleet and that its numbers are
the fleet's, a principal's requests through several members are counted once, and a fleet's
members' demand is summed per interval: the recommendation is the fleet-wide bound."""

from __future__ import annotations

import argparse
import csv
import html
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipeline.report
from pipeline.fleet import FLEET_WIDE, NAMED, members, notes
from pipeline.report import Options, run_report
from pipeline.spark import read_usage
from usage.schema import arrow_schema

from .usage_rows import write_rows

S = 1_800_000_000
PRODUCE = 0
TOPIC = "__kqp_quota_usage"


def _write_version_2(path, rows: list[dict]) -> None:
    """A file as a version 2 proxy wrote it: the schema without ``fleet``."""
    schema = pa.schema([f for f in arrow_schema() if f.name != "fleet"], metadata={b"kqp.usage.schema_version": b"2"})
    columns = {f.name: [r.get(f.name, 0) for r in rows] for f in schema}
    columns["schema_version"] = [2] * len(rows)
    columns["upstream_latency_ms_sum"] = [float(v) for v in columns["upstream_latency_ms_sum"]]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns, schema=schema), path)


def test_a_version_2_file_reads_with_fleet_empty_beside_a_fleet_members_file(spark, tmp_path):
    usage = tmp_path / "usage"
    write_rows(usage, [dict(start_s=S, user="alice", client_id="app", api_key=PRODUCE, requests=3)],
               proxy="edge-1", fleet=TOPIC)
    _write_version_2(usage / "old" / "usage-v2.parquet", [
        dict(interval_start=datetime.fromtimestamp(S, UTC), interval_seconds=10, proxy="old",
             user="bob", client_id="legacy", api_key=PRODUCE, requests=5, shadow_throttled=1)])
    assert "fleet" not in pq.read_schema(usage / "old" / "usage-v2.parquet").names

    df = read_usage(spark, str(usage))
    assert df.schema["fleet"].dataType.simpleString() == "string"
    rows = {r.proxy: r for r in df.collect()}
    assert (rows["old"].schema_version, rows["old"].fleet, rows["old"].shadow_throttled) == (2, "", 1)
    assert (rows["edge-1"].schema_version, rows["edge-1"].fleet) == (3, TOPIC)


def _traffic(requests: int, throttled: int = 0) -> list[dict]:
    """alice / app at one member: ``requests`` Produce requests of 100 bytes in each of 3 intervals."""
    return [dict(start_s=S + 10 * i, user="alice", client_id="app", api_key=PRODUCE, requests=requests,
                 request_bytes=100 * requests, records=requests, batches=requests, throttled=throttled,
                 throttle_time_ms_sum=50 * throttled, throttle_time_ms_max=50 if throttled else 0)
            for i in range(3)]


@pytest.fixture(scope="module")
def fleet_report(spark, tmp_path_factory):
    """alice / app through two fleet members (edge-1, edge-2) and a proxy alone (solo)."""
    root = tmp_path_factory.mktemp("fleet")
    write_rows(root / "usage", _traffic(10, throttled=2), proxy="edge-1", fleet=TOPIC)
    write_rows(root / "usage", _traffic(20, throttled=1), proxy="edge-2", fleet=TOPIC)
    write_rows(root / "usage", _traffic(5), proxy="solo")
    return run_report(Options(usage=str(root / "usage"), out=root / "report", replay=False, quiet=True), spark)


def _summary(page: str) -> list[str]:
    return page[page.index("<ul>") + 4:page.index("</ul>")].removeprefix("<li>").removesuffix("</li>").split(
        "</li><li>")


def test_the_report_says_which_proxies_ran_a_fleet_and_that_values_are_per_instance(fleet_report):
    assert fleet_report.fleet == [
        f"Fleet (usage topic {TOPIC}): 2 proxies (edge-1, edge-2) enforced each quota across the fleet; "
        f'in the report as "fleet {TOPIC}"',
        "Enforced alone (no fleet): 1 proxy (solo)",
        FLEET_WIDE,
    ]
    summary = _summary(fleet_report.files["html"].read_text())
    assert summary[1:4] == [html.escape(line) for line in fleet_report.fleet]
    # The recommended file, which is what gets applied, says it too, as comments.
    text = fleet_report.files["recommended_quotas"].read_text()
    header = [line.removeprefix("# ") for line in text.splitlines() if line.startswith("# ")]
    assert all(line in header for line in fleet_report.fleet), header


def test_requests_through_several_members_are_counted_once(fleet_report):
    with open(fleet_report.files["throttling"], newline="") as f:
        (alice,) = list(csv.DictReader(f))
    # 3 intervals at each proxy: 10 + 20 + 5 requests, 2 + 1 throttled at the members.
    assert [int(alice[c]) for c in ("requests", "throttled", "throttle_time_ms")] == [105, 9, 450]
    with open(fleet_report.files["demand"], newline="") as f:
        request_rate = next(r for r in csv.DictReader(f) if r["kind"] == "request_rate")
    # Demand is taken per fleet (or proxy alone) and interval: the members' 3 intervals summed into
    # the fleet's 3, and solo's 3; every request counted once.
    assert (int(request_rate["samples"]), float(request_rate["total"])) == (6, 105.0)


def test_without_a_fleet_the_report_says_quotas_were_per_proxy(spark, tmp_path):
    write_rows(tmp_path / "usage", _traffic(10), proxy="solo")
    result = run_report(Options(usage=str(tmp_path / "usage"), out=tmp_path / "report", replay=False, quiet=True),
                        spark)
    (line,) = result.fleet
    assert line.startswith("Quotas enforced per proxy: no proxy ran a fleet")
    assert line in result.files["html"].read_text()
    text = result.files["recommended_quotas"].read_text()
    assert "Fleet" not in text and FLEET_WIDE not in text and line not in text


def test_the_printed_summary_names_the_fleet(spark, tmp_path, monkeypatch, capsys):
    write_rows(tmp_path / "usage", _traffic(10), proxy="edge-1", fleet="edge-usage")
    monkeypatch.setattr(pipeline.report, "run_report", lambda opts: run_report(opts, spark))
    args = argparse.Namespace(usage=str(tmp_path / "usage"), out=tmp_path / "report", replay=False, quiet=True)
    assert pipeline.report.main(args) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[1:3] == ["Fleet (usage topic edge-usage): 1 proxy (edge-1) enforced each quota across the fleet; "
                            'in the report as "fleet edge-usage"', FLEET_WIDE]


def test_fleet_groups_and_notes():
    groups = members([("t", "b"), ("", "c"), ("t", "a"), ("", "b"), ("u", "z")])
    assert groups == {"": ["b", "c"], "t": ["a", "b"], "u": ["z"]}  # b ran both ways: under both
    assert notes(groups) == [
        'Fleet (usage topic t): 2 proxies (a, b) enforced each quota across the fleet; in the report as "fleet t"',
        'Fleet (usage topic u): 1 proxy (z) enforced each quota across the fleet; in the report as "fleet u"',
        "Enforced alone (no fleet): 2 proxies (b, c)",
        FLEET_WIDE,
    ]
    many = [f"p{i:02d}" for i in range(NAMED + 3)]
    assert notes(members([(TOPIC, p) for p in many]))[0] == (
        f"Fleet (usage topic {TOPIC}): {NAMED + 3} proxies ({', '.join(many[:NAMED])} and 3 more) "
        f'enforced each quota across the fleet; in the report as "fleet {TOPIC}"')
    assert notes({"": ["a", "b"]}) == [notes({"": ["a"]})[0]]  # alone: one line, whoever the proxies


def _steady(proxy: str, fleet: str = "") -> list[dict]:
    """alice / app through one proxy: 1 MB produced in each of 60 10-s intervals (100 KB/s)."""
    return [dict(start_s=S + 10 * i, user="alice", client_id="app", api_key=PRODUCE, requests=10,
                 request_bytes=1_000_000, records=10, batches=10) for i in range(60)]


def _recommended_byte_rate(result) -> float:
    with open(result.files["recommended"], newline="") as f:
        row = next(r for r in csv.DictReader(f) if r["kind"] == "producer_byte_rate" and r["user"] == "alice")
    return float(row["recommended"])


@pytest.mark.parametrize("fleet", [TOPIC, ""])
def test_three_fleet_members_get_a_fleet_wide_bound_and_three_proxies_alone_one_each(spark, tmp_path, fleet):
    for proxy in ("edge-1", "edge-2", "edge-3"):
        write_rows(tmp_path / "usage", _steady(proxy), proxy=proxy, fleet=fleet)
    result = run_report(Options(usage=str(tmp_path / "usage"), out=tmp_path / "report", quiet=True), spark)
    # Admitting the demand one proxy saw, 100 KB/s, plus an allowance of a tenth of a request a
    # second (10 KB/s), with the default 20 % headroom: 120 to 132 KB/s; the fleet's, three times it.
    if fleet:
        assert 3 * 120_000 <= _recommended_byte_rate(result) <= 3 * 100_000 * 1.2 + 10_000 * 1.2  # the fleet's sum
        with open(result.files["replay"], newline="") as f:
            assert {r["proxy"] for r in csv.DictReader(f)} == {f"fleet {TOPIC}"}  # one set of engines
        assert FLEET_WIDE in result.fleet
    else:
        assert 120_000 <= _recommended_byte_rate(result) <= 132_000
        with open(result.files["replay"], newline="") as f:
            assert {r["proxy"] for r in csv.DictReader(f)} == {"edge-1", "edge-2", "edge-3"}
        assert result.fleet[0].startswith("Quotas enforced per proxy")
