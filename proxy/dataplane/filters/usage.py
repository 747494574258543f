"""What the usage log needs that no quota filter counted: the records and new producer ids of
every Produce request and the records of every Fetch and ShareFetch response, quota or not."""

from __future__ import annotations

from collections.abc import Callable

from protocol.apis import ApiKey
from protocol.headers import RequestHeader
from proxy.dataplane.filters.api import FilterContext, FilterSpec, Frame
from proxy.dataplane.filters.quotas import now_ms
from proxy.dataplane.filters.records import count_fetched, produce_scan
from proxy.dataplane.inflight import InFlight
from quotas.producer_ids import ProducerIdObserver


class UsageFilter:
    spec = FilterSpec(request_keys=frozenset({ApiKey.PRODUCE}),
                      response_keys=frozenset({ApiKey.FETCH, ApiKey.SHARE_FETCH}))

    def __init__(self, producer_ids: ProducerIdObserver, count_fetch_records: bool = True,
                 clock: Callable[[], int] = now_ms) -> None:
        self.producer_ids = producer_ids
        self.count_fetch_records = count_fetch_records
        self.clock = clock

    def on_request(self, ctx: FilterContext, header: RequestHeader, frame: Frame, entry: InFlight) -> None:
        # Before the producer-id quota: a rejected request's ids were still asked for.
        scan = produce_scan(ctx, header, frame, entry)
        if scan is not None and scan.producer_ids:
            entry.new_producer_ids = self.producer_ids.new_ids(ctx.session.principal, scan.producer_ids, self.clock())
        return None

    def on_response(self, ctx: FilterContext, entry: InFlight, frame: Frame) -> Frame:
        if self.count_fetch_records:
            count_fetched(ctx, entry, frame)  # at most once per response
        return frame

