"""Realistic multi-tenant usage in the usage log's own schema, for trying the pipeline and for
its tests and benchmark.

The tenants, over ``hours`` from ``start``:
- steady tenants ``tenant-NNN`` (client ``svc-NNN``): half producers, half consumers, each with
  its own typical rate (log-normal across tenants), a daily cycle and noise;
- a noisy neighbour ``bulk-loader`` (client ``nightly-import``): a producer that, during the
  middle third of the time, sends 20x the bytes of the busiest steady tenant;
- a topic-creation storm ``provisioner`` (client ``terraform``): KIP-599's experiment, 5,000
  topics of 10 partitions created in about ten minutes, a quarter of the way in;
- a producer restart loop ``flaky-app`` (client ``flaky-producer``): KIP-936's case, a new
  idempotent producer (InitProducerId, then a Produce with a new producer id) every 2 seconds.

One file per hour and proxy: ``date=YYYY-MM-DD/hour=HH/usage-<hour start>-<proxy>-generated.parquet``.
"""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from pathlib import Path

from protocol.apis import ApiKey

PRODUCE, FETCH, CREATE_TOPICS, INIT_PRODUCER_ID = (ApiKey.PRODUCE, ApiKey.FETCH, ApiKey.CREATE_TOPICS,
                                                   ApiKey.INIT_PRODUCER_ID)
NOISY = ("bulk-loader", "nightly-import")
STORM = ("provisioner", "terraform")
RESTARTS = ("flaky-app", "flaky-producer")
STORM_TOPICS, STORM_PARTITIONS, STORM_SECONDS = 5000, 10, 600
RESTART_EVERY_S = 2


def generate(out: str | Path, principals: int = 20, hours: float = 2.0, interval_s: int = 10,
             start: datetime | None = None, seed: int = 0, proxies: int = 1) -> int:
    """Writes the usage of ``principals`` steady tenants plus the three special ones; returns
    the rows written."""
    if principals < 2 or hours <= 0 or interval_s < 1 or proxies < 1:
        raise ValueError("need at least 2 principals, a positive duration, interval and proxy count")
    from .sample import write_usage  # numpy and pyarrow: only when sample data is asked for

    return write_usage(out, principals, hours, interval_s, start, seed, proxies)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=Path, help="usage log directory to write")
    p.add_argument("--principals", type=int, default=20, help="steady tenants (20)")
    p.add_argument("--hours", type=float, default=2.0, help="hours of usage (2)")
    p.add_argument("--interval-seconds", type=int, default=10, help="usage-log interval (10)")
    p.add_argument("--proxies", type=int, default=1, help="proxy instances sharing the load (1)")
    p.add_argument("--seed", type=int, default=0, help="random seed: the same seed writes the same usage (0)")
    p.add_argument("--start", help="first interval, ISO 8601 UTC (default 2026-11-01)")


def main(args: argparse.Namespace) -> int:
    start = datetime.fromisoformat(args.start).replace(tzinfo=UTC) if args.start else None
    rows = generate(args.out, args.principals, args.hours, args.interval_seconds, start, args.seed, args.proxies)
    print(f"wrote {rows:,} usage rows to {args.out}")
    return 0
