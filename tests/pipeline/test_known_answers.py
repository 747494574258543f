"""The report against a small usage log whose answers are worked out by hand, and the replay
against the proxy's own engines on the same request sequence."""

from __future__ import annotations

import csv
import math

import numpy as np
import pandas as pd
import pytest
import yaml

from config.engines import producer_id_manager_for, quota_manager_for
from config.loader import load_config, parse_config
from pipeline.recommend import admitting, quota_entries, recommended_value
from pipeline.replay import replay, replay_user
from pipeline.report import Options, run_report
from proxy.app.cli import main as cli_main
from proxy.observability.usage_log import UsageAggregator, UsageLogWriter
from quotas.common import CONTROLLER_MUTATION_RATE, PRODUCER_IDS_RATE

from .usage_rows import write_rows

S = 1_800_000_000  # a multiple of 10 and of 3600: intervals and producer-id windows align
PRODUCE, FETCH, CREATE_TOPICS, SHARE_FETCH = 0, 1, 19, 78


# -- the recommendation rule, by hand ------------------------------------------------------------

def test_admitting_share_by_volume():
    t = np.full(4, 10.0)
    # Σ min(r, q)·10 ≥ 0.99 × 1300 → 300 + 10q ≥ 1287 → q = 98.7
    assert admitting(np.array([10.0, 10, 10, 100]), t, 0.99) == pytest.approx(98.7)
    assert admitting(np.array([100.0, 10, 10, 10]), t, 1.0) == pytest.approx(100.0)
    assert admitting(np.array([5.0, 5, 5, 5]), t, 0.5) == pytest.approx(2.5)
    # Longer samples weigh more: 2 s at 10/s and 8 s at 1/s; share 0.5 of 28 = 14 → 2q + 8 = 14.
    assert admitting(np.array([10.0, 1.0]), np.array([2.0, 8.0]), 0.5) == pytest.approx(3.0)
    assert admitting(np.array([0.0, 0.0]), np.array([10.0, 10.0]), 0.99) == 0.0


def test_recommended_value_rounds_up_with_headroom():
    assert recommended_value(980.0, 0.2) == 1176.0
    assert recommended_value(98.7, 0.2) == 119.0  # 118.44 up
    assert recommended_value(0.198, 0.2) == 1.0  # at least 1


def test_quota_entries_follow_kafka_entities():
    rows = [
        {"user": "alice", "client_id": "app", "kind": "producer_byte_rate", "recommended": 10.0},
        {"user": "alice", "client_id": "app", "kind": "request_rate", "recommended": 3.0},
        {"user": "ANONYMOUS", "client_id": "web", "kind": "consumer_byte_rate", "recommended": 7.0},
        {"user": "alice", "client_id": "", "kind": "producer_ids_rate", "recommended": 5.0},
        {"user": "ANONYMOUS", "client_id": "", "kind": "request_rate", "recommended": 2.0},
    ]
    entries, notes = quota_entries(rows)
    assert entries == [
        {"client_id": "web", "consumer_byte_rate": 7},
        {"user": "alice", "producer_ids_rate": 5},
        {"user": "alice", "client_id": "app", "request_rate": 3, "producer_byte_rate": 10},
    ]
    assert len(notes) == 1 and "ANONYMOUS without a client id" in notes[0]


# -- the whole report on a hand-made log --------------------------------------------------------

def _hand_rows() -> list[dict]:
    rows = []
    for i, rate in enumerate([100, 200, 300, 400, 1000]):
        rows.append(dict(start_s=S + 10 * i, user="alice", client_id="app-a", api_key=PRODUCE, requests=10,
                         request_bytes=rate * 10, records=rate, batches=10,
                         throttled=2 if i == 4 else 0, throttle_time_ms_sum=500 if i == 4 else 0,
                         throttle_time_ms_max=300 if i == 4 else 0))
    for i, rate in enumerate([50, 150]):
        rows.append(dict(start_s=S + 10 * i, user="ANONYMOUS", client_id="app-b", api_key=FETCH, requests=10,
                         response_bytes=rate * 10, records=rate))
    rows.append(dict(start_s=S + 10, user="ops", client_id="tf", api_key=CREATE_TOPICS, requests=2,
                     partition_mutations=40, rejected=1))
    for i in range(3):
        rows.append(dict(start_s=S + 10 * i, user="flaky", client_id="fp", api_key=PRODUCE, requests=3,
                         new_producer_ids=3))
    # The overflow row (max_keys_per_interval reached): shown as demand, never given a quota.
    rows.append(dict(start_s=S, user="(other)", client_id="(other)", api_key=3, requests=5))
    return rows


