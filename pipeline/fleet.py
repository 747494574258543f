"""Which proxies enforced their quotas as one fleet (the usage log's ``fleet`` column, schema
version 3), and what that means for the report's numbers.

Each proxy logs only the requests its own clients sent: the other members' usage it reads from
the fleet's topic goes to its quota engines, never to its usage log. So summing rows over proxies
(totals, throttling, top talkers, charts) counts every request once, fleet or not. What a fleet
changes is the bound: a quota holds a principal's usage across the fleet. So the report takes a
fleet as the one place its quotas were enforced (:func:`enforced_as`): its members' usage is
summed per interval, a recommended value is the fleet-wide bound, and the replay runs the
fleet's usage through one set of engines; a proxy that enforced alone is taken per proxy, as its
quotas were. ``new_producer_ids`` follow each member's own Bloom filter: a producer id seen
through two members is new at each, as the fleet's producer-id quota charges it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

NAMED = 8  # proxies named per fleet; more are counted

FLEET_WIDE = ("Demand, recommendations and the replay are the fleet's for its members: their usage is summed per "
              "interval (each member logs only its own clients' requests), so a recommended value is the bound a "
              "fleet-wide quota holds for the principal across every member, and the replay runs the fleet's usage "
              "through one set of engines, as the fleet enforces one quota. The proxies that enforced alone are "
              "taken per proxy, as their quotas were.")

FLEET_PREFIX = "fleet "  # the proxy column of a fleet's rows: "fleet <usage topic>"


def enforced_as(usage: DataFrame) -> DataFrame:
    """``usage`` with ``proxy`` naming where each row's quotas were enforced: a fleet member's rows
    carry their fleet (``fleet <usage topic>``), so every step that groups by proxy and interval
    sums the members; a proxy that enforced alone keeps its name."""
    from pyspark.sql import functions as F

    fleet = F.col("fleet")
    return usage.withColumn("proxy", F.when(fleet.isNotNull() & (fleet != ""), F.concat(F.lit(FLEET_PREFIX), fleet))
                            .otherwise(F.col("proxy")))


def members_agg() -> Column:
    """An aggregate column: the distinct (fleet, proxy) pairs of the usage rows (few: one per
    proxy and setting), for :func:`members`."""
    from pyspark.sql import functions as F

    return F.collect_set(F.struct("fleet", "proxy"))


def members(pairs: Iterable[Sequence[str]]) -> dict[str, list[str]]:
    """fleet topic ("" for the proxies that enforced alone) → its proxies, sorted, from the rows
    of :func:`members_agg` (or (fleet, proxy) tuples). A proxy run both ways is under both."""
    out: dict[str, list[str]] = {}
    for fleet, proxy in sorted((p[0], p[1]) for p in pairs):
        out.setdefault(fleet, []).append(proxy)
    return out


def any_fleet(groups: dict[str, list[str]]) -> bool:
    """Whether any proxy of :func:`members`' groups ran a fleet."""
    return any(topic for topic in groups)


def notes(groups: dict[str, list[str]]) -> list[str]:
    """The report's lines on how the proxies enforced: one per fleet, one for the proxies alone
    when there was a fleet, then what a fleet means for the numbers (:data:`FLEET_WIDE`)."""
    fleets = {topic: proxies for topic, proxies in groups.items() if topic}
    if not any_fleet(groups):
        return ["Quotas enforced per proxy: no proxy ran a fleet (fleet.enabled), so demand, recommendations "
                "and the replay are per proxy, as its quotas were"]
    lines = [f"Fleet (usage topic {topic}): {_named(proxies)} enforced each quota across the fleet; in the "
             f"report as \"{FLEET_PREFIX}{topic}\""
             for topic, proxies in sorted(fleets.items())]
    if groups.get(""):
        lines.append(f"Enforced alone (no fleet): {_named(groups[''])}")
    return [*lines, FLEET_WIDE]


def _named(proxies: list[str]) -> str:
    word = "proxy" if len(proxies) == 1 else "proxies"
    shown = ", ".join(proxies[:NAMED])
    more = f" and {len(proxies) - NAMED} more" if len(proxies) > NAMED else ""
    return f"{len(proxies)} {word} ({shown}{more})"
