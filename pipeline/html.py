"""The HTML report: charts (matplotlib, PNG beside the page) and the tables that are also CSV."""

from __future__ import annotations

import html
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from .frames import PandasFrame

if TYPE_CHECKING:
    from .demand import Span

CHARTS = (
    # (timeline column, title, unit)
    ("producer_byte_rate", "Produce bytes per second", "bytes/s"),
    ("consumer_byte_rate", "Fetch bytes per second", "bytes/s"),
    ("request_rate", "Requests per second", "requests/s"),
    ("controller_mutation_rate", "Partition mutations per second (KIP-599)", "partitions/s"),
    ("new_producer_ids", "New producer ids per second (KIP-936)", "ids/s"),
    ("throttle_time_ms", "Throttle time given, ms per second", "ms/s"),
)


def _pyplot() -> ModuleType:
    """matplotlib's pyplot, drawing to files only (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# A table of the report: (heading, CSV file name, pandas DataFrame), or with a fourth item, the
# sentence shown instead of an empty table.
Table = tuple[str, str, PandasFrame] | tuple[str, str, PandasFrame, str]


def stacked_chart(pdf: PandasFrame | None, title: str, unit: str, path: Path, span: Span | None = None) -> bool:
    """A stacked area chart of ``pdf`` (time, series, rate): the biggest series first and
    named in the legend, so the one that dominates is seen at once; buckets without demand are
    drawn as zero over the whole ``span`` (first, last, step seconds). False if nothing to draw."""
    import pandas as pd

    if pdf is None or pdf.empty:
        return False
    wide = pdf.pivot_table(index="time", columns="series", values="rate", aggfunc="sum").fillna(0.0).sort_index()
    if span is not None:
        first, last, step = span
        full = pd.to_datetime([first + i * step for i in range(int((last - first) // step) + 1)], unit="s")
        wide.index = pd.to_datetime(wide.index)
        wide = wide.reindex(full, fill_value=0.0)
    order = wide.sum().sort_values(ascending=False).index.tolist()
    if "others" in order:
        order.remove("others")
        order.append("others")
    wide = wide[order]
    total = float(wide.to_numpy().sum()) or 1.0
    labels = [f"{name} ({wide[name].sum() / total:.0%})" for name in order]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 3.6), dpi=100)
    ax.stackplot(wide.index, wide.T.to_numpy(), labels=labels, alpha=0.85)
    ax.set_title(title)
    ax.set_ylabel(unit)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def bar_chart(labels: list[str], values: list[float], title: str, unit: str, path: Path) -> bool:
    if not labels:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(labels) + 1.2), dpi=100)
    ax.barh(labels[::-1], values[::-1], color="#c0392b")
    ax.set_title(title)
    ax.set_xlabel(unit)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _table(pdf: PandasFrame | None, limit: int = 50, empty: str | None = None) -> str:
    if pdf is None or pdf.empty:
        return f"<p>{html.escape(empty)}</p>" if empty else "<p><em>none</em></p>"
    more = f"<p>{len(pdf) - limit} more rows in the CSV.</p>" if len(pdf) > limit else ""
    table: str = pdf.head(limit).to_html(index=False, float_format=lambda v: f"{v:,.3f}", border=0, classes="t")
    return table + more


def write_report(out: Path, *, title: str, summary: list[str], headlines: list[str], charts: list[Path],
                 tables: list[Table], recommended_yaml: str, quota_table: PandasFrame | None = None,
                 glance_charts: tuple[Path | None, Path | None] = (None, None)) -> Path:
    """The page. Its first screen answers who should get which quota (``quota_table``), who
    stands out (``headlines``) and what the new quotas would have done (``glance_charts``: the
    held-back chart and the demand-against-bound chart, each None when not drawn); then the
    charts over time, ``tables`` ((heading, CSV file name, pandas DataFrame), or with a fourth
    item the sentence shown instead of an empty table) and the recommended YAML."""
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:1200px}"
        "table.t{border-collapse:collapse;font-size:13px}table.t td,table.t th{padding:3px 8px;"
        "border-bottom:1px solid #ddd;text-align:right}table.t td:first-child,table.t td:nth-child(2)"
        "{text-align:left}li.hot{color:#c0392b}pre{background:#f6f6f6;padding:1em;overflow:auto}</style>",
        f"</head><body><h1>{html.escape(title)}</h1>",
        "<ul>" + "".join(f"<li>{html.escape(s)}</li>" for s in summary) + "</ul>",
        "<h2>At a glance</h2>",
        "<h3>Who should get which quota</h3><p>The recommended value of each quota kind for the principals "
        "that moved the most bytes (all of them: <a href='recommended-quotas.yaml'>recommended-quotas.yaml</a>, "
        "<a href='recommended.csv'>recommended.csv</a>).</p>",
        _table(quota_table, limit=10, empty="No principal had demand a quota applies to."),
        "<h3>Who stands out</h3><ul>" + "".join(f"<li class='hot'>{html.escape(h)}</li>" for h in headlines) + "</ul>",
    ]
    held, bounds = glance_charts
    if held is not None:
        parts.append("<h3>What the new quotas would have done</h3>" + _image(out, held))
    if bounds is not None:
        parts.append("<h3>Demand against the recommended bound</h3>" + _image(out, bounds))
    parts.append("<h2>Demand over time</h2>")
    parts += [_image(out, p) for p in charts]
    for heading, csv_name, pdf, *empty in tables:
        parts.append(f"<h2>{html.escape(heading)}</h2>"
                     f"<p><a href='{html.escape(csv_name)}'>{html.escape(csv_name)}</a></p>")
        parts.append(_table(pdf, empty=empty[0] if empty else None))
    parts.append("<h2>Recommended quotas</h2><p><a href='recommended-quotas.yaml'>recommended-quotas.yaml</a></p>")
    parts.append(f"<pre>{html.escape(recommended_yaml)}</pre></body></html>")
    path = out / "report.html"
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def _image(out: Path, path: Path) -> str:
    return f"<p><img src='{html.escape(path.relative_to(out).as_posix())}' alt='{html.escape(path.stem)}'></p>"
