"""``workers: N`` against the byte pump: throughput and intermediary CPU per MB under several
concurrent clients, in one run.

    python -m bench.run --configs none --workers 1,2            # this phase alone
    python -m bench.run --configs none --workers 1,2,4,8 --producers 16   # a bigger machine

The kernel hands each new connection to one worker (SO_REUSEPORT hashes the connection's
addresses), so one client connection only ever uses one worker: the load is ``producers``
confluent-kafka producers, each in its own process (one Python thread drives one producer at
about half a core, see bench/README.md), each producing 1 KiB records to a topic of its own,
all started together once every one of them is connected. Then as many consumers read those
topics back, also together. Every configuration has its own fresh Tansu broker, as in
bench.run's throughput phase, and the configurations take turns round by round.

For each run: aggregate records/s and MB/s over the window from the common start to the last
client's end, and the CPU time of the intermediary's whole process tree (the supervisor and
its workers; the pump is one process), the broker, the clients and the rest of the machine,
from the scheduler's per-thread run times (procs.CpuClock). The client connections each worker
holds (ESTABLISHED sockets on its listening ports, from /proc) are counted while the clients
are still connected, and each worker's share of the CPU is kept, so an uneven spread shows.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Producer, TopicPartition

from proxy.app.procnet import TCP_LISTEN, socket_inodes, tcp_sockets

from . import clients
from .procs import CpuClock, Launcher, Proc, system_busy_seconds
from .run import Quiet, _median_run, log, start_config

PUMP = "byte-pump"
TCP_ESTABLISHED = "01"
CLIENT_READY_TIMEOUT_S = 60.0
RUN_TIMEOUT_S = 120.0


def config_name(workers: int) -> str:
    return f"workers-{workers}"


@dataclass(frozen=True)
class LoadPlan:
    producers: int  # concurrent clients (each its own process and connections), as many consumers
    records: int  # per producer and round; each run also stops after max_produce_s
    max_produce_s: float
    repeats: int
    record_size: int = 1024


# On the 2-core development VM four producers move about 300 MB/s together: 150,000 records
# each is about two seconds (the topics are deleted after each round, so Tansu's memory stays small).
FULL_LOAD = LoadPlan(producers=4, records=150_000, max_produce_s=5.0, repeats=3)
QUICK_LOAD = LoadPlan(producers=4, records=75_000, max_produce_s=3.0, repeats=2)


# --- the clients (child processes) ----------------------------------------------------------------


def _producer_client(bootstrap: str, topic: str, records: int, size: int, max_s: float,
                     conn, start, release) -> None:
    """One producer, configured as clients.produce configures its own: connected and warmed up
    (metadata and the leader's connection) before it reports ready; produces from ``start``."""
    try:
        delivered = [0, 0]  # ok, failed

        def on_delivery(err, _msg) -> None:
            delivered[1 if err is not None else 0] += 1

        producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "acks": "all",
                             "compression.type": "none", "queue.buffering.max.messages": 500_000,
                             "queue.buffering.max.kbytes": 512 * 1024})
        producer.produce(topic, b"w" * size)
        if producer.flush(30) != 0:
            raise RuntimeError("warm-up record not delivered")
        value = os.urandom(size)
        conn.send(("ready", None))
        start.wait()
        t0 = time.monotonic()
        deadline = t0 + max_s
        sent = 0
        while sent < records:
            try:
                producer.produce(topic, value, on_delivery=on_delivery)
            except BufferError:
                producer.poll(0.005)
                continue
            sent += 1
            if sent % 2000 == 0:
                producer.poll(0)
                if time.monotonic() >= deadline:
                    break
        remaining = producer.flush(60)
        end = time.monotonic()
        if remaining:
            raise RuntimeError(f"{remaining} records still undelivered after flush")
        conn.send(("done", {"records": delivered[0], "bytes": delivered[0] * size,
                                            "errors": delivered[1], "start": t0, "end": end}))
        release.wait(RUN_TIMEOUT_S)  # its connections stay open until they are counted
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _consumer_client(bootstrap: str, topic: str, records: int, size: int, max_s: float,
                     conn, start, release) -> None:
    """One consumer, with clients.consume's fetch settings; ready once it has asked the leader
    for the topic's end offset (so its connections are up); reads the whole topic from ``start``."""
    del records, size, max_s
    try:
        consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{topic}",
                             "enable.auto.commit": False, "enable.auto.offset.store": False,
                             "fetch.max.bytes": 52428800, "max.partition.fetch.bytes": 10485760,
                             "fetch.wait.max.ms": 100, "queued.min.messages": 1_000_000,
                             "queued.max.messages.kbytes": 1_048_576, "fetch.queue.backoff.ms": 1})
        _low, expected = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=30)
        conn.send(("ready", None))
        start.wait()
        t0 = time.monotonic()
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        got = nbytes = 0
        while got < expected:
            if time.monotonic() - t0 > RUN_TIMEOUT_S:
                raise RuntimeError(f"consumed only {got} of {expected} records in {RUN_TIMEOUT_S}s")
            for msg in consumer.consume(num_messages=10000, timeout=0.5):
                if msg.error() is not None:
                    raise KafkaException(msg.error())
                got += 1
                nbytes += len(msg.value())
        end = time.monotonic()
        conn.send(("done", {"records": got, "bytes": nbytes, "errors": 0, "start": t0, "end": end}))
        release.wait(RUN_TIMEOUT_S)
        consumer.close()
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


