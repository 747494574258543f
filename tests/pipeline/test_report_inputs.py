"""``report`` checks its options and inputs before it starts Spark: a refusal exits 2 with the
option named, starts no Spark, and leaves no ``--out`` directory behind; a refusal found while
Spark reads the log removes the ``--out`` it made. Spark's own output (the JVM's banner and log4j
lines) goes to OUT/spark.log, not between the report's lines, unless ``--verbose``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pipeline.spark
from pipeline import report
from pipeline.errors import UsageError
from pipeline.report import Options, run_report
from proxy.app.cli import main as cli_main

from .usage_rows import write_rows

S = 1_800_000_000


@pytest.fixture
def no_spark(monkeypatch):
    """Any attempt to start Spark fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("Spark was started")

    monkeypatch.setattr(pipeline.spark, "spark_session", refuse)


@pytest.fixture
def usage(tmp_path):
    directory = tmp_path / "usage"
    write_rows(directory, [dict(start_s=S, user="u", client_id="c", api_key=0, requests=1, request_bytes=10)])
    return directory


def _report(tmp_path, *args: str, usage=None, out=None) -> int:
    argv = ["report", "--usage", str(usage or tmp_path / "usage"), "--out", str(out or tmp_path / "out"), *args]
    return cli_main(argv)


@pytest.mark.parametrize("make, message", [
    (lambda d: None, "does not exist or is not a directory"),
    (lambda d: d.mkdir(), r"no usage log files \(\*\.parquet\) under"),
    (lambda d: (d.mkdir(), (d / "notes.txt").write_text("x")), r"no usage log files \(\*\.parquet\) under"),
    (lambda d: d.write_text("not a directory"), "does not exist or is not a directory"),
])
def test_a_usage_log_that_is_not_there_is_refused_before_spark_and_no_out_is_left(
        no_spark, tmp_path, capsys, make, message):
    make(tmp_path / "usage")
    out = tmp_path / "reports" / "today"
    assert _report(tmp_path, out=out) == 2
    err = capsys.readouterr().err
    assert err.startswith("report: ") and len(err.splitlines()) == 1, err
    assert re.search(message, err), err
    assert not (tmp_path / "reports").exists()


