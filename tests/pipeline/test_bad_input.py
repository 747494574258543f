"""Bad usage-log input: each case stops the report with a message naming the problem (and the
file), and nothing is skipped silently: one bad file among good ones still stops it."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.errors import UsageError
from pipeline.report import Options, run_report
from pipeline.spark import read_usage
from proxy.app.cli import main as cli_main
from usage.schema import SCHEMA_VERSION

from .usage_rows import write_rows

S = 1_800_000_000


def _good(directory):
    return write_rows(directory, [dict(start_s=S, user="u", client_id="c", api_key=0, requests=1, request_bytes=10)])


def _read_all(spark, directory):
    df = read_usage(spark, str(directory))
    return df.count()


def test_empty_directory(spark, tmp_path):
    with pytest.raises(UsageError, match=r"no usage log files \(\*\.parquet\) under"):
        _read_all(spark, tmp_path)


def test_missing_directory_exits_2_with_a_message(tmp_path, capsys):
    code = cli_main(["report", "--usage", str(tmp_path / "nope"), "--out", str(tmp_path / "out"), "--quiet"])
    assert code == 2
    assert "does not exist or is not a directory" in capsys.readouterr().err


def test_half_written_file_is_named(spark, tmp_path):
    (good,) = _good(tmp_path / "usage")
    half = good.with_name("usage-half.parquet")
    data = good.read_bytes()
    half.write_bytes(data[: len(data) // 2])
    with pytest.raises(UsageError) as info:
        _read_all(spark, tmp_path / "usage")
    message = str(info.value)
    assert "usage-half.parquet" in message and "not a complete Parquet file" in message


def test_hidden_temporary_files_are_not_read(spark, tmp_path):
    """The proxy writes under a hidden name and renames: a reader never sees the temp file."""
    (good,) = _good(tmp_path / "usage")
    (good.parent / f".{good.name}.tmp").write_bytes(good.read_bytes()[:100])
    assert _read_all(spark, tmp_path / "usage") == 1


def test_unknown_schema_version_is_named(spark, tmp_path):
    (good,) = _good(tmp_path / "usage")
    table = pq.read_table(good)
    future = table.set_column(0, table.schema.field(0), pa.array([SCHEMA_VERSION + 1], type=pa.int16()))
    pq.write_table(future, good.with_name("usage-future.parquet"))
    with pytest.raises(UsageError) as info:
        _read_all(spark, tmp_path / "usage")
    message = str(info.value)
    assert "unknown schema version" in message
    assert f"usage-future.parquet (schema_version {SCHEMA_VERSION + 1})" in message


def test_foreign_parquet_file_is_named(spark, tmp_path):
    _good(tmp_path / "usage")
    pq.write_table(pa.table({"foo": [1, 2]}), tmp_path / "usage" / "other.parquet")
    with pytest.raises(UsageError) as info:
        _read_all(spark, tmp_path / "usage")
    assert "other.parquet (schema_version missing)" in str(info.value)


def test_time_range_with_no_rows(spark, tmp_path):
    _good(tmp_path / "usage")
    opts = Options(usage=str(tmp_path / "usage"), out=tmp_path / "out", since="2030-01-01", quiet=True)
    with pytest.raises(UsageError, match=r"no usage rows .* between --since and --until"):
        run_report(opts, spark)


def test_bad_options(tmp_path):
    with pytest.raises(UsageError, match="--share"):
        run_report(Options(usage=str(tmp_path), out=tmp_path / "o", share=1.5))
    with pytest.raises(UsageError, match="not an ISO 8601 time"):
        run_report(Options(usage=str(tmp_path), out=tmp_path / "o", since="yesterday"))
    bad = tmp_path / "candidate.yaml"
    bad.write_text("upstream: {bootstrap_servers: ['h:1']}\nquotas: [{user: a, producer_byte_rate: -1}]\n")
    with pytest.raises(UsageError, match=r"--candidate .*quotas\[0\]\.producer_byte_rate"):
        run_report(Options(usage=str(tmp_path), out=tmp_path / "o", candidate=bad))
