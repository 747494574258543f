"""Outliers: principals whose demand of a quota kind is far beyond the rest of the fleet's, and
whose recommendation therefore comes from the rest of the fleet, not from their own demand.

"Admit 0.99 of each principal's own demand" turns abuse into the quota: a producer restart
loop gets a producer_ids_rate that admits its loop, a topic storm a controller_mutation_rate
that admits its storm. So, per quota kind:

- the *population* is every principal that could have had that demand: those that sent the
  APIs the kind charges (Produce for the producer kinds, producer_ids_rate per user; Fetch and
  ShareFetch for the consumer kinds), and every principal for request_rate and
  controller_mutation_rate (any client may create topics; that most never do is the norm).
  A principal of the population without demand of the kind counts with 0;
- a principal's *statistic* is its p99 per-second rate of the kind over the intervals in which
  it used it (demand.csv's p99); for producer_ids_rate, its p99 of new producer ids per window;
- it is an *outlier* when its statistic is above ``factor`` × the nearest-rank ``percentile``
  of the other principals' statistics, and above the kind's ``floor`` (demand no fleet would
  call abuse, so that a fleet of idle principals flags nobody). With fewer than
  ``min_principals`` others, the kind is not judged and nobody is flagged;
- an outlier's *bound* is the nearest-rank ``percentile`` of the other principals' own
  recommended values (0 for those without demand), but at least the floor (demand at the floor
  is never abuse, so a quota allows it), and never more than its own recommendation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from quotas.common import (
    CONSUMER_BYTE_RATE,
    CONSUMER_RECORD_RATE,
    CONTROLLER_MUTATION_RATE,
    PRODUCER_BATCH_RATE,
    PRODUCER_BYTE_RATE,
    PRODUCER_IDS_RATE,
    PRODUCER_RECORD_RATE,
    REQUEST_RATE,
)
from usage.schema import OTHER

from .frames import PandasFrame

# Demand below these is never called abuse, whatever the rest of the fleet does, and an
# outlier's quota is never below them. Byte, record, batch and request rates vary over orders of
# magnitude between healthy principals (one ingest pipeline moves more than a hundred small
# services), so their floors are what one busy client moves; producer ids and partition
# mutations are near zero for healthy principals, so theirs are what a large deployment's
# rolling restart or a batch of new topics needs.
FLOORS: dict[str, float] = {
    REQUEST_RATE: 1_000.0,
    PRODUCER_BYTE_RATE: 10 * 1048576.0,
    CONSUMER_BYTE_RATE: 10 * 1048576.0,
    PRODUCER_RECORD_RATE: 100_000.0,
    CONSUMER_RECORD_RATE: 100_000.0,
    PRODUCER_BATCH_RATE: 10_000.0,
    CONTROLLER_MUTATION_RATE: 10.0,  # partitions/s: with KIP-599's burst of 11 s, 110 at once
    PRODUCER_IDS_RATE: 100.0,  # per producer-id window
}
UNITS: dict[str, str] = {
    REQUEST_RATE: "requests/s",
    PRODUCER_BYTE_RATE: "bytes/s",
    CONSUMER_BYTE_RATE: "bytes/s",
    PRODUCER_RECORD_RATE: "records/s",
    CONSUMER_RECORD_RATE: "records/s",
    PRODUCER_BATCH_RATE: "batches/s",
    CONTROLLER_MUTATION_RATE: "partitions/s",
    PRODUCER_IDS_RATE: "new producer ids per window",
}
# Kinds whose population is every principal, not only those that sent the APIs they charge.
EVERYONE = frozenset({REQUEST_RATE, CONTROLLER_MUTATION_RATE})
# producer_ids_rate is judged over the users that sent Produce (KIP-936: a user-level quota).
POPULATION_OF = {PRODUCER_IDS_RATE: PRODUCER_BYTE_RATE}

Key = tuple[str, str]  # (user, client_id); client_id "" for producer_ids_rate


@dataclass(frozen=True)
class Rule:
    factor: float = 10.0
    percentile: float = 0.9
    min_principals: int = 5
    floors: Mapping[str, float] = field(default_factory=lambda: dict(FLOORS))

    def check(self) -> None:
        """Raises ValueError naming the flag whose value makes no rule."""
        if not self.factor > 1:
            raise ValueError(f"--outlier-factor must be above 1, got {self.factor:g}")
        if not 0 < self.percentile <= 1:
            raise ValueError(f"--outlier-percentile must be in (0, 1], got {self.percentile:g}")
        if self.min_principals < 1:
            raise ValueError(f"--outlier-min-principals must be at least 1, got {self.min_principals}")
        for kind, floor in self.floors.items():
            if not floor >= 0:
                raise ValueError(f"--outlier-floor {kind} must be >= 0, got {floor:g}")

    def floor(self, kind: str) -> float:
        return float(self.floors.get(kind, 0.0))


def parse_floors(items: Iterable[str] | None) -> dict[str, float]:
    """FLOORS with ``KIND=VALUE`` overrides; ValueError for an unknown kind or a bad value."""
    floors = dict(FLOORS)
    for item in items or ():
        kind, sep, value = item.partition("=")
        kind = kind.strip()
        if not sep or kind not in FLOORS:
            raise ValueError(f"--outlier-floor {item!r}: expected KIND=VALUE, KIND one of {', '.join(FLOORS)}")
        try:
            floors[kind] = float(value)
        except ValueError:
            raise ValueError(f"--outlier-floor {item!r}: {value!r} is not a number") from None
    return floors


def nearest_rank(values: Iterable[float], q: float) -> float:
    """The nearest-rank ``q`` percentile: the ⌈q·n⌉-th smallest of the n values (the smallest
    for tiny q); 0.0 for no values."""
    ordered = sorted(float(v) for v in values)
    if not ordered:
        return 0.0
    rank = max(1, math.ceil(q * len(ordered) - 1e-9))
    return ordered[rank - 1]


@dataclass(frozen=True)
class Verdict:
    """How one principal's statistic of a kind was judged against the others'. ``threshold``
    is None when there were too few others to judge (``outlier`` is then False)."""
    kind: str
    key: Key
    statistic: float
    others: int
    fleet: float  # the percentile of the others' statistics
    threshold: float | None
    outlier: bool


def judge(statistics: Mapping[Key, float], kind: str, rule: Rule) -> dict[Key, Verdict]:
    """Every principal of the kind's population (``statistics``: 0 for those without demand),
    judged against the others. Strictly above the threshold is an outlier: equal demand never is."""
    keys = list(statistics)
    values = [float(statistics[k]) for k in keys]
    out = {}
    for i, key in enumerate(keys):
        others = values[:i] + values[i + 1:]
        if len(others) < rule.min_principals:
            out[key] = Verdict(kind, key, values[i], len(others), 0.0, None, False)
            continue
        fleet = nearest_rank(others, rule.percentile)
        threshold = max(rule.factor * fleet, rule.floor(kind))
        out[key] = Verdict(kind, key, values[i], len(others), fleet, threshold, values[i] > threshold)
    return out


def bound_from_rest(own: float, others: Iterable[float], kind: str, rule: Rule) -> tuple[float, float]:
    """(bound, the others' percentile) for an outlier: the percentile of the other principals'
    recommended values (0 for those without one), at least the kind's floor, at most ``own``
    (the rule only ever tightens a recommendation)."""
    fleet = nearest_rank(others, rule.percentile)
    floor = float(math.ceil(rule.floor(kind)))
    return min(float(own), max(fleet, floor, 1.0)), fleet  # a quota of 0 would refuse everything


@dataclass(frozen=True)
class Flag:
    """An outlier and the bound it gets from the rest of the fleet."""
    verdict: Verdict
    own: float  # its recommendation from its own demand
    bound: float
    fleet_recommended: float  # the percentile of the others' recommended values
    basis: str  # where the bound came from, in words
    reason: str


def assess(population: Mapping[str, Iterable[Key]], statistics: Mapping[tuple[str, Key], float],
           recommended: Mapping[tuple[str, Key], float], rule: Rule, window_s: float = 3600.0
           ) -> tuple[list[Verdict], list[Flag], list[str]]:
    """Every principal of every kind's population judged (statistics and recommended values
    keyed by (kind, principal); missing means no demand, 0); the outliers that have a
    recommendation, with their bound and a sentence saying why; and one note naming the kinds
    that had too few principals to judge (none when every kind was judged)."""
    verdicts: list[Verdict]
    verdicts, flags, unjudged = [], [], []
    for kind, keys in population.items():
        keys = list(dict.fromkeys(keys))
        judged = judge({k: statistics.get((kind, k), 0.0) for k in keys}, kind, rule)
        verdicts += judged.values()
        if keys and next(iter(judged.values())).threshold is None:
            unjudged.append(f"{kind} ({len(keys)} principal{'s' if len(keys) != 1 else ''})")
        for key, v in judged.items():
            own = recommended.get((kind, key))
            if not v.outlier or own is None:
                continue
            others = [recommended.get((kind, k), 0.0) for k in keys if k != key]
            bound, fleet_rec = bound_from_rest(own, others, kind, rule)
            flags.append(Flag(v, float(own), bound, fleet_rec, basis(float(own), bound, fleet_rec, v.others, rule),
                              _reason(v, float(own), bound, fleet_rec, rule, window_s)))
    notes = [f"outliers not judged for {', '.join(unjudged)}: {rule.min_principals} other principals of a kind "
             "needed (--outlier-min-principals)"] if unjudged else []
    return verdicts, flags, notes


def not_judged_reason(others: int, rule: Rule) -> str:
    return (f"not judged for outliers: {others} other principal{'s' if others != 1 else ''} of this kind, "
            f"{rule.min_principals} needed")


def unit(kind: str, window_s: float = 3600.0) -> str:
    return f"new producer ids per {window_s:g}-s window" if kind == PRODUCER_IDS_RATE else UNITS.get(kind, "")


def _n(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 or float(x).is_integer() else f"{x:,.3g}"


def basis(own: float, bound: float, fleet_rec: float, others: int, rule: Rule) -> str:
    """Where an outlier's bound came from, in words."""
    p = f"p{rule.percentile * 100:g}"
    if bound == fleet_rec:
        return f"the {p} of the other {others} principals' recommendations"
    if bound == own:
        return f"its own demand, already below the {p} of the other {others} principals' recommendations"
    what = "the floor" if bound > 1 else "the least quota"
    return f"{what}, above the {p} of the other {others} principals' recommendations ({_n(fleet_rec)})"


