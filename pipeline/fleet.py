"""Which proxies enforced their quotas as one fleet (the usage log's ``fleet`` column, schema
version 3), and what that means for the report's numbers.

Each proxy logs only the requests its own clients sent: the other members' usage it reads from
the fleet's topic goes to its quota engines, never to its usage log. So summing rows over proxies
(totals, throttling, top talkers, charts) counts every request once, fleet or not. What a fleet
changes is the bound: a quota holds a principal's usage across the fleet, while demand, the
recommendations and the replay are taken per proxy and interval, as quotas are without a fleet.
For a principal whose clients spread over n members, a recommended value is about what one
member saw (up to 1 / n of what a fleet-wide quota must admit), and the replay, which runs each
proxy's rows through engines of their own, holds back less than the fleet-wide quota would.
``new_producer_ids`` follow each member's own Bloom filter: a producer id seen through two members
is new at each, as the fleet's producer-id quota charges it. (Summing demand over a fleet's
members per interval is issue 31; :func:`members` gives the groups.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import Column

NAMED = 8  # proxies named per fleet; more are counted

PER_INSTANCE = ("Demand, recommendations and the replay are per proxy instance, fleet members included: a fleet's "
                "quota bounds a principal across all its members, so for a principal whose clients spread over "
                "n members a recommended value is what one member saw (a fleet-wide quota needs up to n times it), "
                "and the replay, one member at a time, holds back less than the fleet would. Totals and throttling "
                "count each request once (a member logs only its own clients' requests).")


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
    when there was a fleet, then what a fleet means for the numbers (:data:`PER_INSTANCE`)."""
    fleets = {topic: proxies for topic, proxies in groups.items() if topic}
    if not any_fleet(groups):
        return ["Quotas enforced per proxy: no proxy ran a fleet (fleet.enabled), so demand, recommendations "
                "and the replay are per proxy, as its quotas were"]
    lines = [f"Fleet (usage topic {topic}): {_named(proxies)} enforced each quota across the fleet"
             for topic, proxies in sorted(fleets.items())]
    if groups.get(""):
        lines.append(f"Enforced alone (no fleet): {_named(groups[''])}")
    return [*lines, PER_INSTANCE]


def _named(proxies: list[str]) -> str:
    word = "proxy" if len(proxies) == 1 else "proxies"
    shown = ", ".join(proxies[:NAMED])
    more = f" and {len(proxies) - NAMED} more" if len(proxies) > NAMED else ""
    return f"{len(proxies)} {word} ({shown}{more})"
