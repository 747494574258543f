"""``kafka-quota-proxy report``: usage log in, report out.

Steps (each prints a progress line; Spark's own stage progress shows while it runs):
read and check the usage log → demand per principal and interval → percentiles, throttling,
top talkers → recommended quotas (YAML, checked with the proxy's own loader) → what-if replay
of a candidate configuration (default: the recommendation) → charts and HTML.

What it guarantees: the options and inputs are checked before Spark starts (:mod:`.options`),
and a refusal then leaves no ``--out`` behind; a refusal found while Spark reads the usage log
removes the ``--out`` it made; Spark's own output goes to OUT/spark.log unless --verbose, while
the progress lines stay on the console. The headlines' wording is :mod:`.headlines`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, cast

from . import glance
from .errors import UsageError
from .frames import PandasFrame
from .headlines import NO_SHADOW as NO_SHADOW
from .headlines import headlines as headlines
from .headlines import outlier_header, outlier_headlines, shadow_table
from .headlines import shadow_headline as shadow_headline
from .options import Inputs as Inputs
from .options import Options as Options
from .options import add_arguments as add_arguments
from .options import check_inputs as check_inputs

if TYPE_CHECKING:
    from pyspark.sql import Row, SparkSession

    from .outliers import Flag
    from .recommend import CommentKey

QUANTILES = (0.5, 0.95, 0.99)


@dataclass
class Outputs:
    files: dict[str, Path] = field(default_factory=dict)
    rows: int = 0
    headlines: list[str] = field(default_factory=list)
    fleet: list[str] = field(default_factory=list)  # how the proxies enforced: fleets, and what that means
    outliers: list[Flag] = field(default_factory=list)  # one per flagged (principal, kind)
    seconds: dict[str, float] = field(default_factory=dict)


class Progress:
    def __init__(self, steps: int, quiet: bool, stream: TextIO | None = None) -> None:
        self.steps, self.quiet, self.n = steps, quiet, 0
        self.stream = stream  # None: sys.stderr as it is when a line is printed
        self.started = time.monotonic()
        self.seconds: dict[str, float] = {}
        self.spark: SparkSession | None = None  # once started: each step's jobs in a job group of its own

    def print(self, line: str) -> None:
        if not self.quiet:
            print(line, file=self.stream or sys.stderr, flush=True)

    def step(self, key: str, what: str) -> _Timed:
        """Times a step; its seconds are kept under ``key``."""
        self.n += 1
        self.print(f"[{self.n}/{self.steps}] {what} …")
        return _Timed(self, key)


class _Timed:
    def __init__(self, progress: Progress, key: str) -> None:
        self.progress, self.key = progress, key

    def __enter__(self) -> None:
        self.t = time.monotonic()
        if self.progress.spark is not None:
            from .spark_metrics import step_group

            step_group(self.progress.spark, self.key, self.key)

    def __exit__(self, *exc: object) -> None:
        if self.progress.spark is not None:
            from .spark_metrics import no_step

            no_step(self.progress.spark)  # later jobs (a failed report's caller's too) are not the step's
        took = time.monotonic() - self.t
        self.progress.seconds[self.key] = took
        if exc[0] is None:
            self.progress.print(f"      done in {took:.1f} s")


def run_report(opts: Options, spark: SparkSession | None = None) -> Outputs:
    """Builds every output under ``opts.out``. Raises UsageError on bad input or options: found
    before Spark starts where they can be (:func:`check_inputs`), and then ``opts.out`` is not
    created; a refusal found while Spark reads the usage log removes the ``opts.out`` it created."""
    inputs = check_inputs(opts)
    created = _make_out(opts.out)
    try:
        with _jvm_output(opts.spark_log) as console:
            return _report(opts, inputs, spark, Progress(7 if opts.replay else 6, opts.quiet, console))
    except UsageError:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise


def _make_out(out: Path) -> Path | None:
    """Creates ``out`` and ``out/charts``; returns the topmost directory it created (what a
    refusal removes), None when both were there."""
    created = next((p for p in reversed((out / "charts", out, *out.absolute().parents)) if not p.exists()), None)
    (out / "charts").mkdir(parents=True, exist_ok=True)
    return created


@contextlib.contextmanager
def _jvm_output(path: Path | None) -> Iterator[TextIO | None]:
    """Moves file descriptor 2, where the JVM Spark starts (and its Python workers) write their
    banner, log4j lines and stage progress, to ``path`` meanwhile; yields a stream on the
    original stderr for the report's own progress lines. None: nothing moved (yields None)."""
    if path is None:
        yield None
        return
    sys.stderr.flush()
    saved = os.dup(2)
    console = open(os.dup(saved), "w", encoding="utf-8", errors="replace")  # closed below
    try:
        with open(path, "wb") as log:
            os.dup2(log.fileno(), 2)
        yield console
    except BaseException as exc:
        if not isinstance(exc, UsageError):
            print(f"report: failed; Spark's own output is in {path}", file=console, flush=True)
        raise
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        console.close()


