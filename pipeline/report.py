"""``kafka-quota-proxy report``: usage log in, report out.

Steps (each prints a progress line; Spark's own stage progress shows while it runs):
read and check the usage log → demand per principal and interval → percentiles, throttling,
top talkers → recommended quotas (YAML, checked with the proxy's own loader) → what-if replay
of a candidate configuration (default: the recommendation) → charts and HTML.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, cast

import yaml

from .errors import UsageError
from .frames import PandasFrame

if TYPE_CHECKING:
    from pyspark.sql import Row, SparkSession

    from .outliers import Flag, Rule
    from .recommend import CommentKey

QUANTILES = (0.5, 0.95, 0.99)


@dataclass
class Options:
    usage: str
    out: Path
    master: str = "local[*]"
    since: str | None = None
    until: str | None = None
    share: float = 0.99
    headroom: float = 0.2
    config: Path | None = None  # the base configuration carried into the recommendation
    candidate: Path | None = None  # the configuration to replay (default: the recommendation)
    top: int = 10
    max_events: int = 10
    replay: bool = True
    outliers: bool = True  # --no-outliers: every principal's recommendation from its own demand
    outlier_factor: float = 10.0
    outlier_percentile: float = 0.9
    outlier_min_principals: int = 5
    outlier_floor: list[str] | None = None  # KIND=VALUE overrides of outliers.FLOORS
    shuffle_partitions: int | None = None
    driver_memory: str | None = None
    quiet: bool = False
    # Where the output of the JVM Spark starts (its banner, log4j lines, stage progress) goes while
    # the report runs: file descriptor 2 is moved there. None: left where it is (report --verbose).
    spark_log: Path | None = None


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

    def __exit__(self, *exc: object) -> None:
        took = time.monotonic() - self.t
        self.progress.seconds[self.key] = took
        if exc[0] is None:
            self.progress.print(f"      done in {took:.1f} s")


@dataclass
class Inputs:
    """The options and input files as :func:`check_inputs` read them."""

    rule: Rule | None  # None with --no-outliers
    base: dict[str, Any] | None  # --config as YAML read it
    window_s: float  # producer_id_quota_window_size_seconds
    measured_over_s: float  # the quota windows' span a rate is measured over
    candidate_text: str | None
    since: datetime | None
    until: datetime | None


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


def check_inputs(opts: Options) -> Inputs:
    """Every check of the options and inputs that needs no Spark: the numbers are sane, the
    configurations load as the proxy loads them, the times parse, the usage log is there with
    files in it (a local one: a remote one is read by Spark), and ``--out`` can be created.
    Raises UsageError naming the option; creates nothing."""
    _check_numbers(opts)
    from config import ConfigError, parse_config

    from .outliers import Rule, parse_floors
    from .replay import candidate
    from .spark import check_local, is_local, parse_time

    rule = None
    if opts.outliers:
        try:
            rule = Rule(opts.outlier_factor, opts.outlier_percentile, opts.outlier_min_principals,
                        parse_floors(opts.outlier_floor))
            rule.check()
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    base = _load_yaml(opts.config, "--config") if opts.config else None
    window_s, measured_over_s = 3600.0, 10.0  # Kafka's defaults
    if base is not None:
        try:
            base_config = parse_config(base)
        except ConfigError as exc:
            raise UsageError(f"--config {opts.config}: {exc}") from exc
        window_s = base_config.producer_id_quota.producer_id_quota_window_size_seconds
        w = base_config.quota_windows
        measured_over_s = max(w.quota_window_num - 1, 1) * w.quota_window_size_seconds
    candidate_text = None
    if opts.candidate:
        candidate_text = _read(opts.candidate, "--candidate")
        try:
            candidate(candidate_text)  # the replay parses the same text the same way
        except (ConfigError, yaml.YAMLError) as exc:
            raise UsageError(f"--candidate {opts.candidate}: {exc}") from exc
    since = parse_time(opts.since) if opts.since else None
    until = parse_time(opts.until) if opts.until else None
    if since is not None and until is not None and since >= until:
        raise UsageError(f"--since {opts.since} must be before --until {opts.until}")
    if is_local(opts.usage):
        check_local(opts.usage)
    _check_out(opts.out)
    return Inputs(rule, base, window_s, measured_over_s, candidate_text, since, until)


# Spark's master URLs: local, local[4], local[*], local[4,2], local-cluster[...], yarn, spark://...
_MASTER = re.compile(r"local(\[(\*|\d+)(,\d+)?\])?|local-cluster\[[^\]]+\]|yarn|[a-z0-9+]+://\S+")
_MEMORY = re.compile(r"\d+([kmgtp]b?|b)?", re.IGNORECASE)  # spark.driver.memory: 512m, 4g, 4096


def _check_numbers(opts: Options) -> None:
    if not 0 < opts.share <= 1:
        raise UsageError(f"--share must be in (0, 1], got {opts.share}")
    if not math.isfinite(opts.headroom) or opts.headroom < 0:
        raise UsageError(f"--headroom must be a number >= 0, got {opts.headroom}")
    if opts.max_events < 1:
        raise UsageError(f"--max-events must be at least 1, got {opts.max_events}")
    if opts.top < 1:
        raise UsageError(f"--top must be at least 1, got {opts.top}")
    if opts.shuffle_partitions is not None and opts.shuffle_partitions < 1:
        raise UsageError(f"--shuffle-partitions must be at least 1, got {opts.shuffle_partitions}")
    if opts.driver_memory is not None and not _MEMORY.fullmatch(opts.driver_memory):
        raise UsageError(f"--driver-memory must be a size such as 4g or 512m, got {opts.driver_memory!r}")
    if not _MASTER.fullmatch(opts.master):
        raise UsageError(f"--master must be a Spark master URL (local[*], local[4], spark://host:7077, yarn, "
                         f"k8s://...), got {opts.master!r}")


def _check_out(out: Path) -> None:
    """``out`` is a directory, or can be made one: its nearest existing ancestor is a directory
    this process may write in."""
    if out.exists():
        if not out.is_dir():
            raise UsageError(f"--out {out}: exists and is not a directory")
        if not os.access(out, os.W_OK | os.X_OK):
            raise UsageError(f"--out {out}: cannot write in it (permission denied)")
        return
    ancestor = next(p for p in out.absolute().parents if p.exists())
    if not ancestor.is_dir():
        raise UsageError(f"--out {out}: cannot be created, {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out}: cannot be created, no permission to write in {ancestor}")


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
    from .recommend import entity_key, quota_entries, quotas_yaml, recommendations
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

        with progress.step("demand", "demand per principal and interval; percentiles, throttling, top talkers"):
            intervals = demand.interval_demand(usage).cache()
            pid_windows = demand.producer_id_windows(usage, window_s).cache()
            # toPandas() is typed with pandas' DataFrame, which the checker cannot see: PandasFrame.
            percentiles: PandasFrame = demand.demand_percentiles(intervals, pid_windows, QUANTILES) \
                .orderBy("kind", "user", "client_id").toPandas()
            throttling = demand.throttling(intervals)
            throttled: PandasFrame = throttling.orderBy(F.desc("throttle_time_ms"), "user", "client_id").toPandas()
            shadow: PandasFrame = demand.shadow_affected(throttling).toPandas()
            talkers: PandasFrame = demand.top_talkers(intervals, opts.top).toPandas()
            principals: PandasFrame = demand.principal_kinds(intervals).toPandas()
            result.files["demand"] = _csv(percentiles, out / "demand.csv")
            result.files["throttling"] = _csv(throttled, out / "throttling.csv")
            result.files["top_talkers"] = _csv(talkers, out / "top_talkers.csv")

        with progress.step("recommend",
                           f"recommending quotas (admit {opts.share:g} of demand, {opts.headroom:.0%} headroom)"):
            recommended: PandasFrame = recommendations(intervals, pid_windows, opts.share, opts.headroom,
                                                       measured_over_s).orderBy("user", "client_id", "kind").toPandas()
            percentiles, recommended, flags, outlier_notes = mark(percentiles, recommended, principals, rule,
                                                                  window_s)
            result.outliers = flags
            _csv(percentiles, result.files["demand"])  # now with the outlier columns
            result.files["recommended"] = _csv(recommended, out / "recommended.csv")
            entries, notes = quota_entries(recommended.to_dict("records"))
            comments: dict[CommentKey, str] = {
                (entity_key(f.verdict.key[0], f.verdict.key[1], f.verdict.kind), f.verdict.kind): f.reason
                for f in flags}
            text = quotas_yaml(entries, notes, opts.share, opts.headroom, base, (stats.lo, stats.hi), comments,
                               _outlier_header(rule, flags, outlier_notes)
                               # The file is what gets applied: it says when its values are per fleet member.
                               + (result.fleet if fleet.any_fleet(fleets) else []))
            path = out / "recommended-quotas.yaml"
            path.write_text(text, encoding="utf-8")
            try:
                load_config(path)  # what the proxy would say about it
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
                replayed = replay(usage, candidate_text or text, opts.max_events) \
                    .orderBy("proxy", "user", "client_id", "kind").toPandas()
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

    result.headlines = headlines(percentiles, throttled, shadow) + outlier_headlines(flags, outlier_notes)
    with progress.step("html", "writing the HTML report"):
        summary = [
            f"{stats.rows:,} usage rows, {stats.principals:,} principals, {stats.lo:%Y-%m-%d %H:%M} to "
            f"{stats.hi:%Y-%m-%d %H:%M} UTC",
            *result.fleet,
            f"Recommendation: admit {opts.share:g} of each principal's demand, plus {opts.headroom:.0%} headroom",
        ]
        summary.append(_outlier_header(rule, [], [])[0])
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
            recommended_yaml=text)
    result.seconds = progress.seconds
    return result


def headlines(percentiles: PandasFrame, throttled: PandasFrame, shadow: PandasFrame | None = None) -> list[str]:
    """One line per quota kind naming the principal with the largest share of its demand (when
    that share is large), the most throttled principal, and the one quotas in shadow mode would
    have held back the most (``shadow``: demand.shadow_affected, most affected first)."""
    lines = []
    for kind, group in percentiles.groupby("kind", sort=True):
        total = group["total"].sum()
        if total <= 0:
            continue
        top = group.sort_values("total", ascending=False).iloc[0]
        share = top["total"] / total
        if share >= 0.5:
            who = f"{top['user']} / {top['client_id']}" if top["client_id"] else top["user"]
            lines.append(f"{kind}: {who} is {share:.0%} of all demand (p99 {top['p99']:,.1f}, max {top['max']:,.1f})")
    worst = throttled[throttled["throttle_time_ms"] > 0].head(1)
    for _, row in worst.iterrows():
        lines.append(f"most throttled: {row['user']} / {row['client_id']}, {row['throttled']:,} of "
                     f"{row['requests']:,} requests throttled, {row['rejected']:,} rejected, "
                     f"{row['throttle_time_ms'] / 1000:,.1f} s of throttle")
    if shadow is not None and not shadow.empty:
        lines.append(shadow_headline(shadow))
    return lines or ["no principal stands out"]


NO_SHADOW = "No quota in shadow mode throttled or rejected anything in this period."


def shadow_headline(shadow: PandasFrame) -> str:
    """The principal quotas in shadow mode would have held back the most, in a sentence."""
    row = shadow.iloc[0]
    requests, throttled, rejected = row["requests"], row["shadow_throttled"], row["shadow_rejected"]
    held = []
    if throttled:
        held.append(f"throttled on {_percent(row['shadow_throttled_ratio'])} of its requests "
                    f"({throttled:,} of {requests:,})")
    if rejected:
        held.append(f"rejected on {_percent(row['shadow_rejected_ratio'])}"
                    + (f" ({rejected:,})" if throttled else f" of its requests ({rejected:,} of {requests:,})"))
    line = f"In shadow mode, {row['user']} / {row['client_id']} would have been {' and '.join(held)}"
    if row["shadow_throttle_time_ms"]:
        waited = row["shadow_throttle_time_ratio"]
        line += (f", waiting {waited:.2g} s" if waited >= 0.01 else f", waiting {waited * 1000:.2g} ms") \
            + " per second of activity"
    if len(shadow) > 1:
        line += f"; {len(shadow)} principals in all would have been held back"
    return line


def shadow_table(shadow: PandasFrame) -> PandasFrame:
    """``shadow`` (demand.shadow_affected) with the report's column headings."""
    return shadow.assign(
        shadow_throttled_ratio=shadow["shadow_throttled_ratio"].map(_percent),
        shadow_rejected_ratio=shadow["shadow_rejected_ratio"].map(_percent),
    ).rename(columns={
        "shadow_throttled": "would have been throttled", "shadow_throttled_ratio": "% throttled",
        "shadow_rejected": "would have been rejected", "shadow_rejected_ratio": "% rejected",
        "shadow_throttle_time_ms": "throttle ms it would have waited",
        "shadow_throttle_time_ratio": "throttle s per second of activity",
    })


