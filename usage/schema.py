"""The usage log's schema, version 1: one row per interval start, proxy, user, client id and API key.

``proxy.usage_log`` writes rows of this schema as Parquet; ``pipeline`` reads them. This module
is the only thing the two share about the file, and it imports nothing but the standard library
(pyarrow only inside ``arrow_schema``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa

SCHEMA_VERSION = 1
OTHER = "(other)"  # user and client id of the row that overflow is folded into

# (name, Arrow type name, meaning). The counters are sums over the interval unless noted.
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("schema_version", "int16", "this schema's version (1)"),
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
)
COLUMN_NAMES = tuple(name for name, _, _ in COLUMNS)
KEY_COLUMNS = 7  # schema_version .. api_key; the counters follow, in COLUMNS order


def arrow_schema() -> pa.Schema:
    """The Parquet schema (pyarrow is imported only when the usage log is used)."""
    import pyarrow as pa

    types = {
        "int16": pa.int16(), "int32": pa.int32(), "int64": pa.int64(), "float64": pa.float64(),
        "string": pa.string(), "timestamp[ms, UTC]": pa.timestamp("ms", tz="UTC"),
    }
    fields = [pa.field(name, types[t], nullable=False) for name, t, _ in COLUMNS]
    return pa.schema(fields, metadata={b"kqp.usage.schema_version": str(SCHEMA_VERSION).encode()})
