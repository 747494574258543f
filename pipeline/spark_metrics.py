"""Where a report's time goes, in Spark's own metrics: the task metrics of its event log
(``spark.eventLog.enabled``), summed per report step (a retried stage's attempts all count: the
work was done).

The report runs each step's Spark jobs in a job group named after the step (:func:`step_group`),
so every stage in the log belongs to a step. Per step: the stages and tasks it ran, the tasks'
run time and JVM CPU time (run time less CPU is mostly the Python workers of ``applyInPandas``
and I/O), garbage collection, the rows and bytes read from the usage log, and the shuffle.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

GROUP = "spark.jobGroup.id"
PREFIX = "kafka-quota-proxy report: "  # a report step's job group: this and the step's key


@dataclass
class StepMetrics:
    """Spark's task metrics summed over one report step's stages (times in seconds)."""

    stages: int = 0
    tasks: int = 0
    task_s: float = 0.0  # executorRunTime: the tasks' wall time, Python workers included
    cpu_s: float = 0.0  # executorCpuTime: the JVM threads' CPU
    gc_s: float = 0.0
    input_rows: int = 0
    input_bytes: int = 0
    shuffle_write_bytes: int = 0
    shuffle_read_bytes: int = 0

    def as_dict(self) -> dict[str, float]:
        return {f.name: round(getattr(self, f.name), 2) for f in fields(self)}


# Accumulable name → (field, scale) for the task metrics summed.
_METRICS = {
    "internal.metrics.executorRunTime": ("task_s", 1e-3),  # ms
    "internal.metrics.executorCpuTime": ("cpu_s", 1e-9),  # ns
    "internal.metrics.jvmGCTime": ("gc_s", 1e-3),
    "internal.metrics.input.recordsRead": ("input_rows", 1),
    "internal.metrics.input.bytesRead": ("input_bytes", 1),
    "internal.metrics.shuffle.write.bytesWritten": ("shuffle_write_bytes", 1),
    "internal.metrics.shuffle.read.remoteBytesRead": ("shuffle_read_bytes", 1),
    "internal.metrics.shuffle.read.localBytesRead": ("shuffle_read_bytes", 1),
}


def step_group(spark: SparkSession, key: str, what: str) -> None:
    """Runs what this thread submits next under the job group of report step ``key``."""
    spark.sparkContext.setJobGroup(PREFIX + key, what)


def no_step(spark: SparkSession) -> None:
    """What this thread submits next belongs to no report step."""
    spark.sparkContext.setLocalProperty(GROUP, None)  # type: ignore[arg-type]  # null: removed


def enable_event_log(builder: Any, directory: Path) -> Any:
    """``builder`` (a SparkSession.Builder) with its event log written under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    # One plain JSON-lines file per application (Spark 4 otherwise rolls and zstd-compresses it).
    return (builder.config("spark.eventLog.enabled", "true")
            .config("spark.eventLog.dir", directory.absolute().as_uri())
            .config("spark.eventLog.compress", "false")
            .config("spark.eventLog.rolling.enabled", "false"))


def per_step(event_log: Path) -> dict[str, StepMetrics]:
    """Step key → its metrics, from one application's event log file (jobs outside a report
    step, or of a step without stages, are not listed)."""
    stage_step: dict[int, str] = {}
    out: dict[str, StepMetrics] = {}
    for event in _events(event_log):
        kind = event.get("Event")
        if kind == "SparkListenerJobStart":
            group = (event.get("Properties") or {}).get(GROUP, "")
            if group.startswith(PREFIX):
                for stage in event.get("Stage IDs", ()):
                    stage_step[stage] = group[len(PREFIX):]
        elif kind == "SparkListenerStageCompleted":
            info = event.get("Stage Info", {})
            step = stage_step.get(info.get("Stage ID"))
            if step is None:
                continue
            m = out.setdefault(step, StepMetrics())
            m.stages += int(info.get("Stage Attempt ID", 0) == 0)  # a retried stage is one stage (its work twice)
            m.tasks += int(info.get("Number of Tasks", 0))
            for acc in info.get("Accumulables", ()):
                target = _METRICS.get(acc.get("Name", ""))
                if target is not None:
                    name, scale = target
                    value = float(acc.get("Value", 0)) * scale
                    now = getattr(m, name)
                    setattr(m, name, now + (int(value) if isinstance(now, int) else value))
    return out


def latest_log(directory: Path, app_id: str) -> Path | None:
    """The event log file of application ``app_id`` under ``directory`` (in progress or done),
    as :func:`enable_event_log` has Spark write it."""
    found = sorted(p for p in directory.glob(f"{app_id}*") if p.suffix != ".crc")
    return found[0] if found else None


def _events(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:  # the last line of a log still being written
                    return
