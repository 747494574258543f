"""What the report says in words: the headlines about demand, throttling, quotas in shadow mode
and outliers, the outlier rule in a sentence, and the shadow table's headings.

What it guarantees: every sentence is built from the pandas tables the Spark run produced (no
Spark here); a principal is named as ``user / client_id``; when no principal stands out, or no
quota in shadow mode held anyone back (:data:`NO_SHADOW`), the report says so rather than stay silent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .frames import PandasFrame
from .outliers import population_words

if TYPE_CHECKING:
    from .outliers import Flag, Rule


def headlines(percentiles: PandasFrame, throttled: PandasFrame, shadow: PandasFrame | None = None) -> list[str]:
    """One line per quota kind naming the principal with the largest share of its demand (when
    that share is large), the most throttled principal, and the one quotas in shadow mode would
    have held back the most (``shadow``: demand.shadow_affected, most affected first)."""
    lines = []
    for kind, group in percentiles.groupby("kind", sort=True):
        total = group["total"].sum()
        if total <= 0:
            continue
        top = group.sort_values("total", ascending=False).iloc[0]
        share = top["total"] / total
        if share >= 0.5:
            who = f"{top['user']} / {top['client_id']}" if top["client_id"] else top["user"]
            lines.append(f"{kind}: {who} is {share:.0%} of all demand (p99 {top['p99']:,.1f}, max {top['max']:,.1f})")
    worst = throttled[throttled["throttle_time_ms"] > 0].head(1)
    for _, row in worst.iterrows():
        lines.append(f"most throttled: {row['user']} / {row['client_id']}, {row['throttled']:,} of "
                     f"{row['requests']:,} requests throttled, {row['rejected']:,} rejected, "
                     f"{row['throttle_time_ms'] / 1000:,.1f} s of throttle")
    if shadow is not None and not shadow.empty:
        lines.append(shadow_headline(shadow))
    return lines or ["no principal stands out"]


NO_SHADOW = "No quota in shadow mode throttled or rejected anything in this period."


def shadow_headline(shadow: PandasFrame) -> str:
    """The principal quotas in shadow mode would have held back the most, in a sentence."""
    row = shadow.iloc[0]
    requests, throttled, rejected = row["requests"], row["shadow_throttled"], row["shadow_rejected"]
    held = []
    if throttled:
        held.append(f"throttled on {_percent(row['shadow_throttled_ratio'])} of its requests "
                    f"({throttled:,} of {requests:,})")
    if rejected:
        held.append(f"rejected on {_percent(row['shadow_rejected_ratio'])}"
                    + (f" ({rejected:,})" if throttled else f" of its requests ({rejected:,} of {requests:,})"))
    line = f"In shadow mode, {row['user']} / {row['client_id']} would have been {' and '.join(held)}"
    if row["shadow_throttle_time_ms"]:
        waited = row["shadow_throttle_time_ratio"]
        line += (f", waiting {waited:.2g} s" if waited >= 0.01 else f", waiting {waited * 1000:.2g} ms") \
            + " per second of activity"
    if len(shadow) > 1:
        line += f"; {len(shadow)} principals in all would have been held back"
    return line


def shadow_table(shadow: PandasFrame) -> PandasFrame:
    """``shadow`` (demand.shadow_affected) with the report's column headings."""
    return shadow.assign(
        shadow_throttled_ratio=shadow["shadow_throttled_ratio"].map(_percent),
        shadow_rejected_ratio=shadow["shadow_rejected_ratio"].map(_percent),
    ).rename(columns={
        "shadow_throttled": "would have been throttled", "shadow_throttled_ratio": "% throttled",
        "shadow_rejected": "would have been rejected", "shadow_rejected_ratio": "% rejected",
        "shadow_throttle_time_ms": "throttle ms it would have waited",
        "shadow_throttle_time_ratio": "throttle s per second of activity",
    })


def _percent(ratio: float) -> str:
    if ratio == 0 or ratio >= 0.01:
        return f"{ratio:.0%}"
    return f"{ratio:.1%}" if ratio >= 0.001 else "<0.1%"


def outlier_header(rule: Rule | None, flags: list[Flag], notes: list[str]) -> list[str]:
    """The outlier rule in a sentence, how many it flagged, and the kinds it could not judge."""
    if rule is None:
        return ["Outliers: not looked for (--no-outliers); every value comes from the principal's own demand"]
    p = f"p{rule.percentile * 100:g}"
    lines = [f"Outliers: a principal whose p99 demand of a kind is above {rule.factor:g} × the {p} of the other "
             f"principals' (and above the kind's floor) gets the {p} of their recommendations instead "
             f"(at least the floor); at least {rule.min_principals} other principals needed"]
    if flags:
        lines.append(f"{len(flags)} outlier{'s' if len(flags) != 1 else ''} bounded from the rest of the fleet")
    return lines + notes


def outlier_headlines(flags: list[Flag], notes: list[str]) -> list[str]:
    """One line per outlier (its demand, the bound it gets and where from, its own
    recommendation, and who "the other principals" of its kind are), and a line per kind too
    small to judge."""
    lines = []
    for f in flags:
        user, client_id = f.verdict.key
        who = f"{user} / {client_id}" if client_id else user
        # "the other N principals" differs per kind (each has its own population): say which.
        lines.append(f"outlier: {who}, {f.verdict.kind} p99 {f.verdict.statistic:,.1f} over the threshold "
                     f"{f.verdict.threshold:,.1f}: quota {f.bound:,.0f} "
                     f"({f.basis}), "
                     f"not {f.own:,.0f} from its own demand; {f.verdict.kind} is judged among "
                     f"{population_words(f.verdict.kind)}")
    return lines + notes
