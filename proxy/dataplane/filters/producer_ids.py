"""KIP-936: a Produce request that brings a user more new producer ids than its quota allows is
rejected with THROTTLING_QUOTA_EXCEEDED on every partition (or, with ``reaction: delay``, held
until the quota admits it)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from protocol import errors
from protocol.apis import ApiKey
from protocol.headers import RequestHeader
from protocol.produce import produce_error_response
from proxy.dataplane.filters.api import Answer, Close, Defer, FilterContext, FilterSpec, Frame
from proxy.dataplane.filters.quotas import now_ms
from proxy.dataplane.filters.records import produce_scan
from proxy.dataplane.filters.shadow import applied
from proxy.dataplane.inflight import InFlight
from quotas.common import PRODUCER_IDS_RATE
from quotas.producer_ids import ProducerIdQuotaManager

log = logging.getLogger(__name__)

REJECTED_MESSAGE = "producer_ids_rate exceeded: too many new producer ids for this user in the quota window"


class ProducerIdQuotaFilter:

    def __init__(self, manager: ProducerIdQuotaManager, reaction: str = "reject",
                 clock: Callable[[], int] = now_ms) -> None:
        if reaction not in ("reject", "delay"):
            raise ValueError(f"reaction must be reject or delay, got {reaction!r}")
        self.manager = manager
        self.reaction = reaction
        self.clock = clock
        self.delayed_total = 0  # requests held by the delay reaction

    @property
    def spec(self) -> FilterSpec:
        """Produce requests; idle without a producer_ids_rate quota."""
        return FilterSpec(request_keys=frozenset({ApiKey.PRODUCE}), idle=not self.manager.active)

    def on_request(self, ctx: FilterContext, header: RequestHeader, frame: Frame,
                   entry: InFlight) -> Answer | Close | Defer | None:
        manager = self.manager
        if not manager.active:
            return None
        scan = produce_scan(ctx, header, frame, entry)
        if scan is None or not scan.producer_ids:
            return None
        user = ctx.session.principal
        delay = self.reaction == "delay"
        decided = manager.admit(user, scan.producer_ids, self.clock(), rejecting=not delay)
        decision = applied(ctx, entry, PRODUCER_IDS_RATE, decided,
                           "a Produce delayed for new producer ids" if delay else "a Produce with new producer ids")
        if decision.admitted:
            return None
        if delay:
            self.delayed_total += 1
            return Defer(self._admitted_later(user, scan.producer_ids, decision.throttle_ms))
        if scan.acks == 0:
            # Nothing can be answered to acks=0: KafkaApis.handleProduceRequest closes the
            # connection of an acks=0 produce that failed, so the client learns of it.
            return Close(f"new producer ids over producer_ids_rate for user {user!r} on an acks=0 produce")
        throttle = max(entry.throttle_ms, decision.throttle_ms)  # answered, then muted (KIP-219)
        entry.rejected = True
        return Answer(produce_error_response(
            header.correlation_id, header.api_version, scan.topics,
            errors.THROTTLING_QUOTA_EXCEEDED, throttle, REJECTED_MESSAGE,
        ), throttle_ms=throttle)

    async def _admitted_later(self, user: str, producer_ids: Sequence[int], wait_ms: int) -> None:
        """Waits until the quota admits the request's new ids (another connection of the same
        user may take the tokens first: then it waits again)."""
        manager = self.manager
        while True:
            await asyncio.sleep(max(wait_ms, 1) / 1000)
            decision = manager.admit(user, producer_ids, self.clock(), rejecting=False)
            if decision.admitted:
                return None
            wait_ms = decision.throttle_ms
