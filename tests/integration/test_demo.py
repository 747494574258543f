"""The demo as a new operator runs it (``kafka-quota-proxy demo --duration ... --no-report``): its
own lines only (no client library or proxy logs), every step's key line, a summary, exit 0, and
no process left behind (the Tansu broker it started is gone)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
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


def test_the_demo_shows_its_own_lines_and_leaves_nothing_behind():
    done = subprocess.run([sys.executable, "-m", "proxy", "demo", "--duration", "1", "--no-report"], cwd=ROOT,
                          capture_output=True, text=True, timeout=200, start_new_session=True)
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


def test_with_the_report_spark_is_quiet_and_gone_before_the_demo_runs_on():
    demo = subprocess.Popen([sys.executable, "-m", "proxy", "demo", "--duration", "6"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
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
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