@pytest.fixture(scope="module")
def hand_report(spark, tmp_path_factory):
    root = tmp_path_factory.mktemp("hand")
    write_rows(root / "usage", _hand_rows())
    opts = Options(usage=str(root / "usage"), out=root / "report", quiet=True)
    return run_report(opts, spark)


def _csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _find(rows, **match) -> dict:
    found = [r for r in rows if all(r[k] == v for k, v in match.items())]
    assert len(found) == 1, (match, rows)
    return found[0]


def test_percentiles_are_nearest_rank(hand_report):
    demand = _csv(hand_report.files["demand"])
    a = _find(demand, user="alice", client_id="app-a", kind="producer_byte_rate")
    # rates 100, 200, 300, 400, 1000 bytes/s: nearest rank p50 = 3rd, p95 = p99 = 5th
    assert (float(a["p50"]), float(a["p95"]), float(a["p99"]), float(a["max"])) == (300, 1000, 1000, 1000)
    assert (int(a["samples"]), float(a["total"]), float(a["mean"])) == (5, 20000, 400)
    b = _find(demand, user="ANONYMOUS", client_id="app-b", kind="consumer_byte_rate")
    assert (float(b["p50"]), float(b["max"])) == (50, 150)
    c = _find(demand, user="ops", client_id="tf", kind="controller_mutation_rate")
    assert float(c["p99"]) == 4.0  # 40 partitions in 10 s
    f = _find(demand, user="flaky", kind="producer_ids_rate")
    assert (f["client_id"], float(f["total"]), int(f["samples"])) == ("", 9, 1)  # one window, 9 new ids
    # No kind is reported for a principal that never used it.
    assert not [r for r in demand if r["user"] == "alice" and r["kind"].startswith("consumer")]


def test_recommendations_match_hand_values(hand_report):
    rec = {(r["user"], r["client_id"], r["kind"]): float(r["recommended"])
           for r in _csv(hand_report.files["recommended"])}
    # Rate kinds: the volume-share bound plus one request's worth per 10-s measurement window.
    assert rec[("alice", "app-a", "producer_byte_rate")] == 1224  # (980 + 400 B / 10 s) × 1.2
    assert rec[("alice", "app-a", "producer_record_rate")] == 123  # (98 + 40 / 10) × 1.2 = 122.4
    assert rec[("alice", "app-a", "producer_batch_rate")] == 2  # (0.99 + 0.1) × 1.2 = 1.31
    assert rec[("ANONYMOUS", "app-b", "consumer_byte_rate")] == 190  # (148 + 100 / 10) × 1.2 = 189.6
    assert rec[("ANONYMOUS", "app-b", "consumer_record_rate")] == 19  # (14.8 + 1) × 1.2 = 18.96
    # The token bucket holds bursts: no per-request allowance.
    assert rec[("ops", "tf", "controller_mutation_rate")] == 5  # 3.96 × 1.2 = 4.75
    assert rec[("ops", "tf", "request_rate")] == 1  # (0.198 + 0.1) × 1.2 → at least 1
    assert rec[("flaky", "", "producer_ids_rate")] == 11  # 8.91 × 1.2 = 10.69
    assert not [key for key in rec if key[0] == "(other)"]
    demand = _csv(hand_report.files["demand"])
    assert float(_find(demand, user="(other)", kind="request_rate")["total"]) == 5
    assert "(other)" not in {r["user"] for r in _csv(hand_report.files["replay"])}


