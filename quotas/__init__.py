"""Pure quota engines, time passed in: token bucket, windowed rate, entity resolution, manager.

Nothing here reads a clock, starts a timer or touches asyncio; ``proxy/`` does, and passes
``now_ms`` (milliseconds from any monotonic origin) to every call.
"""

from quotas.common import (
    ADMIT,
    ALL_KINDS,
    CONSUMER_BYTE_RATE,
    CONSUMER_RECORD_RATE,
    CONTROLLER_MUTATION_RATE,
    MAX_THROTTLE_MS,
    PRODUCER_BATCH_RATE,
    PRODUCER_BYTE_RATE,
    PRODUCER_IDS_RATE,
    PRODUCER_RECORD_RATE,
    RATE_KINDS,
    RECORD_KINDS,
    REQUEST_RATE,
    TOKEN_BUCKET_KINDS,
    USER_LEVEL_ONLY_KINDS,
    Decision,
)
from quotas.entities import ANONYMOUS, DEFAULT, EntityResolver, EntityTable, QuotaRule, ResolvedQuota
from quotas.entity_state import EntityStats, KindCounters
from quotas.manager import QuotaManager
from quotas.rate import WindowedRate
from quotas.token_bucket import TokenBucket

__all__ = [
    "ADMIT",
    "ALL_KINDS",
    "ANONYMOUS",
    "CONSUMER_BYTE_RATE",
    "CONSUMER_RECORD_RATE",
    "CONTROLLER_MUTATION_RATE",
    "DEFAULT",
    "MAX_THROTTLE_MS",
    "PRODUCER_BATCH_RATE",
    "PRODUCER_BYTE_RATE",
    "PRODUCER_IDS_RATE",
    "PRODUCER_RECORD_RATE",
    "RATE_KINDS",
    "RECORD_KINDS",
    "REQUEST_RATE",
    "TOKEN_BUCKET_KINDS",
    "USER_LEVEL_ONLY_KINDS",
    "Decision",
    "EntityResolver",
    "EntityStats",
    "EntityTable",
    "KindCounters",
    "QuotaManager",
    "QuotaRule",
    "ResolvedQuota",
    "TokenBucket",
    "WindowedRate",
]
