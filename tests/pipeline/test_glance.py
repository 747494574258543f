"""The report's first screen from pandas tables (no Spark): the quota table, what the new
quotas would have held back, and the two charts."""

from __future__ import annotations

import pandas as pd

from pipeline import glance


def recommended() -> pd.DataFrame:
    return pd.DataFrame([
        {"user": "alice", "client_id": "app", "kind": "producer_byte_rate", "recommended": 1_048_576.0,
         "outlier": False},
        {"user": "alice", "client_id": "app", "kind": "request_rate", "recommended": 40.0, "outlier": False},
        {"user": "bob", "client_id": "", "kind": "producer_byte_rate", "recommended": 2_000.0, "outlier": True},
        {"user": "carol", "client_id": "x", "kind": "consumer_byte_rate", "recommended": 5.0, "outlier": False},
    ])


def test_the_quota_table_puts_outliers_then_the_biggest_talkers_first():
    talkers = pd.DataFrame({"user": ["carol", "alice"], "client_id": ["x", "app"], "bytes": [9e9, 1e9]})
    table = glance.quota_table(recommended(), talkers)
    # bob, an outlier, moved the fewest bytes: first all the same; then by bytes moved.
    assert list(table["principal"]) == ["bob", "carol / x", "alice / app"]
    assert list(table["producer_byte_rate"]) == ["2,000", "", "1,048,576"]
    assert list(table["request_rate"]) == ["", "", "40"]
    assert list(table["outlier"]) == ["producer_byte_rate", "", ""]
    assert glance.quota_table(recommended(), talkers, rows=1)["principal"].tolist() == ["bob", "carol / x"]


def test_held_back_compares_the_log_with_the_replay():
    throttled = pd.DataFrame({"user": ["alice", "bob"], "client_id": ["app", ""], "requests": [100, 10],
                              "throttled": [5, 0], "rejected": [5, 0]})
    replayed = pd.DataFrame([
        {"proxy": "p1", "user": "alice", "client_id": "app", "kind": "(any)", "requests": 60,
         "throttled_requests": 30, "rejected_requests": 0},
        {"proxy": "p2", "user": "alice", "client_id": "app", "kind": "(any)", "requests": 40,
         "throttled_requests": 10, "rejected_requests": 10},
        {"proxy": "p1", "user": "alice", "client_id": "app", "kind": "request_rate", "requests": 60,
         "throttled_requests": 30, "rejected_requests": 0},
    ])
    table = glance.held_back(throttled, replayed, [("alice", "app"), ("bob", "")])
    alice, bob = table.to_dict("records")
    # alice: 10 of 100 held back in the log; 30 + 10 + 10 of 100 in the replay (its two proxies).
    assert alice == {"principal": "alice / app", "requests": 100.0, "held_in_log": 0.1, "held_in_replay": 0.5}
    assert (bob["held_in_log"], pd.isna(bob["held_in_replay"])) == (0.0, True)  # not in the replay


def test_the_charts_are_drawn_and_left_out_when_there_is_nothing(tmp_path):
    times = pd.to_datetime([1_800_000_000 + 60 * i for i in range(10)], unit="s")
    pdf = pd.DataFrame({"time": list(times) * 2, "series": ["alice / app"] * 10 + ["others"] * 10,
                        "rate": [float(i * 300_000) for i in range(10)] + [1.0] * 10})
    path = tmp_path / "bound.png"
    assert glance.bound_chart(pdf, {"alice / app": 1_048_576.0}, "Produce", "bytes/s", path)
    assert path.stat().st_size > 5_000
    assert not glance.bound_chart(pdf[pdf["series"] == "others"], {}, "Produce", "bytes/s", tmp_path / "none.png")
    assert not glance.bound_chart(None, {}, "Produce", "bytes/s", tmp_path / "none.png")
    held = pd.DataFrame({"principal": ["alice / app"], "requests": [100.0], "held_in_log": [0.1],
                         "held_in_replay": [0.5]})
    assert glance.held_back_chart(held, tmp_path / "held.png") and (tmp_path / "held.png").stat().st_size > 5_000
    without_replay = held.assign(held_in_replay=[None])
    assert not glance.held_back_chart(without_replay, tmp_path / "no-replay.png")
    assert not (tmp_path / "none.png").exists() and not (tmp_path / "no-replay.png").exists()
