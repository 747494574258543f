"""The sample-data generator's tenants, and the report seeing at a glance who the noisy
neighbour, the topic storm and the restart loop are."""

from __future__ import annotations

import csv

import pyarrow.parquet as pq
import pytest

from pipeline.generate import NOISY, RESTARTS, STORM, STORM_PARTITIONS, STORM_TOPICS, generate
from pipeline.report import Options, run_report
from proxy.cli import main as cli_main
from proxy.usage_log import arrow_schema


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