# --- the intermediary's processes -----------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (for a supervisor: its workers, restarted ones included)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                todo.extend(int(c) for c in Path(f"/proc/{p}/task/{tid}/children").read_text().split())
            except OSError:
                continue
    return out


class TreeCpu:
    """CPU seconds of a process tree from now on, per process (procs.CpuClock each); a process
    that exits meanwhile is reported as missing rather than counted short."""

    def __init__(self, pid: int) -> None:
        self.clocks = {p: CpuClock(p) for p in process_tree(pid)}

    def elapsed(self) -> tuple[float, dict[int, float], list[int]]:
        per_pid, gone = {}, []
        for p, clock in self.clocks.items():
            try:
                per_pid[p] = clock.elapsed()
            except OSError:
                gone.append(p)
        return sum(per_pid.values()), per_pid, gone


def client_connections(pids: list[int], bootstrap_port: int) -> dict[int, dict[str, int]]:
    """Per pid, the client connections it holds: ESTABLISHED sockets whose local port is one it
    listens on, split into the bootstrap port and the broker ports (where the records go)."""
    owned = {p: socket_inodes(p) for p in pids}
    sockets = list(tcp_sockets())
    out: dict[int, dict[str, int]] = {}
    for p, inodes in owned.items():
        ports = {local[1] for local, _r, state, inode in sockets if state == TCP_LISTEN and inode in inodes}
        counts = {"bootstrap": 0, "broker": 0}
        for local, _remote, state, inode in sockets:
            if state == TCP_ESTABLISHED and inode in inodes and local[1] in ports:
                counts["bootstrap" if local[1] == bootstrap_port else "broker"] += 1
        out[p] = counts
    return out


# --- one run ----------------------------------------------------------------------------------------


@dataclass
class Target:
    """One configuration: its broker and intermediary, and the pids that serve clients."""

    name: str
    launcher: Launcher
    address: tuple[str, int] = ("", 0)
    broker: Proc | None = None
    mid: Proc | None = None
    result: dict = field(default_factory=dict)
    failed: bool = False

    @property
    def serving_pids(self) -> list[int]:
        assert self.mid is not None
        return list(self.mid.extra.get("workers") or [self.mid.pid])


