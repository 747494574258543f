"""Usage-log files built row by row, for tests that need exact, hand-checkable input."""

from __future__ import annotations

from pathlib import Path

from proxy.observability.usage_log import Interval, UsageLogWriter
from usage.schema import COUNTER_COLUMNS as COUNTERS  # whatever the schema version adds


def write_rows(directory: Path, rows: list[dict], interval_s: int = 10, proxy: str = "p1",
               fleet: str = "") -> list[Path]:
    """``rows``: dicts with start_s, user, client_id, api_key and any counters (others 0); one
    file per interval, written by the proxy's own writer (as a fleet member when ``fleet``
    names the fleet's usage topic)."""
    by_start: dict[int, dict] = {}
    for r in rows:
        counters = [float(r.get(c, 0)) if c == "upstream_latency_ms_sum" else r.get(c, 0) for c in COUNTERS]
        by_start.setdefault(r["start_s"], {})[(r["user"], r["client_id"], r["api_key"])] = counters
    writer = UsageLogWriter(directory, proxy, fleet)
    return [writer.write(Interval(start, interval_s, keyed)) for start, keyed in sorted(by_start.items())]
