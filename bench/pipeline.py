"""Rows per second through ``kafka-quota-proxy report`` on generated usage, at growing sizes.

    python -m bench.pipeline                       # 1,000 principals, 1 / 3 / 6 / 24 hours at 10 s
    python -m bench.pipeline --hours 1,24 --master local[2]
    python -m bench.pipeline --no-replay --out bench/results/pipeline-no-replay.json

Each size is generated once (pipeline.generate: 1,000 steady tenants plus a noisy neighbour, a
topic storm and a restart loop, one row per tenant per 10-s interval, as a month of 1,000
principals would be: ~260 million rows), then reported on with one Spark session, timing each
step, with Spark's own task metrics per step (pipeline.spark_metrics, from the session's event
log). Results go to bench/results/pipeline.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from pipeline.generate import generate
from pipeline.report import Options, run_report
from pipeline.spark import spark_session
from pipeline.spark_metrics import StepMetrics, latest_log, per_step

RESULTS = Path(__file__).resolve().parent / "results" / "pipeline.json"
MONTH_ROWS = 1000 * 30 * 24 * 360  # 1,000 principals, one row per 10-s interval, 30 days


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__.split("\n\n")[0])
    p.add_argument("--principals", type=int, default=1000)
    p.add_argument("--hours", default="1,3,6,24", help="comma-separated sizes in hours of usage")
    p.add_argument("--master", default="local[*]")
    p.add_argument("--driver-memory", default="6g")
    p.add_argument("--max-events", type=int, default=10, help="replay events per usage row")
    p.add_argument("--no-replay", dest="replay", action="store_false", help="time everything but the replay")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="kqp-bench-pipeline-"))
    events = work / "spark-events"
    spark = spark_session(args.master, driver_memory=args.driver_memory, console_progress=False, event_log=events)
    app_id = spark.sparkContext.applicationId
    runs: list[dict[str, Any]] = []
    before: dict[str, StepMetrics] = {}
    try:
        for hours in (float(h) for h in args.hours.split(",")):
            usage = work / f"usage-{hours:g}h"
            t = time.perf_counter()
            rows = generate(usage, principals=args.principals, hours=hours, seed=1)
            generated_s = time.perf_counter() - t
            t = time.perf_counter()
            result = run_report(Options(usage=str(usage), out=work / f"report-{hours:g}h", quiet=True,
                                        max_events=args.max_events, replay=args.replay), spark)
            total_s = time.perf_counter() - t
            steps = {k: round(v, 2) for k, v in result.seconds.items()}
            log = latest_log(events, app_id)
            totals = per_step(log) if log else {}
            spark_steps = {k: _minus(m, before.get(k)) for k, m in totals.items()}
            before = totals
            runs.append({"hours": hours, "rows": rows, "generate_s": round(generated_s, 2),
                         "report_s": round(total_s, 2), "rows_per_s": round(rows / total_s),
                         "steps_s": steps, "spark": spark_steps})
            print(f"{hours:>5g} h  {rows:>11,} rows  report {total_s:7.1f} s  {rows / total_s:>10,.0f} rows/s  "
                  f"(generate {generated_s:.1f} s)", flush=True)
            _where_time_goes(steps, spark_steps)
            shutil.rmtree(usage, ignore_errors=True)
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(f"{'hours':>6} {'rows':>12} {'report s':>9} {'rows/s':>10}   slowest steps")
    for r in runs:
        slow = sorted(r["steps_s"].items(), key=lambda kv: -kv[1])[:3]
        print(f"{r['hours']:>6g} {r['rows']:>12,} {r['report_s']:>9.1f} {r['rows_per_s']:>10,}   "
              + ", ".join(f"{k} {v:.1f} s" for k, v in slow))
    if len(runs) >= 2:
        # The two largest sizes: the first run of a session also warms the JVM, which a month's would not.
        a, b = sorted(runs, key=lambda r: r["rows"])[-2:]
        marginal = (b["rows"] - a["rows"]) / max(b["report_s"] - a["report_s"], 1e-9)
        print(f"\nmarginal rate between the two largest sizes: {marginal:,.0f} rows/s; "
              f"a month of {args.principals:,} principals ({MONTH_ROWS * args.principals // 1000:,} rows) "
              f"at that rate: {MONTH_ROWS * args.principals / 1000 / marginal / 3600:.1f} h on this machine")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": runs, "master": args.master, "replay": args.replay, "cpus": os.cpu_count(),
                                    "python": platform.python_version()}, indent=2))
    print(f"results: {args.out}")
    return 0



def _minus(now: StepMetrics, then: StepMetrics | None) -> dict[str, float]:
    """This run's share of a step's metrics (the session's event log holds every run so far)."""
    a, b = now.as_dict(), (then.as_dict() if then else {})
    return {k: round(v - b.get(k, 0), 2) for k, v in a.items()}


def _where_time_goes(steps: dict[str, float], spark_steps: dict[str, dict[str, float]]) -> None:
    """Per step: wall seconds, and Spark's task metrics for it (from the event log)."""
    print(f"        {'step':<10} {'wall s':>7} {'stages':>6} {'tasks':>6} {'task s':>7} {'JVM CPU s':>9} "
          f"{'GC s':>5} {'rows read':>12} {'shuffle MB':>10}")
    for step, wall in steps.items():
        m = spark_steps.get(step, {})
        print(f"        {step:<10} {wall:>7.1f} {m.get('stages', 0):>6.0f} {m.get('tasks', 0):>6.0f} "
              f"{m.get('task_s', 0):>7.1f} {m.get('cpu_s', 0):>9.1f} {m.get('gc_s', 0):>5.1f} "
              f"{m.get('input_rows', 0):>12,.0f} {m.get('shuffle_write_bytes', 0) / 1e6:>10.1f}", flush=True)



if __name__ == "__main__":
    raise SystemExit(main())