def run_clients(t: Target, client, topics: list[str], plan: LoadPlan, quiet: Quiet) -> dict:
    """``client`` (one of the functions above) in one process per topic, started together once
    all are connected; aggregate throughput and CPU over the common window."""
    assert t.mid is not None and t.broker is not None
    ctx = multiprocessing.get_context("spawn")  # no fork of a process running librdkafka threads
    start, release = ctx.Event(), ctx.Event()
    bootstrap = f"{t.address[0]}:{t.address[1]}"
    procs, conns = [], []
    for topic in topics:
        ours, theirs = ctx.Pipe(duplex=False)
        procs.append(ctx.Process(target=client, daemon=True, args=(
            bootstrap, topic, plan.records, plan.record_size, plan.max_produce_s, theirs, start, release)))
        conns.append(ours)
    for p in procs:
        p.start()
    try:
        _collect(procs, conns, "ready", CLIENT_READY_TIMEOUT_S)
        quiet.wait()
        mid_cpu, broker_cpu = TreeCpu(t.mid.pid), CpuClock(t.broker.pid)
        client_cpu = [CpuClock(p.pid) for p in procs if p.pid is not None]
        busy0, t0 = system_busy_seconds(), time.monotonic()
        start.set()
        done = _collect(procs, conns, "done", RUN_TIMEOUT_S)
        seconds = max(d["end"] for d in done) - t0
        mid_s, per_pid, gone = mid_cpu.elapsed()
        broker_s = broker_cpu.elapsed()
        client_s = sum(c.elapsed() for c in client_cpu)
        busy = system_busy_seconds() - busy0
        spread = client_connections(t.serving_pids, t.address[1])
    finally:
        release.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    records, nbytes = sum(d["records"] for d in done), sum(d["bytes"] for d in done)
    mb = nbytes / 1e6
    out = {
        "clients": len(procs), "records": records, "bytes": nbytes, "errors": sum(d["errors"] for d in done),
        "seconds": seconds, "records_per_s": records / seconds, "mb_per_s": mb / seconds,
        "client_mb_per_s": [d["bytes"] / 1e6 / (d["end"] - d["start"]) for d in done],
        "server_cpu_s": mid_s, "server_cpu_pct": 100 * mid_s / seconds,
        "server_cpu_ms_per_mb": 1e3 * mid_s / mb if mb else None,
        "broker_cpu_pct": 100 * broker_s / seconds, "client_cpu_pct": 100 * client_s / seconds,
        "other_cpu_pct": 100 * max(0.0, busy - mid_s - broker_s - client_s) / seconds,
        "cpu_s_by_pid": {str(p): s for p, s in per_pid.items()},
        "connections_by_pid": {str(p): c for p, c in spread.items()},
    }
    if gone:
        out["exited_during_run"] = gone  # a worker restarted: its CPU is missing from server_cpu_s
    return out


