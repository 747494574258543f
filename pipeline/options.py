"""The report's options (its command-line flags and :class:`Options`), and every check of them
and of its inputs that needs no Spark (:func:`check_inputs`).

What it guarantees: a bad option (a share outside (0, 1], a master that is no Spark master URL, an
outlier rule that cannot judge), a base or candidate configuration the proxy's own loader refuses,
a time range that is empty, a local usage log with no files, or an ``--out`` that cannot be made is
refused with a UsageError naming the flag, before Spark starts and before anything is created.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from .errors import UsageError

if TYPE_CHECKING:
    from .outliers import Rule


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
class Inputs:
    """The options and input files as :func:`check_inputs` read them."""

    rule: Rule | None  # None with --no-outliers
    base: dict[str, Any] | None  # --config as YAML read it
    window_s: float  # producer_id_quota_window_size_seconds
    measured_over_s: float  # the quota windows' span a rate is measured over
    candidate_text: str | None
    since: datetime | None
    until: datetime | None


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
            base_config = parse_config(base, filters=False)  # the proxy's plug-ins: not loaded here
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
