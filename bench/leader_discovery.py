"""KIP-951's micro-benchmark, small: produce latency while every partition's leader rotates.

    python -m bench.leader_discovery --quick   # about a minute
    python -m bench.leader_discovery           # full run, about 5 minutes

A librdkafka producer (this process) sends a steady stream (2,000 records/s of 100 B by
default, round-robin over the 12 partitions of one topic, ``acks=all``, ``linger.ms=5``) to a
scripted three-broker cluster (tests/support/scripted_broker.py, in a subprocess) through the
proxy (``python -m proxy run``, another subprocess). During the measured window the leader of
every partition moves to the next broker every ``--rotate-ms`` (2 s), all 12 at once, as the
KIP's benchmark reassigned every partition of its topic in one go (``--staggered`` moves one
partition at a time instead); the old leader then answers NOT_LEADER_OR_FOLLOWER. Each
record's latency is the time from ``produce()`` to its delivery report; records produced in
the window count. Configurations (each with its own fresh cluster and proxy):

  fill-on       brokers before Kafka 3.7 (no CurrentLeader / NodeEndpoints), proxy with
                ``leader_discovery.fill_hints: true``: it fills the hint from its leader cache
  fill-off      the same brokers, ``fill_hints: false``: the client must refresh its metadata
  broker-hints  brokers that send KIP-951 hints themselves (Kafka 3.7+), proxy as by default:
                the reference for what hints can do for this client
  (only with --configs:)
  fill-on-nowait  fill-on with ``hint_wait_ms: 0``: hints only from what the cache already knows
  direct-old, direct-hints  the same brokers without the proxy

Each configuration runs twice (``--metadata-delays-ms``): with brokers answering Metadata at
once, and 150 ms late. Hints only save the client a metadata round trip, and on loopback
against idle brokers that takes a millisecond or two; the KIP's gain came from Metadata RPCs
slowed down (by produce requests ahead of them) to hundreds of milliseconds. 150 ms is above
librdkafka's 100 ms retry backoff, so there the round trip is on the critical path.

librdkafka's leader-discovery settings stay at their defaults: ``retry.backoff.ms`` 100
(doubling per retry up to ``retry.backoff.max.ms`` 1000, ±20 % jitter), and
``topic.metadata.refresh.fast.interval.ms`` (defaults to ``retry.backoff.ms``). librdkafka
(KIP-951 since 2.5.0) moves a partition to the hinted leader at once, but still holds the
failed batch, and every record queued behind it on that partition, for the retry backoff;
it does not retry at once as the KIP's Java client does.

``--hint-wait-ms`` and ``--refresh-min-interval-ms`` set those ``leader_discovery`` settings in
every proxy configuration (a configuration's own setting wins); without them the proxy's
defaults apply. ``--old-broker-versions`` makes the hintless brokers also stop at Produce v9 /
Fetch v15, as Kafka before 3.7 does, so the proxy's version uplift is in the path too.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .procs import REPO, Launcher, Proc, cpu_seconds, system_busy_seconds

TOPIC = "rotating"
NODE_IDS = [1, 2, 3]
NOT_LEADER_OR_FOLLOWER = 6
CONFIGS = {
    # name: (brokers send KIP-951 hints, the proxy's leader_discovery settings or None for no proxy)
    "fill-on": (False, {"fill_hints": True}),
    "fill-off": (False, {"fill_hints": False}),
    "broker-hints": (True, {}),
    "fill-on-nowait": (False, {"fill_hints": True, "hint_wait_ms": 0}),
    "direct-old": (False, None),
    "direct-hints": (True, None),
}
DEFAULT_CONFIGS = ("fill-on", "fill-off", "broker-hints")


@dataclass(frozen=True)
class Plan:
    warmup_s: float
    window_s: float
    rounds: int


FULL = Plan(warmup_s=3.0, window_s=20.0, rounds=2)
QUICK = Plan(warmup_s=2.0, window_s=8.0, rounds=1)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- the scripted cluster, in its own process ---------------------------------------------------
#
# Python's GIL would let the brokers' request handling delay this process's delivery reports
# (and the other way round), so the cluster runs apart. It takes one-line commands on stdin:
#   rotate <interval_ms> <all|staggered>   start moving leaders
#   stats                                  stop moving, answer one JSON line on stdout
#   quit


async def _cluster_main(args) -> None:  # noqa: C901 (a bench script: one step after another)
    from protocol.apis import ApiKey
    from tests.support.scripted_broker import Script, ScriptedCluster

    counts: dict[str, int] = {"produce_requests": 0, "not_leader_partitions": 0, "not_leader_hinted": 0,
                              "metadata_requests_client": 0, "metadata_requests_other": 0,
                              "rotations": 0, "moves": 0}
    metadata_delay_s = args.metadata_delay_ms / 1000

    def produce(broker, req):
        resp = broker.default_response(req)
        counts["produce_requests"] += 1
        for topic in resp.responses:
            for p in topic.partition_responses:
                if p.error_code == NOT_LEADER_OR_FOLLOWER:
                    counts["not_leader_partitions"] += 1
                    counts["not_leader_hinted"] += p.current_leader is not None
        return resp

    async def metadata(broker, req):
        # The client's requests keep their client id through the proxy; the proxy's own refreshes
        # use the proxy's.
        counts["metadata_requests_client" if req.client_id == args.client_id else "metadata_requests_other"] += 1
        if metadata_delay_s:
            await asyncio.sleep(metadata_delay_s)  # answered in order: later requests wait too
        return broker.default_response(req)

    script = Script(leader_hints=args.leader_hints, handlers={ApiKey.PRODUCE: produce, ApiKey.METADATA: metadata})
    if args.old_broker_versions:
        for key, highest in ((ApiKey.PRODUCE, 9), (ApiKey.FETCH, 15)):
            script.api_versions[key] = (script.api_versions[key][0], highest)
    cluster = ScriptedCluster(node_ids=NODE_IDS, script=script)
    cluster.add_topic(TOPIC, args.partitions, [NODE_IDS[p % len(NODE_IDS)] for p in range(args.partitions)])
    await cluster.start()
    loop = asyncio.get_running_loop()

    lags: list[float] = []

    async def sample_lag() -> None:  # how late the loop wakes up: can the brokers keep up?
        while True:
            t = loop.time()
            await asyncio.sleep(0.005)
            lags.append(loop.time() - t - 0.005)

    async def forget() -> None:  # nothing reads the records or the request log back
        while True:
            await asyncio.sleep(1.0)
            cluster.requests.clear()
            for p in cluster.topics[TOPIC].partitions:
                p.batches.clear()

    async def rotate(interval_s: float, staggered: bool) -> None:
        partitions = cluster.topics[TOPIC].partitions
        step_s = interval_s / len(partitions) if staggered else interval_s
        index = 0
        next_s = loop.time() + step_s
        while True:
            await asyncio.sleep(max(0.0, next_s - loop.time()))
            next_s += step_s
            moving = [index % len(partitions)] if staggered else range(len(partitions))
            for i in moving:
                current = NODE_IDS.index(partitions[i].leader)
                cluster.move_leader(TOPIC, i, NODE_IDS[(current + 1) % len(NODE_IDS)])
                counts["moves"] += 1
            counts["rotations"] += 1
            index += 1

    tasks = [loop.create_task(sample_lag()), loop.create_task(forget())]
    ready = {"pid": os.getpid(), "bootstrap": cluster.bootstrap_servers}
    tmp = Path(args.ready_file).with_suffix(".tmp")
    tmp.write_text(json.dumps(ready))
    tmp.replace(args.ready_file)

    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    rotation: asyncio.Task | None = None
    try:
        while line := (await reader.readline()).decode().split():
            if line[0] == "rotate":
                lags.clear()
                rotation = loop.create_task(rotate(int(line[1]) / 1000, line[2] == "staggered"))
                answer = {"ok": True}
            elif line[0] == "stats":
                if rotation is not None:
                    rotation.cancel()
                ordered = sorted(lags) or [0.0]
                answer = {**counts, "errors": [repr(e) for e in cluster.errors[:5]],
                          "loop_lag_p99_ms": 1000 * _pct(ordered, 0.99),
                          "loop_lag_max_ms": 1000 * ordered[-1]}
            else:
                break
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()
    finally:
        for t in tasks:
            t.cancel()
        await cluster.stop()


class ClusterProc:
    """The scripted cluster's subprocess, driven over its stdin/stdout."""

    def __init__(self, launcher: Launcher, leader_hints: bool, metadata_delay_ms: int, args) -> None:
        n = len(launcher.procs) + 1
        ready = launcher.workdir / f"cluster-{n}-{time.monotonic_ns()}.ready.json"
        log_path = launcher.workdir / f"cluster-{n}-{time.monotonic_ns()}.log"
        argv = [sys.executable, "-m", "bench.leader_discovery", "--cluster-process", "--ready-file", str(ready),
                "--partitions", str(args.partitions), "--metadata-delay-ms", str(metadata_delay_ms),
                "--client-id", args.client_id, *(["--leader-hints"] if leader_hints else []),
                *(["--old-broker-versions"] if args.old_broker_versions and not leader_hints else [])]
        cpus = launcher.pin.get("broker")
        if cpus:
            argv = ["taskset", "-c", cpus, *argv]
        with open(log_path, "wb") as log_file:
            popen = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file,
                                     cwd=REPO, start_new_session=True, text=True)
        self.proc = Proc("scripted-cluster", popen, ("127.0.0.1", 0), log_path)
        launcher.procs.append(self.proc)  # so launcher.close() stops it whatever happens
        deadline = time.monotonic() + 30.0
        while not ready.exists():
            if not self.proc.alive() or time.monotonic() > deadline:
                self.proc.stop(1.0)
                raise RuntimeError(f"the scripted cluster did not start:\n{self.proc.log_tail()}")
            time.sleep(0.02)
        info = json.loads(ready.read_text())
        self.bootstrap: list[str] = info["bootstrap"]
        self.pid: int = info["pid"]

    def command(self, line: str) -> dict:
        popen = self.proc.popen
        popen.stdin.write(line + "\n")
        popen.stdin.flush()
        answer = popen.stdout.readline()
        if not answer:
            raise RuntimeError(f"the scripted cluster exited:\n{self.proc.log_tail()}")
        return json.loads(answer)

    def close(self, launcher: Launcher) -> None:
        popen = self.proc.popen
        if popen.poll() is None:
            try:
                popen.stdin.write("quit\n")
                popen.stdin.close()
                popen.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        launcher.stop(self.proc)


