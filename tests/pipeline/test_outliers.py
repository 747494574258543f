"""The outlier rule on small hand-made inputs, answers worked out by hand (no Spark)."""

from __future__ import annotations

import pandas as pd
import pytest
import yaml

from config.loader import load_config
from pipeline.headlines import outlier_headlines
from pipeline.kinds import ALL_KINDS, RATE_KINDS
from pipeline.outliers import (
    FLOORS,
    Rule,
    assess,
    bound_from_rest,
    judge,
    mark,
    nearest_rank,
    outlier_rows,
    parse_floors,
    population_words,
    replay_outcome,
)
from pipeline.recommend import entity_key, quota_entries, quotas_yaml
from proxy.app.cli import main as cli_main
from quotas.common import (
    CONSUMER_BYTE_RATE,
    CONSUMER_RECORD_RATE,
    CONTROLLER_MUTATION_RATE,
    PRODUCER_BYTE_RATE,
    PRODUCER_IDS_RATE,
    REQUEST_RATE,
)

NO_FLOOR = Rule(floors={})


def test_nearest_rank_is_the_ceil_q_n_th_smallest():
    values = [7, 1, 10, 3, 2, 9, 4, 8, 6, 5]
    assert nearest_rank(values, 0.9) == 9  # ⌈9.0⌉ = 9th of 10
    assert nearest_rank(values, 0.91) == 10  # ⌈9.1⌉ = 10th
    assert nearest_rank(values, 1.0) == 10
    assert nearest_rank(values, 0.01) == 1
    assert nearest_rank([4, 4, 4], 0.9) == 4
    assert nearest_rank([], 0.9) == 0.0


def _fleet(*values, abuser=None) -> dict:
    stats = {(f"t{i}", "c"): float(v) for i, v in enumerate(values)}
    if abuser is not None:
        stats[("loop", "c")] = float(abuser)
    return stats


def test_an_outlier_is_above_factor_times_the_others_percentile():
    verdicts = judge(_fleet(*range(1, 11), abuser=200), PRODUCER_IDS_RATE, NO_FLOOR)
    loop = verdicts[("loop", "c")]
    # The others are 1..10: their p90 is 9, the threshold 90.
    assert (loop.others, loop.fleet, loop.threshold, loop.outlier) == (10, 9, 90, True)
    # t9 (10) against 1..9 and 200: p90 is 9 again; the abuser among the others does not move it.
    assert verdicts[("t9", "c")].fleet == 9 and not verdicts[("t9", "c")].outlier
    assert [k for k, v in verdicts.items() if v.outlier] == [("loop", "c")]


def test_the_floor_raises_the_threshold():
    rule = Rule(floors={PRODUCER_IDS_RATE: 300})
    assert not judge(_fleet(*range(1, 11), abuser=200), PRODUCER_IDS_RATE, rule)[("loop", "c")].outlier
    v = judge(_fleet(*range(1, 11), abuser=301), PRODUCER_IDS_RATE, rule)[("loop", "c")]
    assert (v.threshold, v.outlier) == (300, True)


def test_equal_to_the_threshold_is_not_an_outlier():
    v = judge(_fleet(*range(1, 11), abuser=90), PRODUCER_IDS_RATE, NO_FLOOR)[("loop", "c")]
    assert v.threshold == 90 and not v.outlier


def test_too_few_other_principals_flags_nobody():
    verdicts = judge(_fleet(1, 1, 1, 1, abuser=1e9), PRODUCER_IDS_RATE, NO_FLOOR)  # 4 others, 5 needed
    assert all(v.threshold is None and not v.outlier for v in verdicts.values())
    assert judge(_fleet(1, 1, 1, 1, abuser=1e9), PRODUCER_IDS_RATE, Rule(min_principals=4, floors={})
                 )[("loop", "c")].outlier


def test_an_idle_fleet_flags_nobody():
    # Nobody else created a topic: the threshold is the floor (10 partitions/s by default).
    verdicts = judge(_fleet(*[0] * 20, abuser=9.5), CONTROLLER_MUTATION_RATE, Rule())
    assert verdicts[("loop", "c")].threshold == FLOORS[CONTROLLER_MUTATION_RATE]
    assert not any(v.outlier for v in verdicts.values())
    # All idle, even without a floor: 0 is not above 10 × 0.
    assert not any(v.outlier for v in judge(_fleet(*[0] * 20), REQUEST_RATE, NO_FLOOR).values())


