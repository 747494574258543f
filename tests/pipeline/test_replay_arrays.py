"""The replay with its windowed rates over whole arrays (pipeline.replay_arrays) against the
replay through the engines event by event (pipeline.replay.run_events): the very same rows
(throttled and rejected requests, throttle milliseconds, rejected amounts) for every principal
of generated usage under loose, tight and very tight candidates, at client and user level, with
Fetch throttles that un-record, KIP-936 and KIP-599 rejections, and a hand-made log."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml

import pipeline.replay_arrays
from config.loader import parse_config
from pipeline.generate import generate
from pipeline.kinds import FETCH, PRODUCE, SHARE_FETCH
from pipeline.replay import REPLAY_COLUMNS, replay_user


def candidate(scale: float, level: dict) -> object:
    """Bounds for every kind at ``scale`` times a typical tenant's demand, on the entity ``level``."""
    values = {"producer_byte_rate": 150_000 * scale, "consumer_byte_rate": 150_000 * scale,
              "request_rate": 20 * scale, "producer_record_rate": 500 * scale, "producer_batch_rate": 30 * scale,
              "consumer_record_rate": 500 * scale, "controller_mutation_rate": max(1.0, 5 * scale),
              "producer_ids_rate": max(1.0, 50 * scale)}
    pids = {"producer_ids_rate": values.pop("producer_ids_rate")}  # user-level only (KIP-936)
    quotas = ([{**level, **values, **pids}] if "client_id" not in level
              else [{**level, **values}, {"user": "<default>", **pids}])
    # The default rate limiters enforce the record and batch rates.
    return parse_config({"upstream": {"bootstrap_servers": ["h:1"]}, "quotas": quotas}, filters=False)


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> list[tuple[tuple[str, str], pd.DataFrame]]:
    out = tmp_path_factory.mktemp("generated")
    generate(out, principals=6, hours=0.5, seed=3, proxies=2)
    rows = pd.concat([pq.read_table(f).to_pandas() for f in sorted(Path(out).rglob("*.parquet"))])
    rows["interval_start"] = rows["interval_start"].astype("int64") // 10**6
    return [(key, group.sort_values(["interval_start", "client_id", "api_key"])[list(REPLAY_COLUMNS)]
             .reset_index(drop=True)) for key, group in rows.groupby(["proxy", "user"])]


@pytest.mark.parametrize("scale", [0.05, 0.3, 1.0, 20.0])
@pytest.mark.parametrize("level", [{"user": "<default>", "client_id": "<default>"}, {"user": "<default>"}],
                         ids=["client-level", "user-level"])
def test_generated_usage_replays_alike(generated, scale, level):
    config = candidate(scale, level)
    held = 0
    for (proxy, user), rows in generated:
        arrays = replay_user(proxy, user, rows, config, 10, arrays=True)
        engines = replay_user(proxy, user, rows, config, 10, arrays=False)
        assert arrays == engines, (proxy, user)
        held += sum(r[6] + r[8] for r in engines)
    if scale < 1:
        assert held > 0  # the candidates at these scales hold something back: the comparison means something


def test_fetches_that_need_the_engine_after_too_many_rounds_replay_alike(generated, monkeypatch):
    monkeypatch.setattr(pipeline.replay_arrays, "MAX_ROUNDS", 1)  # straight to the event-by-event fallback
    config = candidate(0.05, {"user": "<default>", "client_id": "<default>"})
    for (proxy, user), rows in generated:
        assert replay_user(proxy, user, rows, config, 10, arrays=True) == \
            replay_user(proxy, user, rows, config, 10, arrays=False)


def test_a_hand_made_log_replays_alike():
    """Rows without requests, the same instant twice, Fetch and ShareFetch of two clients of one
    user sharing a user-level quota, and a long idle gap that purges the samples."""
    def row(t_s, cid, api, requests, **amounts):
        base = dict(interval_start=t_s * 1000, interval_seconds=10, client_id=cid, api_key=api, requests=requests,
                    request_bytes=0, response_bytes=0, records=0, batches=0, partition_mutations=0,
                    new_producer_ids=0)
        return {**base, **amounts}

    rows = pd.DataFrame([
        row(0, "a", FETCH, 10, response_bytes=90_000, records=900),
        row(0, "b", SHARE_FETCH, 5, response_bytes=40_000, records=400),
        row(10, "a", FETCH, 0),
        row(10, "b", PRODUCE, 3, request_bytes=30_000, records=30, batches=3, new_producer_ids=2),
        row(20, "a", FETCH, 10, response_bytes=5_000, records=50),
        row(500, "a", FETCH, 7, response_bytes=70_000, records=700),
        row(510, "b", SHARE_FETCH, 9, response_bytes=180_000, records=1800),
    ]).sort_values(["interval_start", "client_id"]).reset_index(drop=True)
    text = yaml.safe_dump({"upstream": {"bootstrap_servers": ["h:1"]},
                           "quotas": [{"user": "<default>", "consumer_byte_rate": 2000, "request_rate": 1,
                                       "consumer_record_rate": 20, "producer_byte_rate": 500,
                                       "producer_ids_rate": 1}]})
    config = parse_config(yaml.safe_load(text), filters=False)
    for max_events in (1, 3, 10):
        engines = replay_user("p", "ANONYMOUS", rows, config, max_events, arrays=False)
        assert replay_user("p", "ANONYMOUS", rows, config, max_events, arrays=True) == engines
        assert sum(r[6] for r in engines) > 0


def test_demand_per_client_and_kind_is_what_the_rows_hold(generated):
    from pipeline.replay import _CHARGES, ANY, _demand

    for _, rows in generated:
        want: dict = {}
        for kind, (column, apis) in _CHARGES.items():  # the plain pandas reading of the rows
            on = rows if apis is None else rows[rows["api_key"].isin(sorted(apis))]
            on = on[on[column] > 0]
            for client_id, g in on.groupby("client_id", sort=False):
                want[(client_id, kind)] = [int(g["requests"].sum()), float(g[column].sum())]
        for client_id, g in rows.groupby("client_id", sort=False):
            want[(client_id, ANY)] = [int(g["requests"].sum()), float(g["requests"].sum())]
        assert _demand(rows) == want
