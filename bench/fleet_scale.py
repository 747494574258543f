"""What the fleet's usage exchange costs one member as the fleet and its active entities grow.

One Tansu broker; one real proxy with ``fleet.enabled`` and a client-id quota that covers every
simulated entity; and simulated members: one child process that writes, for each of them, the
report format members write (quotas.fleet: a report every sync interval, each its own
record key and its partition of the usage topic, gzip as the proxy writes it) with an entry for
each of the fleet's active entities (every member charged every entity: the exchange's worst
case, and a fleet behind one load balancer's). No client sends anything through the real
member, so what it spends is what sharing costs it.

Per grid point (members × active entities), over ``--seconds``: the real member's CPU (% of one
core, every thread), the usage-topic bytes it wrote and read a second and the other members'
entries it applied a second (``kqp_fleet_*``), its sync lag (the oldest of the members' freshest
usage, sampled every half second), and its ``/metrics`` answer time (a client's stand-in: a
member busy with the exchange answers it late). The simulator's own lateness is reported too: a
point where it could not keep up measures less than it says.

    python -m bench.fleet_scale                          # 4x2000,8x5000 (members x entities)
    python -m bench.fleet_scale --grid 3x1000,4x2000 --seconds 20 --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import struct
import sys
import tempfile
import time
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench import clients
from bench.procs import CpuClock, Launcher
from quotas.common import PRODUCER_BYTE_RATE
from quotas.fleet import UsageEntry, UsageReport, encode_report

TOPIC = "__kqp_quota_usage"
SYNC_INTERVAL_MS = 250
# Where a report's incarnation, sequence number and send time sit (quotas.fleet's documented
# encoding: magic, version u8, incarnation u64, seq u64, sent_at_ms i64): rewritten in place for
# every report, so the simulator does not encode thousands of entries each interval.
_COUNTERS = struct.Struct(">QQq")
_COUNTERS_AT = 5


@dataclass(frozen=True)
class Point:
    members: int  # simulated members, besides the real one
    entities: int  # active entities, each in every member's report

    @property
    def label(self) -> str:
        return f"{self.members}x{self.entities}"


def parse_grid(text: str) -> list[Point]:
    points = []
    for part in text.split(","):
        members, _, entities = part.strip().partition("x")
        points.append(Point(int(members), int(entities)))
    return points


def proxy_yaml(partitions: int) -> str:
    """Every client id under a quota far above what it can reach, so the real member keeps a
    state for every simulated entity and applies every entry it reads."""
    return ("quotas:\n"
            "  - client_id: \"<default>\"\n"
            "    producer_byte_rate: 1000000000000\n"
            "fleet:\n"
            "  enabled: true\n"
            f"  partitions: {partitions}\n"
            f"  sync_interval_ms: {SYNC_INTERVAL_MS}\n")


def simulate(address: tuple[str, int], point: Point, partitions: int, stop: Any, conn: Any) -> None:
    """Child process: every sync interval, one report a simulated member, until ``stop`` is set;
    sends back ("done", {intervals, late intervals, the longest lateness in ms, bytes written})."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": f"{address[0]}:{address[1]}", "compression.type": "gzip",
                         "linger.ms": 5, "acks": 1, "message.max.bytes": 10 << 20})
    members = []
    for m in range(point.members):
        member_id = f"sim-member-{m}"
        # Amounts that differ from entity to entity and member to member, as charged bytes do:
        # gzip would shrink reports of equal amounts (in one batch) far below what members write.
        rng = random.Random(m)
        entries = tuple(UsageEntry(PRODUCER_BYTE_RATE, None, f"client-{i}", float(rng.randrange(100, 1_000_000)))
                        for i in range(point.entities))
        chunks = [bytearray(v) for v in encode_report(UsageReport(member_id, 1, 0, 0, SYNC_INTERVAL_MS, entries))]
        members.append((member_id.encode(), zlib.crc32(member_id.encode()) % partitions, chunks))
    interval_s = SYNC_INTERVAL_MS / 1000
    seq = intervals = late = written = 0
    worst_ms = 0.0
    next_at = time.monotonic()
    while not stop.is_set():
        sent_at = int(time.time() * 1000)
        for key, partition, chunks in members:
            for i, chunk in enumerate(chunks):
                _COUNTERS.pack_into(chunk, _COUNTERS_AT, 1, seq + i, sent_at)
                producer.produce(TOPIC, bytes(chunk), key, partition=partition)
                written += len(chunk)
        seq += max(len(c) for _, _, c in members) if members else 0
        producer.poll(0)
        intervals += 1
        next_at += interval_s
        behind_s = time.monotonic() - next_at
        if behind_s > 0:
            late += 1
            worst_ms = max(worst_ms, behind_s * 1000)
            next_at = time.monotonic()
        else:
            time.sleep(-behind_s)
    producer.flush(10)
    conn.send(("done", {"intervals": intervals, "late_intervals": late, "worst_late_ms": worst_ms,
                        "bytes_written": written}))