def test_ties_two_equal_abusers_are_both_flagged_an_equal_fleet_nobody():
    stats = _fleet(*range(1, 19))
    stats[("loop", "a")] = stats[("loop", "b")] = 500.0
    flagged = {k for k, v in judge(stats, PRODUCER_IDS_RATE, NO_FLOOR).items() if v.outlier}
    assert flagged == {("loop", "a"), ("loop", "b")}  # each one's p90 of others: 17, the other at the top
    assert not any(v.outlier for v in judge(_fleet(*[50] * 12), PRODUCER_IDS_RATE, NO_FLOOR).values())


def test_bound_from_the_rest():
    rule = Rule(floors={PRODUCER_IDS_RATE: 100})
    others = [120, 130, 140, 150, 160, 170, 180, 190, 200, 210]
    assert bound_from_rest(2139, others, PRODUCER_IDS_RATE, rule) == (200, 200)  # p90: 9th of 10
    assert bound_from_rest(2139, [0] * 11, PRODUCER_IDS_RATE, rule) == (100, 0)  # the floor
    assert bound_from_rest(150, others, PRODUCER_IDS_RATE, rule) == (150, 200)  # never above its own
    assert bound_from_rest(50, [0] * 11, PRODUCER_IDS_RATE, NO_FLOOR) == (1, 0)  # a quota of 0 refuses all
    assert bound_from_rest(5, [0.5] * 5, PRODUCER_IDS_RATE, Rule(floors={PRODUCER_IDS_RATE: 2.5}))[0] == 3


def test_assess_counts_principals_without_demand_and_says_why():
    steady = [(f"t{i}", "") for i in range(10)]
    population = {PRODUCER_IDS_RATE: [*steady, ("loop", "")], REQUEST_RATE: [("a", "x"), ("b", "y")]}
    stats = {(PRODUCER_IDS_RATE, ("loop", "")): 1800.0, (PRODUCER_IDS_RATE, ("t0", "")): 2.0,
             (REQUEST_RATE, ("a", "x")): 1e6}
    recommended = {(PRODUCER_IDS_RATE, ("loop", "")): 2139.0, (PRODUCER_IDS_RATE, ("t0", "")): 3.0,
                   (REQUEST_RATE, ("a", "x")): 1.2e6}
    verdicts, flags, notes = assess(population, stats, recommended, Rule())
    assert len(verdicts) == 13
    (flag,) = flags
    assert flag.verdict.key == ("loop", "") and (flag.own, flag.bound, flag.fleet_recommended) == (2139, 100, 0)
    assert flag.reason == (
        "outlier: p99 1,800 new producer ids per 3600-s window, where the p90 of the other 10 principals is 0; "
        "threshold 100 (the floor); bound 100 from the floor, above the p90 of the other 10 principals' "
        "recommendations (0), not 2,139 from its own demand")
    assert notes == ["outliers not judged for request_rate (2 principals): 5 other principals of a kind needed "
                     "(--outlier-min-principals)"]


def test_an_outlier_headline_says_who_the_other_principals_are():
    """"the other N principals" counts the kind's population, not every principal of the log:
    the headline says which population that is."""
    steady = [(f"t{i}", "") for i in range(10)]
    population = {PRODUCER_IDS_RATE: [*steady, ("loop", "")],
                  CONTROLLER_MUTATION_RATE: [(f"t{i}", "c") for i in range(20)] + [("storm", "tf")]}
    stats = {(PRODUCER_IDS_RATE, ("loop", "")): 1800.0, (CONTROLLER_MUTATION_RATE, ("storm", "tf")): 84.0}
    recommended = {(PRODUCER_IDS_RATE, ("loop", "")): 2139.0, (CONTROLLER_MUTATION_RATE, ("storm", "tf")): 85.0}
    _, flags, notes = assess(population, stats, recommended, Rule())
    lines = outlier_headlines(flags, notes)
    assert [line.rsplit("; ", 1)[1] for line in lines] == [
        "producer_ids_rate is judged among the users that sent Produce",
        "controller_mutation_rate is judged among every principal in the log"]
    assert "other 10 principals" in lines[0] and "other 20 principals" in lines[1]
    assert {population_words(kind) for kind in ALL_KINDS} == {
        "every principal in the log", "the users that sent Produce", "the principals that sent Produce",
        "the principals that sent Fetch or ShareFetch"}


def test_assess_bound_from_the_others_recommendations():
    population = {PRODUCER_BYTE_RATE: [(f"t{i}", "c") for i in range(10)] + [("bulk", "c")]}
    stats = {(PRODUCER_BYTE_RATE, (f"t{i}", "c")): 1e6 * (i + 1) for i in range(10)}
    stats[(PRODUCER_BYTE_RATE, ("bulk", "c"))] = 1e9
    recommended = {(PRODUCER_BYTE_RATE, k): v * 1.5 for (_, k), v in stats.items()}
    _, (flag,), _ = assess(population, stats, recommended, Rule())
    # Others' p99: 1..10 MB/s, their p90 9 MB/s, threshold 90 MB/s; bound: their p90 recommendation.
    assert (flag.verdict.fleet, flag.verdict.threshold, flag.bound) == (9e6, 9e7, 1.35e7)
    assert "111× the p90 of the other 10 principals (9,000,000); threshold 90,000,000 (10 × p90)" in flag.reason
    assert "bound 13,500,000 from the p90 of the other 10 principals' recommendations, not 1,500,000,000" \
        in flag.reason


