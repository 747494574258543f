"""The usage log's schema, version 3: one row per interval start, proxy, user, client id and API key.

``proxy.observability.usage_log`` writes rows of this schema as Parquet; ``pipeline`` reads them. This module
is the only thing the two share about the file, and it imports nothing but the standard library
(pyarrow only inside ``arrow_schema``).

Version 2 added the ``shadow_*`` columns at the end (what quotas in shadow mode would have done),
version 3 the ``fleet`` column after them (the usage topic of the fleet the proxy enforced its
quotas with, "" alone). A file of an older version reads as the current one with the columns it
lacks at their type's zero: 0, or "" for a string (:data:`ADDED_IN`, :func:`zero_of`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa

SCHEMA_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)  # what the pipeline reads
OTHER = "(other)"  # user and client id of the row that overflow is folded into

# (name, Arrow type name, meaning). The counters are sums over the interval unless noted.
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("schema_version", "int16", "this schema's version (3)"),
    ("interval_start", "timestamp[ms, UTC]", "start of the interval (UTC)"),
    ("interval_seconds", "int32", "length of the interval"),
    ("proxy", "string", "the proxy instance that counted (usage_log.proxy_name)"),
    ("user", "string", "the principal (SASL user, or ANONYMOUS); (other) for overflow"),
    ("client_id", "string", "the request header's client id; (other) for overflow"),
    ("api_key", "int16", "the request's API key"),
    ("requests", "int64", "requests completed (acks=0 Produce: forwarded)"),
    ("request_bytes", "int64", "request sizes, header included (what producer_byte_rate charges on Produce)"),
    ("response_bytes", "int64",
     "response sizes sent to the client (what consumer_byte_rate charges on Fetch and ShareFetch)"),
    ("records", "int64", "records in Produce requests / delivered by Fetch and ShareFetch responses (batch headers)"),
    ("batches", "int64", "record batches in Produce requests / Fetch responses"),
    ("partition_mutations", "int64", "partitions created or deleted asked for (KIP-599 charge)"),
    ("new_producer_ids", "int64", "producer ids not seen from this user within the producer-id window"),
    ("throttle_time_ms_sum", "int64", "throttle the proxy's quotas gave these requests"),
    ("throttle_time_ms_max", "int32", "the longest single throttle"),
    ("throttled", "int64", "requests given a throttle"),
    ("rejected", "int64", "requests rejected by a quota (THROTTLING_QUOTA_EXCEEDED)"),
    ("upstream_latency_ms_sum", "float64", "time the broker took to answer, summed"),
    ("shadow_throttle_time_ms_sum", "int64", "throttle quotas in shadow mode would have given these requests"),
    ("shadow_throttle_time_ms_max", "int32", "the longest single throttle of quotas in shadow mode"),
    ("shadow_throttled", "int64", "requests quotas in shadow mode would have throttled"),
    ("shadow_rejected", "int64", "requests quotas in shadow mode would have rejected (THROTTLING_QUOTA_EXCEEDED)"),
    ("fleet", "string",
     "the fleet's usage topic (fleet.topic) when the proxy enforced its quotas with fleet.enabled; \"\" alone"),
)
COLUMN_NAMES = tuple(name for name, _, _ in COLUMNS)
KEY_COLUMNS = 7  # schema_version .. api_key; the counters follow, in COLUMNS order
# The counters end before ``fleet``, which is the writer's setting (the same on every row of a file).
COUNTER_COLUMNS = COLUMN_NAMES[KEY_COLUMNS:COLUMN_NAMES.index("fleet")]
# Columns a file of an older version lacks, by the version that added them: read as their type's zero.
ADDED_IN = {**{name: 2 for name in COLUMN_NAMES if name.startswith("shadow_")}, "fleet": 3}
_TYPES = {name: t for name, t, _ in COLUMNS}
_ZEROS: dict[str, int | float | str] = {"int16": 0, "int32": 0, "int64": 0, "float64": 0.0, "string": ""}


def zero_of(name: str) -> int | float | str:
    """What column ``name`` reads as in a file that lacks it (see :data:`ADDED_IN`)."""
    return _ZEROS[_TYPES[name]]


def arrow_schema() -> pa.Schema:
    """The Parquet schema (pyarrow is imported only when the usage log is used)."""
    import pyarrow as pa

    types = {
        "int16": pa.int16(), "int32": pa.int32(), "int64": pa.int64(), "float64": pa.float64(),
        "string": pa.string(), "timestamp[ms, UTC]": pa.timestamp("ms", tz="UTC"),
    }
    fields = [pa.field(name, types[t], nullable=False) for name, t, _ in COLUMNS]
    return pa.schema(fields, metadata={b"kqp.usage.schema_version": str(SCHEMA_VERSION).encode()})