def scrape(address: tuple[str, int], timeout_s: float = 5.0) -> tuple[dict[str, float], float]:
    """The real member's ``kqp_fleet_*`` samples ({name{labels}: value}) and how long
    ``/metrics`` took to answer, in ms."""
    t0 = time.perf_counter()
    with urllib.request.urlopen(f"http://{address[0]}:{address[1]}/metrics", timeout=timeout_s) as r:
        text = r.read().decode()
    took_ms = (time.perf_counter() - t0) * 1000
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("kqp_fleet"):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out, took_ms


def lag_s(samples: dict[str, float]) -> float:
    """The oldest of the members' freshest usage (0 with none heard)."""
    return max((v for k, v in samples.items() if k.startswith("kqp_fleet_sync_lag_seconds")), default=0.0)


def measure(point: Point, workdir: Path, seconds: float, partitions: int) -> dict[str, Any]:
    launcher = Launcher(workdir / point.label)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    here, there = ctx.Pipe()
    sim = None
    try:
        broker = launcher.tansu_broker(name="fleet-tansu-broker")
        clients.create_topic(broker.address, TOPIC, partitions)
        member = launcher.our_proxy(broker.address, name="fleet-member", extra_yaml=proxy_yaml(partitions))
        metrics = tuple(member.extra["metrics"])
        sim = ctx.Process(target=simulate, args=(broker.address, point, partitions, stop, there), daemon=True)
        sim.start()
        deadline = time.monotonic() + 60
        while True:  # until the real member hears every simulated one
            samples, _ = scrape(metrics)
            if samples.get("kqp_fleet_members", 0) >= point.members + 1 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        time.sleep(2 * SYNC_INTERVAL_MS / 1000)
        before, _ = scrape(metrics)
        clock = CpuClock(member.pid)
        t0 = time.monotonic()
        lags, answers = [], []
        while time.monotonic() - t0 < seconds:
            time.sleep(0.5)
            samples, took_ms = scrape(metrics, timeout_s=30)
            lags.append(lag_s(samples))
            answers.append(took_ms)
        elapsed = time.monotonic() - t0
        cpu_s = clock.elapsed()
        after, _ = scrape(metrics)
        stop.set()
        sim_stats = here.recv()[1] if here.poll(30) else {}

        def rate(name: str) -> float:
            return (after.get(name, 0.0) - before.get(name, 0.0)) / elapsed

        return {
            "members": point.members + 1, "entities": point.entities,
            "members_heard": int(after.get("kqp_fleet_members", 0)),
            "cpu_pct": 100 * cpu_s / elapsed,
            "written_bytes_per_s": rate("kqp_fleet_sync_bytes_total{direction=written}"),
            "read_bytes_per_s": rate("kqp_fleet_sync_bytes_total{direction=read}"),
            "remote_entries_per_s": rate("kqp_fleet_remote_entries_total"),
            "sync_lag_max_s": max(lags, default=0.0),
            "metrics_answer_max_ms": max(answers, default=0.0),
            "simulator": sim_stats,
        }
    finally:
        stop.set()
        if sim is not None:
            sim.join(10)
            if sim.is_alive():
                sim.kill()
        launcher.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet_scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", default="4x2000,8x5000", help="simulated members x active entities, comma-separated")
    parser.add_argument("--seconds", type=float, default=15.0, help="measured time per grid point")
    parser.add_argument("--partitions", type=int, default=1, help="the usage topic's partitions (fleet.partitions)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kqp-fleet-scale-"))
    rows = []
    for point in parse_grid(args.grid):
        row = measure(point, workdir, args.seconds, args.partitions)
        rows.append(row)
        sim = row["simulator"]
        print(f"[{time.strftime('%H:%M:%S')}] {point.label}: member CPU {row['cpu_pct']:.1f} % of a core, "
              f"read {row['read_bytes_per_s'] / 1e3:,.1f} kB/s, written {row['written_bytes_per_s'] / 1e3:,.1f} kB/s, "
              f"{row['remote_entries_per_s']:,.0f} remote entries/s, lag {row['sync_lag_max_s']:.2f} s, "
              f"/metrics {row['metrics_answer_max_ms']:.0f} ms; simulator late in {sim.get('late_intervals', '?')} "
              f"of {sim.get('intervals', '?')} intervals", file=sys.stderr, flush=True)
    print(f"{'members':>8} {'entities':>9} {'CPU %':>7} {'read kB/s':>10} {'written kB/s':>13} {'entries/s':>10} "
          f"{'lag s':>6} {'/metrics ms':>12}")
    for r in rows:
        print(f"{r['members']:>8} {r['entities']:>9,} {r['cpu_pct']:>7.1f} {r['read_bytes_per_s'] / 1e3:>10,.1f} "
              f"{r['written_bytes_per_s'] / 1e3:>13,.1f} {r['remote_entries_per_s']:>10,.0f} "
              f"{r['sync_lag_max_s']:>6.2f} {r['metrics_answer_max_ms']:>12.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
