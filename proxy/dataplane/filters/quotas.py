"""Rate quotas: request_rate on every request, producer_byte_rate on Produce, consumer_byte_rate
on Fetch and ShareFetch responses. Record, then check (Kafka's Sensor.record with checkQuotas);
the throttle is part of the decision (Forward) and becomes the response's throttle_time_ms and a
mute. In a fleet (proxy.control.fleet), a Produce that would take this member past its part of a burst is
held until the next usage report instead (QuotaManager.paced_ms)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from protocol.apis import ApiKey
from protocol.fetch import cap_fetch_bytes, fetch_session, throttled_fetch_body
from protocol.frames import Buffer
from protocol.headers import RequestHeader, response_body_offset
from protocol.share_fetch import cap_share_fetch_bytes
from proxy.dataplane.filters.api import Defer, FilterContext, FilterSpec, Forward, Frame, ResponseDecision
from proxy.dataplane.filters.shadow import applied, enforced
from proxy.dataplane.inflight import InFlight
from quotas import CONSUMER_BYTE_RATE, PRODUCER_BYTE_RATE, REQUEST_RATE, QuotaManager

_MAX_PACED_WAITS = 4  # a fleet member holds a Produce for at most this many sync intervals


def now_ms() -> int:
    return time.monotonic_ns() // 1_000_000


class RateQuotaFilter:
    """request_rate and producer_byte_rate on requests, consumer_byte_rate on Fetch and
    ShareFetch responses."""

    def __init__(self, manager: QuotaManager, max_value_window_s: float, clock: Callable[[], int] = now_ms) -> None:
        self.manager = manager
        self.max_value_window_s = max_value_window_s  # (quota_window_num - 1) x window size
        self.clock = clock

    @property
    def spec(self) -> FilterSpec:
        """Every request, and (Share)Fetch responses; idle without any quota entry (nothing to
        record or check)."""
        return FilterSpec(request_keys=None, response_keys=frozenset({ApiKey.FETCH, ApiKey.SHARE_FETCH}),
                          idle=not self.manager.rules)

    def on_request(self, ctx: FilterContext, header: RequestHeader, frame: Frame,
                   entry: InFlight) -> Forward | Defer | None:
        manager = self.manager
        if not manager.rules:
            return None
        user, client_id = ctx.session.principal, header.client_id or ""
        now = self.clock()
        if header.api_key == ApiKey.PRODUCE and manager.paced_ms(user, client_id, PRODUCER_BYTE_RATE, len(frame),
                                                                 now):
            return Defer(self._paced(ctx, header, frame, entry, user, client_id))
        return self._charged(ctx, header, frame, entry, user, client_id, now)

    async def _paced(self, ctx: FilterContext, header: RequestHeader, frame: Frame, entry: InFlight, user: str,
                     client_id: str) -> Forward | None:
        """A fleet member holds a Produce that would take it past its part of a burst until the
        others have heard of what it admitted (the next report; at most _MAX_PACED_WAITS of them),
        rather than forwarding it and throttling after: see QuotaManager.paced_ms."""
        for _ in range(_MAX_PACED_WAITS):
            wait_ms = self.manager.paced_ms(user, client_id, PRODUCER_BYTE_RATE, len(frame), self.clock())
            if not wait_ms:
                break
            await asyncio.sleep(wait_ms / 1000)
        return self._charged(ctx, header, frame, entry, user, client_id, self.clock())

    def _charged(self, ctx: FilterContext, header: RequestHeader, frame: Frame, entry: InFlight, user: str,
                 client_id: str, now: int) -> Forward | None:
        manager = self.manager
        throttle = applied(ctx, entry, REQUEST_RATE,
                           manager.check_and_record(user, client_id, REQUEST_RATE, 1, now)).throttle_ms
        key = header.api_key
        if key == ApiKey.PRODUCE:
            # ClientQuotaManager records a Produce's request size (KafkaApis.handleProduceRequest).
            produced = applied(ctx, entry, PRODUCER_BYTE_RATE,
                               manager.check_and_record(user, client_id, PRODUCER_BYTE_RATE, len(frame), now))
            throttle = max(throttle, produced.throttle_ms)
        elif key == ApiKey.FETCH and header.body_offset >= 0:
            entry.fetch_session = fetch_session(frame, header.body_offset, header.api_version)
            capped = self._cap_fetch(header, frame, user, client_id)
            if capped is not frame or throttle:
                return Forward(None if capped is frame else capped, throttle_ms=throttle)
            return None
        elif key == ApiKey.SHARE_FETCH and header.body_offset >= 0:
            capped = self._cap_fetch(header, frame, user, client_id, cap_share_fetch_bytes)
            if capped is not frame or throttle:
                return Forward(None if capped is frame else capped, throttle_ms=throttle)
            return None
        return Forward(throttle_ms=throttle) if throttle else None

    def _cap_fetch(self, header: RequestHeader, frame: Frame, user: str, client_id: str,
                   cap: Callable[[Buffer, int, int, int], Buffer] = cap_fetch_bytes) -> Frame:
        # KafkaApis.handleFetchRequest (and handleFetchFromShareFetchRequest, KIP-932): a fetch
        # may not ask for more than the quota admits in
        # (samples - 1) windows (ClientQuotaManager.getMaxValueInQuotaWindow), or a response
        # larger than the window could hold would be throttled, emptied and asked for again forever.
        resolved = enforced(self.manager.resolve(user, client_id, CONSUMER_BYTE_RATE))
        if resolved is None:
            return frame
        cap_bytes = max(int(resolved.quota * self.max_value_window_s), 1)
        return cap(frame, header.body_offset, header.api_version, min(cap_bytes, 2**31 - 1))

    def on_response(self, ctx: FilterContext, entry: InFlight, frame: Frame) -> ResponseDecision:
        manager = self.manager
        if not manager.rules:
            return frame
        user, client_id = ctx.session.principal, ctx.session.client_id or ""
        now = self.clock()
        size = len(frame)
        # Not paced in a fleet: a throttled Fetch is emptied and un-recorded (below), so pacing a
        # response larger than this member's part of the burst would starve its consumer.
        decided = manager.check_and_record(user, client_id, CONSUMER_BYTE_RATE, size, now, paced=False)
        if decided.throttle_ms <= 0:
            return frame
        share = entry.api_key == ApiKey.SHARE_FETCH
        if not share:
            # KafkaApis: a fetch over its byte quota is answered empty, and its bytes un-recorded;
            # in shadow mode too, so the shadow counts are the ones enforcing would give.
            manager.unrecord(user, client_id, CONSUMER_BYTE_RATE, size, now)
        throttle = applied(ctx, entry, CONSUMER_BYTE_RATE, decided).throttle_ms
        if not throttle:
            return frame  # shadow mode: delivered as it is
        if share:
            # Not as KafkaApis.handleShareFetchRequest, which answers empty and un-records: the
            # broker has acquired these records for this member, and an empty answer would leave
            # them locked until their acquisition lock expires, a delivery attempt spent
            # (group.share.delivery.count.limit). They are delivered; the mute holds the rate.
            return Forward(frame, throttle_ms=max(entry.throttle_ms, throttle))
        throttle = max(entry.throttle_ms, throttle)
        offset = response_body_offset(frame, entry.api_key, entry.api_version)
        body = throttled_fetch_body(entry.api_version, throttle, entry.fetch_session)
        return Forward(bytes(frame[:offset]) + body, throttle_ms=throttle)
