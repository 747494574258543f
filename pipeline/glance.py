"""The first screen of the report: who should get which quota, who stands out, and what the
recommended (or candidate) quotas would have done, in a table and two charts.

What it guarantees: built from the pandas tables the Spark run produced (no Spark here); a
principal is named as ``user / client_id`` (``user`` alone for a user-level entry); the charts
show at most :data:`TOP` principals, the ones with the most demand, and are left out (False)
when there is nothing to draw.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .frames import PandasFrame
from .html import _pyplot

if TYPE_CHECKING:
    from .demand import Span

TOP = 6  # principals in each chart
TABLE_ROWS = 10  # principals in the quota table


def name(user: str, client_id: str) -> str:
    return f"{user} / {client_id}" if client_id else str(user)


def quota_table(recommended: PandasFrame, talkers: PandasFrame, rows: int = TABLE_ROWS) -> PandasFrame:
    """One row per principal with the value recommended for each quota kind (blank where none)
    and the kinds whose value is an outlier's (bounded by the rest of the fleet): every outlier
    first, then the ``rows`` others that moved the most bytes."""
    import pandas as pd

    if recommended is None or recommended.empty:
        return pd.DataFrame()
    wide = recommended.pivot_table(index=["user", "client_id"], columns="kind", values="recommended", aggfunc="max")
    outliers = (recommended[recommended["outlier"]].groupby(["user", "client_id"])["kind"]
                .agg(lambda kinds: ", ".join(sorted(kinds))) if "outlier" in recommended else None)
    flagged = sorted(outliers.index) if outliers is not None else []
    order = [(u, c) for u, c in zip(talkers["user"], talkers["client_id"]) if (u, c) in wide.index]
    order += [key for key in wide.index if key not in set(order)]
    wide = wide.reindex(flagged + [key for key in order if key not in set(flagged)][:rows])
    out = pd.DataFrame({"principal": [name(u, c) for u, c in wide.index]})
    for kind in wide.columns:
        out[kind] = [f"{v:,.0f}" if v == v else "" for v in wide[kind]]  # v != v: NaN, no value for that kind
    out["outlier"] = ["" if outliers is None else outliers.get(key, "") for key in wide.index]
    return out


def held_back(throttled: PandasFrame, replayed: PandasFrame | None, principals: list[tuple[str, str]]
              ) -> PandasFrame:
    """For ``principals``: the share of their requests throttled or rejected in the log (what the
    quotas in force did) and in the replay (what the recommended or candidate quotas would have
    done), each of the requests the log has."""
    import pandas as pd

    before = {(r["user"], r["client_id"]): r for _, r in throttled.iterrows()}
    after: dict[tuple[str, str], float] = {}
    if replayed is not None and not replayed.empty:
        anything = replayed[replayed["kind"] == "(any)"].groupby(["user", "client_id"])[
            ["requests", "throttled_requests", "rejected_requests"]].sum()
        for key, r in anything.iterrows():
            held = float(r["throttled_requests"] + r["rejected_requests"])
            after[key] = held / float(r["requests"]) if r["requests"] else 0.0
    rows = []
    for key in principals:
        b = before.get(key)
        requests = float(b["requests"]) if b is not None else 0.0
        held = float(b["throttled"] + b["rejected"]) if b is not None else 0.0
        rows.append({"principal": name(*key), "requests": requests,
                     "held_in_log": held / requests if requests else 0.0, "held_in_replay": after.get(key)})
    return pd.DataFrame(rows)


def bound_chart(pdf: PandasFrame | None, bounds: dict[str, float], title: str, unit: str, path: Path,
                span: Span | None = None) -> bool:
    """One panel per principal (the :data:`TOP` with the most demand in ``pdf``, a timeline of
    (time, series, rate)): its demand over time against the bound recommended for it (dashed)."""
    import pandas as pd

    if pdf is None or pdf.empty:
        return False
    wide = pdf[pdf["series"] != "others"].pivot_table(index="time", columns="series", values="rate",
                                                      aggfunc="sum").fillna(0.0).sort_index()
    if wide.empty:
        return False
    if span is not None:
        first, last, step = span
        full = pd.to_datetime([first + i * step for i in range(int((last - first) // step) + 1)], unit="s")
        wide.index = pd.to_datetime(wide.index)
        wide = wide.reindex(full, fill_value=0.0)
    order = wide.sum().sort_values(ascending=False).index.tolist()[:TOP]
    plt = _pyplot()
    fig, axes = plt.subplots(len(order), 1, figsize=(10, 1.5 * len(order) + 0.8), dpi=100, sharex=True,
                             squeeze=False)
    for ax, series in zip(axes[:, 0], order):
        ax.plot(wide.index, wide[series], color="#2c7fb8", linewidth=1)
        bound = bounds.get(series)
        if bound is not None:
            ax.axhline(bound, color="#c0392b", linestyle="--", linewidth=1)
        over = ("" if bound is None
                else f" (bound {bound:,.0f}; over it {(wide[series] > bound).mean():.0%} of the time)")
        ax.set_title(f"{series}{over}", fontsize=9, loc="left")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0, 0].set_ylabel(unit, fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def held_back_chart(table: PandasFrame, path: Path) -> bool:
    """Grouped bars per principal: the share of its requests held back in the log and in the replay."""
    if table.empty or table["held_in_replay"].isna().all():
        return False
    plt = _pyplot()
    labels = list(table["principal"])[::-1]
    y = range(len(labels))
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(labels) + 1.3), dpi=100)
    ax.barh([i + 0.2 for i in y], list(table["held_in_log"])[::-1], height=0.4, color="#7f8c8d",
            label="in the log (the quotas in force)")
    ax.barh([i - 0.2 for i in y], list(table["held_in_replay"].fillna(0.0))[::-1], height=0.4, color="#c0392b",
            label="in the replay (the new quotas)")
    ax.set_yticks(list(y), labels)
    ax.set_xlabel("share of the principal's requests throttled or rejected")
    from matplotlib.ticker import PercentFormatter

    ax.xaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlim(0, max(1e-9, float(table[["held_in_log", "held_in_replay"]].max().max())) * 1.1)
    ax.set_title("What the new quotas would have held back")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
