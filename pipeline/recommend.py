"""Recommended quotas: for each principal and quota kind, the smallest bound that would have
admitted a chosen share of its observed demand unthrottled, plus headroom; written as a
``quotas:`` block the proxy loads unchanged.

"Admitted" is by volume: a bound q admits min(demand, q × seconds) of each interval's demand,
so q admits share s when Σ min(rate_i, q)·t_i ≥ s · Σ rate_i·t_i. Demand within an interval is
taken as even (the log keeps sums per interval), so bursts shorter than an interval are not seen.

A rate quota is measured over (quota_window_num − 1) × quota_window_size_seconds (Kafka's
``Rate`` over its samples, 10 s by default), and requests arrive whole: a bound within one
request's worth per measurement window of the average throttles evenly spaced requests whenever
one more of them falls inside the window. So rate kinds get that much on top: the principal's
mean amount per request divided by the measurement window. (controller_mutation_rate's token
bucket holds a burst of quota × samples × window and needs no such allowance.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from quotas.common import RATE_KINDS as WINDOWED_RATE_KINDS
from quotas.entities import ANONYMOUS
from usage.schema import OTHER

from .demand import PRINCIPAL
from .frames import PandasFrame
from .groups import per_group, tasks_for
from .kinds import ALL_KINDS, PER_WINDOW, RATE_KINDS

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


EntityKey = tuple[tuple[str, str], ...]  # ((field, value), ...): ("user", ...) and / or ("client_id", ...)
QuotaEntry = dict[str, str | float]  # an entry of the quotas: list: its entity's fields, then kind → value
# (entity, kind) of a comment: the entity as entity_key gives it (None: it has none), or as an entry's fields.
CommentKey = tuple[tuple[tuple[str, str | float], ...] | None, str]


def admitting(rates: np.ndarray, seconds: np.ndarray, share: float) -> float:
    """The smallest q with Σ min(rate, q)·seconds ≥ share · Σ rate·seconds (0 for no demand)."""
    order = np.argsort(rates, kind="stable")
    r, t = rates[order].astype(float), seconds[order].astype(float)
    total = float(np.dot(r, t))
    if total <= 0:
        return 0.0
    target = share * total
    # Below r[k], the first k samples are admitted whole and the rest at q each.
    whole = np.concatenate(([0.0], np.cumsum(r * t)))[:-1]
    rest = np.cumsum(t[::-1])[::-1]
    admitted_at = whole + r * rest
    k = int(np.searchsorted(admitted_at, target * (1 - 1e-12), side="left"))
    k = min(k, len(r) - 1)
    return float(max((target - whole[k]) / rest[k], 0.0))


def recommended_value(admitting_q: float, headroom: float) -> float:
    """``admitting_q`` plus headroom, rounded up to a whole unit (at least 1)."""
    return float(max(1, math.ceil(admitting_q * (1 + headroom) - 1e-9)))


def recommendations(intervals: DataFrame, pid_windows: DataFrame, share: float, headroom: float,
                    measured_over_s: float = 10.0, quantiles: Sequence[float] = (0.5, 0.95, 0.99),
                    rows: int | None = None) -> DataFrame:
    """For every principal and kind with demand (producer_ids_rate per user, client_id ""): its
    demand (samples, total, mean, the nearest-rank ``quantiles`` as ``p<q>``, and the max of the
    per-second rate over the intervals in which it used the kind; for producer_ids_rate, new ids
    per window) and its recommendation (admitting, per_request, recommended). ``per_request``:
    the allowance for whole requests (mean amount per request / ``measured_over_s``; 0 for token
    buckets and per-window kinds). The (other) overflow row's recommendation is for no one to
    apply: :func:`split` leaves it out.

    One pass over each principal's intervals, every kind of it at once
    (:func:`pipeline.groups.per_group`; ``rows``: about how many intervals, for the tasks)."""
    from pyspark.sql import functions as F

    labels = [f"p{_label(q)}" for q in quantiles]
    schema = ("user string, client_id string, kind string, samples long, total double, mean double, "
              + ", ".join(f"{label} double" for label in labels)
              + ", max double, admitting double, per_request double, recommended double")

    def build(samples: Callable[[PandasFrame], Iterator[Samples]]) -> Callable[[], Callable[[PandasFrame], list[Row]]]:
        return lambda: lambda group: [
            _recommend(group["user"].iat[0], group["client_id"].iat[0], kind, amount, seconds, requests, quantiles,
                       share, headroom, measured_over_s) for kind, amount, seconds, requests in samples(group)]

    columns = [*PRINCIPAL, "interval_seconds", *RATE_KINDS, *(f"{k}__requests" for k in RATE_KINDS)]
    by_principal = per_group(intervals.select(*columns), PRINCIPAL, (), tasks_for(intervals, rows),
                             build(_rate_samples), schema)
    by_user = per_group(pid_windows.select("user", F.lit("").alias("client_id"), "amount"), ("user",), (),
                        tasks_for(pid_windows), build(_window_samples), schema)
    return by_principal.unionByName(by_user)


Samples = tuple[str, np.ndarray, np.ndarray, float]  # (kind, amount, seconds, requests) of one principal
Row = tuple[object, ...]


def _rate_samples(group: PandasFrame) -> Iterator[Samples]:
    """Each rate kind of one principal's intervals: the intervals with some of the kind's amount,
    and the requests of the APIs it charges."""
    seconds = group["interval_seconds"].to_numpy(dtype=float)
    for kind in RATE_KINDS:
        amount = group[kind].to_numpy(dtype=float)
        used = amount > 0
        if used.any():
            yield kind, amount[used], seconds[used], float(group[f"{kind}__requests"].to_numpy(dtype=float)[used].sum())


def _window_samples(group: PandasFrame) -> Iterator[Samples]:
    """One user's new producer ids per window: its rate is per window, not per second."""
    (kind,) = PER_WINDOW
    amount = group["amount"].to_numpy(dtype=float)
    yield kind, amount, np.ones(len(amount)), 0.0