def test_recommended_yaml_loads_and_passes_check_config(hand_report, capsys):
    path = hand_report.files["recommended_quotas"]
    assert cli_main(["check-config", str(path)]) == 0
    quotas = {(r.user, r.client_id): dict(r.values) for r in load_config(path).quotas}
    assert quotas[(None, "app-b")]["consumer_byte_rate"] == 190  # ANONYMOUS: a client-id quota
    assert quotas[("alice", "app-a")]["producer_byte_rate"] == 1224
    assert quotas[("flaky", None)] == {PRODUCER_IDS_RATE: 11}


def test_throttling_and_top_talkers(hand_report):
    t = _find(_csv(hand_report.files["throttling"]), user="alice")
    assert (int(t["requests"]), int(t["throttled"]), int(t["throttle_time_ms"])) == (50, 2, 500)
    assert float(t["throttled_ratio"]) == pytest.approx(0.04)
    assert float(t["throttle_time_ratio"]) == pytest.approx(500 / 50_000)
    ops = _find(_csv(hand_report.files["throttling"]), user="ops")
    assert float(ops["rejected_ratio"]) == pytest.approx(0.5)
    top = _csv(hand_report.files["top_talkers"])
    assert [r["user"] for r in top[:2]] == ["alice", "ANONYMOUS"]
    assert float(top[0]["bytes_share"]) == pytest.approx(20000 / 22000)


def test_report_html_names_the_busiest_and_the_most_throttled(hand_report):
    page = hand_report.files["html"].read_text()
    assert "most throttled: alice / app-a" in page
    assert "producer_byte_rate: alice / app-a is 100% of all demand" in page or "alice / app-a" in page
    for name in ("demand.csv", "throttling.csv", "recommended-quotas.yaml", "charts/producer_byte_rate.png",
                 "charts/demand_against_bound.png", "charts/held_back.png"):
        assert name in page
        assert (hand_report.files["html"].parent / name).exists()


def test_the_first_screen_says_who_gets_which_quota_who_stands_out_and_what_the_quotas_would_do(hand_report):
    page = hand_report.files["html"].read_text()
    first = page[page.index("<h2>At a glance</h2>"):page.index("<h2>Demand over time</h2>")]
    headings = ["Who should get which quota", "Who stands out", "What the new quotas would have done",
                "Demand against the recommended bound"]
    assert [first.index(h) for h in headings] == sorted(first.index(h) for h in headings)
    # The quota table: alice / app-a moved the most bytes, so it comes first, with its recommended values.
    table = first[first.index("<table"):first.index("</table>")]
    assert table.index("alice / app-a") < table.index("ANONYMOUS")
    assert "most throttled: alice / app-a" in first
    assert page.index("<h2>At a glance</h2>") < page.index("<h2>Demand over time</h2>") < page.index("Top talkers")


# -- replay = the proxy's engines on the same sequence ------------------------------------------

CANDIDATE = """
upstream: {bootstrap_servers: ["127.0.0.1:9092"]}
producer_id_quota: {producer_id_quota_window_size_seconds: 60}
quotas:
  - user: flaky
    producer_ids_rate: 10
  - user: ops
    client_id: tf
    controller_mutation_rate: 5
"""


def _sequence():
    """(time ms, user, client id, api key, mutations, producer id): a restart loop (a new
    producer id every 2 s for 60 s) and a topic storm (10 partitions a second for 30 s), at the
    times the replay spreads a 10-s row's requests to."""
    events = []
    for k in range(30):
        events.append((S * 1000 + 1000 + 2000 * k, "flaky", "fp", PRODUCE, 0, 1000 + k))
    for k in range(30):
        events.append((S * 1000 + 500 + 1000 * k, "ops", "tf", CREATE_TOPICS, 10, None))
    return sorted(events)


def _engine_rejections(config):
    quotas, producer_ids = quota_manager_for(config), producer_id_manager_for(config)
    rejected = {CONTROLLER_MUTATION_RATE: 0, PRODUCER_IDS_RATE: 0}
    for t, user, client_id, api_key, mutations, pid in _sequence():
        if api_key == CREATE_TOPICS:
            rejected[CONTROLLER_MUTATION_RATE] += not quotas.try_admit(user, client_id, CONTROLLER_MUTATION_RATE,
                                                                       mutations, t).admitted
        else:
            rejected[PRODUCER_IDS_RATE] += not producer_ids.admit(user, [pid], t).admitted
    return rejected