def _report(opts: Options, inputs: Inputs, spark: SparkSession | None, progress: Progress) -> Outputs:
    """The report itself, on inputs :func:`check_inputs` passed, under the ``opts.out`` made."""
    from config import ConfigError, load_config

    from . import demand, fleet
    from .html import CHARTS, bar_chart, stacked_chart, write_report
    from .outliers import mark, outlier_rows, replay_outcome
    from .recommend import entity_key, quota_entries, quotas_yaml, recommendations, split
    from .replay import replay
    from .spark import read_usage, spark_errors, spark_session

    rule, base, window_s, measured_over_s = inputs.rule, inputs.base, inputs.window_s, inputs.measured_over_s
    candidate_text, since, until = inputs.candidate_text, inputs.since, inputs.until
    out = opts.out
    result = Outputs()

    where = "" if opts.spark_log is None else f" (its own output: {opts.spark_log})"
    with progress.step("spark", f"starting Spark{where}"):
        spark = spark or spark_session(opts.master, shuffle_partitions=opts.shuffle_partitions,
                                       driver_memory=opts.driver_memory,
                                       console_progress=not opts.quiet and opts.spark_log is None)
    progress.spark = spark
    from pyspark.sql import functions as F

    with spark_errors():
        with progress.step("read", f"reading and checking the usage log in {opts.usage}"):
            usage = read_usage(spark, opts.usage, since, until)
            # An aggregate without groups has exactly one row: first() is never None here.
            stats = cast("Row", usage.agg(F.count("*").alias("rows"), F.min("interval_start").alias("lo"),
                                          F.max("interval_start").alias("hi"),
                                          F.countDistinct("user", "client_id").alias("principals"),
                                          fleet.members_agg().alias("fleets")).first())
            if not stats.rows:
                raise UsageError(f"no usage rows in {opts.usage}"
                                 + (" between --since and --until" if since or until else ""))
            result.rows = stats.rows
            fleets = fleet.members(stats.fleets)
            result.fleet = fleet.notes(fleets)
            if fleet.any_fleet(fleets):
                usage = fleet.enforced_as(usage)  # a fleet's members summed: its quotas were one

        with progress.step("demand", "demand per principal and interval; throttling, top talkers"):
            intervals = demand.interval_demand(usage).cache()
            pid_windows = demand.producer_id_windows(intervals, window_s).cache()  # not another scan
            # toPandas() is typed with pandas' DataFrame, which the checker cannot see: PandasFrame.
            per_principal: PandasFrame = demand.per_principal(intervals).toPandas()
            throttled = demand.throttling(per_principal)
            shadow = demand.shadow_affected(throttled)
            talkers = demand.top_talkers(per_principal, opts.top)
            principals = demand.principal_kinds(per_principal)
            result.files["demand"] = out / "demand.csv"  # written with the recommendations, below
            result.files["throttling"] = _csv(throttled, out / "throttling.csv")
            result.files["top_talkers"] = _csv(talkers, out / "top_talkers.csv")

        with progress.step("recommend",
                           f"percentiles and recommended quotas (admit {opts.share:g} of demand, "
                           f"{opts.headroom:.0%} headroom)"):
            percentiles, recommended = split(recommendations(intervals, pid_windows, opts.share, opts.headroom,
                                                             measured_over_s, QUANTILES, stats.rows).toPandas())
            percentiles, recommended, flags, outlier_notes = mark(percentiles, recommended, principals, rule,
                                                                  window_s)
            result.outliers = flags
            result.files["demand"] = _csv(percentiles, out / "demand.csv")  # with the outlier columns
            result.files["recommended"] = _csv(recommended, out / "recommended.csv")
            entries, notes = quota_entries(recommended.to_dict("records"))
            comments: dict[CommentKey, str] = {
                (entity_key(f.verdict.key[0], f.verdict.key[1], f.verdict.kind), f.verdict.kind): f.reason
                for f in flags}
            text = quotas_yaml(entries, notes, opts.share, opts.headroom, base, (stats.lo, stats.hi), comments,
                               outlier_header(rule, flags, outlier_notes)
                               # The file is what gets applied: it says when its values are a fleet's.
                               + (result.fleet if fleet.any_fleet(fleets) else []))
            path = out / "recommended-quotas.yaml"
            path.write_text(text, encoding="utf-8")
            try:
                load_config(path, filters=False)  # what the proxy would say of its quotas
            except ConfigError as exc:
                raise RuntimeError(f"the recommended configuration does not load: {exc}") from exc
            result.files["recommended_quotas"] = path

        # None without the replay; not "PandasFrame | None": assigning toPandas() would narrow it to pyspark's
        # unresolved pandas type (see above).
        replayed: PandasFrame = None
        if opts.replay:
            with progress.step(
                "replay",
                f"replaying {'the candidate ' + str(opts.candidate) if opts.candidate else 'the recommended quotas'}"
            ):
                # Sorted here, not by Spark: a sort there samples its input first, which would run
                # the whole replay twice.
                replayed = replay(usage, candidate_text or text, opts.max_events, rows=stats.rows).toPandas()
                replayed = replayed.sort_values(["proxy", "user", "client_id", "kind"], kind="stable") \
                    .reset_index(drop=True)
                replayed["outlier"] = outlier_rows(replayed, flags)
                result.files["replay"] = _csv(replayed, out / "replay.csv")

        with progress.step("charts", "charts"):
            columns = [c for c, _, _ in CHARTS]
            series = demand.timeline(intervals, columns, keep=6, max_points=400)
            charts = []
            for column, title, unit in CHARTS:
                path = out / "charts" / f"{column}.png"
                if stacked_chart(series.get(column), title, unit, path, series.get("span")):
                    charts.append(path)
            hot = throttled[throttled["throttle_time_ms"] > 0].head(15)
            path = out / "charts" / "throttled_principals.png"
            if bar_chart([f"{u} / {c}" for u, c in zip(hot["user"], hot["client_id"])],
                         list(hot["throttle_time_ratio"]), "Throttle time per second of activity",
                         "throttled seconds per active second", path):
                charts.append(path)
            glance_charts = _glance_charts(out, series, recommended, throttled, replayed)  # the first screen's


    result.headlines = headlines(percentiles, throttled, shadow) + outlier_headlines(flags, outlier_notes)
    with progress.step("html", "writing the HTML report"):
        summary = [
            f"{stats.rows:,} usage rows, {stats.principals:,} principals, {stats.lo:%Y-%m-%d %H:%M} to "
            f"{stats.hi:%Y-%m-%d %H:%M} UTC",
            *result.fleet,
            f"Recommendation: admit {opts.share:g} of each principal's demand, plus {opts.headroom:.0%} headroom",
        ]
        summary.append(outlier_header(rule, [], [])[0])
        if opts.replay:
            summary.append(f"Replay of {opts.candidate or 'the recommended quotas'}: open loop "
                           "(clients assumed to send what they sent)")
        flagged = recommended[recommended["outlier"]][
            ["user", "client_id", "kind", "own_recommended", "recommended", "reason"]]
        result.files["html"] = write_report(
            out, title="kafka-quota-proxy usage report", summary=summary,
            headlines=result.headlines, charts=charts,
            tables=[("Outliers: principals whose quota comes from the rest of the fleet", "recommended.csv",
                     flagged),
                    *([("What the replay did to the outliers and to everyone else", "replay.csv",
                        replay_outcome(replayed, flags))] if replayed is not None and flags else []),
                    ("Shadow mode: what the quotas in shadow mode would have done", "throttling.csv",
                     shadow_table(shadow), NO_SHADOW),
                    ("Throttled and rejected, per principal", "throttling.csv", throttled),
                    ("Top talkers (bytes)", "top_talkers.csv", talkers),
                    ("Demand per principal and quota kind (per-second rates; producer_ids_rate per window)",
                     "demand.csv", percentiles),
                    ("Recommended quota per principal and kind", "recommended.csv", recommended),
                    *([("What-if replay", "replay.csv", replayed[replayed["kind"] == "(any)"])]
                      if replayed is not None else [])],
            recommended_yaml=text, quota_table=glance.quota_table(recommended, talkers), glance_charts=glance_charts)
    result.seconds = progress.seconds
    return result