def test_parse_floors_and_rule_check():
    floors = parse_floors(["producer_ids_rate=500", " controller_mutation_rate = 2.5"])
    assert floors[PRODUCER_IDS_RATE] == 500 and floors[CONTROLLER_MUTATION_RATE] == 2.5
    assert floors[REQUEST_RATE] == FLOORS[REQUEST_RATE]
    for bad in ("nonsense=1", "producer_ids_rate", "producer_ids_rate=lots"):
        with pytest.raises(ValueError, match="--outlier-floor"):
            parse_floors([bad])
    for rule, flag in ((Rule(factor=1), "--outlier-factor"), (Rule(percentile=0), "--outlier-percentile"),
                       (Rule(percentile=1.5), "--outlier-percentile"), (Rule(min_principals=0), "--outlier-min"),
                       (Rule(floors={REQUEST_RATE: -1}), "--outlier-floor")):
        with pytest.raises(ValueError, match=flag):
            rule.check()


# -- the report's tables -------------------------------------------------------------------------

def _tables():
    """Five producers, five consumers, a restart loop and a topic storm, as the report's tables."""
    producers = [(f"p{i}", f"pc{i}") for i in range(5)] + [("loop", "lc")]
    consumers = [(f"c{i}", f"cc{i}") for i in range(5)]
    everyone = producers + consumers + [("ops", "tf")]

    def requests(u, c, kind):
        if kind in (REQUEST_RATE, CONTROLLER_MUTATION_RATE):
            return 3 if kind == REQUEST_RATE or u == "ops" else 0
        return 10 if (u, c) in (producers if kind.startswith("producer") else consumers) else 0

    principals = pd.DataFrame([{"user": u, "client_id": c, **{f"{k}__requests": requests(u, c, k) for k in RATE_KINDS}}
                               for u, c in [*everyone, ("(other)", "(other)")]])
    demand = [("loop", "", PRODUCER_IDS_RATE, 1800.0, 2139.0), ("p0", "", PRODUCER_IDS_RATE, 1.0, 2.0),
              ("ops", "tf", CONTROLLER_MUTATION_RATE, 84.0, 99.0)]
    demand += [(u, c, PRODUCER_BYTE_RATE, 1000.0 * (i + 1), 1500.0 * (i + 1)) for i, (u, c) in enumerate(producers)]
    percentiles = pd.DataFrame([{"user": u, "client_id": c, "kind": k, "p99": s} for u, c, k, s, _ in demand])
    recommended = pd.DataFrame([{"user": u, "client_id": c, "kind": k, "recommended": r} for u, c, k, _, r in demand])
    return percentiles, recommended, principals


def test_mark_flags_and_bounds_the_tables():
    percentiles, recommended, flags, notes = mark(*_tables(), Rule())
    rec = recommended.set_index(["user", "kind"])
    assert rec.loc[("loop", PRODUCER_IDS_RATE), ["recommended", "own_recommended", "outlier"]].tolist() == \
        [100, 2139, True]
    assert rec.loc[("ops", CONTROLLER_MUTATION_RATE), ["recommended", "own_recommended", "outlier"]].tolist() == \
        [10, 99, True]
    assert rec.loc[("loop", PRODUCER_IDS_RATE), "reason"].startswith("outlier: p99 1,800 new producer ids")
    assert not rec.loc[("p0", PRODUCER_IDS_RATE), "outlier"] and rec.loc[("p0", PRODUCER_IDS_RATE), "reason"] == ""
    assert not recommended[recommended["kind"] == PRODUCER_BYTE_RATE]["outlier"].any()
    # producer_ids_rate is judged over the 6 users that produce (5 others), controller mutations
    # over all 12 principals (11 others); the consumers are no producer's population.
    by_kind = {f.verdict.kind: f.verdict.others for f in flags}
    assert by_kind == {PRODUCER_IDS_RATE: 5, CONTROLLER_MUTATION_RATE: 11}
    # 5 consumers: 4 others each, too few to judge.
    assert notes == [f"outliers not judged for {CONSUMER_BYTE_RATE} (5 principals), {CONSUMER_RECORD_RATE} "
                     "(5 principals): 5 other principals of a kind needed (--outlier-min-principals)"]
    dem = percentiles.set_index(["user", "kind"])
    assert dem.loc[("loop", PRODUCER_IDS_RATE), ["outlier_threshold", "outlier"]].tolist() == [100, True]
    # Others' p99 up to 6,000 bytes/s: the threshold is the floor.
    assert dem.loc[("p4", PRODUCER_BYTE_RATE), ["outlier_threshold", "outlier"]].tolist() == \
        [FLOORS[PRODUCER_BYTE_RATE], False]


