"""Where a report's time goes, from Spark's own event log (pipeline.spark_metrics): a real report
on the tests' session (its event log on) is attributed step by step, and the parser keeps other
jobs and a half-written last line out."""

from __future__ import annotations

import json

from pipeline.generate import generate
from pipeline.report import Options, run_report
from pipeline.spark_metrics import PREFIX, latest_log, per_step


def test_a_reports_spark_work_is_attributed_to_its_steps(spark, spark_events, tmp_path):
    rows = generate(tmp_path / "usage", principals=6, hours=0.25, seed=3)
    log = latest_log(spark_events, spark.sparkContext.applicationId)
    before = per_step(log) if log else {}
    result = run_report(Options(usage=str(tmp_path / "usage"), out=tmp_path / "report", quiet=True), spark)
    spark.range(10).count()  # after the report: no step's
    after = per_step(latest_log(spark_events, spark.sparkContext.applicationId))

    def ran(step: str, field: str) -> float:
        prior = before[step].as_dict()[field] if step in before else 0
        return after[step].as_dict()[field] - prior

    for step in ("read", "demand", "recommend", "replay", "charts"):
        assert step in result.seconds
        assert ran(step, "stages") >= 1 and ran(step, "tasks") >= 1, step
        assert ran(step, "task_s") > 0, step
    assert ran("read", "input_rows") >= rows  # the read step looks at every row
    assert ran("recommend", "shuffle_write_bytes") > 0  # grouping per principal and kind shuffles
    assert set(after) <= {"spark", *result.seconds}


def test_stages_of_other_jobs_and_a_half_written_line_are_left_out_and_a_retry_counts_its_work(tmp_path):
    def job(job_id: int, stages: list[int], group: str | None) -> dict:
        props = {"spark.jobGroup.id": group} if group else {}
        return {"Event": "SparkListenerJobStart", "Job ID": job_id, "Stage IDs": stages, "Properties": props}

    def stage(stage_id: int, run_ms: int, rows: int, attempt: int = 0) -> dict:
        return {"Event": "SparkListenerStageCompleted",
                "Stage Info": {"Stage ID": stage_id, "Stage Attempt ID": attempt, "Number of Tasks": 2,
                               "Accumulables": [
                    {"Name": "internal.metrics.executorRunTime", "Value": run_ms},
                    {"Name": "internal.metrics.executorCpuTime", "Value": run_ms * 500_000},
                    {"Name": "internal.metrics.input.recordsRead", "Value": rows},
                    {"Name": "internal.metrics.shuffle.read.localBytesRead", "Value": 10},
                    {"Name": "internal.metrics.shuffle.read.remoteBytesRead", "Value": 5}]}}

    events = [job(0, [0, 1], PREFIX + "demand"), stage(0, 1500, 100), stage(1, 500, 0),
              job(1, [2], None), stage(2, 9000, 7),  # no step's
              job(2, [3], "someone else's group"), stage(3, 9000, 7),
              job(3, [4], PREFIX + "replay"), stage(4, 400, 40), stage(4, 400, 40, attempt=1)]  # retried
    path = tmp_path / "local-1"
    path.write_text("\n".join(json.dumps(e) for e in events) + '\n{"Event": "SparkListenerStageCom')
    got = {k: m.as_dict() for k, m in per_step(path).items()}
    assert got == {
        "demand": {"stages": 2, "tasks": 4, "task_s": 2.0, "cpu_s": 1.0, "gc_s": 0.0, "input_rows": 100,
                   "input_bytes": 0, "shuffle_write_bytes": 0, "shuffle_read_bytes": 30},
        "replay": {"stages": 1, "tasks": 4, "task_s": 0.8, "cpu_s": 0.4, "gc_s": 0.0, "input_rows": 80,
                   "input_bytes": 0, "shuffle_write_bytes": 0, "shuffle_read_bytes": 30},
    }
    assert latest_log(tmp_path, "local-1") == path
    assert latest_log(tmp_path, "local-2") is None