# The first screen's demand chart: the first kind of these with demand.
_BOUND_KINDS = ("producer_byte_rate", "consumer_byte_rate", "request_rate", "controller_mutation_rate")


def _glance_charts(out: Path, series: dict[str, Any], recommended: PandasFrame, throttled: PandasFrame,
                   replayed: PandasFrame) -> tuple[Path | None, Path | None]:
    """(what the new quotas would have held back, demand against the recommended bound): the
    files drawn, None for one with nothing to draw."""
    from .html import CHARTS

    units = {column: (title, unit) for column, title, unit in CHARTS}
    bound_path: Path | None = None
    for kind in _BOUND_KINDS:
        pdf = series.get(kind)
        if pdf is None or pdf.empty:
            continue
        rows = recommended[recommended["kind"] == kind]
        bounds = {glance.name(u, c): float(v) for u, c, v in zip(rows["user"], rows["client_id"], rows["recommended"])}
        title, unit = units[kind]
        path = out / "charts" / "demand_against_bound.png"
        if glance.bound_chart(pdf, bounds, f"{title}, each principal against its recommended {kind}", unit, path,
                              series.get("span")):
            bound_path = path
            break
    top = throttled.sort_values("requests", ascending=False).head(glance.TOP)
    principals = list(zip(top["user"], top["client_id"]))
    held_path = out / "charts" / "held_back.png"
    if replayed is None or not glance.held_back_chart(glance.held_back(throttled, replayed, principals), held_path):
        return None, bound_path
    return held_path, bound_path


def _csv(pdf: PandasFrame, path: Path) -> Path:
    pdf.to_csv(path, index=False)
    return path


def main(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("pyspark") is None:
        print("report needs PySpark: pip install 'kafka-quota-proxy[pipeline]' (and Java 17)", file=sys.stderr)
        return 2
    opts = Options(**{k: v for k, v in vars(args).items() if k in Options.__dataclass_fields__})
    if not getattr(args, "verbose", False):
        opts.spark_log = opts.out / "spark.log"
    try:
        result = run_report(opts)
    except UsageError as exc:
        print(f"report: {exc}", file=sys.stderr)
        return 2
    print(f"read {result.rows:,} usage rows")
    for line in result.fleet:
        print(line)
    for name, path in result.files.items():
        print(f"{name:>18}: {path}")
    return 0
