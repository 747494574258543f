"""What quotas in shadow mode would have done, through the whole report, on hand-made logs:
throttling.csv's shadow_* columns, the shadow section of report.html (most affected first) and its
headline; a log without shadow activity says so; a version 1 file read beside version 2 ones."""

from __future__ import annotations

import csv
import re
from datetime import UTC, datetime

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.report import NO_SHADOW, Options, run_report, shadow_headline
from pipeline.spark import read_usage
from usage.schema import ADDED_IN, arrow_schema

from .usage_rows import write_rows

S = 1_800_000_000
PRODUCE, CREATE_TOPICS = 0, 19
SECTION = "Shadow mode: what the quotas in shadow mode would have done"


def _rows(shadow: bool = True) -> list[dict]:
    """alice / app: 30 requests in 3 intervals, 10 would have been throttled for 6 s in all.
    ops / tf: 4 requests in one interval, 1 would have been throttled (5 s) and rejected.
    bob / quiet: 20 requests, 1 really throttled (100 ms), nothing in shadow mode."""
    on = 1 if shadow else 0
    rows = [dict(start_s=S + 10 * i, user="alice", client_id="app", api_key=PRODUCE, requests=10,
                 request_bytes=1000, records=10, batches=10, shadow_throttled=n * on,
                 shadow_throttle_time_ms_sum=1000 * (i + 1) * on, shadow_throttle_time_ms_max=600 * on)
            for i, n in enumerate([2, 3, 5])]
    rows.append(dict(start_s=S, user="ops", client_id="tf", api_key=CREATE_TOPICS, requests=4,
                     partition_mutations=20, shadow_throttled=on, shadow_rejected=on,
                     shadow_throttle_time_ms_sum=5000 * on, shadow_throttle_time_ms_max=5000 * on))
    rows += [dict(start_s=S + 10 * i, user="bob", client_id="quiet", api_key=PRODUCE, requests=10,
                  request_bytes=500, records=5, batches=5, throttled=1 - i, throttle_time_ms_sum=100 * (1 - i),
                  throttle_time_ms_max=100 * (1 - i)) for i in range(2)]
    return rows


def _throttling(result) -> dict:
    with open(result.files["throttling"], newline="") as f:
        return {(r["user"], r["client_id"]): r for r in csv.DictReader(f)}


def _section(page: str) -> str:
    start = page.index(f"<h2>{SECTION}</h2>")
    return page[start:page.index("<h2>", start + 4)]


@pytest.fixture(scope="module")
def shadow_report(spark, tmp_path_factory):
    root = tmp_path_factory.mktemp("shadow")
    write_rows(root / "usage", _rows())
    return run_report(Options(usage=str(root / "usage"), out=root / "report", replay=False, quiet=True), spark)


def test_throttling_csv_has_the_shadow_counterparts(shadow_report):
    t = _throttling(shadow_report)
    alice, ops, bob = t[("alice", "app")], t[("ops", "tf")], t[("bob", "quiet")]
    shadow = ("shadow_throttled", "shadow_rejected", "shadow_throttle_time_ms")
    assert [int(alice[c]) for c in ("requests", *shadow)] == [30, 10, 0, 6000]
    assert float(alice["shadow_throttled_ratio"]) == pytest.approx(1 / 3)
    assert float(alice["shadow_rejected_ratio"]) == 0
    assert float(alice["shadow_throttle_time_ratio"]) == pytest.approx(6000 / 30_000)  # 0.2 s per active s
    assert [int(ops[c]) for c in ("requests", *shadow)] == [4, 1, 1, 5000]
    assert float(ops["shadow_throttled_ratio"]) == float(ops["shadow_rejected_ratio"]) == 0.25
    assert float(ops["shadow_throttle_time_ratio"]) == pytest.approx(0.5)
    # Applied and shadow apart: bob was really throttled, nothing in shadow mode; the others the reverse.
    assert [int(bob[c]) for c in ("requests", "throttled", "throttle_time_ms", *shadow)] == [20, 1, 100, 0, 0, 0]
    assert float(bob["throttled_ratio"]) == pytest.approx(0.05)
    assert [float(bob[f"shadow_{c}_ratio"]) for c in ("throttled", "rejected", "throttle_time")] == [0, 0, 0]
    assert [int(alice[c]) for c in ("throttled", "rejected", "throttle_time_ms")] == [0, 0, 0]
    assert int(ops["rejected"]) == 0


def test_report_html_lists_the_principals_shadow_mode_held_back_most_affected_first(shadow_report):
    section = _section(shadow_report.files["html"].read_text())
    assert NO_SHADOW not in section and "bob" not in section
    # alice: a third of its requests; ops: a quarter (though it would have waited longer per second).
    assert section.index("alice") < section.index("ops")
    cells = [re.findall(r"<td>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", section, re.S)]
    assert [c for c in cells if c] == [
        ["alice", "app", "30", "10", "33%", "0", "0%", "6000", "0.200"],
        ["ops", "tf", "4", "1", "25%", "1", "25%", "5000", "0.500"],
    ]
    for heading in ("would have been throttled", "% throttled", "would have been rejected",
                    "throttle s per second of activity"):
        assert f"<th>{heading}</th>" in section