def _percent(ratio: float) -> str:
    if ratio == 0 or ratio >= 0.01:
        return f"{ratio:.0%}"
    return f"{ratio:.1%}" if ratio >= 0.001 else "<0.1%"


def _outlier_header(rule: Rule | None, flags: list[Flag], notes: list[str]) -> list[str]:
    """The outlier rule in a sentence, how many it flagged, and the kinds it could not judge."""
    if rule is None:
        return ["Outliers: not looked for (--no-outliers); every value comes from the principal's own demand"]
    p = f"p{rule.percentile * 100:g}"
    lines = [f"Outliers: a principal whose p99 demand of a kind is above {rule.factor:g} × the {p} of the other "
             f"principals' (and above the kind's floor) gets the {p} of their recommendations instead "
             f"(at least the floor); at least {rule.min_principals} other principals needed"]
    if flags:
        lines.append(f"{len(flags)} outlier{'s' if len(flags) != 1 else ''} bounded from the rest of the fleet")
    return lines + notes


def outlier_headlines(flags: list[Flag], notes: list[str]) -> list[str]:
    """One line per outlier (its demand, the bound it gets and where from, its own
    recommendation), and a line per kind too small to judge."""
    lines = []
    for f in flags:
        user, client_id = f.verdict.key
        who = f"{user} / {client_id}" if client_id else user
        lines.append(f"outlier: {who}, {f.verdict.kind} p99 {f.verdict.statistic:,.1f} over the threshold "
                     f"{f.verdict.threshold:,.1f}: quota {f.bound:,.0f} "
                     f"({f.basis}), "
                     f"not {f.own:,.0f} from its own demand")
    return lines + notes