def _reason(v: Verdict, own: float, bound: float, fleet_rec: float, rule: Rule, window_s: float) -> str:
    """A sentence for recommended.csv and the YAML comment, e.g. "outlier: p99 1,800 new producer
    ids per 3600-s window, where the p90 of the other 11 principals is 0; threshold 100 (the
    floor); bound 100 ...". Every number in it is one the rule used."""
    p, floor, n = f"p{rule.percentile * 100:g}", rule.floor(v.kind), v.others
    head = f"outlier: p99 {_n(v.statistic)} {unit(v.kind, window_s)}"
    threshold = v.threshold or 0.0
    if v.fleet > 0:
        head += f", {v.statistic / v.fleet:,.0f}× the {p} of the other {n} principals ({_n(v.fleet)})"
    else:
        head += f", where the {p} of the other {n} principals is 0"
    head += f"; threshold {_n(threshold)} " + (f"({rule.factor:g} × {p})" if rule.factor * v.fleet >= floor
                                                else "(the floor)")
    if bound == own:
        return f"{head}; bound {_n(bound)}: {basis(own, bound, fleet_rec, n, rule)}"
    return f"{head}; bound {_n(bound)} from {basis(own, bound, fleet_rec, n, rule)}, not {_n(own)} from its own demand"


# -- the report's tables ------------------------------------------------------------------------