def test_mark_with_too_few_principals_or_no_rule():
    tables = _tables()
    _, recommended, flags, notes = mark(*tables, Rule(min_principals=6))
    # Judged only over everyone (12 principals): request_rate and controller_mutation_rate.
    assert [f.verdict.key for f in flags] == [("ops", "tf")]
    (note,) = notes
    assert all((f"{kind} (" in note) == (kind not in (REQUEST_RATE, CONTROLLER_MUTATION_RATE)) for kind in ALL_KINDS)
    assert f"{PRODUCER_IDS_RATE} (6 principals)" in note and note.endswith("6 other principals of a kind needed "
                                                                            "(--outlier-min-principals)")
    assert set(recommended[recommended["kind"] == PRODUCER_IDS_RATE]["reason"]) == \
        {"not judged for outliers: 5 other principals of this kind, 6 needed"}
    percentiles, recommended, flags, notes = mark(*tables, None)
    assert not flags and not notes and not recommended["outlier"].any() and not percentiles["outlier"].any()
    assert (recommended["recommended"] == recommended["own_recommended"]).all()


def test_the_yaml_carries_the_reason_and_passes_check_config(tmp_path, capsys):
    _, recommended, flags, _ = mark(*_tables(), Rule())
    entries, notes = quota_entries(recommended.to_dict("records"))
    comments = {(entity_key(*f.verdict.key, f.verdict.kind), f.verdict.kind): f.reason for f in flags}
    text = quotas_yaml(entries, notes, 0.99, 0.2, None, None, comments, ["2 outliers bounded"])
    path = tmp_path / "recommended-quotas.yaml"
    path.write_text(text)
    assert cli_main(["check-config", str(path)]) == 0
    assert yaml.safe_load(text)["quotas"] == entries
    lines = text.splitlines()
    at = lines.index("  producer_ids_rate: 100")
    assert lines[at - 2:at] == ["- user: loop", "  # outlier: p99 1,800 new producer ids per 3600-s window, "
                                "1,800× the p90 of the other 5 principals (1); threshold 100 (the floor); bound 100 "
                                "from the floor, above the p90 of the other 5 principals' recommendations (2), not "
                                "2,139 from its own demand"]
    assert lines[lines.index("  controller_mutation_rate: 10") - 1].startswith("  # outlier: p99 84 partitions/s")
    assert "# 2 outliers bounded" in lines
    quotas = {(q.user, q.client_id): dict(q.values) for q in load_config(path).quotas}
    assert quotas[("loop", None)] == {PRODUCER_IDS_RATE: 100}


def test_replay_outcome_compares_the_outlier_with_everyone_else():
    _, _, flags, _ = mark(*_tables(), Rule())
    cols = ["proxy", "user", "client_id", "kind", "requests", "demand", "throttled_requests", "throttle_time_ms",
            "rejected_requests", "rejected_amount"]
    replayed = pd.DataFrame([
        ("p", "loop", "lc", PRODUCER_IDS_RATE, 100, 100.0, 90, 1e6, 90, 90.0),
        ("p", "loop", "lc", "(any)", 200, 200.0, 90, 1e6, 90, 90.0),
        ("p", "ops", "tf", CONTROLLER_MUTATION_RATE, 10, 100.0, 6, 10.0, 6, 60.0),
        ("p", "ops", "tf", "(any)", 10, 10.0, 6, 10.0, 6, 6.0),
        ("p", "p0", "pc0", "(any)", 100, 100.0, 1, 5.0, 0, 0.0),
        ("p", "c0", "cc0", "(any)", 300, 300.0, 3, 5.0, 0, 0.0),
    ], columns=cols)
    assert outlier_rows(replayed, flags) == [True, True, True, True, False, False]
    out = replay_outcome(replayed, flags).set_index(["who", "kind"])
    assert out.loc[("loop", PRODUCER_IDS_RATE), ["requests", "rejected_share", "rejected_amount_share"]].tolist() \
        == [100, 0.9, 0.9]
    assert out.loc[("ops / tf", CONTROLLER_MUTATION_RATE), "rejected_amount_share"] == 0.6
    assert out.loc[("the other 2 principals", "(any)"), ["requests", "throttled_share", "rejected_share"]].tolist() \
        == [400, 0.01, 0.0]