# -- the client ---------------------------------------------------------------------------------


@dataclass
class Load:
    latencies_ms: list[float] = field(default_factory=list)  # records sent in the window
    failed: int = 0  # delivery reports with an error (window)
    sent_total: int = 0
    behind_max: int = 0  # the most records the pacing loop was ever behind schedule
    client_cpu_s: float = 0.0


def run_load(bootstrap: str, args, plan: Plan, cluster: ClusterProc, watch: dict[str, int]) -> tuple[Load, dict]:
    """Warm-up, then the measured window with leaders rotating, then a flush."""
    from confluent_kafka import Producer

    load = Load()
    window = [math.inf, math.inf]  # records produced in [start, end) are measured

    def delivered(sent_at: float, err, _msg) -> None:
        if window[0] <= sent_at < window[1]:
            if err is not None:
                load.failed += 1
            else:
                load.latencies_ms.append(1000 * (time.monotonic() - sent_at))

    producer = Producer({
        "bootstrap.servers": bootstrap,
        "client.id": args.client_id,
        "acks": "all",
        "linger.ms": args.linger_ms,
        "compression.type": "none",
        # Everything about leader discovery at librdkafka's defaults (see the module doc).
    })
    value = os.urandom(args.record_bytes)
    produce, poll, now = producer.produce, producer.poll, time.monotonic
    partitions = args.partitions
    t0 = now()
    window[0] = t0 + plan.warmup_s
    window[1] = window[0] + plan.window_s
    rotating = False
    cpu0: dict[str, float] = {}
    busy0 = tw = client0 = 0.0
    sent = 0
    while True:
        t = now()
        if t >= window[1]:
            break
        if not rotating and t >= window[0]:
            cluster.command(f"rotate {args.rotate_ms} {'staggered' if args.staggered else 'all'}")
            rotating = True
            cpu0 = {name: cpu_seconds(pid) for name, pid in watch.items()}
            busy0, tw = system_busy_seconds(), now()
            client0 = time.process_time()
        due = int((t - t0) * args.rate)
        load.behind_max = max(load.behind_max, due - sent)
        while sent < due:
            sent_at = now()
            try:
                produce(TOPIC, value, partition=sent % partitions, on_delivery=functools.partial(delivered, sent_at))
            except BufferError:
                poll(0.01)
                break
            sent += 1
        poll(0)
        time.sleep(0.0005)
    stats = cluster.command("stats")  # stops the rotation
    elapsed = now() - tw
    load.client_cpu_s = time.process_time() - client0
    cpu = {name: 100 * (cpu_seconds(pid) - cpu0[name]) / elapsed for name, pid in watch.items()}
    cpu["client"] = 100 * load.client_cpu_s / elapsed
    cpu["machine"] = 100 * (system_busy_seconds() - busy0) / elapsed  # everything, ours included
    remaining = producer.flush(30)
    load.sent_total = sent
    if remaining:
        log(f"{remaining} records still undelivered after flush")
    stats["cpu_pct"] = cpu
    stats["undelivered"] = remaining
    return load, stats


