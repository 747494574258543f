"""What the fleet's usage exchange costs one member as the fleet and its active entities grow.

One Tansu broker; one real proxy with ``fleet.enabled`` and a client-id quota (``BOUND`` bytes a
second) that covers every simulated entity; and simulated members: one child process that
writes, for each of them, the report format members write (quotas.fleet: a report every sync
interval, each its own record key and its partition of the usage topic, gzip as the proxy
writes it). Every member charges every active entity (the exchange's worst case, and a fleet
behind one load balancer's): a ``--hot`` fraction of them near their bound (together 0.9 of it),
the others far below (``--cold``, 0.001 of it); each simulated member reports an entity as a
member does (quotas.fleet.worth_reporting at ``--report-threshold``, and every amount of an
entity the fleet shares), so ``--report-threshold 0`` measures the exchange that reports every
entity. No client sends anything through the real member, so what it spends is what sharing
costs it.

With ``--aggregation owners`` (proxy.control.fleet_owners) the simulated members write each
entity's usage to the partition it hashes to, a heartbeat each to the totals topic, and the
totals of the partitions they own (worked out from what they write, rendezvous over them and
the real member, as a member does); the real member is given an instance id that owns at least
one partition (``owned``), so what it spends is an owner's: the members that cost the most.

Per grid point (members × active entities), after a quota window of reports, over ``--seconds``
with nothing else asked of it: the real member's CPU (% of one core, every thread), the
usage-topic bytes it wrote and read a second and the other members' entries it applied (and
dropped, past ``fleet.max_remote_entries_per_s``) a second (``kqp_fleet_*``). Then, scraped every
half second for five seconds: its sync lag (the oldest of the members' freshest usage), its
``/metrics`` answer time (a client's stand-in: a member busy with the exchange answers it late),
and its accuracy: the rate it holds for the hot entities it shows in ``kqp_quota_rate`` against
the rate the simulated members charged them. The simulator's own
lateness is reported too: a point where it could not keep up measures less than it says.

    python -m bench.fleet_scale                          # 4x2000,8x5000 (members x entities)
    python -m bench.fleet_scale --grid 3x1000,32x10000,128x10000 --seconds 20 --json out.json
    python -m bench.fleet_scale --aggregation owners --partitions 32 --grid 32x10000,128x10000
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
from config.model import FleetConfig
from proxy.control.fleet_owners import TOTALS_SUFFIX, heartbeat_ms
from quotas.common import PRODUCER_BYTE_RATE
from quotas.fleet import UsageEntry, UsageReport, encode_report, worth_reporting
from quotas.fleet_totals import Totals, encode_totals, entity_partition, owner_of

TOPIC = "__kqp_quota_usage"
REAL_MEMBER = "real-member"  # the real proxy's fleet.instance_id (with owners: real_member_id)
SYNC_INTERVAL_MS = 250
BOUND = 10_000_000  # every client id's producer_byte_rate, bytes a second
HOT_TOTAL = 0.9  # of the bound: what the whole fleet charges a hot entity
WINDOW_S = 11  # the quota window (Kafka's 11 x 1 s, the proxy's default)
PROBE_S = 5.0  # scraped every half second after the measured time: lag, /metrics, accuracy
# Where a report's incarnation, sequence number and send time sit (quotas.fleet's documented
# encoding: magic, version u8, incarnation u64, seq u64, sent_at_ms i64): rewritten in place for
# every report, so the simulator does not encode thousands of entries each interval.
_COUNTERS = struct.Struct(">QQq")
_COUNTERS_AT = 5


@dataclass(frozen=True)
class Point:
    members: int  # simulated members, besides the real one
    entities: int  # active entities, each charged by every member

    @property
    def label(self) -> str:
        return f"{self.members}x{self.entities}"


def parse_grid(text: str) -> list[Point]:
    points = []
    for part in text.split(","):
        members, _, entities = part.strip().partition("x")
        points.append(Point(int(members), int(entities)))
    return points


@dataclass(frozen=True)
class Load:
    hot: float  # the fraction of the active entities near their bound
    cold: float  # what each of the others is charged, a fraction of its bound (the whole fleet's)
    report_threshold: float  # fleet.report_threshold, of the real member and the simulated ones
    aggregation: str = "flat"  # fleet.aggregation

    def hot_entities(self, point: Point) -> int:
        return max(1, round(point.entities * self.hot))


def sim_ids(point: Point) -> list[str]:
    return [f"sim-member-{m}" for m in range(point.members)]


def real_member_id(point: Point, load: Load, partitions: int) -> str:
    """The real member's instance id: with owners, one that owns a partition among the simulated
    members (the figures measured are then an owner's, the members that cost the most)."""
    if load.aggregation != "owners":
        return REAL_MEMBER
    ids = sim_ids(point)
    return next(name for k in range(100_000) for name in [f"{REAL_MEMBER}-{k}"]
                if any(owner_of(p, [*ids, name]) == name for p in range(partitions)))


def proxy_yaml(partitions: int, load: Load, instance_id: str = REAL_MEMBER) -> str:
    """Every client id under a bound of BOUND bytes a second: the real member keeps a state for
    every entity reported and applies every entry it reads."""
    return ("quotas:\n"
            "  - client_id: \"<default>\"\n"
            f"    producer_byte_rate: {BOUND}\n"
            "fleet:\n"
            "  enabled: true\n"
            f"  partitions: {partitions}\n"
            f"  sync_interval_ms: {SYNC_INTERVAL_MS}\n"
            f"  report_threshold: {load.report_threshold}\n"
            f"  aggregation: {load.aggregation}\n"
            f"  instance_id: {instance_id}\n")


def member_entries(point: Point, load: Load, member: int) -> tuple[UsageEntry, ...]:
    """What one simulated member reports every interval: each entity's part of what the fleet
    (the real member included, which charges nothing) charges it, varied by ±20 % between
    members (gzip would shrink reports of equal amounts far below what members write), where
    it is worth reporting as a member decides it. Every member charges an entity alike, so one
    reports it where all do: the fleet shares it."""
    rng = random.Random(member)
    members = point.members + 1
    hot = load.hot_entities(point)
    out = []
    for i in range(point.entities):
        fleet_rate = BOUND * (HOT_TOTAL if i < hot else load.cold)
        amount = fleet_rate * SYNC_INTERVAL_MS / 1000 / members
        if worth_reporting(amount, BOUND, SYNC_INTERVAL_MS, members, load.report_threshold):
            out.append(UsageEntry(PRODUCER_BYTE_RATE, None, f"client-{i}", round(amount * rng.uniform(0.8, 1.2))))
    return tuple(out)


def simulate(address: tuple[str, int], point: Point, load: Load, partitions: int, stop: Any, conn: Any) -> None:
    """Child process: every sync interval, one report a simulated member (with aggregation
    owners, a record to each partition it has entries for, the totals of the partitions
    simulated members own, and a heartbeat a member as often as members write them), until
    ``stop`` is set; sends back ("done",
    {intervals, late intervals, the longest lateness in ms, bytes written, entries a member
    reports})."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": f"{address[0]}:{address[1]}", "compression.type": "gzip",
                         "linger.ms": 5, "acks": 1, "message.max.bytes": 10 << 20})
    owners = load.aggregation == "owners"
    ids = sim_ids(point)
    records: list[tuple[bytes, int, list[bytearray]]] = []  # (key, partition, chunks), per member in order
    per_member = 0  # records a member writes an interval
    reported = 0
    for m, member_id in enumerate(ids):
        entries = member_entries(point, load, m)
        reported = len(entries)
        home = zlib.crc32(member_id.encode()) % partitions  # where a flat member writes
        split: dict[int, list[UsageEntry]] = {} if owners else {home: []}
        for e in entries:
            split.setdefault(entity_partition((e.kind, e.user, e.client_id), partitions) if owners else home,
                             []).append(e)
        n = 0
        for partition, part in split.items():
            chunks = [bytearray(v) for v in encode_report(UsageReport(member_id, 1, 0, 0, SYNC_INTERVAL_MS,
                                                                      tuple(part)))]
            records.append((member_id.encode(), partition, chunks))
            n += len(chunks)
        per_member = max(per_member, n)
    # With owners: the partitions simulated members own, and what their totals carry an interval.
    sim_totals = owned_totals(point, load, partitions, ids, real_member_id(point, load, partitions)) if owners else {}
    next_offset = [0] * partitions

    def delivered(err: Any, msg: Any) -> None:
        if err is None and msg.topic() == TOPIC:
            next_offset[msg.partition()] = max(next_offset[msg.partition()], msg.offset() + 1)

    from_offset = [0] * partitions
    heartbeats = [bytearray(encode_report(UsageReport(m, 1, 0, 0, SYNC_INTERVAL_MS))[0]) for m in ids]
    heartbeat_every = max(1, round(heartbeat_ms(FleetConfig(sync_interval_ms=SYNC_INTERVAL_MS)) / SYNC_INTERVAL_MS))
    interval_s = SYNC_INTERVAL_MS / 1000
    seq = intervals = late = written = 0
    worst_ms = 0.0
    next_at = time.monotonic()
    while not stop.is_set():
        sent_at = int(time.time() * 1000)
        member_seq = seq
        last_key = None
        for key, partition, chunks in records:
            if key != last_key:
                member_seq, last_key = seq, key
            for chunk in chunks:
                _COUNTERS.pack_into(chunk, _COUNTERS_AT, 1, member_seq, sent_at)
                producer.produce(TOPIC, bytes(chunk), key, partition=partition, on_delivery=delivered)
                member_seq += 1
                written += len(chunk)
        if owners and intervals % heartbeat_every == 0:
            for key, value in zip(ids, heartbeats, strict=True):
                _COUNTERS.pack_into(value, _COUNTERS_AT, 1, seq, sent_at)
                producer.produce(TOPIC + TOTALS_SUFFIX, bytes(value), key.encode(), partition=0)
                written += len(value)
        for partition, (owner, entries) in sim_totals.items():
            # The range: what was delivered to the partition since the last totals (ranges only order them).
            totals = Totals(owner, 1, partition, from_offset[partition], max(next_offset[partition],
                            from_offset[partition]), sent_at, SYNC_INTERVAL_MS, entries)
            from_offset[partition] = totals.next_offset
            for value in encode_totals(totals):
                producer.produce(TOPIC + TOTALS_SUFFIX, value, owner.encode(), partition=0)
                written += len(value)
        seq += max(per_member, 1)
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
                        "bytes_written": written, "entries_per_report": reported}))


def owned_totals(point: Point, load: Load, partitions: int, ids: list[str],
                 real: str) -> dict[int, tuple[str, tuple[UsageEntry, ...]]]:
    """For each partition a simulated member owns (rendezvous over them and the real member):
    (its owner, the entities' sums an interval)."""
    everyone = [*ids, real]
    owners = {p: owner for p in range(partitions) if (owner := owner_of(p, everyone)) not in (None, real)}
    sums: dict[int, dict[tuple[str, str | None, str | None], float]] = {p: {} for p in owners}
    for m in range(len(ids)):
        for e in member_entries(point, load, m):
            key = (e.kind, e.user, e.client_id)
            part = sums.get(entity_partition(key, partitions))
            if part is not None:
                part[key] = part.get(key, 0.0) + e.amount
    return {p: (owner, tuple(UsageEntry(k, u, c, a) for (k, u, c), a in sums[p].items()))
            for p, owner in owners.items()}


def scrape(address: tuple[str, int], timeout_s: float = 5.0) -> tuple[dict[str, float], float]:
    """The real member's ``kqp_fleet_*`` and ``kqp_quota_rate`` samples ({name{labels}: value})
    and how long ``/metrics`` took to answer, in ms."""
    t0 = time.perf_counter()
    with urllib.request.urlopen(f"http://{address[0]}:{address[1]}/metrics", timeout=timeout_s) as r:
        text = r.read().decode()
    took_ms = (time.perf_counter() - t0) * 1000
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("kqp_fleet") or family.name == "kqp_quota_rate":
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out, took_ms


def lag_s(samples: dict[str, float]) -> float:
    """The oldest of the members' freshest usage (0 with none heard)."""
    return max((v for k, v in samples.items() if k.startswith("kqp_fleet_sync_lag_seconds")), default=0.0)


def hot_accuracy(samples: dict[str, float], point: Point, load: Load) -> float | None:
    """The rate the real member holds for the hot entities it shows, over what the simulated
    members charge them (their part of HOT_TOTAL x BOUND): 1.0 is exact; None: none shown."""
    hot = load.hot_entities(point)
    truth = BOUND * HOT_TOTAL * point.members / (point.members + 1)
    seen = [v for k, v in samples.items() if k.startswith("kqp_quota_rate{")
            for i in [_client_index(k)] if i is not None and i < hot]
    return sum(seen) / len(seen) / truth if seen else None


def _client_index(key: str) -> int | None:
    _, found, rest = key.partition("client_id=client-")
    digits = rest.split(",", 1)[0].rstrip("}")
    return int(digits) if found and digits.isdigit() else None


def measure(point: Point, load: Load, workdir: Path, seconds: float, partitions: int) -> dict[str, Any]:
    launcher = Launcher(workdir / point.label)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    here, there = ctx.Pipe()
    sim = None
    try:
        broker = launcher.tansu_broker(name="fleet-tansu-broker")
        clients.create_topic(broker.address, TOPIC, partitions)
        if load.aggregation == "owners":
            clients.create_topic(broker.address, TOPIC + TOTALS_SUFFIX, 1)
        member = launcher.our_proxy(broker.address, name="fleet-member",
                                    extra_yaml=proxy_yaml(partitions, load, real_member_id(point, load, partitions)))
        metrics = tuple(member.extra["metrics"])
        sim = ctx.Process(target=simulate, args=(broker.address, point, load, partitions, stop, there), daemon=True)
        sim.start()
        deadline = time.monotonic() + 60
        while True:  # until the real member hears every simulated one
            samples, _ = scrape(metrics)
            if samples.get("kqp_fleet_members", 0) >= point.members + 1 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        # A quota window (Kafka's 11 x 1 s) of reports first: the rates read are then the fleet's.
        time.sleep(WINDOW_S)
        # What sharing costs, with nothing else asked of the member: a scrape of /metrics costs
        # it per entity too (kqp_quota_*), so none is made meanwhile.
        before, _ = scrape(metrics)
        clock = CpuClock(member.pid)
        t0 = time.monotonic()
        time.sleep(seconds)
        elapsed = time.monotonic() - t0
        cpu_s = clock.elapsed()
        after, _ = scrape(metrics)
        # Then what a client and the fleet's quotas see of it: sync lag, how long /metrics
        # takes to answer, the hot entities' rates.
        lags, answers, accuracy = [], [], []
        t1 = time.monotonic()
        while time.monotonic() - t1 < PROBE_S:
            time.sleep(0.5)
            samples, took_ms = scrape(metrics, timeout_s=30)
            lags.append(lag_s(samples))
            answers.append(took_ms)
            seen = hot_accuracy(samples, point, load)
            if seen is not None:
                accuracy.append(seen)
        stop.set()
        sim_stats = here.recv()[1] if here.poll(30) else {}

        def rate(name: str) -> float:
            return (after.get(name, 0.0) - before.get(name, 0.0)) / elapsed

        return {
            "members": point.members + 1, "entities": point.entities,
            "members_heard": int(after.get("kqp_fleet_members", 0)),
            "partitions_owned": int(after.get("kqp_fleet_partitions_owned", 0)),
            "cpu_pct": 100 * cpu_s / elapsed,
            "written_bytes_per_s": rate("kqp_fleet_sync_bytes_total{direction=written}"),
            "read_bytes_per_s": rate("kqp_fleet_sync_bytes_total{direction=read}"),
            "remote_entries_per_s": rate("kqp_fleet_remote_entries_total"),
            "dropped_entries_per_s": rate("kqp_fleet_remote_entries_dropped_total"),
            "hot_accuracy": (min(accuracy), max(accuracy)) if accuracy else None,
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
    parser.add_argument("--hot", type=float, default=0.01, help="fraction of the entities near their bound")
    parser.add_argument("--cold", type=float, default=0.001, help="what each other entity is charged, of its bound")
    parser.add_argument("--report-threshold", type=float, default=0.5, help="fleet.report_threshold (0: every entity)")
    parser.add_argument("--aggregation", choices=("flat", "owners"), default="flat", help="fleet.aggregation")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kqp-fleet-scale-"))
    load = Load(args.hot, args.cold, args.report_threshold, args.aggregation)
    rows = []
    for point in parse_grid(args.grid):
        row = measure(point, load, workdir, args.seconds, args.partitions)
        row["load"] = {"hot": load.hot, "cold": load.cold, "report_threshold": load.report_threshold,
                       "aggregation": load.aggregation, "partitions": args.partitions}
        rows.append(row)
        sim = row["simulator"]
        print(f"[{time.strftime('%H:%M:%S')}] {point.label}: member CPU {row['cpu_pct']:.1f} % of a core, "
              f"read {row['read_bytes_per_s'] / 1e3:,.1f} kB/s, written {row['written_bytes_per_s'] / 1e3:,.1f} kB/s, "
              f"{row['remote_entries_per_s']:,.0f} remote entries/s, lag {row['sync_lag_max_s']:.2f} s, "
              f"/metrics {row['metrics_answer_max_ms']:.0f} ms; simulator late in {sim.get('late_intervals', '?')} "
              f"of {sim.get('intervals', '?')} intervals", file=sys.stderr, flush=True)
    print(f"{'members':>8} {'entities':>9} {'reported':>9} {'owned':>6} {'CPU %':>7} {'read kB/s':>10} "
          f"{'written kB/s':>13} {'entries/s':>10} {'dropped/s':>10} {'lag s':>6} {'/metrics ms':>12} "
          f"{'hot accuracy':>13}")
    for r in rows:
        acc = r["hot_accuracy"]
        print(f"{r['members']:>8} {r['entities']:>9,} {r['simulator'].get('entries_per_report', 0):>9,} "
              f"{r['partitions_owned']:>6} "
              f"{r['cpu_pct']:>7.1f} {r['read_bytes_per_s'] / 1e3:>10,.1f} {r['written_bytes_per_s'] / 1e3:>13,.1f} "
              f"{r['remote_entries_per_s']:>10,.0f} {r['dropped_entries_per_s']:>10,.0f} {r['sync_lag_max_s']:>6.2f} "
              f"{r['metrics_answer_max_ms']:>12.0f} {f'{acc[0]:.2f}-{acc[1]:.2f}' if acc else '-':>13}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
