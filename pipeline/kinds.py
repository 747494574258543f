"""Which usage-log column each quota kind charges, and on which APIs (as the proxy charges them)."""

from __future__ import annotations

from typing import NamedTuple

from protocol.apis import STRICT_SINCE, ApiKey
from quotas.common import (
    CONSUMER_BYTE_RATE,
    CONSUMER_RECORD_RATE,
    CONTROLLER_MUTATION_RATE,
    PRODUCER_BATCH_RATE,
    PRODUCER_BYTE_RATE,
    PRODUCER_IDS_RATE,
    PRODUCER_RECORD_RATE,
    REQUEST_RATE,
)

PRODUCE, FETCH, SHARE_FETCH = ApiKey.PRODUCE, ApiKey.FETCH, ApiKey.SHARE_FETCH
MUTATING = frozenset(STRICT_SINCE)  # the APIs the controller-mutation quota charges


class Demand(NamedTuple):
    column: str
    api_keys: frozenset[int] | None  # None: every API


DEMAND: dict[str, Demand] = {
    REQUEST_RATE: Demand("requests", None),
    PRODUCER_BYTE_RATE: Demand("request_bytes", frozenset({PRODUCE})),
    CONSUMER_BYTE_RATE: Demand("response_bytes", frozenset({FETCH, SHARE_FETCH})),  # KIP-932: as a Fetch
    PRODUCER_RECORD_RATE: Demand("records", frozenset({PRODUCE})),
    CONSUMER_RECORD_RATE: Demand("records", frozenset({FETCH, SHARE_FETCH})),
    PRODUCER_BATCH_RATE: Demand("batches", frozenset({PRODUCE})),
    CONTROLLER_MUTATION_RATE: Demand("partition_mutations", MUTATING),
}
# KIP-936: producer_ids_rate counts new ids per user per producer-id window, not per second.
PER_WINDOW = {PRODUCER_IDS_RATE: Demand("new_producer_ids", frozenset({PRODUCE}))}
ANY = "(any)"  # the replay's row of a request held back by any quota
RATE_KINDS = tuple(DEMAND)
ALL_KINDS = RATE_KINDS + tuple(PER_WINDOW)