# -- one configuration ---------------------------------------------------------------------------


def scrape(metrics_address) -> dict[str, float]:
    """The proxy's KIP-951 counters: leader hints by source, its own metadata refreshes."""
    from prometheus_client.parser import text_string_to_metric_families

    if not metrics_address:
        return {}
    url = "http://{}:{}/metrics".format(*metrics_address)
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kqp_leader_hints_total":
                out[f"hints_{s.labels['source']}"] = s.value
            elif s.name == "kqp_metadata_refreshes_total":
                out[f"refresh_{s.labels['outcome']}"] = s.value
    return out


def proxy_settings(name: str, args) -> dict | None:
    """The leader_discovery section of a configuration's proxy (None: no proxy)."""
    own = CONFIGS[name][1]
    if own is None:
        return None
    common = {"hint_wait_ms": args.hint_wait_ms, "expedited_refresh_min_interval_ms": args.refresh_min_interval_ms}
    return {**{k: v for k, v in common.items() if v is not None}, **own}


def run_config(name: str, metadata_delay_ms: int, args, plan: Plan, launcher: Launcher) -> dict:
    broker_hints = CONFIGS[name][0]
    settings = proxy_settings(name, args)
    cluster = ClusterProc(launcher, broker_hints, metadata_delay_ms, args)
    proxy = None
    try:
        watch = {"cluster": cluster.pid}
        if settings is None:
            bootstrap = ",".join(cluster.bootstrap)
        else:
            host, port = cluster.bootstrap[0].rsplit(":", 1)
            section = "".join(f"  {k}: {json.dumps(v)}\n" for k, v in settings.items())
            proxy = launcher.our_proxy((host, int(port)), name=f"proxy-{name}",
                                       extra_yaml="leader_discovery:\n" + section)
            bootstrap = "{}:{}".format(*proxy.address)
            watch["proxy"] = proxy.pid
        load, stats = run_load(bootstrap, args, plan, cluster, watch)
        if proxy is not None:
            stats["proxy"] = scrape(proxy.extra.get("metrics"))
        return {"latencies_ms": load.latencies_ms, "failed": load.failed, "sent_total": load.sent_total,
                "behind_max": load.behind_max, "cluster": stats}
    finally:
        if proxy is not None:
            launcher.stop(proxy)
        cluster.close(launcher)


