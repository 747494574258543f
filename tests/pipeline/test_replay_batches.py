"""Per-group work streamed over a task's Arrow batches (pipeline.groups): each group whole and in
order however the batches cut the rows; and on Spark, the replay and the recommendations the
same as each group's on its own."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.generate import generate
from pipeline.groups import groups_of
from pipeline.replay import REPLAY_COLUMNS, candidate, replay, replay_user

CANDIDATE = yaml.safe_dump({
    "upstream": {"bootstrap_servers": ["h:1"]},
    "quotas": [{"user": "<default>", "client_id": "<default>", "request_rate": 3, "producer_byte_rate": 20_000,
                "consumer_byte_rate": 20_000},
               {"user": "<default>", "producer_ids_rate": 2}],
})


KEYS = ("proxy", "user")


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> pd.DataFrame:
    """Generated usage of two proxies, sorted as the replay's tasks sort it."""
    out = tmp_path_factory.mktemp("generated")
    generate(out, principals=5, hours=0.3, seed=5, proxies=2)
    usage = pd.concat([pq.read_table(f).to_pandas() for f in sorted(Path(out).rglob("*.parquet"))])
    usage["interval_start"] = usage["interval_start"].astype("int64") // 10**6
    return (usage[["proxy", "user", *REPLAY_COLUMNS]]
            .sort_values(["proxy", "user", "interval_start", "client_id", "api_key"], kind="stable")
            .reset_index(drop=True))


def batches(rows: pd.DataFrame, cuts: list[int]) -> list[pd.DataFrame]:
    edges = [0, *sorted(cuts), len(rows)]
    return [rows.iloc[a:b] for a, b in itertools.pairwise(edges)]  # some empty when cuts repeat


@pytest.mark.parametrize("seed", range(8))
def test_every_user_comes_whole_and_in_order_however_the_batches_cut(rows, seed):
    rng = np.random.default_rng(seed)
    cuts = [*rng.integers(0, len(rows), int(rng.integers(0, 60))).tolist(), 1, 1, len(rows) - 1]
    got = list(groups_of(batches(rows, cuts), KEYS))
    want = [g.reset_index(drop=True) for _, g in rows.groupby(["proxy", "user"], sort=True)]
    assert len(got) == len(want) > 5
    for g, w in zip(got, want):
        pd.testing.assert_frame_equal(g, w)


def test_one_row_batches_and_no_batches(rows):
    head = rows.iloc[:40]
    got = list(groups_of([head.iloc[i:i + 1] for i in range(len(head))], KEYS))
    assert sum(len(g) for g in got) == 40
    assert [tuple(g[["proxy", "user"]].iloc[0]) for g in got] == \
        list(dict.fromkeys(map(tuple, head[["proxy", "user"]].to_numpy().tolist())))
    assert list(groups_of([], KEYS)) == []


def test_the_replay_on_spark_gives_each_users_own_replay(spark, rows):
    usage = rows.assign(interval_start=pd.to_datetime(rows["interval_start"], unit="ms", utc=True))
    got = replay(spark.createDataFrame(usage), CANDIDATE, 10).toPandas()
    config = candidate(CANDIDATE)
    own = sorted(r for (proxy, user), g in rows.groupby(["proxy", "user"])
                 for r in replay_user(proxy, user, g.reset_index(drop=True), config, 10))
    assert sorted(tuple(r) for r in got.itertuples(index=False)) == own
    assert (got["throttled_requests"] + got["rejected_requests"]).sum() > 0  # the candidate holds some back