def _collect(procs: list, conns: list, kind: str, timeout_s: float) -> list[dict]:
    """One ``kind`` message from every client; a client that reports an error, or dies without
    a word, fails the run at once."""
    deadline = time.monotonic() + timeout_s
    got: dict[int, dict] = {}
    while len(got) < len(conns):
        waiting = {c: i for i, c in enumerate(conns) if i not in got}
        ready = multiprocessing.connection.wait([*waiting, *(procs[i].sentinel for i in waiting.values())],
                                                timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise RuntimeError(f"{len(waiting)} of {len(conns)} clients not {kind} after {timeout_s}s")
        for obj in ready:
            if obj not in waiting:  # a sentinel: that client exited; its last words come first
                i = next(i for i in waiting.values() if procs[i].sentinel == obj)
                if not conns[i].poll():
                    raise RuntimeError(f"client {procs[i].pid} exited with {procs[i].exitcode} before {kind}")
                continue
            what, payload = obj.recv()
            if what == "error":
                raise RuntimeError(f"client {procs[waiting[obj]].pid}: {payload}")
            if what == kind:
                got[waiting[obj]] = payload or {}
    return list(got.values())


def one_round(t: Target, plan: LoadPlan, rnd: int, acc: dict, quiet: Quiet) -> None:
    """Produce then consume, each with ``plan.producers`` clients on topics of their own; a
    produce run during which other processes were busy is marked noisy and repeated once."""
    for attempt in range(2):
        topics = [f"workers-{rnd}-{attempt}-{i}" for i in range(plan.producers)]
        for topic in topics:
            clients.create_topic(t.address, topic, 1)
        try:
            p = run_clients(t, _producer_client, topics, plan, quiet)
            c = run_clients(t, _consumer_client, topics, plan, quiet)
        finally:
            clients.delete_topics(t.address, topics)
        p["noisy"] = c["noisy"] = quiet.noisy(p, c)
        acc.setdefault("produce", []).append(p)
        acc.setdefault("consume", []).append(c)
        log(f"workers round {rnd + 1} {t.name}: produce {p['mb_per_s']:.0f} MB/s "
            f"({p['server_cpu_ms_per_mb']:.2f} mid CPU ms/MB), consume {c['mb_per_s']:.0f} MB/s; "
            f"client connections {spread_text(p)}" + (" (noisy)" if p["noisy"] else ""))
        if not p["noisy"] or not quiet.may_retry(p["seconds"] + c["seconds"]):
            break


def spread_text(run: dict) -> str:
    """Client connections per serving process: ``3 / 5``."""
    return " / ".join(str(c["bootstrap"] + c["broker"]) for c in run["connections_by_pid"].values())


def start_target(t: Target, workers: int | None) -> None:
    """The pump (``workers`` None) with its advertised broker, or the proxy with ``workers: N``
    in front of a fresh broker; a short drain so stopping it does not wait."""
    if workers is None:
        t.address, t.broker, t.mid = start_config(t.launcher, PUMP)
        return
    t.broker = t.launcher.tansu_broker()
    yaml = f"workers:\n  count: {workers}\n  drain_timeout_ms: 1000\n"
    t.mid = t.launcher.our_proxy(t.broker.address, name=t.name, extra_yaml=yaml)
    t.address = t.mid.address
    served = t.serving_pids
    if len(served) != workers and workers > 1:
        raise RuntimeError(f"{t.name}: the ready file names {len(served)} workers")


def run_workers(counts: list[int], plan: LoadPlan, workdir: Path, quiet: Quiet) -> dict:
    """The pump and the proxy with each worker count, every one with its own broker, measured
    in ``plan.repeats`` rounds (the order rotating); the median run by records/s of each."""
    targets = [Target(PUMP, Launcher(workdir / "workers-pump"))]
    targets += [Target(config_name(n), Launcher(workdir / config_name(n))) for n in counts]
    accs: dict[str, dict] = {t.name: {} for t in targets}
    try:
        for t, n in zip(targets, [None, *counts]):
            try:
                start_target(t, n)
                log(f"{t.name}: up at {t.address[0]}:{t.address[1]}, serving pids {t.serving_pids}")
            except Exception as exc:
                _fail(t, exc)
        for rnd in range(plan.repeats):
            for t in targets[rnd % len(targets):] + targets[:rnd % len(targets)]:
                if t.failed:
                    continue
                try:
                    one_round(t, plan, rnd, accs[t.name], quiet)
                except Exception as exc:
                    _fail(t, exc)
    finally:
        for t in targets:
            t.launcher.close()
    for t in targets:
        for key, runs in accs[t.name].items():
            t.result[key] = _median_run(runs)
            t.result[key]["all_server_cpu_ms_per_mb"] = [r["server_cpu_ms_per_mb"] for r in runs]
    return {t.name: t.result for t in targets}


def _fail(t: Target, exc: BaseException) -> None:
    t.failed = True
    t.result["error"] = f"{type(exc).__name__}: {exc}"
    t.result["traceback"] = traceback.format_exc()
    log(f"{t.name}: FAILED: {t.result['error']}")


# --- reporting ----------------------------------------------------------------------------------------


def derived(results: dict[str, dict], counts: list[int]) -> dict:
    """Records/s and intermediary CPU ms/MB of each worker count over the pump's and over one
    worker's, for produce and consume."""
    out: dict = {}
    pump, one = results.get(PUMP, {}), results.get(config_name(1), {})
    for n in counts:
        r = results.get(config_name(n), {})
        for key in ("produce", "consume"):
            for field_, label in (("records_per_s", "records/s"), ("server_cpu_ms_per_mb", "mid CPU ms/MB")):
                v = r.get(key, {}).get(field_)
                for base_name, base in ((PUMP, pump), (config_name(1), one)):
                    b = base.get(key, {}).get(field_)
                    if base is not r:
                        out[f"{key} {label} {config_name(n)}/{base_name}"] = v / b if v and b else None
    return out


COLUMNS = (
    # (header, key, field, format)
    ("prod MB/s", "produce", "mb_per_s", ".0f"),
    ("prod rec/s", "produce", "records_per_s", ",.0f"),
    ("mid ms/MB", "produce", "server_cpu_ms_per_mb", ".2f"),
    ("mid %", "produce", "server_cpu_pct", ".0f"),
    ("broker %", "produce", "broker_cpu_pct", ".0f"),
    ("clients %", "produce", "client_cpu_pct", ".0f"),
    ("cons MB/s", "consume", "mb_per_s", ".0f"),
    ("mid ms/MB", "consume", "server_cpu_ms_per_mb", ".2f"),
    ("mid %", "consume", "server_cpu_pct", ".0f"),
)


def table(results: dict[str, dict], counts: list[int], plan: LoadPlan) -> str:
    names = [PUMP, *(config_name(n) for n in counts)]
    lines = [f"workers: {plan.producers} producers, then {plan.producers} consumers, {plan.record_size} B "
             f"records, one topic each ({os.cpu_count()} CPUs here)"]
    head = "configuration".ljust(14) + "".join(h.rjust(11) for h, *_ in COLUMNS)
    lines += [head, "-" * len(head)]
    for name in names:
        r = results.get(name, {})
        if "error" in r:
            lines.append(name.ljust(14) + f"FAILED: {r['error'].splitlines()[0]}")
            continue
        cells = []
        for _h, key, field_, fmt in COLUMNS:
            v = r.get(key, {}).get(field_)
            cells.append(("-" if v is None else format(v, fmt)).rjust(11))
        lines.append(name.ljust(14) + "".join(cells))
    lines.append("(prod/cons: aggregate of all clients; mid = pump, or supervisor + workers; % of one core)")
    lines.append("")
    lines.append("ratios".ljust(48) + "value")
    for key, v in derived(results, counts).items():
        lines.append(key.ljust(48) + ("-" if v is None else f"{v:.3f}"))
    lines.append("")
    lines.append("client connections per serving process (pump, or each worker) and its share of the mid CPU")
    lines.append("(a consumer holds two: the leader's, which carries the fetches, and its group coordinator's):")
    for name in names:
        for key in ("produce", "consume"):
            run = results.get(name, {}).get(key)
            if run:
                cpu, serving = run["cpu_s_by_pid"], run["connections_by_pid"]
                total = sum(cpu.values()) or 1.0
                shares = [cpu.get(p, 0.0) / total for p in serving]
                rest = 1.0 - sum(shares)
                lines.append(f"  {name:<12} {key:<8} {spread_text(run):<16} CPU "
                             + " / ".join(f"{100 * x:.0f}%" for x in shares)
                             + (f" (supervisor {100 * rest:.0f}%)" if len(cpu) > 1 else "")
                             + ("  UNEVEN: a worker under half its share" if min(shares) < 0.5 / len(shares) else ""))
    return "\n".join(lines)


def report(results: dict[str, dict], counts: list[int], plan: LoadPlan) -> dict:
    """What goes into the results JSON under ``workers``."""
    return {"plan": asdict(plan), "worker_counts": counts, "cpus": os.cpu_count(),
            "results": results, "derived": derived(results, counts)}
