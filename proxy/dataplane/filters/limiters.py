"""KIP-731 rate limiters in the proxy: each request (and each Fetch response) is shown to every
limiter that asked for it; the longest throttle any of them wants becomes the response's
throttle_time_ms and a mute, once, alongside the other quotas (KIP-219)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from protocol.apis import ApiKey
from protocol.headers import RequestHeader
from proxy.dataplane.filters.api import FilterContext, FilterSpec, Forward, Frame, ResponseDecision
from proxy.dataplane.filters.quotas import now_ms
from proxy.dataplane.filters.records import count_fetched, produce_scan
from proxy.dataplane.filters.shadow import note_shadow
from proxy.dataplane.inflight import InFlight
from quotas.limiters import RateLimiter, Usage

log = logging.getLogger(__name__)


class RateLimiterFilter:
    """Shown the requests (and Fetch responses) some limiter asked for; its spec follows the
    limiters as (re)configured."""

    def __init__(self, limiters: Sequence[RateLimiter], clock: Callable[[], int] = now_ms) -> None:
        self.clock = clock
        self.failures: dict[str, int] = {}  # limiter class → calls that raised
        self.set_limiters(limiters)

    def set_limiters(self, limiters: Sequence[RateLimiter]) -> None:
        """Takes the limiters as (re)configured: what each wants to see is read now."""
        self.limiters = tuple(limiters)
        self._all_apis = tuple(lim for lim in self.limiters if lim.api_keys is None)
        by_key: dict[int, list[RateLimiter]] = {}
        for lim in self.limiters:
            for key in lim.api_keys or ():
                by_key.setdefault(key, []).append(lim)
        self._by_key = {key: tuple(lims) + self._all_apis for key, lims in by_key.items()}
        self._on_fetch = tuple(lim for lim in self.limiters if lim.fetch_responses)
        self.spec = FilterSpec(
            request_keys=None if self._all_apis else frozenset(self._by_key),
            response_keys=frozenset({ApiKey.FETCH, ApiKey.SHARE_FETCH}) if self._on_fetch else frozenset(),
            idle=not (self._all_apis or self._by_key or self._on_fetch),  # no limiter wants to see anything
        )

    def on_request(self, ctx: FilterContext, header: RequestHeader, frame: Frame, entry: InFlight) -> Forward | None:
        key = header.api_key
        limiters = self._by_key.get(key, self._all_apis)
        if not limiters:
            return None
        batches = records = 0
        if key == ApiKey.PRODUCE:
            scan = produce_scan(ctx, header, frame, entry)
            if scan is not None:
                batches, records = scan.batches, scan.records
        usage = Usage(ctx.session.principal, header.client_id or "", key, header.api_version,
                      len(frame), batches, records)
        throttle = self._throttle(ctx, entry, limiters, usage)
        return Forward(throttle_ms=throttle) if throttle else None

    def on_response(self, ctx: FilterContext, entry: InFlight, frame: Frame) -> ResponseDecision:
        limiters = self._on_fetch
        if not limiters:
            return frame
        if not count_fetched(ctx, entry, frame):
            return frame
        usage = Usage(ctx.session.principal, ctx.session.client_id or "", entry.api_key, entry.api_version,
                      len(frame), entry.batches, entry.records or 0, response=True)
        # KIP-731: the records are delivered and the client then pauses just long enough to
        # bring its rate back to the bound (not emptied and re-fetched like a byte quota).
        throttle = self._throttle(ctx, entry, limiters, usage)
        return Forward(frame, throttle_ms=throttle) if throttle else frame

    def _throttle(self, ctx: FilterContext, entry: InFlight, limiters: Sequence[RateLimiter], usage: Usage) -> int:
        now = self.clock()
        throttle = 0
        for lim in limiters:
            try:
                t, shadow_ms = lim.charge(usage, now)
                if shadow_ms and not t:  # a limiter's quota is enforced or shadowed, never both for one usage
                    note_shadow(ctx, entry, type(lim).__qualname__, int(shadow_ms))
            except Exception:
                # A plug-in's failure must not cost the client its connection: it is counted,
                # logged the first time, and that limiter asks for no throttle this time.
                name = type(lim).__qualname__
                if not self.failures.get(name):
                    log.exception("rate limiter %s failed; it is skipped for this request", name)
                self.failures[name] = self.failures.get(name, 0) + 1
                continue
            if t > throttle:
                throttle = int(t)
        return throttle
