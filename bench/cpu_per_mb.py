"""The intermediaries' CPU per MB of records, on runs long enough to measure it, side by side.

    python -m bench.cpu_per_mb                         # 2 rounds, about 3 minutes
    python -m bench.cpu_per_mb --rounds 3 --baseline /tmp/other   # another work tree's proxy too

bench.run's throughput runs are short (a quick run produces 60 MB of 1 KiB records, about 0.2 s
of it): too short for the CPU an intermediary spends per MB, which is a few tenths of a ms. Here
each configuration has a fresh Tansu broker (memory storage) of its own, and in every round each
produces ``--records-1k`` records of 1 KiB and ``--records-100`` of 100 B with confluent-kafka
(as bench.run: ``linger.ms`` 5, acks=all, no compression, one partition; a run stops after
``--max-seconds``) to a topic of that round, then consumes them from the beginning. The order of
the configurations rotates from round to round.

Configurations: ``haproxy`` (Debian's HAProxy, one thread, TCP mode: the C relay operators
already run, as bench.run starts it), ``byte-pump`` (bench.byte_pump: the ceiling for a Python
proxy), ``kafka-quota-proxy`` (no quotas) and ``proxy-with-quotas`` (a quota of every kind on
every client, never reached: bench.run's QUOTAS_NOT_EXCEEDED), and with ``--baseline DIR`` the
proxy of another work tree, without and with those quotas (``proxy-baseline``,
``proxy-baseline-with-quotas``).

Reported for each run: the intermediary's CPU time (all its threads, from the scheduler's
nanosecond counters) per MB of record values, and its minor page faults per MB; per round and
their median, and each over HAProxy's in the same round. JSON to bench/results/cpu_per_mb.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench import clients
from bench.procs import Launcher, Proc, haproxy_binary, raise_nofile
from bench.run import QUOTAS_NOT_EXCEEDED

RESULTS = Path(__file__).resolve().parent / "results" / "cpu_per_mb.json"
HAPROXY = "haproxy"
CONFIGS = (HAPROXY, "byte-pump", "kafka-quota-proxy", "proxy-with-quotas")
BASELINE = "proxy-baseline"
BASELINE_QUOTAS = "proxy-baseline-with-quotas"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def minor_faults(pid: int) -> int:
    """The process's minor page faults so far (/proc/<pid>/stat, field 10)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def start(launcher: Launcher, name: str, baseline: Path | None) -> tuple[Proc, Proc]:
    """(broker, intermediary) of configuration ``name``."""
    if name == HAPROXY:
        return launcher.haproxy_broker()
    if name == "byte-pump":
        return launcher.pumped_broker()
    broker = launcher.tansu_broker()
    if name == "kafka-quota-proxy":
        return broker, launcher.our_proxy(broker.address, name=name)
    if name == "proxy-with-quotas":
        return broker, launcher.our_proxy(broker.address, name=name, extra_yaml=QUOTAS_NOT_EXCEEDED)
    if name == BASELINE and baseline is not None:
        return broker, launcher.our_proxy(broker.address, name=name, checkout=baseline)
    if name == BASELINE_QUOTAS and baseline is not None:
        return broker, launcher.our_proxy(broker.address, name=name, checkout=baseline, extra_yaml=QUOTAS_NOT_EXCEEDED)
    raise ValueError(name)


def measure(broker: Proc, mid: Proc, topic: str, size: int, records: int, max_seconds: float) -> dict[str, dict]:
    """Produce then consume ``records`` of ``size`` bytes through ``mid``: per direction, MB/s,
    the intermediary's CPU ms and minor page faults per MB."""
    clients.create_topic(mid.address, topic, 1)
    out: dict[str, dict] = {}
    faults = minor_faults(mid.pid)
    produced = clients.produce(mid.address, topic, size, records, max_seconds, watch_pid=mid.pid,
                               broker_pid=broker.pid)
    out["produce"] = _row(produced, minor_faults(mid.pid) - faults)
    faults = minor_faults(mid.pid)
    consumed = clients.consume(mid.address, topic, 1, produced.records, watch_pid=mid.pid, broker_pid=broker.pid)
    out["consume"] = _row(consumed, minor_faults(mid.pid) - faults)
    clients.delete_topics(mid.address, [topic])  # measured: its memory back to the broker
    return out