def _csv(pdf: PandasFrame, path: Path) -> Path:
    pdf.to_csv(path, index=False)
    return path


def _read(path: Path, flag: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot read: {exc.strerror}") from exc


def _load_yaml(path: Path, flag: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(_read(path, flag))
    except yaml.YAMLError as exc:
        raise UsageError(f"{flag} {path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise UsageError(f"{flag} {path}: must be a configuration mapping")
    return data


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--usage", required=True, help="usage log directory (usage_log.directory; any Spark path)")
    p.add_argument("--out", required=True, type=Path, help="where the report goes (created)")
    p.add_argument("--master", default="local[*]", help="Spark master URL (default local[*])")
    p.add_argument("--since", help="first interval to include, ISO 8601 (UTC unless an offset is given)")
    p.add_argument("--until", help="end of the time range (exclusive), ISO 8601")
    p.add_argument("--share", type=float, default=0.99, help="share of demand a recommended quota admits (0.99)")
    p.add_argument("--headroom", type=float, default=0.2, help="added on top of the recommendation (0.2 = 20%%)")
    p.add_argument("--config", type=Path, help="your proxy configuration: carried into the recommended file")
    p.add_argument("--candidate", type=Path, help="configuration to replay (default: the recommendation)")
    p.add_argument("--top", type=int, default=10, help="top talkers listed (10)")
    p.add_argument("--max-events", type=int, default=10, help="replay events per usage row (10)")
    p.add_argument("--no-replay", dest="replay", action="store_false",
                   help="skip the what-if replay (the slowest step: one Python pass per user)")
    p.add_argument("--outlier-factor", type=float, default=10.0,
                   help="a principal whose p99 demand of a kind is above this many times the other principals' "
                        "--outlier-percentile (and above the kind's floor) is an outlier (10)")
    p.add_argument("--outlier-percentile", type=float, default=0.9,
                   help="the other principals' percentile an outlier is compared with, and its quota taken "
                        "from (0.9: their p90)")
    p.add_argument("--outlier-min-principals", type=int, default=5,
                   help="other principals of a kind needed to judge anyone an outlier in it (5)")
    p.add_argument("--outlier-floor", action="append", metavar="KIND=VALUE",
                   help="demand of KIND never called an outlier, and the least an outlier's quota is "
                        "(repeatable; defaults: request_rate=1000, producer/consumer_byte_rate=10485760, "
                        "producer/consumer_record_rate=100000, producer_batch_rate=10000, "
                        "controller_mutation_rate=10, producer_ids_rate=100 per window)")
    p.add_argument("--no-outliers", dest="outliers", action="store_false",
                   help="take every recommendation from the principal's own demand, outliers included")
    p.add_argument("--shuffle-partitions", type=int, help="spark.sql.shuffle.partitions")
    p.add_argument("--driver-memory", help="spark.driver.memory, e.g. 4g (local mode: all the memory Spark gets)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--verbose", action="store_true",
                   help="show Spark's own output (its JVM's log4j lines and stage progress) here; without it, "
                        "it goes to OUT/spark.log")


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