def population_words(kind: str) -> str:
    """Who ``kind``'s outliers are judged against, in words: the population :func:`populations`
    builds (whoever had demand of the kind belongs to it too)."""
    if kind in EVERYONE:
        return "every principal in the log"
    if kind == PRODUCER_IDS_RATE:
        return "the users that sent Produce"
    if kind in (CONSUMER_BYTE_RATE, CONSUMER_RECORD_RATE):
        return "the principals that sent Fetch or ShareFetch"
    return "the principals that sent Produce"


def populations(principals: PandasFrame, other: str = OTHER) -> dict[str, list[Key]]:
    """Each kind's population from ``principals`` (pandas: user, client_id, and per rate kind
    ``<kind>__requests``, the requests of the APIs it charges); the overflow row is nobody."""
    from .kinds import ALL_KINDS

    rows = principals[principals["user"] != other]
    out: dict[str, list[Key]] = {}
    for kind in ALL_KINDS:
        column = f"{POPULATION_OF.get(kind, kind)}__requests"
        used = rows if kind in EVERYONE else rows[rows[column] > 0]
        if kind == PRODUCER_IDS_RATE:
            out[kind] = sorted({(u, "") for u in used["user"]})
        else:
            out[kind] = sorted(set(zip(used["user"], used["client_id"])))
    return out