def _row(t: clients.Throughput, faults: int) -> dict:
    mb = t.bytes / 1e6
    return {"mb": round(mb, 1), "mb_per_s": round(t.mb_per_s, 1),
            "cpu_ms_per_mb": (t.server_cpu_s or 0.0) * 1000 / mb if mb else None,
            "faults_per_mb": faults / mb if mb else None,
            "other_cpu_pct": round(t.as_dict().get("other_cpu_pct", 0), 1)}


def table(results: dict[str, list[dict]], names: list[str]) -> str:
    """One line per (workload, configuration): CPU ms per MB each round and their median, the
    median over HAProxy's, page faults per MB."""
    lines = [f"{'workload':16} {'configuration':18} {'CPU ms/MB by round':>24} {'median':>7} {'/haproxy':>9} "
             f"{'faults/MB':>9}"]
    for workload in ("produce 1KiB", "produce 100B", "consume 1KiB", "consume 100B"):
        ref = _median(results.get(HAPROXY, []), workload, "cpu_ms_per_mb")
        for name in names:
            rounds = [r[workload]["cpu_ms_per_mb"] for r in results.get(name, []) if workload in r]
            med = _median(results.get(name, []), workload, "cpu_ms_per_mb")
            faults = _median(results.get(name, []), workload, "faults_per_mb")
            ratio = f"{med / ref:9.2f}" if med is not None and ref else f"{'-':>9}"
            lines.append(f"{workload:16} {name:18} {' '.join(f'{v:.3f}' for v in rounds):>24} "
                         f"{(med or 0):7.3f} {ratio} {(faults or 0):9.1f}")
    return "\n".join(lines)


def _median(rounds: list[dict], workload: str, key: str) -> float | None:
    values = [r[workload][key] for r in rounds if workload in r and r[workload][key] is not None]
    return statistics.median(values) if values else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_per_mb", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--records-1k", type=int, default=400_000, help="1 KiB records per run (about 410 MB)")
    ap.add_argument("--records-100", type=int, default=2_000_000, help="100 B records per run (200 MB)")
    ap.add_argument("--max-seconds", type=float, default=15.0, help="a produce run stops after this")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--baseline", type=Path, help="another work tree's proxy, as proxy-baseline")
    ap.add_argument("--json", type=Path, default=RESULTS)
    ap.add_argument("--workdir", type=Path)
    args = ap.parse_args(argv)
    names = [n for n in args.configs.split(",") if n]
    if args.baseline is not None:
        names += [BASELINE, BASELINE_QUOTAS]
    if HAPROXY in names and haproxy_binary() is None:
        log("haproxy is not installed (apt-get install haproxy): left out")
        names.remove(HAPROXY)
    raise_nofile()
    launcher = Launcher(args.workdir)
    log(f"logs and configs in {launcher.workdir}")
    results: dict[str, list[dict]] = {n: [] for n in names}
    try:
        started = {n: start(launcher, n, args.baseline) for n in names}
        for rnd in range(args.rounds):
            order = names[rnd % len(names):] + names[: rnd % len(names)]
            for name in order:
                broker, mid = started[name]
                row: dict = {}
                for size, records in ((1024, args.records_1k), (100, args.records_100)):
                    label = "1KiB" if size == 1024 else "100B"
                    got = measure(broker, mid, f"cpu-{rnd}-{label}", size, records, args.max_seconds)
                    row[f"produce {label}"], row[f"consume {label}"] = got["produce"], got["consume"]
                results[name].append(row)
                log(f"round {rnd + 1}/{args.rounds} {name}: " + ", ".join(
                    f"{w} {v['cpu_ms_per_mb']:.3f} ms/MB" for w, v in row.items()))
    finally:
        launcher.close()
    print(table(results, names))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                    indent=1))
    log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
