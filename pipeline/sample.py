"""The numpy side of :mod:`pipeline.generate`: builds and writes the sample usage (kept apart so
that the proxy's command line does not load numpy and pyarrow to run the proxy)."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from numpy.typing import DTypeLike, NDArray

from usage.schema import ADDED_IN, SCHEMA_VERSION, arrow_schema, zero_of

from .generate import (
    CREATE_TOPICS,
    FETCH,
    INIT_PRODUCER_ID,
    NOISY,
    PRODUCE,
    RESTART_EVERY_S,
    RESTARTS,
    STORM,
    STORM_PARTITIONS,
    STORM_SECONDS,
    STORM_TOPICS,
)

Columns = dict[str, NDArray[Any]]  # column name → its values, one array per column (dtypes differ)
Amount = int | NDArray[np.int64]  # one amount for every row, or one per row


def write_usage(out: str | Path, principals: int, hours: float, interval_s: int, start: datetime | None,
                seed: int, proxies: int) -> int:
    """See :func:`pipeline.generate.generate`."""
    rng = np.random.default_rng(seed)
    start = start or datetime(2026, 11, 1, tzinfo=UTC)
    t0 = int(start.timestamp()) // interval_s * interval_s
    total_s = int(hours * 3600)
    # Per tenant: typical produce bytes/s (log-normal), record size, records per batch.
    base_rate = rng.lognormal(mean=math.log(40_000), sigma=1.0, size=principals)
    record_size = rng.choice([100, 250, 500, 1000, 2000], size=principals)
    producer = np.arange(principals) % 2 == 0
    schema = arrow_schema()
    rows = 0
    hour_starts = range(t0 - t0 % 3600, t0 + total_s, 3600)
    for hour_start in hour_starts:
        lo, hi = max(hour_start, t0), min(hour_start + 3600, t0 + total_s)
        starts = np.arange(t0 + -(-(lo - t0) // interval_s) * interval_s, hi, interval_s)
        if not len(starts):
            continue
        for proxy in range(proxies):
            cols = _hour(rng, starts, t0, total_s, interval_s, base_rate / proxies, record_size, producer,
                         proxy, proxies)
            n = len(cols["user"])
            arrays = {
                "schema_version": np.full(n, SCHEMA_VERSION, dtype=np.int16),
                "interval_start": cols["interval_start"] * 1000,
                "interval_seconds": np.full(n, interval_s, dtype=np.int32),
                "proxy": np.full(n, f"proxy-{proxy}", dtype=object),
                **{k: v for k, v in cols.items() if k != "interval_start"},
            }
            # Nothing is in shadow mode in the sample and every proxy enforces alone: the columns
            # added since version 1 are at their zero (shadow_* 0, fleet "").
            table = pa.Table.from_arrays([pa.array(arrays[f.name] if f.name not in ADDED_IN else [zero_of(f.name)] * n,
                                                   type=f.type) for f in schema], schema=schema)
            t = datetime.fromtimestamp(hour_start, UTC)
            path = (Path(out) / f"date={t:%Y-%m-%d}" / f"hour={t:%H}"
                    / f"usage-{hour_start}-proxy-{proxy}-generated.parquet")
            path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(table, path, compression="zstd")
            rows += n
    return rows



def _hour(rng: np.random.Generator, starts: NDArray[np.int64], t0: int, total_s: int, interval_s: int,
          base_rate: NDArray[np.float64], record_size: NDArray[np.int64], producer: NDArray[np.bool_], proxy: int,
          proxies: int) -> Columns:
    """The rows of one hour at one proxy, as column arrays."""
    p, k = len(base_rate), len(starts)
    # Steady tenants: one row per tenant and interval (Produce or Fetch).
    day = 1.0 + 0.5 * np.sin(2 * math.pi * (starts % 86400) / 86400.0)
    rate = base_rate[:, None] * day[None, :] * rng.gamma(8.0, 1 / 8.0, size=(p, k))
    nbytes = (rate * interval_s).astype(np.int64)
    size = record_size[:, None]
    records = np.maximum(nbytes // size, 1)
    batches = np.maximum(records // 20, 1)
    requests = np.maximum(batches // 4, 1) + interval_s  # at least one request a second
    prod = np.repeat(producer[:, None], k, axis=1)
    cols = {
        "interval_start": np.tile(starts, p),
        "user": np.repeat(np.array([f"tenant-{i:03d}" for i in range(p)], dtype=object), k),
        "client_id": np.repeat(np.array([f"svc-{i:03d}" for i in range(p)], dtype=object), k),
        "api_key": np.where(prod, PRODUCE, FETCH).ravel().astype(np.int16),
        "requests": requests.ravel(),
        "request_bytes": np.where(prod, nbytes + requests * 120, requests * 90).ravel(),
        "response_bytes": np.where(prod, requests * 60, nbytes + requests * 100).ravel(),
        "records": records.ravel(),
        "batches": batches.ravel(),
        "partition_mutations": np.zeros(p * k, dtype=np.int64),
        "new_producer_ids": np.zeros(p * k, dtype=np.int64),
    }
    extra = [_noisy(starts, t0, total_s, interval_s, float(base_rate.max()) * 20),
             _storm(starts, t0, total_s, interval_s, proxy, proxies), _restarts(starts, interval_s, proxies)]
    for more in extra:
        if more is not None:
            cols = {c: np.concatenate([cols[c], more[c]]) for c in cols}
    n = len(cols["user"])
    zeros = np.zeros(n, dtype=np.int64)
    cols.update(throttle_time_ms_sum=zeros, throttle_time_ms_max=zeros.astype(np.int32), throttled=zeros,
                rejected=zeros)
    cols["upstream_latency_ms_sum"] = cols["requests"] * rng.gamma(4.0, 0.5, size=n)
    return cols


def _rows(starts: NDArray[np.int64], user: str, client_id: str, api_key: int, requests: Amount, request_bytes: Amount,
          response_bytes: Amount, records: Amount = 0, batches: Amount = 0, mutations: Amount = 0,
          new_ids: Amount = 0) -> Columns:
    n = len(starts)

    def full(v: Amount, dtype: DTypeLike = np.int64) -> NDArray[Any]:
        return np.broadcast_to(np.asarray(v, dtype=dtype), (n,)).copy()

    return {
        "interval_start": starts, "user": np.full(n, user, dtype=object),
        "client_id": np.full(n, client_id, dtype=object),
        "api_key": full(api_key, np.int16), "requests": full(requests), "request_bytes": full(request_bytes),
        "response_bytes": full(response_bytes), "records": full(records), "batches": full(batches),
        "partition_mutations": full(mutations), "new_producer_ids": full(new_ids),
    }


def _noisy(starts: NDArray[np.int64], t0: int, total_s: int, interval_s: int, rate: float) -> Columns | None:
    on = starts[(starts >= t0 + total_s / 3) & (starts < t0 + 2 * total_s / 3)]
    if not len(on):
        return None
    nbytes = int(rate * interval_s)
    records = nbytes // 1000
    return _rows(on, *NOISY, PRODUCE, 10 * interval_s, nbytes, 60 * interval_s, records, max(records // 50, 1))


def _storm(starts: NDArray[np.int64], t0: int, total_s: int, interval_s: int, proxy: int,
           proxies: int) -> Columns | None:
    begin = t0 + total_s // 4
    on = starts[(starts >= begin) & (starts < begin + STORM_SECONDS)]
    if not len(on):
        return None
    # 5,000 topics in all, split as evenly as whole numbers allow over the storm's intervals.
    slots = -(-STORM_SECONDS // interval_s) * proxies
    j = (on - begin) // interval_s * proxies + proxy
    topics = STORM_TOPICS // slots + (j < STORM_TOPICS % slots)
    return _rows(on, *STORM, CREATE_TOPICS, topics, topics * 80, topics * 40, mutations=topics * STORM_PARTITIONS)


def _restarts(starts: NDArray[np.int64], interval_s: int, proxies: int) -> Columns:
    new_ids = max(interval_s // RESTART_EVERY_S // proxies, 1)
    init = _rows(starts, *RESTARTS, INIT_PRODUCER_ID, new_ids, new_ids * 40, new_ids * 30)
    produce = _rows(starts, *RESTARTS, PRODUCE, new_ids, new_ids * 1200, new_ids * 60, new_ids * 10, new_ids,
                    new_ids=new_ids)
    return {c: np.concatenate([init[c], produce[c]]) for c in init}
