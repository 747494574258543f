"""The charts' timelines (pipeline.demand.timeline) against the same sums done by hand in pandas
on generated usage: the top principals by name per column, everyone else as "others", per bucket,
and a principal whose name would break SQL text charted like any other."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from pipeline.demand import interval_demand, timeline
from pipeline.generate import NOISY, generate

COLUMNS = ["producer_byte_rate", "request_rate", "new_producer_ids", "throttle_time_ms"]


def epoch_s(times: pd.Series) -> pd.Series:
    return (times - pd.Timestamp(0, tz="UTC")) // pd.Timedelta(seconds=1)


def by_hand(usage: pd.DataFrame, column: str, source: str, keep: int, bucket_s: int) -> pd.DataFrame:
    usage = usage.assign(principal=usage["user"] + " / " + usage["client_id"], amount=usage[source].astype(float))
    if column == "producer_byte_rate":
        usage = usage.assign(amount=usage["amount"].where(usage["api_key"] == 0, 0.0))
    totals = usage.groupby("principal")["amount"].sum()
    totals = totals[totals > 0].reset_index().sort_values(["amount", "principal"], ascending=[False, True])
    top = set(totals["principal"].head(keep))
    seconds = epoch_s(usage["interval_start"])
    usage = usage.assign(time=pd.to_datetime(seconds // bucket_s * bucket_s, unit="s"),
                         series=usage["principal"].where(usage["principal"].isin(top), "others"))
    out = usage.groupby(["time", "series"])["amount"].sum().reset_index()
    out = out[out["amount"] != 0].assign(rate=lambda d: d["amount"] / bucket_s)
    return out[["time", "series", "rate"]].sort_values(["time", "series"]).reset_index(drop=True)


@pytest.mark.parametrize("keep, max_points", [(3, 50), (1, 7), (100, 1000)])
def test_each_column_is_the_top_principals_and_the_others_per_bucket(spark, tmp_path, keep, max_points):
    generate(tmp_path / "usage", principals=8, hours=1.0, seed=11)
    usage = pd.concat([pq.read_table(f).to_pandas() for f in sorted(Path(tmp_path / "usage").rglob("*.parquet"))])
    # A client id made to break SQL text: quotes, a backslash and a closing parenthesis.
    odd = "nightly') OR ('1'='1 \\"  # the noisy neighbour's: top of producer bytes
    usage["client_id"] = usage["client_id"].replace(NOISY[1], odd)
    frame = spark.createDataFrame(usage.assign(interval_start=usage["interval_start"].dt.tz_convert("UTC")))
    got = timeline(interval_demand(frame), COLUMNS, keep=keep, max_points=max_points)
    first, last, bucket_s = got["span"]
    seconds = epoch_s(usage["interval_start"])
    assert bucket_s % 10 == 0 and (seconds.max() - seconds.min() + 10) / bucket_s <= max_points
    assert first == seconds.min() // bucket_s * bucket_s and last == seconds.max() // bucket_s * bucket_s
    sources = {"producer_byte_rate": "request_bytes", "request_rate": "requests",
               "new_producer_ids": "new_producer_ids", "throttle_time_ms": "throttle_time_ms_sum"}
    named = set()
    for column in COLUMNS:
        want = by_hand(usage, column, sources[column], keep, int(bucket_s))
        have = got[column].assign(time=pd.to_datetime(got[column]["time"]).dt.tz_localize(None))
        have = have.sort_values(["time", "series"]).reset_index(drop=True)
        pd.testing.assert_frame_equal(have, want, check_dtype=False, check_exact=False, rtol=1e-9)
        named |= set(have["series"])
    assert ("others" in named) == (keep < usage.groupby(["user", "client_id"]).ngroups)
    assert f"{NOISY[0]} / {odd}" in named  # charted by its name like any principal
    assert timeline(interval_demand(frame.limit(0)), COLUMNS, keep, max_points) == {}
