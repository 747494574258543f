"""What the usage log needs that no quota filter counted: the records and new producer ids of
every Produce request and the records of every Fetch and ShareFetch response, quota or not."""

from __future__ import annotations

from protocol.apis import ApiKey
from proxy.dataplane.filters.api import FilterSpec
from proxy.dataplane.filters.quotas import now_ms
from proxy.dataplane.filters.records import count_fetched, produce_scan
from quotas.producer_ids import ProducerIdObserver


class UsageFilter:
    spec = FilterSpec(request_keys=frozenset({ApiKey.PRODUCE}),
                      response_keys=frozenset({ApiKey.FETCH, ApiKey.SHARE_FETCH}))

    def __init__(self, producer_ids: ProducerIdObserver, count_fetch_records: bool = True, clock=now_ms) -> None:
        self.producer_ids = producer_ids
        self.count_fetch_records = count_fetch_records
        self.clock = clock

    def on_request(self, ctx, header, frame, entry):
        # Before the producer-id quota: a rejected request's ids were still asked for.
        scan = produce_scan(ctx, header, frame, entry)
        if scan is not None and scan.producer_ids:
            entry.new_producer_ids = self.producer_ids.new_ids(ctx.session.principal, scan.producer_ids, self.clock())
        return None

    def on_response(self, ctx, entry, frame):
        if self.count_fetch_records:
            count_fetched(ctx, entry, frame)  # at most once per response
        return frame