@pytest.mark.parametrize("args, message", [
    (["--share", "0"], "--share must be in (0, 1]"),
    (["--share", "nan"], "--share must be in (0, 1]"),
    (["--headroom", "-0.1"], "--headroom must be a number >= 0"),
    (["--headroom", "inf"], "--headroom must be a number >= 0"),
    (["--top", "0"], "--top must be at least 1"),
    (["--max-events", "0"], "--max-events must be at least 1"),
    (["--shuffle-partitions", "0"], "--shuffle-partitions must be at least 1"),
    (["--driver-memory", "lots"], "--driver-memory must be a size such as 4g"),
    (["--master", "locale[2]"], "--master must be a Spark master URL"),
    (["--since", "yesterday"], "not an ISO 8601 time"),
    (["--since", "2026-11-02", "--until", "2026-11-01"], "--since 2026-11-02 must be before --until 2026-11-01"),
    (["--outlier-factor", "0.5"], "--outlier-factor must be above 1"),
    (["--config", "missing.yaml"], "--config missing.yaml: cannot read"),
])
def test_bad_options_are_refused_before_spark_and_no_out_is_left(no_spark, usage, tmp_path, capsys, args, message):
    assert _report(tmp_path, *args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_candidate_with_several_errors_names_them_all(no_spark, usage, tmp_path, capsys):
    candidate = tmp_path / "candidate.yaml"
    candidate.write_text("upstream: {bootstrap_servers: ['h:1']}\n"
                         "quotas: [{user: a, producer_byte_rte: 1e6}, {user: b, request_rate: -1}]\n")
    assert _report(tmp_path, "--candidate", str(candidate)) == 2
    err = capsys.readouterr().err
    assert "quotas[0].producer_byte_rte: unknown key; did you mean producer_byte_rate?" in err
    assert "quotas[1].request_rate: must be a positive number, got -1" in err
    assert not (tmp_path / "out").exists()


def test_an_out_that_cannot_be_created_is_refused_before_spark(no_spark, usage, tmp_path, capsys):
    (tmp_path / "a-file").write_text("x")
    assert _report(tmp_path, out=tmp_path / "a-file") == 2
    err = capsys.readouterr().err
    assert "--out" in err and "exists and is not a directory" in err
    assert (tmp_path / "a-file").read_text() == "x"
    assert _report(tmp_path, out=tmp_path / "a-file" / "report") == 2
    assert "cannot be created" in capsys.readouterr().err


def test_an_out_in_a_directory_not_writable_is_refused(no_spark, usage, tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    if os.geteuid() == 0:  # root writes anywhere (CI runs as root): os.access answers as for anyone else
        import pipeline.report

        real_access = os.access
        monkeypatch.setattr(pipeline.report.os, "access", lambda path, mode: (
            not mode & os.W_OK if os.path.abspath(path) == str(locked) else real_access(path, mode)))
    try:
        assert _report(tmp_path, out=locked / "report") == 2
        assert "no permission to write in" in capsys.readouterr().err
    finally:
        locked.chmod(0o755)


def test_an_existing_out_is_kept_when_the_inputs_are_refused(no_spark, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.html").write_text("an earlier report")
    assert _report(tmp_path, out=out) == 2  # no usage directory
    assert (out / "report.html").read_text() == "an earlier report"
    assert sorted(p.name for p in out.iterdir()) == ["report.html"]


def test_a_refusal_found_while_spark_reads_removes_the_out_it_made(spark, usage, tmp_path):
    out = tmp_path / "reports" / "out"
    opts = Options(usage=str(usage), out=out, since="2030-01-01", quiet=True)
    with pytest.raises(UsageError, match=r"no usage rows .* between --since and --until"):
        run_report(opts, spark)
    assert not (tmp_path / "reports").exists()


def test_the_jvms_output_goes_to_the_log_and_the_progress_lines_to_the_console(tmp_path, capfd):
    log = tmp_path / "spark.log"
    with report._jvm_output(log) as console:
        os.write(2, b"WARN NativeCodeLoader: Unable to load native-hadoop library\n")
        progress = report.Progress(1, quiet=False, stream=console)
        with progress.step("spark", "starting Spark"):
            pass
    os.write(2, b"after\n")
    err = capfd.readouterr().err
    assert "[1/1] starting Spark" in err and "done in" in err and "after" in err
    assert "NativeCodeLoader" not in err
    assert "NativeCodeLoader" in log.read_text()


def test_an_unexpected_failure_points_at_the_log(tmp_path, capfd):
    log = tmp_path / "spark.log"
    with pytest.raises(RuntimeError), report._jvm_output(log):
        os.write(2, b"java.lang.OutOfMemoryError\n")
        raise RuntimeError("boom")
    err = capfd.readouterr().err
    assert f"Spark's own output is in {log}" in err and "OutOfMemoryError" not in err


@pytest.mark.slow
def test_the_command_prints_its_own_lines_only_and_spark_s_go_to_its_log(usage, tmp_path):
    """What an operator sees: the progress lines and the outputs, no JVM banner, no log4j line,
    no stage progress bar (they are in OUT/spark.log)."""
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "proxy", "report", "--usage", str(usage), "--out", str(out),
                           "--no-replay"], cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"html: {out / 'report.html'}" in done.stdout
    lines = done.stderr.splitlines()
    assert lines and all(line.startswith(("[", "      done in ")) for line in lines), done.stderr
    assert "[6/6] writing the HTML report" in done.stderr and "[Stage" not in done.stderr
    assert (out / "spark.log").is_file()
