"""Readiness (``/readyz``): whether a client sent to this proxy now can be served.

``/healthz`` stays a liveness check (the proxy's own listeners serve). Ready is more: every
listener serving, at least one broker known from metadata, and one of the proxy's own metadata
refreshes (periodic, or expedited for a leader change) answered within ``max_silence_s``. An
orchestrator then stops sending clients to a proxy that cannot reach its cluster, and sends
them again once it can.

A refresh's success is noticed from ProxyStats' counters when readiness is checked, so its
time is known to within the interval between checks (orchestrators check every few seconds).
Bytes relayed to clients are not taken as a broker's answer: the proxy answers some requests
itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Protocol

from proxy.observability.stats import ProxyStats


class KnownBrokers(Protocol):
    """What readiness reads of the cluster (proxy.cluster.brokers.Cluster is one)."""

    @property
    def brokers(self) -> Mapping[int, tuple[str, int]]: ...


class Readiness:
    def __init__(self, stats: ProxyStats, cluster: KnownBrokers, max_silence_s: float,
                 clock_s: Callable[[], float] = time.monotonic) -> None:
        self._stats = stats
        self._cluster = cluster
        self.max_silence_s = max_silence_s
        self._clock_s = clock_s
        self._successes_seen = 0  # the counters start at zero
        self._last_success_s: float | None = None  # when a success was first noticed

    def check(self, serving: bool) -> tuple[bool, str]:
        """(ready, detail); the detail names everything missing, or what readiness rests on."""
        now_s = self._clock_s()
        successes = self._refreshes_answered()
        if successes != self._successes_seen:
            self._successes_seen = successes
            self._last_success_s = now_s
        brokers = sorted(self._cluster.brokers)
        missing = []
        if not serving:
            missing.append("listeners not serving")
        if not brokers:
            missing.append("no broker known (no metadata yet)")
        if self._last_success_s is None:
            missing.append("no metadata refresh has succeeded yet")
        elif now_s - self._last_success_s > self.max_silence_s:
            missing.append(f"no metadata refresh succeeded for {now_s - self._last_success_s:.0f} s "
                           f"(more than {self.max_silence_s:g} s)")
        if missing:
            return False, "not ready: " + "; ".join(missing)
        return True, f"ready; brokers known: {brokers}"

    def _refreshes_answered(self) -> int:
        # Counted by reason: "success" (bootstrap), "periodic_leaders", "expedited"; failures
        # as "failure" / "<reason>_failure".
        return sum(n for reason, n in self._stats.metadata_refreshes.items() if not reason.endswith("failure"))