def split(both: PandasFrame) -> tuple[PandasFrame, PandasFrame]:
    """(demand, recommended) from :func:`recommendations`' rows: the demand per (kind, user,
    client_id), the recommendations per (user, client_id, kind), (other) left out of them."""
    at = list(both.columns).index("max") + 1
    demand = both[list(both.columns[:at])].sort_values(["kind", *PRINCIPAL], kind="stable").reset_index(drop=True)
    rec = both[both["user"] != OTHER][[*PRINCIPAL, "kind", *both.columns[at:]]]
    return demand, rec.sort_values([*PRINCIPAL, "kind"], kind="stable").reset_index(drop=True)


def nearest_rank(rates: np.ndarray, quantiles: Sequence[float]) -> list[float]:
    """The nearest-rank quantiles: for each q, the smallest sample with at least q of the samples
    at or below it."""
    ordered = np.sort(rates)
    return [float(ordered[max(0, math.ceil(q * len(ordered) - 1e-9) - 1)]) for q in quantiles]


def _label(quantile: float) -> str:
    return f"{quantile * 100:g}".replace(".", "_")


def _recommend(user: str, client_id: str, kind: str, amount: np.ndarray, seconds: np.ndarray, requests: float,
               quantiles: Sequence[float], share: float, headroom: float, measured_over_s: float) -> Row:
    """One (user, client_id, kind)'s row of :func:`recommendations` from its samples."""
    rate = amount / seconds
    q = admitting(rate, seconds, share)
    total = float(amount.sum())
    allowance = total / requests / measured_over_s if kind in WINDOWED_RATE_KINDS and requests > 0 else 0.0
    return (user, client_id, kind, len(rate), total, float(rate.mean()), *nearest_rank(rate, quantiles),
            float(rate.max()), q, allowance, recommended_value(q + allowance, headroom))



def entity_key(user: str, client_id: str, kind: str) -> EntityKey | None:
    """The quota entity a recommendation for (user, client_id, kind) is written for, as
    ((field, value), ...), or None when it has none (ANONYMOUS without a client id).

    An authenticated user gets user + client_id entries; ANONYMOUS gets client_id entries
    (Kafka's client-id quotas); producer_ids_rate is user-level (KIP-936).
    """
    if kind in PER_WINDOW:
        return (("user", user),)
    if not client_id:
        return None if user == ANONYMOUS else (("user", user),)
    if user == ANONYMOUS:
        return (("client_id", client_id),)
    return (("user", user), ("client_id", client_id))