def _logged_sequence(directory):
    """The sequence through the proxy's own usage aggregator and writer."""
    agg = UsageAggregator(10, 1000)
    for t, user, client_id, api_key, mutations, pid in _sequence():
        agg.add(t / 1000, user, client_id, api_key, request_bytes=100, mutations=mutations,
                new_producer_ids=1 if pid is not None else 0)
    writer = UsageLogWriter(directory, "p1")
    for interval in agg.drain(None):
        writer.write(interval)


def test_replay_rejects_what_the_engines_reject(spark, tmp_path):
    config = parse_config(yaml.safe_load(CANDIDATE))
    direct = _engine_rejections(config)
    # By hand: 10 new ids per 60-s window, 30 asked for within one window.
    assert direct[PRODUCER_IDS_RATE] == 20
    assert 0 < direct[CONTROLLER_MUTATION_RATE] < 30

    _logged_sequence(tmp_path / "usage")
    from pipeline.spark import read_usage

    rows = replay(read_usage(spark, str(tmp_path / "usage")), CANDIDATE).toPandas()
    got = {kind: int(rows[(rows.kind == kind)]["rejected_requests"].sum())
           for kind in (CONTROLLER_MUTATION_RATE, PRODUCER_IDS_RATE)}
    assert got == direct
    anyq = rows[rows.kind == "(any)"].set_index("user")
    assert int(anyq.loc["flaky", "rejected_requests"]) == 20
    assert int(anyq.loc["flaky", "requests"]) == 30


