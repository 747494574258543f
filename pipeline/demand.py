"""Per-principal demand from the usage log: per-interval amounts for each quota kind, with the
DataFrame API (nothing raw reaches the driver), and the per-principal tables (throttling, shadow
mode, top talkers) from one aggregate row per principal. Each kind's percentiles come with its
recommendation, in one pass over its samples (pipeline.recommend).

A principal is (user, client id), Kafka's finest quota entity. Each proxy enforces its own
quotas, so a sample is one principal's demand at one proxy in one interval.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quotas.common import CONTROLLER_MUTATION_RATE, REQUEST_RATE

from .frames import PandasFrame, PandasSeries
from .kinds import DEMAND, RATE_KINDS

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

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


def producer_id_windows(usage: DataFrame, window_s: float) -> DataFrame:
    """New producer ids per (proxy, user, window), windows of ``window_s`` from the epoch
    (tumbling: a burst across a window edge is split; the quota's own window slides), from usage
    rows or :func:`interval_demand`'s (the same sums)."""
    from pyspark.sql import functions as F

    start = F.floor(F.unix_timestamp("interval_start") / window_s) * window_s
    return (usage.where(F.col("new_producer_ids") > 0)
            .groupBy("proxy", "user", start.alias("window_start"))
            .agg(F.sum("new_producer_ids").cast("double").alias("amount")))


def per_principal(intervals: DataFrame) -> DataFrame:
    """One row per (user, client_id), every sum the per-principal tables need, in one pass over
    the intervals: requests, active seconds, throttling and shadow throttling, bytes, partition
    mutations, new producer ids, and per rate kind ``<kind>__requests`` (the requests of the APIs
    that kind charges, whether it had any demand of the kind or not)."""
    from pyspark.sql import functions as F

    sums = [F.sum(REQUEST_RATE).alias("requests"), F.sum("interval_seconds").alias("active_seconds"),
            F.sum("bytes").alias("bytes"), F.sum(CONTROLLER_MUTATION_RATE).alias("partition_mutations"),
            F.sum("new_producer_ids").alias("new_producer_ids")]
    for prefix in ("", "shadow_"):
        sums += [F.sum(f"{prefix}{c}").alias(f"{prefix}{c}") for c in ("throttled", "rejected", "throttle_time_ms")]
    sums += [F.sum(f"{kind}__requests").alias(f"{kind}__requests") for kind in RATE_KINDS]
    return intervals.groupBy(*PRINCIPAL).agg(*sums)


def _ratio(part: PandasSeries, whole: PandasSeries) -> PandasSeries:
    """part / whole, empty (not infinite) where whole is 0, as Spark's division gives null."""
    return (part / whole.where(whole != 0)).astype("float64")


def throttling(principals: PandasFrame) -> PandasFrame:
    """Per (user, client_id) of :func:`per_principal`'s rows: requests, how many were throttled or
    rejected, and the throttle time per second of activity (1.0: throttled all the time it was
    active); then the same for what quotas in shadow mode would have done (``shadow_*``), none of
    which was applied. Most throttle time first."""
    out = principals.copy()
    for prefix in ("", "shadow_"):
        out[f"{prefix}throttled_ratio"] = _ratio(principals[f"{prefix}throttled"], principals["requests"])
        out[f"{prefix}rejected_ratio"] = _ratio(principals[f"{prefix}rejected"], principals["requests"])
        out[f"{prefix}throttle_time_ratio"] = _ratio(principals[f"{prefix}throttle_time_ms"],
                                                     principals["active_seconds"] * 1000.0)
    columns = [*PRINCIPAL, "requests", "throttled", "rejected", "throttle_time_ms", "active_seconds",
               "throttled_ratio", "rejected_ratio", "throttle_time_ratio",
               "shadow_throttled", "shadow_rejected", "shadow_throttle_time_ms",
               "shadow_throttled_ratio", "shadow_rejected_ratio", "shadow_throttle_time_ratio"]
    return (out[columns].sort_values(["throttle_time_ms", *PRINCIPAL], ascending=[False, True, True], kind="stable")
            .reset_index(drop=True))


def shadow_affected(throttled: PandasFrame) -> PandasFrame:
    """The principals quotas in shadow mode would have throttled or rejected (of
    :func:`throttling`'s rows), most affected first: by the larger of the two shares of its
    requests (a request can be both), then by the throttle time it would have waited per second
    of activity."""
    hit = throttled[(throttled["shadow_throttled"] > 0) | (throttled["shadow_rejected"] > 0)].copy()
    hit["_held"] = hit[["shadow_throttled_ratio", "shadow_rejected_ratio"]].max(axis=1)
    hit = hit.sort_values(["_held", "shadow_throttle_time_ratio", *PRINCIPAL], ascending=[False, False, True, True],
                          kind="stable")
    columns = [*PRINCIPAL, "requests", "shadow_throttled", "shadow_throttled_ratio", "shadow_rejected",
               "shadow_rejected_ratio", "shadow_throttle_time_ms", "shadow_throttle_time_ratio"]
    return hit[columns].reset_index(drop=True)


def principal_kinds(principals: PandasFrame) -> PandasFrame:
    """Per (user, client_id): per rate kind ``<kind>__requests`` (see :func:`per_principal`)."""
    return principals[[*PRINCIPAL, *(f"{kind}__requests" for kind in RATE_KINDS)]].reset_index(drop=True)


def top_talkers(principals: PandasFrame, n: int) -> PandasFrame:
    """The ``n`` principals that moved the most bytes, with their share of all bytes."""
    out = principals[[*PRINCIPAL, "bytes", "requests", "partition_mutations", "new_producer_ids"]].copy()
    total = out["bytes"].sum()
    out["bytes_share"] = out["bytes"] / total if total else float("nan")
    out = out.sort_values(["bytes", *PRINCIPAL], ascending=[False, True, True], kind="stable")
    return out.head(n).reset_index(drop=True)


def timeline(intervals: DataFrame, columns: list[str], keep: int, max_points: int) -> dict[str, PandasFrame | Span]:
    """Per-second rates of ``columns`` over time for charts: the ``keep`` principals with the
    most of each column by name, everyone else as "others", in at most ``max_points`` buckets
    (a bucket where a series had none has no row). Small by construction: (max_points × (keep +
    1)) rows per column. The key ``"span"`` holds (first bucket, last bucket, bucket seconds) so
    charts share one time axis. Two passes over the intervals, whatever the columns: totals per
    principal (and the span), then every column's series per bucket."""
    from pyspark.sql import functions as F

    principal = F.concat_ws(" / ", *PRINCIPAL)
    totals: PandasFrame = (intervals.groupBy(principal.alias("principal"))
                           .agg(F.min("interval_start").alias("lo"), F.max("interval_start").alias("hi"),
                                F.max("interval_seconds").alias("step"),
                                *[F.sum(c).alias(c) for c in columns]).toPandas())
    if totals.empty:
        return {}
    lo, hi, step = totals["lo"].min(), totals["hi"].max(), int(totals["step"].max())
    seconds = (hi - lo).total_seconds() + step
    # A whole number of intervals per bucket, so every bucket averages the same number of them.
    bucket_s = step * max(1, int(-(-seconds // (max_points * step))))
    bucket = (F.floor(F.unix_timestamp("interval_start") / bucket_s) * bucket_s).cast("timestamp")
    named = {}
    for c in columns:
        top = totals[totals[c] > 0].sort_values([c, "principal"], ascending=[False, True], kind="stable")
        named[c] = top["principal"].head(keep).tolist()
    # (column, series, amount) per interval row: a named principal, or "others"; zeros dropped.
    # Names are the clients' own strings: columns and literals, never SQL text.
    who = F.col("principal")
    parts = F.array(*[F.struct(F.lit(c).alias("kind"),
                               F.when(who.isin(named[c]), who).otherwise(F.lit("others")).alias("series"),
                               F.col(c).cast("double").alias("amount")) for c in columns])
    rates: PandasFrame = (intervals.select(bucket.alias("time"), principal.alias("principal"), *columns)
                          .select("time", F.explode(parts).alias("part"))
                          .select("time", "part.kind", "part.series", "part.amount")
                          .where(F.col("amount") != 0)
                          .groupBy("time", "kind", "series").agg((F.sum("amount") / bucket_s).alias("rate"))
                          .toPandas())
    out: dict[str, PandasFrame | Span] = {
        c: rates[rates["kind"] == c][["time", "series", "rate"]].reset_index(drop=True) for c in columns}
    first = lo.timestamp() // bucket_s * bucket_s
    out["span"] = (first, hi.timestamp() // bucket_s * bucket_s, bucket_s)
    return out