def mark(percentiles: PandasFrame, recommended: PandasFrame, principals: PandasFrame, rule: Rule | None,
         window_s: float = 3600.0, other: str = OTHER
         ) -> tuple[PandasFrame, PandasFrame, list[Flag], list[str]]:
    """The rule applied to the report's tables (pandas, as the CSVs have them). Returns
    (percentiles + ``outlier_threshold``, ``outlier``; recommended + ``own_recommended``,
    ``outlier``, ``reason``, with an outlier's ``recommended`` replaced by its bound; the flags;
    notes). ``rule`` None (--no-outliers): nothing flagged, the columns still there."""
    percentiles, recommended = percentiles.copy(), recommended.copy()
    recommended["own_recommended"] = recommended["recommended"]
    percentiles["outlier_threshold"], percentiles["outlier"] = float("nan"), False
    recommended["outlier"], recommended["reason"] = False, ""
    if rule is None:
        return percentiles, recommended, [], []

    def keyed(pdf: PandasFrame, column: str) -> dict[tuple[str, Key], float]:
        return {(k, (u, c)): float(x) for u, c, k, x in zip(pdf["user"], pdf["client_id"], pdf["kind"], pdf[column])}

    population = populations(principals, other)
    for kind in population:  # whoever had demand is of the population, whatever APIs it used
        have = percentiles[(percentiles["kind"] == kind) & (percentiles["user"] != other)]
        population[kind] = sorted(set(population[kind]) | set(zip(have["user"], have["client_id"])))
    verdicts, flags, notes = assess(population, keyed(percentiles, "p99"), keyed(recommended, "recommended"),
                                    rule, window_s)
    by_key = {(v.kind, v.key): v for v in verdicts}
    flagged = {(f.verdict.kind, f.verdict.key): f for f in flags}

    def verdict_of(pdf: PandasFrame) -> list[Verdict | None]:
        return [by_key.get((k, (u, c))) for u, c, k in zip(pdf["user"], pdf["client_id"], pdf["kind"])]

    found = verdict_of(percentiles)
    percentiles["outlier_threshold"] = [v.threshold if v and v.threshold is not None else float("nan")
                                        for v in found]
    percentiles["outlier"] = [bool(v and v.outlier) for v in found]
    found = verdict_of(recommended)
    fs = [flagged.get((v.kind, v.key)) if v else None for v in found]
    recommended["outlier"] = [f is not None for f in fs]
    recommended["recommended"] = [f.bound if f else x for f, x in zip(fs, recommended["recommended"])]
    recommended["reason"] = [f.reason if f else not_judged_reason(v.others, rule) if v and v.threshold is None
                             else "" for f, v in zip(fs, found)]
    return percentiles, recommended, flags, notes


def replay_outcome(replayed: PandasFrame | None, flags: list[Flag]) -> PandasFrame:
    """What the replay did to each outlier and to everyone else (pandas rows: who, kind,
    requests, throttled_share, rejected_share, demand, rejected_amount_share): per outlier its
    kind and all its requests ("(any)"), then the other principals' requests in all."""
    import pandas as pd

    columns = ["who", "kind", "requests", "throttled_share", "rejected_share", "demand", "rejected_amount_share"]
    if replayed is None or not flags:
        return pd.DataFrame(columns=columns)
    rows: list[tuple[str, str, int, float, float, float, float]] = []
    held: set[tuple[str, str]] = set()

    def line(who: str, kind: str, part: PandasFrame) -> None:
        req, dem = float(part["requests"].sum()), float(part["demand"].sum())
        rows.append((who, kind, int(req), part["throttled_requests"].sum() / req if req else 0.0,
                     part["rejected_requests"].sum() / req if req else 0.0, dem,
                     part["rejected_amount"].sum() / dem if dem else 0.0))

    for f in flags:
        user, client_id = f.verdict.key
        mine = replayed["user"] == user
        if client_id or f.verdict.kind != PRODUCER_IDS_RATE:
            mine &= replayed["client_id"] == client_id
        who = f"{user} / {client_id}" if client_id else user
        line(who, f.verdict.kind, replayed[mine & (replayed["kind"] == f.verdict.kind)])
        line(who, "(any)", replayed[mine & (replayed["kind"] == "(any)")])
        held |= set(zip(replayed.loc[mine, "user"], replayed.loc[mine, "client_id"]))
    anyq = replayed[replayed["kind"] == "(any)"]
    rest = anyq[[(u, c) not in held for u, c in zip(anyq["user"], anyq["client_id"])]]
    n = len(set(zip(rest["user"], rest["client_id"])))
    line(f"the other {n} principals", "(any)", rest)
    return pd.DataFrame(rows, columns=columns)


def outlier_rows(replayed: PandasFrame, flags: list[Flag]) -> list[bool]:
    """replay.csv's ``outlier`` column: a row of an outlier's kind, or its "(any)" row."""
    marked: set[tuple[str, str | None, str]] = set()
    for f in flags:
        user, client_id = f.verdict.key
        marked.add((user, client_id if client_id else None, f.verdict.kind))
        marked.add((user, client_id if client_id else None, "(any)"))
    return [(u, c, k) in marked or (u, None, k) in marked
            for u, c, k in zip(replayed["user"], replayed["client_id"], replayed["kind"])]