def test_replay_of_rate_quota_throttles_like_the_engine():
    """producer_byte_rate: the replay's throttles are the engine's check_and_record answers."""
    config = parse_config(yaml.safe_load(
        'upstream: {bootstrap_servers: ["h:1"]}\nquotas: [{client_id: busy, producer_byte_rate: 1000}]'))
    rows = [dict(interval_start=(S + 10 * i) * 1000, interval_seconds=10, client_id="busy", api_key=PRODUCE,
                 requests=10, request_bytes=b, response_bytes=0, records=0, batches=0, partition_mutations=0,
                 new_producer_ids=0) for i, b in enumerate([5000, 20000, 20000, 5000])]
    out = {r[3]: r for r in replay_user("p1", "ANONYMOUS", pd.DataFrame(rows), config)}
    quotas = quota_manager_for(config)
    throttled = total_ms = 0
    for i, b in enumerate([5000, 20000, 20000, 5000]):
        for k in range(10):
            t = (S + 10 * i) * 1000 + (2 * k + 1) * 10_000 // 20
            ms = quotas.check_and_record("ANONYMOUS", "busy", "producer_byte_rate", b // 10, t).throttle_ms
            throttled += ms > 0
            total_ms += ms
    row = out["producer_byte_rate"]
    assert (row[6], row[7]) == (throttled, total_ms)
    assert throttled > 0 and math.isclose(row[5], 50000)


def test_a_throttled_share_fetch_is_delivered_and_charged_where_a_fetch_is_emptied():
    """Same demand as Fetch and as ShareFetch (KIP-932): a throttled Fetch is emptied and its
    bytes un-recorded (KafkaApis), so its records are not charged; a throttled ShareFetch is
    delivered (the proxy never empties a share fetch), its bytes stay and its records count."""
    config = parse_config(yaml.safe_load(
        'upstream: {bootstrap_servers: ["h:1"]}\n'
        'quotas: [{client_id: c, consumer_byte_rate: 1000, consumer_record_rate: 10}]\n'
        'rate_limiters: [{class: "quotas.limiters:RecordRateLimiter"}]'))

    def replayed(api_key: int) -> dict:
        rows = [dict(interval_start=(S + 10 * i) * 1000, interval_seconds=10, client_id="c", api_key=api_key,
                     requests=10, request_bytes=0, response_bytes=30_000, records=300, batches=10,
                     partition_mutations=0, new_producer_ids=0) for i in range(3)]
        return {r[3]: r for r in replay_user("p1", "ANONYMOUS", pd.DataFrame(rows), config)}

    fetch, share = replayed(FETCH), replayed(SHARE_FETCH)
    assert fetch["consumer_byte_rate"][6] > 0 and share["consumer_byte_rate"][6] > 0  # both throttled
    # Delivered bytes stay recorded: the share consumer is throttled longer.
    assert share["consumer_byte_rate"][7] > fetch["consumer_byte_rate"][7]
    # And its records are charged, where the emptied fetches delivered none to charge.
    assert share["consumer_record_rate"][7] > fetch["consumer_record_rate"][7]


def test_events_spread_requests_and_split_amounts():
    from pipeline.replay import events

    rows = pd.DataFrame([dict(interval_start=10_000, interval_seconds=10, client_id="c", api_key=0, requests=3,
                              request_bytes=10, response_bytes=0, records=2, batches=0, partition_mutations=0,
                              new_producer_ids=0),
                         dict(interval_start=10_000, interval_seconds=10, client_id="c", api_key=1, requests=40,
                              request_bytes=0, response_bytes=25, records=0, batches=0, partition_mutations=0,
                              new_producer_ids=0)])
    row, t, (reqs, req_bytes, resp_bytes, records, *_) = events(rows, max_events=5)
    produce = row == 0
    assert t[produce].tolist() == [11_666, 15_000, 18_333]  # middles of three equal slices
    assert req_bytes[produce].tolist() == [4, 3, 3] and records[produce].tolist() == [1, 1, 0]
    fetch = row == 1  # 40 requests, at most 5 events of 8 requests each
    assert reqs[fetch].tolist() == [8] * 5 and resp_bytes[fetch].sum() == 25
    assert t.tolist() == sorted(t.tolist())


def test_candidate_replay_and_no_replay(spark, tmp_path):
    """--candidate replays that file (not the recommendation); --no-replay skips the step."""
    write_rows(tmp_path / "usage", _hand_rows())
    candidate = tmp_path / "candidate.yaml"
    candidate.write_text('upstream: {bootstrap_servers: ["h:1"]}\n'
                         "quotas: [{user: alice, client_id: app-a, producer_byte_rate: 100}]\n")
    result = run_report(Options(usage=str(tmp_path / "usage"), out=tmp_path / "with", candidate=candidate,
                                quiet=True), spark)
    replayed = _csv(result.files["replay"])
    alice = _find(replayed, user="alice", kind="producer_byte_rate")
    assert int(alice["requests"]) == 50 and int(alice["throttled_requests"]) > 0
    # Under the candidate only alice has a quota: nobody else is held back.
    others = [r for r in replayed if r["user"] != "alice"]
    assert others and all(int(r["throttled_requests"]) == 0 and int(r["rejected_requests"]) == 0 for r in others)
    assert str(candidate) in result.files["html"].read_text()

    skipped = run_report(Options(usage=str(tmp_path / "usage"), out=tmp_path / "without", replay=False,
                                 quiet=True), spark)
    assert "replay" not in skipped.files and not (tmp_path / "without" / "replay.csv").exists()
    assert skipped.files["recommended_quotas"].exists()


def test_too_few_principals_to_judge_outliers_is_said(hand_report):
    # Four principals: nobody has the five others the outlier rule needs.
    recommended = _csv(hand_report.files["recommended"])
    assert not [r for r in recommended if r["outlier"] == "True"]
    assert all(r["recommended"] == r["own_recommended"] for r in recommended)
    assert _find(recommended, user="alice", kind="producer_byte_rate")["reason"] == \
        "not judged for outliers: 1 other principal of this kind, 5 needed"
    note = ("outliers not judged for request_rate (4 principals), producer_byte_rate (2 principals), ")
    assert f"# {note}" in hand_report.files["recommended_quotas"].read_text()
    assert note in hand_report.files["html"].read_text()
    assert not [r for r in _csv(hand_report.files["demand"]) if r["outlier"] == "True"]
