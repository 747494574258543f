"""``report --master spark://HOST:PORT`` against a real standalone Spark cluster: a master and a
worker started from the pyspark package (``spark-class``) on loopback, stopped by the test. The
report's code runs on the worker's executors, which get the project's packages from the driver
(every file of them: the protocol's message definitions included) and read the usage log from
the path they share with it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from proxy.app.cli import main as cli_main

from .usage_rows import write_rows

pytestmark = [pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]


def _spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


class SparkDaemon:
    """One ``spark-class`` process in a session of its own; its log in ``log``."""

    def __init__(self, cls: str, args: list[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        with open(log, "wb") as out:
            self.process = subprocess.Popen([str(_spark_home() / "bin" / "spark-class"), cls, *args], env=env,
                                            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)

    def wait_for(self, pattern: str, timeout_s: float = 90.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.log.read_text(errors="replace")
            found = re.search(pattern, text)
            if found:
                return found
            if self.process.poll() is not None:
                raise AssertionError(f"spark-class exited with {self.process.returncode}:\n{text[-3000:]}")
            time.sleep(0.2)
        raise AssertionError(f"{pattern!r} not seen in {timeout_s} s:\n{self.log.read_text(errors='replace')[-3000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # the JVM and the launcher script it runs under
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)


@pytest.fixture
def standalone_cluster(tmp_path):
    env = {**os.environ, "SPARK_HOME": str(_spark_home()), "SPARK_LOCAL_IP": "127.0.0.1",
           "SPARK_WORKER_DIR": str(tmp_path / "spark-work"), "SPARK_NO_DAEMONIZE": "1"}
    master = SparkDaemon("org.apache.spark.deploy.master.Master",
                         ["--host", "127.0.0.1", "--port", "0", "--webui-port", "0"], tmp_path / "master.log", env)
    worker = None
    try:
        url = master.wait_for(r"Starting Spark master at (spark://127\.0\.0\.1:\d+)").group(1)
        worker = SparkDaemon("org.apache.spark.deploy.worker.Worker",
                             ["--host", "127.0.0.1", "--port", "0", "--webui-port", "0", "--cores", "2",
                              "--memory", "2g", url], tmp_path / "worker.log", env)
        worker.wait_for(r"Successfully registered with master")
        yield url
    finally:
        if worker is not None:
            worker.stop()
        master.stop()


@pytest.mark.slow
def test_the_report_runs_on_a_standalone_cluster_and_recommends_quotas_check_config_accepts(
        standalone_cluster, tmp_path):
    usage = tmp_path / "usage"
    start_s = int(time.time()) // 3600 * 3600 - 3 * 3600
    write_rows(usage, [dict(start_s=start_s + 60 * i, user=user, client_id="app", api_key=0, requests=10 + i,
                            request_bytes=(1 + i % 7) * 1_000_000)
                       for i in range(120) for user in ("alice", "bob")])
    out = tmp_path / "out"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           "SPARK_LOCAL_IP": "127.0.0.1"}
    done = subprocess.run([sys.executable, "-m", "proxy", "report", "--master", standalone_cluster,
                           "--usage", str(usage), "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=540)
    log = (out / "spark.log").read_text(errors="replace") if (out / "spark.log").exists() else ""
    assert done.returncode == 0, done.stderr[-3000:] + log[-3000:]
    assert (out / "report.html").stat().st_size > 1000
    recommended = out / "recommended-quotas.yaml"
    assert cli_main(["check-config", str(recommended)]) == 0
    users = {q.get("user") for q in yaml.safe_load(recommended.read_text())["quotas"]}
    assert {"alice", "bob"} <= users
    # The executors ran the report's code (the cluster's application log names the worker).
    assert "Asked to launch executor" in (tmp_path / "worker.log").read_text(errors="replace")


class SparkException(Exception):
    """Named as pyspark's own, which spark_errors recognises by name."""


@pytest.mark.parametrize(("text", "said"), [
    ("Job aborted due to stage failure: Task 0 failed 4 times\norg.apache.spark.api.python.PythonException: "
     "Traceback (most recent call last):\n  File \"worker.py\", line 1, in main\nFileNotFoundError: [Errno 2] No such "
     "file or directory: './kafka_quota_proxy.zip/protocol/schemas/ShareFetchRequest.json'\n\tat org.apache.spark",
     "report: a Spark executor failed running the report's code: FileNotFoundError: [Errno 2] No such file or "
     "directory: './kafka_quota_proxy.zip/protocol/schemas/ShareFetchRequest.json'"),
    ("Parquet column cannot be converted in file file:/data/usage/x.parquet. Column: [requests]",
     "report: cannot read usage log file file:/data/usage/x.parquet: its columns do not match the usage log schema"),
])
def test_an_executor_failure_is_reported_as_one_and_a_bad_file_as_a_bad_file(text, said):
    """An executor's Python failure (the shipped code) is not the user's files' fault."""
    from pipeline.errors import UsageError
    from pipeline.spark import spark_errors

    with pytest.raises(UsageError) as caught, spark_errors():
        raise SparkException(text)
    assert f"report: {caught.value}" == said
