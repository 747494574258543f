"""Per-principal demand from the usage log, with the DataFrame API only (nothing raw reaches the
driver): per-interval rates for each quota kind, their percentiles, throttling, top talkers.

A principal is (user, client id), Kafka's finest quota entity. Each proxy enforces its own
quotas, so a sample is one principal's demand at one proxy in one interval.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from quotas.common import CONTROLLER_MUTATION_RATE, REQUEST_RATE

from .frames import PandasFrame
from .kinds import DEMAND, PER_WINDOW, RATE_KINDS

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, Row

PRINCIPAL = ("user", "client_id")
Span = tuple[float, float, float]  # (first bucket, last bucket, bucket seconds), in epoch seconds


def interval_demand(usage: DataFrame) -> DataFrame:
    """One row per (proxy, user, client_id, interval_start): the amount each rate kind charged,
    and the throttling the proxy applied. Amounts, not rates: divide by ``interval_seconds``."""
    from pyspark.sql import functions as F

    aggs = []
    for kind, d in DEMAND.items():
        c, n = F.col(d.column), F.col("requests")
        if d.api_keys is not None:
            on = F.col("api_key").isin(*sorted(d.api_keys))
            c, n = F.when(on, c).otherwise(F.lit(0)), F.when(on, n).otherwise(F.lit(0))
        aggs += [F.sum(c).alias(kind), F.sum(n).alias(f"{kind}__requests")]
    aggs += [
        F.sum("new_producer_ids").alias("new_producer_ids"),
        F.sum(F.col("request_bytes") + F.col("response_bytes")).alias("bytes"),
        F.sum("throttle_time_ms_sum").alias("throttle_time_ms"),
        F.sum("throttled").alias("throttled"),
        F.sum("rejected").alias("rejected"),
        F.sum("shadow_throttle_time_ms_sum").alias("shadow_throttle_time_ms"),
        F.sum("shadow_throttled").alias("shadow_throttled"),
        F.sum("shadow_rejected").alias("shadow_rejected"),
    ]
    return usage.groupBy("proxy", *PRINCIPAL, "interval_start", "interval_seconds").agg(*aggs)


def _long(intervals: DataFrame) -> DataFrame:
    """(proxy, user, client_id, interval_start, interval_seconds, kind, amount, requests, rate)
    with amount > 0; ``requests`` are those of the APIs the kind charges."""
    from pyspark.sql import functions as F

    triples = ", ".join(f"'{k}', CAST(`{k}` AS DOUBLE), CAST(`{k}__requests` AS DOUBLE)" for k in RATE_KINDS)
    return (intervals.select("proxy", *PRINCIPAL, "interval_start", "interval_seconds",
                             F.expr(f"stack({len(RATE_KINDS)}, {triples}) AS (kind, amount, requests)"))
            .where(F.col("amount") > 0)
            .withColumn("rate", F.col("amount") / F.col("interval_seconds")))


def producer_id_windows(usage: DataFrame, window_s: float) -> DataFrame:
    """New producer ids per (proxy, user, window), windows of ``window_s`` from the epoch
    (tumbling: a burst across a window edge is split; the quota's own window slides), from usage
    rows or :func:`interval_demand`'s (the same sums)."""
    from pyspark.sql import functions as F

    start = F.floor(F.unix_timestamp("interval_start") / window_s) * window_s
    return (usage.where(F.col("new_producer_ids") > 0)
            .groupBy("proxy", "user", start.alias("window_start"))
            .agg(F.sum("new_producer_ids").cast("double").alias("amount")))


def demand_percentiles(intervals: DataFrame, pid_windows: DataFrame, quantiles: Sequence[float] = (0.5, 0.95, 0.99),
                       accuracy: int = 10_000) -> DataFrame:
    """Per (user, client_id, kind): samples, total, mean, the quantiles and the max of the
    per-second rate over the intervals in which the principal used that kind (for
    producer_ids_rate: new ids per window, per user, client_id "")."""
    from pyspark.sql import functions as F

    q = F.percentile_approx("rate", list(quantiles), accuracy)
    rates = (_long(intervals).groupBy(*PRINCIPAL, "kind")
             .agg(F.count("*").alias("samples"), F.sum("amount").alias("total"), F.avg("rate").alias("mean"),
                  q.alias("q"), F.max("rate").alias("max")))
    (pid_kind,) = PER_WINDOW
    pids = (pid_windows.withColumn("rate", F.col("amount"))
            .groupBy("user").agg(F.count("*").alias("samples"), F.sum("amount").alias("total"),
                                 F.avg("rate").alias("mean"), q.alias("q"), F.max("rate").alias("max"))
            .select("user", F.lit("").alias("client_id"), F.lit(pid_kind).alias("kind"),
                    "samples", "total", "mean", "q", "max"))
    both = rates.unionByName(pids)
    cols = [F.col("q")[i].alias(f"p{_label(x)}") for i, x in enumerate(quantiles)]
    return both.select(*PRINCIPAL, "kind", "samples", "total", "mean", *cols, "max")


def _label(quantile: float) -> str:
    return f"{quantile * 100:g}".replace(".", "_")


def throttling(intervals: DataFrame) -> DataFrame:
    """Per (user, client_id): requests, how many were throttled or rejected, and the throttle
    time per second of activity (1.0: throttled all the time it was active); then the same for
    what quotas in shadow mode would have done (``shadow_*``), none of which was applied."""
    from pyspark.sql import functions as F

    sums = [F.sum(REQUEST_RATE).alias("requests"), F.sum("interval_seconds").alias("active_seconds")]
    ratios = []
    for prefix in ("", "shadow_"):
        throttled, rejected, time_ms = f"{prefix}throttled", f"{prefix}rejected", f"{prefix}throttle_time_ms"
        sums += [F.sum(throttled).alias(throttled), F.sum(rejected).alias(rejected), F.sum(time_ms).alias(time_ms)]
        ratios += [(F.col(throttled) / F.col("requests")).alias(f"{throttled}_ratio"),
                   (F.col(rejected) / F.col("requests")).alias(f"{rejected}_ratio"),
                   (F.col(time_ms) / (F.col("active_seconds") * 1000.0)).alias(f"{prefix}throttle_time_ratio")]
    columns = [*PRINCIPAL, "requests", "throttled", "rejected", "throttle_time_ms", "active_seconds",
               "throttled_ratio", "rejected_ratio", "throttle_time_ratio",
               "shadow_throttled", "shadow_rejected", "shadow_throttle_time_ms",
               "shadow_throttled_ratio", "shadow_rejected_ratio", "shadow_throttle_time_ratio"]
    return intervals.groupBy(*PRINCIPAL).agg(*sums).select("*", *ratios).select(*columns)


def shadow_affected(throttling_df: DataFrame) -> DataFrame:
    """The principals quotas in shadow mode would have throttled or rejected, most affected
    first: by the larger of the two shares of its requests (a request can be both), then by
    the throttle time it would have waited per second of activity."""
    from pyspark.sql import functions as F

    held = F.greatest("shadow_throttled_ratio", "shadow_rejected_ratio")
    return (throttling_df.where((F.col("shadow_throttled") > 0) | (F.col("shadow_rejected") > 0))
            .orderBy(F.desc(held), F.desc("shadow_throttle_time_ratio"), *PRINCIPAL)
            .select(*PRINCIPAL, "requests", "shadow_throttled", "shadow_throttled_ratio", "shadow_rejected",
                    "shadow_rejected_ratio", "shadow_throttle_time_ms", "shadow_throttle_time_ratio"))


def principal_kinds(intervals: DataFrame) -> DataFrame:
    """Per (user, client_id): its requests, and per rate kind ``<kind>__requests``, the requests
    of the APIs that kind charges (whether it had any demand of the kind or not)."""
    from pyspark.sql import functions as F

    return (intervals.groupBy(*PRINCIPAL)
            .agg(*[F.sum(f"{kind}__requests").alias(f"{kind}__requests") for kind in RATE_KINDS]))


def top_talkers(intervals: DataFrame, n: int) -> DataFrame:
    """The ``n`` principals that moved the most bytes, with their share of all bytes."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    totals = (intervals.groupBy(*PRINCIPAL)
              .agg(F.sum("bytes").alias("bytes"), F.sum(REQUEST_RATE).alias("requests"),
                   F.sum(CONTROLLER_MUTATION_RATE).alias("partition_mutations"),
                   F.sum("new_producer_ids").alias("new_producer_ids"))
              .withColumn("bytes_share", F.col("bytes") / F.sum("bytes").over(Window.partitionBy())))
    return totals.orderBy(F.desc("bytes"), *PRINCIPAL).limit(n)


def timeline(intervals: DataFrame, columns: list[str], keep: int, max_points: int) -> dict[str, PandasFrame | Span]:
    """Per-second rates of ``columns`` over time for charts: the ``keep`` principals with the
    most of each column by name, everyone else as "others", in at most ``max_points`` buckets.
    Small by construction: (max_points × (keep + 1)) rows per column. The key ``"span"`` holds
    (first bucket, last bucket, bucket seconds) so charts share one time axis."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    # An aggregate without groups has exactly one row: first() is never None here.
    span = cast("Row", intervals.agg(F.min("interval_start").alias("lo"), F.max("interval_start").alias("hi"),
                                     F.max("interval_seconds").alias("step")).first())
    if span.lo is None:
        return {}
    seconds = (span.hi - span.lo).total_seconds() + span.step
    # A whole number of intervals per bucket, so every bucket averages the same number of them.
    bucket_s = span.step * max(1, int(-(-seconds // (max_points * span.step))))
    bucket = (F.floor(F.unix_timestamp("interval_start") / bucket_s) * bucket_s).cast("timestamp")
    named = intervals.withColumn("principal", F.concat_ws(" / ", *PRINCIPAL))
    out: dict[str, PandasFrame | Span] = {}
    for column in columns:
        ranked = (named.groupBy("principal").agg(F.sum(column).alias("total")).where(F.col("total") > 0)
                  .withColumn("rank", F.row_number().over(Window.orderBy(F.desc("total"), "principal"))))
        labelled = (named.join(ranked.select("principal", "rank"), "principal")
                    .withColumn("series", F.when(F.col("rank") <= keep, F.col("principal")).otherwise("others")))
        out[column] = (labelled.groupBy(bucket.alias("time"), "series")
                       .agg((F.sum(column) / bucket_s).alias("rate")).toPandas())
    first = span.lo.timestamp() // bucket_s * bucket_s
    out["span"] = (first, span.hi.timestamp() // bucket_s * bucket_s, bucket_s)
    return out
