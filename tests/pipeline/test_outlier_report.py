"""The outlier rule through the whole report on a hand-made log in which the other principals
have demand of the kind too, so the outlier's quota is theirs: worked out by hand."""

from __future__ import annotations

import csv

import pytest

from pipeline.errors import UsageError
from pipeline.report import Options, run_report
from quotas.common import PRODUCER_IDS_RATE

from .usage_rows import write_rows

S = 1_800_000_000  # a multiple of 3600: one producer-id window
PRODUCE = 0


def _rows() -> list[dict]:
    rows = [dict(start_s=S + 10 * i, user=f"u{i}", client_id=f"app{i}", api_key=PRODUCE, requests=10,
                 request_bytes=1000, records=10, batches=10, new_producer_ids=150 + 10 * i) for i in range(6)]
    rows.append(dict(start_s=S, user="loop", client_id="restarts", api_key=PRODUCE, requests=10, request_bytes=1000,
                     records=10, batches=10, new_producer_ids=5000))
    return rows


def _csv(path) -> dict:
    with open(path, newline="") as f:
        return {(r["user"], r["kind"]): r for r in csv.DictReader(f)}


@pytest.fixture(scope="module")
def usage(tmp_path_factory):
    root = tmp_path_factory.mktemp("outliers")
    write_rows(root / "usage", _rows())
    return root


def test_the_outliers_quota_is_the_p90_of_the_others(spark, usage):
    result = run_report(Options(usage=str(usage / "usage"), out=usage / "report", quiet=True), spark)
    rec = _csv(result.files["recommended"])
    # Own recommendations: one window each, ⌈0.99 × ids × 1.2⌉: 150 → 179, 160 → 191, ..., 200 → 238.
    assert [float(rec[(f"u{i}", PRODUCER_IDS_RATE)]["recommended"]) for i in range(6)] == \
        [179, 191, 202, 214, 226, 238]
    loop = rec[("loop", PRODUCER_IDS_RATE)]
    # 5,000 ids against the others' p90 of 200 (the 6th of 6): over 2,000; the others' p90
    # recommendation is 238, above the floor of 100, and far below its own 5,940.
    assert (loop["outlier"], float(loop["own_recommended"]), float(loop["recommended"])) == ("True", 5940, 238)
    assert loop["reason"] == (
        "outlier: p99 5,000 new producer ids per 3600-s window, 25× the p90 of the other 6 principals (200); "
        "threshold 2,000 (10 × p90); bound 238 from the p90 of the other 6 principals' recommendations, "
        "not 5,940 from its own demand")
    assert [k for k, r in rec.items() if r["outlier"] == "True"] == [("loop", PRODUCER_IDS_RATE)]
    demand = _csv(result.files["demand"])
    assert float(demand[("u5", PRODUCER_IDS_RATE)]["outlier_threshold"]) == 50_000  # 10 × the loop's 5,000
    replayed = list(csv.DictReader(open(result.files["replay"], newline="")))
    held = {r["user"]: int(r["rejected_requests"]) for r in replayed if r["kind"] == PRODUCER_IDS_RATE}
    assert held.pop("loop") > 0 and set(held.values()) == {0}


def test_no_outliers_takes_every_quota_from_its_own_demand(spark, usage):
    result = run_report(Options(usage=str(usage / "usage"), out=usage / "plain", outliers=False, replay=False,
                                quiet=True), spark)
    loop = _csv(result.files["recommended"])[("loop", PRODUCER_IDS_RATE)]
    assert (loop["outlier"], float(loop["recommended"]), loop["reason"]) == ("False", 5940, "")
    assert "Outliers: not looked for (--no-outliers)" in result.files["html"].read_text()
    assert "producer_ids_rate: 5940" in result.files["recommended_quotas"].read_text()
    assert not result.outliers


@pytest.mark.parametrize("opts, message", [
    (dict(outlier_factor=0.5), "--outlier-factor must be above 1"),
    (dict(outlier_percentile=90), "--outlier-percentile must be in (0, 1]"),
    (dict(outlier_min_principals=0), "--outlier-min-principals must be at least 1"),
    (dict(outlier_floor=["producer_ids=5"]), "--outlier-floor 'producer_ids=5': expected KIND=VALUE"),
])
def test_bad_outlier_options_are_refused_before_spark_starts(tmp_path, opts, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run_report(Options(usage=str(tmp_path), out=tmp_path / "out", quiet=True, **opts), spark=None)