def test_headline_names_the_most_affected(shadow_report):
    line = ("In shadow mode, alice / app would have been throttled on 33% of its requests (10 of 30), waiting "
            "0.2 s per second of activity; 2 principals in all would have been held back")
    assert line in shadow_report.headlines
    assert line in shadow_report.files["html"].read_text()
    assert [h for h in shadow_report.headlines if h.startswith("most throttled: ")] == [
        "most throttled: bob / quiet, 1 of 20 requests throttled, 0 rejected, 0.1 s of throttle"]


def test_without_shadow_activity_the_report_says_so(spark, tmp_path):
    write_rows(tmp_path / "usage", _rows(shadow=False))
    result = run_report(Options(usage=str(tmp_path / "usage"), out=tmp_path / "report", replay=False, quiet=True),
                        spark)
    page = result.files["html"].read_text()
    assert f"<p>{NO_SHADOW}</p>" in _section(page)
    assert "In shadow mode" not in page and not [h for h in result.headlines if "shadow" in h]
    t = _throttling(result)
    assert {t[k][c] for k in t for c in ("shadow_throttled", "shadow_rejected", "shadow_throttle_time_ms")} == {"0"}


def _write_version_1(path, rows: list[dict]) -> None:
    """A file as a version 1 proxy wrote it: the schema without the shadow columns."""
    v2 = arrow_schema()
    schema = pa.schema([f for f in v2 if f.name not in ADDED_IN], metadata={b"kqp.usage.schema_version": b"1"})
    columns = {f.name: [r.get(f.name, 0) for r in rows] for f in schema}
    columns["schema_version"] = [1] * len(rows)
    columns["upstream_latency_ms_sum"] = [float(v) for v in columns["upstream_latency_ms_sum"]]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns, schema=schema), path)


def test_a_version_1_file_beside_version_2_files_reads_with_shadow_columns_0(spark, tmp_path):
    usage = tmp_path / "usage"
    write_rows(usage, _rows())
    start = datetime.fromtimestamp(S, UTC)
    _write_version_1(usage / "old" / "usage-v1.parquet", [
        dict(interval_start=start, interval_seconds=10, proxy="p0", user="carol", client_id="legacy",
             api_key=PRODUCE, requests=5, request_bytes=250, records=5, batches=5, throttled=2,
             throttle_time_ms_sum=300, throttle_time_ms_max=200, upstream_latency_ms_sum=12.5)])
    assert pq.read_schema(usage / "old" / "usage-v1.parquet").metadata[b"kqp.usage.schema_version"] == b"1"

    df = read_usage(spark, str(usage))
    old = df.where("user = 'carol'").collect()
    assert len(old) == 1 and old[0].schema_version == 1
    assert [old[0][c] for c in ADDED_IN] == [0, 0, 0, 0, ""]  # the shadow columns, then fleet (version 3)
    assert [df.schema[c].dataType.simpleString() for c in ADDED_IN] == ["bigint", "int", "bigint", "bigint", "string"]

    result = run_report(Options(usage=str(usage), out=tmp_path / "report", quiet=True), spark)
    t = _throttling(result)
    carol = t[("carol", "legacy")]
    assert [int(carol[c]) for c in ("requests", "throttled", "throttle_time_ms")] == [5, 2, 300]
    assert [carol[c] for c in ("shadow_throttled", "shadow_rejected", "shadow_throttle_time_ms")] == ["0"] * 3
    assert int(t[("alice", "app")]["shadow_throttled"]) == 10  # the version 2 rows as they were
    section = _section(result.files["html"].read_text())
    assert "alice" in section and "carol" not in section
    assert "carol" in {r["user"] for r in csv.DictReader(open(result.files["replay"], newline=""))}


def _one(**row) -> pd.DataFrame:
    base = dict(user="ops", client_id="tf", requests=4, shadow_throttled=0, shadow_throttled_ratio=0.0,
                shadow_rejected=0, shadow_rejected_ratio=0.0, shadow_throttle_time_ms=0,
                shadow_throttle_time_ratio=0.0)
    return pd.DataFrame([{**base, **row}])


@pytest.mark.parametrize("row, line", [
    (dict(shadow_throttled=1, shadow_throttled_ratio=0.25, shadow_rejected=1, shadow_rejected_ratio=0.25,
          shadow_throttle_time_ms=5000, shadow_throttle_time_ratio=0.5),
     "In shadow mode, ops / tf would have been throttled on 25% of its requests (1 of 4) and rejected on 25% (1), "
     "waiting 0.5 s per second of activity"),
    (dict(requests=4000, shadow_rejected=4, shadow_rejected_ratio=4 / 4000),
     "In shadow mode, ops / tf would have been rejected on 0.1% of its requests (4 of 4,000)"),
    (dict(requests=100_000, shadow_throttled=2, shadow_throttled_ratio=2e-5, shadow_throttle_time_ms=40,
          shadow_throttle_time_ratio=4e-5),
     "In shadow mode, ops / tf would have been throttled on <0.1% of its requests (2 of 100,000), "
     "waiting 0.04 ms per second of activity"),
])
def test_shadow_headline_says_only_what_would_have_happened(row, line):
    assert shadow_headline(_one(**row)) == line