def quota_entries(rows: Iterable[Mapping[str, Any]]) -> tuple[list[QuotaEntry], list[str]]:
    """Config entries (one per entity, kinds merged, in a stable order) from recommendation
    rows (dicts or pandas rows with user, client_id, kind, recommended), and notes on what
    could not be expressed as a quota entity (see :func:`entity_key`)."""
    entities: dict[EntityKey, QuotaEntry] = {}
    notes = []
    for row in rows:
        user, client_id, kind, value = row["user"], row["client_id"], row["kind"], row["recommended"]
        key = entity_key(user, client_id, kind)
        if key is None:
            notes.append(f"{kind}: requests from ANONYMOUS without a client id cannot be given a quota entity")
            continue
        entry = entities.setdefault(key, dict(key))
        entry[kind] = int(value) if float(value).is_integer() else float(value)
    order = {k: i for i, k in enumerate(ALL_KINDS)}
    out: list[QuotaEntry] = []
    for key in sorted(entities):
        e = entities[key]
        head: QuotaEntry = {k: e[k] for k in ("user", "client_id") if k in e}
        kinds = sorted((k for k in e if k not in head), key=order.__getitem__)
        out.append({**head, **{k: e[k] for k in kinds}})
    return out, notes


def quotas_yaml(entries: list[QuotaEntry], notes: list[str], share: float, headroom: float,
                base_config: dict[str, Any] | None, span: tuple[datetime, datetime] | None,
                comments: dict[CommentKey, str] | None = None, header: list[str] | None = None) -> str:
    """A configuration file: the base configuration's sections (or a placeholder upstream) with
    ``quotas:`` replaced by the recommendation. ``check-config`` accepts it as it is.

    ``comments``: (entity key as :func:`entity_key` gives it, kind) → a sentence, written as a
    YAML comment above that value; ``header``: more comment lines at the top."""
    when = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    lines = [
        f"# Recommended quotas, by kafka-quota-proxy report at {when}.",
        f"# Each value admits {share:.4g} of the principal's observed demand (by volume, per usage-log",
        f"# interval) plus {headroom:.0%} headroom" + (", except the outliers marked below." if comments else "."),
    ]
    if span is not None:
        lines.append(f"# Usage from {span[0]:%Y-%m-%d %H:%M} to {span[1]:%Y-%m-%d %H:%M} UTC.")
    lines += [f"# {_one_line(h)}" for h in header or ()]
    lines += [f"# Not covered: {n}" for n in notes]
    config = dict(base_config or {})
    if not base_config:
        lines.append("# upstream below is a placeholder: run report with --config to carry yours over.")
        config["upstream"] = {"bootstrap_servers": ["127.0.0.1:9092"]}
    config["quotas"] = entries
    body = []
    for section, value in config.items():
        if section == "quotas" and entries:
            body += ["quotas:", *_entries_yaml(entries, comments or {})]
        else:
            body.append(_dump({section: value}))
    return "\n".join(lines) + "\n" + "\n".join(body) + "\n"


def _dump(value: object) -> str:
    text: str = yaml.safe_dump(value, sort_keys=False, default_flow_style=False, allow_unicode=True,
                               width=float("inf"))
    return text.rstrip("\n")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _entries_yaml(entries: list[QuotaEntry], comments: dict[CommentKey, str]) -> list[str]:
    """The quotas list item by item, as yaml.safe_dump writes it, with a comment line above
    each value that ``comments`` explains."""
    lines = []
    for entry in entries:
        key = tuple((k, entry[k]) for k in ("user", "client_id") if k in entry)
        for i, (field, value) in enumerate(entry.items()):
            comment = comments.get((key, field))
            if comment:
                lines.append(f"  # {_one_line(comment)}")
            lines.append(("- " if i == 0 else "  ") + _dump({field: value}))
    return lines