# -- report --------------------------------------------------------------------------------------


def _pct(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of a sorted list."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarize(latencies_ms: list[float]) -> dict:
    ordered = sorted(latencies_ms)
    if not ordered:
        return {"count": 0}
    return {"count": len(ordered), "p50": _pct(ordered, 0.50), "p99": _pct(ordered, 0.99),
            "p99.9": _pct(ordered, 0.999), "max": ordered[-1], "mean": sum(ordered) / len(ordered),
            "over_50ms": sum(1 for x in ordered if x > 50.0)}


def libversion() -> str:
    from confluent_kafka import libversion as version

    return version()[0]


def describe(name: str, args) -> str:
    """The brokers and the proxy settings of a configuration, in words."""
    from config.model import LeaderDiscovery

    brokers = "brokers send hints" if CONFIGS[name][0] else "brokers send no hints"
    settings = proxy_settings(name, args)
    if settings is None:
        return f"{brokers}, no proxy"
    d = LeaderDiscovery()
    full = {k: settings.get(k, getattr(d, k)) for k in ("fill_hints", "hint_wait_ms",
                                                         "expedited_refresh_min_interval_ms")}
    return f"{brokers}, proxy leader_discovery " + ", ".join(f"{k}={json.dumps(v)}" for k, v in full.items())


def _reduction(before: float, after: float) -> str:
    if before <= 0:
        return "n/a"
    r = 100 * (before - after) / before
    return f"{r:.0f} % reduction" if r >= 0 else f"{-r:.0f} % increase"


def _versus(label: str, before: dict | None, after: dict | None) -> str | None:
    if not before or not after or not before["summary"]["count"] or not after["summary"]["count"]:
        return None
    a, b = before["summary"], after["summary"]
    return (f"{label}: p99 {a['p99']:.1f} -> {b['p99']:.1f} ms ({_reduction(a['p99'], b['p99'])}),"
            f" p99.9 {a['p99.9']:.1f} -> {b['p99.9']:.1f} ms ({_reduction(a['p99.9'], b['p99.9'])})")


def merge(rs: list[dict]) -> dict:
    """One configuration's rounds: latencies pooled, counters added, CPU averaged."""
    cluster = dict(rs[0]["cluster"])
    for key in ("moves", "not_leader_partitions", "not_leader_hinted", "metadata_requests_client",
                "metadata_requests_other", "rotations", "produce_requests", "undelivered"):
        cluster[key] = sum(r["cluster"][key] for r in rs)
    for key in ("loop_lag_p99_ms", "loop_lag_max_ms"):
        cluster[key] = max(r["cluster"][key] for r in rs)
    cluster["cpu_pct"] = {k: sum(r["cluster"]["cpu_pct"][k] for r in rs) / len(rs) for k in rs[0]["cluster"]["cpu_pct"]}
    cluster["errors"] = [e for r in rs for e in r["cluster"]["errors"]]
    if "proxy" in cluster:
        keys = {k for r in rs for k in r["cluster"]["proxy"]}
        cluster["proxy"] = {k: sum(r["cluster"]["proxy"].get(k, 0) for r in rs) for k in sorted(keys)}
    return {"summary": summarize([x for r in rs for x in r["latencies_ms"]]), "failed": sum(r["failed"] for r in rs),
            "behind_max": max(r["behind_max"] for r in rs), "cluster": cluster,
            "rounds": [{"summary": summarize(r["latencies_ms"]), "failed": r["failed"], "cluster": r["cluster"]}
                       for r in rs]}


def report(scenarios: dict[int, dict[str, dict]], args, plan: Plan) -> None:
    print()
    print(f"Produce latency while the leaders of all {args.partitions} partitions move to the next of 3 brokers "
          f"every {args.rotate_ms} ms ({'staggered' if args.staggered else 'all at once'}); {args.rate} records/s "
          f"of {args.record_bytes} B, acks=all, linger.ms={args.linger_ms}; {plan.rounds} x {plan.window_s:.0f} s "
          f"per configuration" + ("; hintless brokers stop at Produce v9 / Fetch v15" if args.old_broker_versions
                                  else ""))
    print(f"librdkafka {libversion()}, leader discovery at its defaults: retry.backoff.ms 100 (x2 per retry up to "
          f"retry.backoff.max.ms 1000, +-20 % jitter), topic.metadata.refresh.fast.interval.ms = retry.backoff.ms")
    for name in next(iter(scenarios.values())):
        print(f"  {name}: {describe(name, args)}")
    for delay, results in scenarios.items():
        print()
        print(f"Brokers answer Metadata {'at once' if not delay else f'{delay} ms late (in order)'}:")
        header = (f"{'configuration':<15}{'count':>7}{'p50 ms':>8}{'p99 ms':>8}{'p99.9 ms':>10}{'max ms':>8}"
                  f"{'>50 ms':>8}{'failed':>7}{'moves':>7}{'NOT_LEADER':>11}{'client Md':>10}"
                  f"  {'proxy hints proxy/none/broker':<31}{'CPU % cluster/proxy/client':<28}broker lag p99/max ms")
        print(header)
        print("-" * len(header))
        for name, r in results.items():
            s, c = r["summary"], r["cluster"]
            p = c.get("proxy", {})
            hints = "-" if not p else "{}/{}/{}".format(p.get("hints_proxy", 0), p.get("hints_none", 0),
                                                         p.get("hints_broker", 0))
            cpu = c["cpu_pct"]
            cpus = "/".join(f"{cpu[k]:.0f}" if k in cpu else "-" for k in ("cluster", "proxy", "client"))
            figures = ("no data" if not s["count"] else
                       f"{s['count']:>7}{s['p50']:>8.1f}{s['p99']:>8.1f}{s['p99.9']:>10.1f}{s['max']:>8.1f}"
                       f"{s['over_50ms']:>8}")
            print(f"{name:<15}{figures}{r['failed']:>7}{c['moves']:>7}{c['not_leader_partitions']:>11}"
                  f"{c['metadata_requests_client']:>10}  {hints:<31}{cpus:<28}"
                  f"{c['loop_lag_p99_ms']:.1f}/{c['loop_lag_max_ms']:.1f}")
        lines = [_versus("fill-on vs fill-off", results.get("fill-off"), results.get("fill-on")),
                 _versus("broker-hints vs fill-off", results.get("fill-off"), results.get("broker-hints"))]
        for line in filter(None, lines):
            print(line)
    print("(KIP-951's micro-benchmark: an 88 % reduction at p99.9, 1675 -> 215 ms, Java client on a real cluster)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 round of 8 s per configuration (about a minute)")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--rounds", type=int, help="rounds (each runs every configuration once, order rotating)")
    ap.add_argument("--window-s", type=float, help="measured seconds per configuration and round")
    ap.add_argument("--rate", type=int, default=2000, help="records/s (default 2000)")
    ap.add_argument("--record-bytes", type=int, default=100)
    ap.add_argument("--partitions", type=int, default=12)
    ap.add_argument("--linger-ms", type=int, default=5)
    ap.add_argument("--rotate-ms", type=int, default=2000, help="leaders move every this often (default 2000)")
    ap.add_argument("--staggered", action="store_true",
                    help="move one partition every rotate-ms/partitions instead of all at once")
    ap.add_argument("--metadata-delays-ms", default="0,150",
                    help="comma-separated: for each, every configuration runs with brokers answering Metadata that "
                         "much later, in order (a slow metadata path, as the KIP describes); default 0,150")
    ap.add_argument("--old-broker-versions", action="store_true",
                    help="hintless brokers also stop at Produce v9 / Fetch v15 (the proxy uplifts)")
    ap.add_argument("--hint-wait-ms", type=int, help="the proxy's leader_discovery.hint_wait_ms (default: its own)")
    ap.add_argument("--refresh-min-interval-ms", type=int,
                    help="the proxy's leader_discovery.expedited_refresh_min_interval_ms (default: its own)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "leader_discovery.json")
    ap.add_argument("--workdir", type=Path, help="logs and generated configs (default: a new temporary directory)")
    ap.add_argument("--client-id", default="leader-bench", help=argparse.SUPPRESS)
    # The scripted cluster's subprocess (started by this module, not by hand):
    ap.add_argument("--cluster-process", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ready-file", help=argparse.SUPPRESS)
    ap.add_argument("--leader-hints", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--metadata-delay-ms", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.cluster_process:
        asyncio.run(_cluster_main(args))
        return 0

    base = QUICK if args.quick else FULL
    plan = Plan(base.warmup_s, args.window_s or base.window_s, args.rounds or base.rounds)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration(s): {', '.join(unknown)}")
    try:
        delays = [int(d) for d in args.metadata_delays_ms.split(",") if d.strip()]
    except ValueError:
        ap.error(f"--metadata-delays-ms: not a list of integers: {args.metadata_delays_ms!r}")
    launcher = Launcher(args.workdir or Path(tempfile.mkdtemp(prefix="kqp-leaders-")))
    log(f"logs and configs in {launcher.workdir}")
    runs: dict[int, dict[str, list[dict]]] = {d: {n: [] for n in names} for d in delays}
    try:
        for rnd in range(plan.rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for delay in delays:
                for name in order:
                    log(f"round {rnd + 1}/{plan.rounds}, Metadata delay {delay} ms: {name}")
                    r = run_config(name, delay, args, plan, launcher)
                    s, c = summarize(r["latencies_ms"]), r["cluster"]
                    log(f"  {s.get('count', 0)} records, p99 {s.get('p99', 0):.1f} ms, p99.9 {s.get('p99.9', 0):.1f}"
                        f" ms, max {s.get('max', 0):.1f} ms; {c['moves']} moves, {c['not_leader_partitions']}"
                        f" NOT_LEADER; broker CPU {c['cpu_pct']['cluster']:.0f} %, loop lag max"
                        f" {c['loop_lag_max_ms']:.1f} ms")
                    if c["errors"]:
                        log(f"  scripted cluster errors: {c['errors']}")
                    if r["behind_max"] > args.rate // 20:
                        log(f"  the client fell {r['behind_max']} records behind its schedule")
                    runs[delay][name].append(r)
    finally:
        launcher.close()

    scenarios = {d: {n: merge(rs) for n, rs in by_name.items()} for d, by_name in runs.items()}
    report(scenarios, args, plan)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    hidden = ("out", "workdir", "cluster_process", "ready_file", "leader_hints", "metadata_delay_ms")
    settings = {k: v for k, v in vars(args).items() if k not in hidden}
    settings["librdkafka"] = libversion()
    args.out.write_text(json.dumps({"settings": settings, "plan": plan.__dict__,
                                    "scenarios": [{"metadata_delay_ms": d, "results": results}
                                                  for d, results in scenarios.items()]}, indent=1))
    log(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
