"""The sample-data generator's tenants, and the report seeing at a glance who the noisy
neighbour, the topic storm and the restart loop are."""

from __future__ import annotations

import csv

import pyarrow.parquet as pq
import pytest

from config.loader import load_config
from pipeline.generate import NOISY, RESTARTS, STORM, STORM_PARTITIONS, STORM_TOPICS, generate
from pipeline.outliers import Rule, bound_from_rest
from pipeline.report import Options, run_report
from proxy.app.cli import main as cli_main
from proxy.observability.usage_log import arrow_schema
from quotas.common import CONTROLLER_MUTATION_RATE, PRODUCER_IDS_RATE


@pytest.fixture(scope="module")
def sample(spark, tmp_path_factory):
    root = tmp_path_factory.mktemp("sample")
    rows = generate(root / "usage", principals=12, hours=1.5, interval_s=10, seed=7)
    result = run_report(Options(usage=str(root / "usage"), out=root / "report", quiet=True), spark)
    return rows, root, result


def test_generated_files_are_usage_log_files(sample):
    rows, root, _ = sample
    files = sorted((root / "usage").rglob("*.parquet"))
    assert [f.parent.name for f in files] == ["hour=00", "hour=01"]
    tables = [pq.read_table(f) for f in files]
    assert all(t.schema.equals(arrow_schema(), check_metadata=True) for t in tables)
    assert sum(t.num_rows for t in tables) == rows
    storm = sum(sum(pq.read_table(f, filters=[("user", "=", STORM[0])]).column("partition_mutations").to_pylist())
                for f in files)
    assert storm == STORM_TOPICS * STORM_PARTITIONS  # KIP-599's 5,000 topics of 10 partitions


def test_report_headlines_name_each_troublemaker(sample):
    _, _, result = sample
    page = result.files["html"].read_text()
    assert f"producer_byte_rate: {NOISY[0]} / {NOISY[1]} is" in page
    assert f"controller_mutation_rate: {STORM[0]} / {STORM[1]} is 100% of all demand" in page
    assert f"producer_ids_rate: {RESTARTS[0]} is 100% of all demand" in page
    with open(result.files["top_talkers"], newline="") as f:
        assert next(csv.DictReader(f))["user"] == NOISY[0]


def test_generate_usage_command(tmp_path, capsys):
    assert cli_main(["generate-usage", "--out", str(tmp_path), "--principals", "4", "--hours", "0.5"]) == 0
    assert "usage rows to" in capsys.readouterr().out
    assert list(tmp_path.rglob("*.parquet"))


# -- outliers: the restart loop and the storm get their quota from the rest of the fleet ----------

OUTLIERS = {(RESTARTS[0], "", PRODUCER_IDS_RATE), (*STORM, CONTROLLER_MUTATION_RATE)}


def _rows(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_the_restart_loop_and_the_storm_are_outliers_with_margin(sample):
    _, _, result = sample
    recommended = _rows(result.files["recommended"])
    assert {(r["user"], r["client_id"], r["kind"]) for r in recommended if r["outlier"] == "True"} == OUTLIERS
    demand = _rows(result.files["demand"])
    assert {(r["user"], r["client_id"], r["kind"]) for r in demand if r["outlier"] == "True"} == OUTLIERS
    for r in demand:
        ratio = float(r["p99"]) / float(r["outlier_threshold"])
        if (r["user"], r["client_id"], r["kind"]) in OUTLIERS:
            assert ratio > 5, r  # 1,800 ids/h against 100; 84 partitions/s against 10
        elif r["user"].startswith("tenant-"):
            assert ratio < 0.1, r


def test_an_outliers_quota_comes_from_the_other_principals(sample):
    _, _, result = sample
    recommended = _rows(result.files["recommended"])
    assert {((*f.verdict.key, f.verdict.kind)) for f in result.outliers} == OUTLIERS
    for flag in result.outliers:
        kind = flag.verdict.kind
        (mine,) = [r for r in recommended if (r["user"], r["client_id"]) == flag.verdict.key and r["kind"] == kind]
        others = [float(r["own_recommended"]) for r in recommended
                  if r["kind"] == kind and (r["user"], r["client_id"]) != flag.verdict.key]
        # The rest of the kind's population had no demand of it: they count with 0.
        others += [0.0] * (flag.verdict.others - len(others))
        own = float(mine["own_recommended"])
        assert float(mine["recommended"]) == bound_from_rest(own, others, kind, Rule())[0]
        assert float(mine["recommended"]) * 5 < own
        assert mine["reason"] == flag.reason and f"the other {flag.verdict.others} principals" in flag.reason
    steady = [r for r in recommended if r["user"].startswith("tenant-")]
    assert steady and all(r["recommended"] == r["own_recommended"] and r["reason"] == "" for r in steady)


def test_the_recommended_yaml_says_why_and_passes_check_config(sample, capsys):
    _, _, result = sample
    path = result.files["recommended_quotas"]
    assert cli_main(["check-config", str(path)]) == 0
    quotas = {(q.user, q.client_id): dict(q.values) for q in load_config(path).quotas}
    assert quotas[(RESTARTS[0], None)] == {PRODUCER_IDS_RATE: 100}
    assert quotas[STORM][CONTROLLER_MUTATION_RATE] == 10
    lines = path.read_text().splitlines()
    at = lines.index("  producer_ids_rate: 100")
    assert lines[at - 2] == f"- user: {RESTARTS[0]}"
    assert lines[at - 1].startswith("  # outlier: p99 1,800 new producer ids per 3600-s window, where the p90 of "
                                    "the other 7 principals is 0; threshold 100 (the floor); bound 100 from the floor")
    at = lines.index("  controller_mutation_rate: 10")
    assert lines[at - 1].startswith("  # outlier: p99 84 partitions/s")
    assert "# 2 outliers bounded from the rest of the fleet" in lines


def test_the_replay_holds_the_outliers_and_not_the_others(sample):
    _, _, result = sample
    replayed = _rows(result.files["replay"])

    def share(rows, part, whole):
        return sum(float(r[part]) for r in rows) / sum(float(r[whole]) for r in rows)

    loop = [r for r in replayed if r["user"] == RESTARTS[0] and r["kind"] == PRODUCER_IDS_RATE]
    assert loop and all(r["outlier"] == "True" for r in loop)
    assert share(loop, "rejected_requests", "requests") > 0.8  # 100 new ids an hour of 1,800
    storm = [r for r in replayed if (r["user"], r["client_id"]) == STORM and r["kind"] == CONTROLLER_MUTATION_RATE]
    assert share(storm, "rejected_amount", "demand") > 0.8  # 10 partitions/s of 84
    rest = [r for r in replayed if r["kind"] == "(any)" and r["outlier"] == "False"]
    assert len(rest) == 13  # 12 steady tenants and the bulk loader
    assert sum(int(r["rejected_requests"]) for r in rest) == 0
    assert share(rest, "throttled_requests", "requests") < 0.05
    page = result.files["html"].read_text()
    assert "What the replay did to the outliers and to everyone else" in page
    assert "the other 13 principals" in page
    assert f"outlier: {RESTARTS[0]}, producer_ids_rate p99 1,800.0 over the threshold 100.0: quota 100" in page
