"""Compare several ways of reaching one Tansu broker and print a table.

    python -m bench.run            # full run (about 10 minutes, 12 on a busy machine)
    python -m bench.run --quick    # about three and a half minutes

Configurations (each gets a fresh Tansu broker for throughput, so runs do not influence each
other; for round trips, each intermediary runs again in front of one shared broker):
  direct             clients talk to Tansu
  byte-pump          bench.byte_pump (asyncio.Protocol, uvloop, no parsing) in front of Tansu,
                     which advertises the pump's port so clients stay inside it
  haproxy            HAProxy in TCP mode with one thread (nbthread 1) in front of Tansu, which
                     advertises HAProxy's port as for the pump (skipped when haproxy is not installed)
  kafka-quota-proxy  this project, ``python -m proxy run``
  tansu-proxy        Tansu's Rust proxy, ``tansu proxy``
  proxy-with-quotas  this project with quotas on every client, set so high they never throttle
                     (byte, request, mutation, record and batch rates, and producer ids)
  proxy-fleet        proxy-with-quotas with ``fleet`` on (a fleet of one: the usage reports every
                     250 ms, every request's usage counted for them)
  proxy-usage-log    this project, no quotas, with the usage log on (one Parquet file a second
                     into the run's workdir; Fetch responses' records counted)
  byte-pump-tls      the byte pump terminating TLS towards the clients (uvloop's TLS layer),
                     plaintext to Tansu; clients use TLS (certificates made at the start, trustme)
  kafka-quota-proxy-tls  this project with ``listen.tls`` (the same certificate), plaintext to Tansu
  proxy-baseline     this project as another work tree has it (--baseline DIR, e.g. a
                     `git worktree` of the commit before a change): before and after in one run

Then, in tables of their own (each by default when --configs is not given):
- bench.workers (--workers 1,2): the byte pump and the proxy with ``workers: N`` for each N, under
  several concurrent producers and then consumers (--producers, each a process of its own),
  throughput and intermediary CPU per MB;
- bench.metadata_scale (--metadata-partitions 2000,20000,200000; 2000,20000 with --quick):
  all-topics Metadata v12 direct, through the byte pump and through the proxy (and the baseline),
  latency, intermediary CPU per partition and another client's longest round trip meanwhile.

The benchmark client is this process; broker, pump and proxies are subprocesses.
Results go to bench/results/latest.json (and are printed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from . import clients, metadata_scale
from .procs import CpuClock, Launcher, Proc, haproxy_binary, raise_nofile, rss_kib, system_busy_seconds, tansu_binary
from .tls import BenchPki, make_pki

CONFIGS = ("direct", "byte-pump", "haproxy", "kafka-quota-proxy", "tansu-proxy", "proxy-with-quotas",
           "proxy-usage-log", "byte-pump-tls", "kafka-quota-proxy-tls", "proxy-fleet")
# TLS between the client and the intermediary (plaintext to the broker); compared with each
# other as the plaintext pump and proxy are.
TLS_CONFIGS = ("byte-pump-tls", "kafka-quota-proxy-tls")
BASELINE = "proxy-baseline"  # only with --baseline
# proxy-with-quotas, sharing its usage through the fleet's topic every 250 ms (a fleet of one:
# what the sync costs an instance, with every request's usage counted for the reports).
FLEET_ON = "fleet:\n  enabled: true\n"
_baseline_checkout: Path | None = None
# Every client of the benchmark falls under these quotas, set far above what it can reach, so
# each request pays for the quota decisions without ever being throttled.
QUOTAS_NOT_EXCEEDED = (
    "quotas:\n"
    "  - user: \"<default>\"\n"
    "    client_id: \"<default>\"\n"
    "    producer_byte_rate: 1000000000000\n"
    "    consumer_byte_rate: 1000000000000\n"
    "    request_rate: 1000000000\n"
    "    controller_mutation_rate: 1000000\n"
    "    producer_record_rate: 1000000000\n"
    "    producer_batch_rate: 1000000000\n"
    "    consumer_record_rate: 1000000000\n"
    "  - user: \"<default>\"\n"
    "    producer_ids_rate: 1000000\n"
)
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def usage_log_yaml(directory: Path) -> str:
    """The usage log on, every second (so files are written during each run), with the
    default count_fetch_records: true."""
    return (
        "usage_log:\n"
        f"  directory: {json.dumps(str(directory))}\n"
        "  interval_seconds: 1\n"
        "  proxy_name: bench\n"
    )


@dataclass(frozen=True)
class Plan:
    records_100: int
    records_1k: int
    max_produce_s: float
    repeats: int
    rtt_n: int
    idle_connections: int
    partitions: int
    idempotent: bool = False  # idempotent producers: every batch carries a producer id


FULL = Plan(records_100=1_000_000, records_1k=300_000, max_produce_s=8.0, repeats=5,
            rtt_n=3000, idle_connections=1000, partitions=1)
QUICK = Plan(records_100=200_000, records_1k=60_000, max_produce_s=3.0, repeats=2,
             rtt_n=1000, idle_connections=1000, partitions=1)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def start_config(launcher: Launcher, name: str,
                 pki: BenchPki | None = None) -> tuple[tuple[str, int], Proc, Proc | None]:
    """Start one configuration; returns (bootstrap address, broker, intermediary or None).
    ``pki``: the certificates of the TLS configurations."""
    if name == "direct":
        broker = launcher.tansu_broker()
        return broker.address, broker, None
    if name in ("byte-pump", "byte-pump-tls"):
        broker, pump = launcher.pumped_broker(name=name, tls=_tls(name, pki))
        return pump.address, broker, pump
    if name == "haproxy":
        broker, hap = launcher.haproxy_broker(name=name)
        return hap.address, broker, hap
    broker = launcher.tansu_broker()
    proxy = start_intermediary(launcher, name, broker.address, pki)
    return proxy.address, broker, proxy


def _tls(name: str, pki: BenchPki | None) -> BenchPki | None:
    if name not in TLS_CONFIGS:
        return None
    if pki is None:
        raise ValueError(f"{name} needs certificates")
    return pki


def start_intermediary(launcher: Launcher, name: str, broker: tuple[str, int], pki: BenchPki | None = None) -> Proc:
    """The intermediary of configuration ``name`` (not direct) in front of ``broker``."""
    if name in ("byte-pump", "byte-pump-tls"):
        return launcher.byte_pump(broker, name=f"rtt-{name}", tls=_tls(name, pki))
    if name in ("kafka-quota-proxy", "kafka-quota-proxy-tls"):
        return launcher.our_proxy(broker, name=name, tls=_tls(name, pki))
    if name == "proxy-with-quotas":
        return launcher.our_proxy(broker, name=name, extra_yaml=QUOTAS_NOT_EXCEEDED)
    if name == "proxy-fleet":
        return launcher.our_proxy(broker, name=name, extra_yaml=QUOTAS_NOT_EXCEEDED + FLEET_ON)
    if name == "proxy-usage-log":
        return launcher.our_proxy(broker, name=name, extra_yaml=usage_log_yaml(launcher.workdir / "usage"))
    if name == "tansu-proxy":
        return launcher.tansu_proxy(broker)
    if name == "haproxy":
        return launcher.haproxy(broker, name="rtt-haproxy")
    if name == BASELINE and _baseline_checkout is not None:
        return launcher.our_proxy(broker, name=name, checkout=_baseline_checkout)
    raise ValueError(name)


def start_round_trip_paths(setups: list[Setup], launcher: Launcher, pki: BenchPki | None = None) -> Proc | None:
    """One more broker, with every configuration's intermediary in front of it, for the round
    trips: Produce round trips through two fresh Tansu brokers differ by up to a third of what
    an intermediary adds (measured with the same proxy in front of each), so the ratios are
    taken against one broker. The round trips need no metadata, so the pump needs no
    advertised listener here. Returns the broker (None if it could not start: no round trips)."""
    try:
        broker = launcher.tansu_broker(name="rtt-tansu-broker")
        clients.create_topic(broker.address, "rtt", 1)
    except Exception as exc:
        for s in setups:
            s.rtt_fail(f"shared round-trip broker: {type(exc).__name__}: {exc}")
        return None
    for s in setups:
        try:
            if s.name == "direct":
                s.rtt_address = broker.address
            else:
                s.rtt_mid = start_intermediary(launcher, s.name, broker.address, pki)
                s.rtt_address = s.rtt_mid.address
        except Exception as exc:
            s.rtt_fail(f"{type(exc).__name__}: {exc}")
    return broker


def _median_run(runs: list[dict]) -> dict:
    """The run with the median records/s among the quiet runs (all runs if none was quiet),
    plus every run's records/s."""
    quiet = [r for r in runs if not r.get("noisy")]
    ordered = sorted(quiet or runs, key=lambda r: r["records_per_s"])
    chosen = dict(ordered[len(ordered) // 2])
    chosen["all_records_per_s"] = [r["records_per_s"] for r in runs]
    chosen["noisy_runs"] = sum(1 for r in runs if r.get("noisy"))
    chosen["runs_considered"] = len(quiet or runs)
    return chosen


class Quiet:
    """Background-load guard for a shared machine.

    ``wait()`` holds a measurement back until the rest of the machine is using less than
    ``threshold_pct`` of a core (it is called while every benchmark process is idle), and a run
    during which other processes used more than that is marked noisy and may be repeated. Both
    draw on one time budget, so a permanently busy machine slows the run down only so much.
    """

    def __init__(self, threshold_pct: float, budget_s: float) -> None:
        self.threshold_pct = threshold_pct
        self.budget_s = budget_s
        self.waited_s = 0.0
        self.retries = 0

    def busy_pct(self, interval_s: float = 0.25) -> float:
        start = system_busy_seconds()
        time.sleep(interval_s)
        return 100.0 * (system_busy_seconds() - start) / interval_s

    def wait(self) -> None:
        t0 = time.monotonic()
        while self.budget_s > 0:
            if self.busy_pct() < self.threshold_pct:
                break
            self.budget_s -= 0.25
        waited = time.monotonic() - t0
        self.waited_s += waited
        if waited > 1.0:
            log(f"waited {waited:.1f}s for the machine to quieten")

    def noisy(self, *runs: dict) -> bool:
        return any((r.get("other_cpu_pct") or 0.0) > self.threshold_pct for r in runs)

    def may_retry(self, cost_s: float) -> bool:
        if self.budget_s <= 0:
            return False
        self.budget_s -= cost_s
        self.retries += 1
        return True


def _profile_start(pid: int, out: Path) -> subprocess.Popen | None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        log("py-spy not found; --profile ignored")
        return None
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--rate", "250", "--format", "speedscope",
                             "--output", str(out), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _profile_stop(p: subprocess.Popen | None) -> None:
    if p is None:
        return
    p.send_signal(2)
    try:
        p.wait(30)
    except subprocess.TimeoutExpired:
        p.kill()


@dataclass
class Setup:
    name: str
    launcher: Launcher
    result: dict
    address: tuple[str, int] | None = None
    broker: Proc | None = None
    mid: Proc | None = None
    rtt_address: tuple[str, int] | None = None  # the same configuration in front of the shared round-trip broker
    rtt_mid: Proc | None = None
    failed: bool = False

    @property
    def ca_file(self) -> str | None:
        """The CA clients trust when the intermediary terminates TLS (None: plaintext)."""
        return self.mid.ca_file if self.mid is not None else None

    @property
    def rtt_ca_file(self) -> str | None:
        return self.rtt_mid.ca_file if self.rtt_mid is not None else None

    def fail(self, exc: BaseException) -> None:
        self.failed = True
        self.result["error"] = f"{type(exc).__name__}: {exc}"
        self.result["traceback"] = traceback.format_exc()
        log(f"{self.name}: FAILED: {self.result['error']}")

    def rtt_fail(self, reason: str) -> None:
        """The round-trip path failed: no more round trips here; throughput goes on."""
        self.rtt_address = None
        self.result["rtt_error"] = reason
        log(f"{self.name}: round trips FAILED: {reason}")

    def check_alive(self) -> None:
        for proc in self.launcher.procs:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log_tail()}")


def one_round(s: Setup, plan: Plan, rnd: int, acc: dict, profile_dir: Path | None, quiet: Quiet) -> None:
    """Produce + consume for both record sizes, on one configuration. A pair that ran while
    other processes were busy is kept (marked noisy) and repeated up to twice."""
    address, mid_pid, broker_pid, ca = s.address, (s.mid.pid if s.mid else None), s.broker.pid, s.ca_file
    parts = []
    for label, size, count in (("100B", 100, plan.records_100), ("1KiB", 1024, plan.records_1k)):
        for attempt in range(3):
            topic = f"bench-{label}-{rnd}-{attempt}"
            clients.create_topic(address, topic, plan.partitions, ca_file=ca)
            spy = None
            if profile_dir is not None and s.mid is not None and rnd == 0 and attempt == 0 and s.name != "tansu-proxy":
                spy = _profile_start(s.mid.pid, profile_dir / f"{s.name}-produce-{label}.speedscope.json")
                time.sleep(0.5)
            quiet.wait()
            t0 = time.monotonic()
            try:
                p = clients.produce(address, topic, size, count, plan.max_produce_s, watch_pid=mid_pid,
                                    broker_pid=broker_pid, idempotent=plan.idempotent, ca_file=ca)
            finally:
                _profile_stop(spy)
            c = clients.consume(address, topic, plan.partitions, p.records + 1,
                                watch_pid=mid_pid, broker_pid=broker_pid, ca_file=ca)
            clients.delete_topics(address, [topic], ca_file=ca)  # measured: its memory back to the broker
            pd, cd = p.as_dict(), c.as_dict()
            noisy = quiet.noisy(pd, cd)
            pd["noisy"] = cd["noisy"] = noisy
            acc.setdefault(f"produce_{label}", []).append(pd)
            acc.setdefault(f"consume_{label}", []).append(cd)
            parts.append(f"{label} produce {p.records_per_s:,.0f} rec/s, consume {c.records_per_s:,.0f} rec/s"
                         + (f" (noisy: others used {max(pd['other_cpu_pct'], cd['other_cpu_pct']):.0f}% CPU)"
                            if noisy else ""))
            if not noisy or attempt == 2 or not quiet.may_retry(time.monotonic() - t0):
                break
    log(f"round {rnd + 1} {s.name}: " + "; ".join(parts))


RTT_KINDS = (("rtt_api_versions", lambda: clients.api_versions_frame(3)),
             ("rtt_produce", lambda: clients.produce_frame("rtt")))


def rtt_phase(setups: list[Setup], plan: Plan, rnd: int, accs: dict[str, dict], quiet: Quiet,
              broker: Proc) -> None:
    """Sequential round trips on every configuration whose round-trip path is up, interleaved in
    small blocks; if that fails, each configuration is measured alone so the failure is pinned
    on the right one (or on the shared broker). Also records the CPU time each intermediary
    spent per request. A failure here stops that configuration's round trips only."""
    live = [s for s in setups if s.rtt_address is not None]
    for key, make_frame in RTT_KINDS:
        quiet.wait()
        cpu0 = {s.name: CpuClock(s.rtt_mid.pid) for s in live if s.rtt_mid is not None}
        busy0 = system_busy_seconds()
        t0 = time.monotonic()
        interleaved = True
        try:
            got = clients.interleaved_round_trips({s.name: s.rtt_address for s in live}, make_frame(), plan.rtt_n,
                                                  ca_files={s.name: s.rtt_ca_file for s in live})
        except Exception:
            interleaved = False
            got = {}
            for s in live:
                try:
                    got[s.name] = clients.round_trip_samples(s.rtt_address, make_frame(), plan.rtt_n,
                                                             ca_file=s.rtt_ca_file)
                except Exception as exc:
                    err = exc if broker.alive() else RuntimeError(
                        f"the shared round-trip broker exited:\n{broker.log_tail()}")
                    s.rtt_fail(f"{type(err).__name__}: {err}")
        elapsed = time.monotonic() - t0
        busy = system_busy_seconds() - busy0
        for s in live:
            if s.name in got:
                accs[s.name].setdefault(key, []).extend(got[s.name])
                accs[s.name].setdefault(f"{key}_machine_busy_pct", []).append(100.0 * busy / elapsed)
                if s.name in cpu0:
                    used = cpu0[s.name].elapsed()
                    sent = clients.interleaved_request_count(plan.rtt_n) if interleaved else plan.rtt_n + 200
                    accs[s.name].setdefault(f"{key}_mid_cpu_us", []).append(1e6 * used / sent)
    def p50(name: str, key: str) -> str:
        samples = accs[name].get(key)
        return f"{clients.summarize(samples[-plan.rtt_n:]).p50_us:.0f}" if samples else "-"

    log(f"round {rnd + 1} RTT p50 ApiVersions / Produce(1 record): " + ", ".join(
        f"{s.name} {p50(s.name, 'rtt_api_versions')}/{p50(s.name, 'rtt_produce')} us"
        for s in live if s.rtt_address is not None))


def run_all(configs: list[str], plan: Plan, workdir: Path, profile_dir: Path | None,  # noqa: C901 (the plan, step by step)
            quiet: Quiet, pin_round_trips: str | None = None) -> dict[str, dict]:
    """Start every configuration (each with its own broker), measure idle-connection memory on
    the fresh intermediaries, start every configuration's round-trip path (its intermediary in
    front of one shared broker), then run ``plan.repeats`` rounds. A round measures request round
    trips on all configurations interleaved, then visits every configuration in turn (rotating
    the order) for produce/consume throughput, so background noise on the machine is spread over
    all of them instead of landing on one."""
    setups = [Setup(name, Launcher(workdir / name), {"config": name}) for name in configs]
    # With pin_round_trips, the round-trip path's Python intermediaries (pump and proxies, one
    # thread each) run on those CPUs; the client, the brokers and Tansu's proxy float.
    rtt_launcher = Launcher(workdir / "round-trips", pin={"intermediary": pin_round_trips} if pin_round_trips else None)
    accs: dict[str, dict] = {name: {} for name in configs}
    # One CA and server certificate (127.0.0.1, localhost) for every TLS configuration.
    pki = make_pki(workdir / "tls") if set(configs) & set(TLS_CONFIGS) else None
    if pki is not None:
        log(f"TLS certificates (trustme) in {workdir / 'tls'}")
    try:
        for s in setups:
            try:
                t0 = time.monotonic()
                s.address, s.broker, s.mid = start_config(s.launcher, s.name, pki)
                s.result["bootstrap"] = list(s.address)
                log(f"{s.name}: up at {s.address[0]}:{s.address[1]} in {time.monotonic() - t0:.2f}s")
            except Exception as exc:
                s.fail(exc)
        for s in setups:
            if s.failed:
                continue
            try:
                if s.mid is not None and plan.idle_connections:
                    mem = clients.idle_connection_memory(s.address, s.mid.pid, plan.idle_connections,
                                                         ca_file=s.ca_file)
                    s.result["idle_memory"] = mem.as_dict()
                    log(f"{s.name}: {mem.per_connection_bytes / 1024:.1f} KiB per idle connection "
                        f"(RSS {mem.rss_before_kib / 1024:.1f} -> {mem.rss_after_kib / 1024:.1f} MiB)")
                    mem = clients.idle_connection_memory(s.address, s.mid.pid, plan.idle_connections, silent=True,
                                                         ca_file=s.ca_file)
                    s.result["silent_memory"] = mem.as_dict()
                    log(f"{s.name}: {mem.per_connection_bytes / 1024:.1f} KiB per connection that sent nothing")
                s.check_alive()
            except Exception as exc:
                s.fail(exc)
        rtt_broker = start_round_trip_paths(setups, rtt_launcher, pki)
        for rnd in range(plan.repeats):
            if rtt_broker is not None:
                rtt_phase(setups, plan, rnd, accs, quiet, rtt_broker)
            order = setups[rnd % len(setups):] + setups[:rnd % len(setups)]
            for s in order:
                if s.failed:
                    continue
                try:
                    one_round(s, plan, rnd, accs[s.name], profile_dir, quiet)
                    s.check_alive()
                except Exception as exc:
                    s.fail(exc)
        for s in setups:
            acc = accs[s.name]
            for key in ("rtt_api_versions", "rtt_produce"):
                if acc.get(key):
                    s.result[key] = clients.summarize(acc[key]).as_dict()
                    s.result[key]["machine_busy_pct"] = acc[f"{key}_machine_busy_pct"]
                    if acc.get(f"{key}_mid_cpu_us"):
                        s.result[key]["mid_cpu_us_per_request"] = statistics.median(acc[f"{key}_mid_cpu_us"])
            for key, runs in acc.items():
                if key.startswith(("produce_", "consume_")) and runs:
                    s.result[key] = _median_run(runs)
            if s.mid is not None and not s.failed:
                s.result["intermediary_rss_kib_end"] = _rss(s.mid.pid)
    finally:
        rtt_launcher.close()
        for s in setups:
            s.launcher.close()
    return {s.name: s.result for s in setups}


def _rss(pid: int) -> int | None:
    try:
        return rss_kib(pid)
    except OSError:
        return None


# --- reporting ----------------------------------------------------------------------------------

ROWS = [
    # (label, path, unit, higher is better)
    ("produce 100B  records/s", ("produce_100B", "records_per_s"), "rec/s", True),
    ("produce 100B  MB/s", ("produce_100B", "mb_per_s"), "MB/s", True),
    ("produce 1KiB  records/s", ("produce_1KiB", "records_per_s"), "rec/s", True),
    ("produce 1KiB  MB/s", ("produce_1KiB", "mb_per_s"), "MB/s", True),
    ("consume 100B  records/s", ("consume_100B", "records_per_s"), "rec/s", True),
    ("consume 100B  MB/s", ("consume_100B", "mb_per_s"), "MB/s", True),
    ("consume 1KiB  records/s", ("consume_1KiB", "records_per_s"), "rec/s", True),
    ("consume 1KiB  MB/s", ("consume_1KiB", "mb_per_s"), "MB/s", True),
    ("ApiVersions RTT p50 us", ("rtt_api_versions", "p50_us"), "us", False),
    ("ApiVersions RTT p99 us", ("rtt_api_versions", "p99_us"), "us", False),
    ("Produce(1 rec) RTT p50 us", ("rtt_produce", "p50_us"), "us", False),
    ("Produce(1 rec) RTT p99 us", ("rtt_produce", "p99_us"), "us", False),
    ("idle conn memory B/conn", ("idle_memory", "per_connection_bytes"), "B", False),
    ("silent conn memory B/conn", ("silent_memory", "per_connection_bytes"), "B", False),
    ("mid CPU us/req ApiVersions", ("rtt_api_versions", "mid_cpu_us_per_request"), "cpu", False),
    ("mid CPU us/req Produce(1)", ("rtt_produce", "mid_cpu_us_per_request"), "cpu", False),
    ("mid CPU ns/rec produce 100B", ("produce_100B", "server_cpu_ns_per_record"), "cpu", False),
    ("mid CPU ms/MB produce 1KiB", ("produce_1KiB", "server_cpu_ms_per_mb"), "cpu", False),
    ("mid CPU ns/rec consume 100B", ("consume_100B", "server_cpu_ns_per_record"), "cpu", False),
    ("mid CPU ms/MB consume 1KiB", ("consume_1KiB", "server_cpu_ms_per_mb"), "cpu", False),
    ("mid CPU% produce 100B", ("produce_100B", "server_cpu_pct"), "%", False),
    ("mid CPU% produce 1KiB", ("produce_1KiB", "server_cpu_pct"), "%", False),
    ("mid CPU% consume 1KiB", ("consume_1KiB", "server_cpu_pct"), "%", False),
    ("broker CPU% produce 100B", ("produce_100B", "broker_cpu_pct"), "%", False),
    ("client CPU% produce 100B", ("produce_100B", "client_cpu_pct"), "%", False),
    ("client CPU% consume 100B", ("consume_100B", "client_cpu_pct"), "%", False),
    ("other CPU% produce 100B", ("produce_100B", "other_cpu_pct"), "%", False),
    ("other CPU% produce 1KiB", ("produce_1KiB", "other_cpu_pct"), "%", False),
]


def _get(result: dict, path: tuple[str, str]):
    v = result.get(path[0])
    if isinstance(v, dict):
        return v.get(path[1])
    return None


def _fmt(v, unit: str = "") -> str:
    if v is None:
        return "-"
    if unit == "cpu" and abs(v) < 10:
        return f"{v:.2f}"  # CPU ms/MB is around 1 (ns resolution, see procs.CpuClock)
    if abs(v) >= 10000:
        return f"{v:,.0f}"
    if abs(v) >= 100:
        return f"{v:.0f}"
    return f"{v:.1f}"


def derived(results: dict[str, dict]) -> dict:
    """Proxy/pump and proxy/tansu-proxy throughput ratios; quotas and usage log against their
    baselines; added-latency ratio."""
    out: dict = {}
    direct, pump = results.get("direct", {}), results.get("byte-pump", {})
    proxy, tproxy = results.get("kafka-quota-proxy", {}), results.get("tansu-proxy", {})
    for key in ("produce_100B", "produce_1KiB", "consume_100B", "consume_1KiB"):
        px = _get(proxy, (key, "records_per_s"))
        pp = _get(pump, (key, "records_per_s"))
        pt = _get(tproxy, (key, "records_per_s"))
        out[f"{key} proxy/pump"] = {"value": px / pp if px and pp else None, "target": ">= 0.95"}
        out[f"{key} proxy/tansu-proxy"] = {"value": px / pt if px and pt else None, "target": None}
    quota = results.get("proxy-with-quotas", {})
    for key in ("produce_100B", "produce_1KiB"):
        pq, pd = _get(quota, (key, "records_per_s")), _get(direct, (key, "records_per_s"))
        out[f"{key} proxy-with-quotas/direct"] = {"value": pq / pd if pq and pd else None, "target": ">= 0.85"}
    fleet = results.get("proxy-fleet", {})
    for key in ("produce_100B", "produce_1KiB", "consume_100B", "consume_1KiB"):
        on, off = _get(fleet, (key, "records_per_s")), _get(quota, (key, "records_per_s"))
        out[f"fleet on/off {key.replace('_', ' ')}"] = {"value": on / off if on and off else None, "target": ">= 0.97"}
    usage = results.get("proxy-usage-log", {})
    for key in ("produce_100B", "produce_1KiB", "consume_1KiB"):
        on, off = _get(usage, (key, "records_per_s")), _get(proxy, (key, "records_per_s"))
        label = key.replace("_", " ")
        out[f"usage log on/off {label}"] = {"value": on / off if on and off else None, "target": None}
    for key, field in (("rtt_api_versions", "mid_cpu_us_per_request"), ("rtt_produce", "mid_cpu_us_per_request"),
                       ("produce_100B", "server_cpu_ns_per_record"), ("produce_1KiB", "server_cpu_ms_per_mb"),
                       ("consume_100B", "server_cpu_ns_per_record"), ("consume_1KiB", "server_cpu_ms_per_mb")):
        px, pp = _get(proxy, (key, field)), _get(pump, (key, field))
        out[f"{key} mid CPU proxy/pump"] = {"value": px / pp if px and pp else None, "target": None}
    haproxy = results.get("haproxy", {})
    if haproxy:
        for key in THROUGHPUT_KEYS:
            px, ph = _get(proxy, (key, "server_cpu_ms_per_mb")), _get(haproxy, (key, "server_cpu_ms_per_mb"))
            out[f"{key} mid CPU/MB kafka-quota-proxy/haproxy"] = {"value": px / ph if px and ph else None,
                                                                  "target": "<= 1.5"}
        for key in THROUGHPUT_KEYS:
            pp, ph = _get(pump, (key, "server_cpu_ms_per_mb")), _get(haproxy, (key, "server_cpu_ms_per_mb"))
            out[f"{key} mid CPU/MB byte-pump/haproxy"] = {"value": pp / ph if pp and ph else None, "target": None}
    for key in ("rtt_api_versions", "rtt_produce"):
        d, p, x = (_get(r, (key, "p50_us")) for r in (direct, pump, proxy))
        ratio = None
        if None not in (d, p, x):
            added_pump, added_proxy = p - d, x - d
            ratio = added_proxy / added_pump if added_pump > 0 else None
            out[f"{key} added p50 us (pump, proxy)"] = {"value": [added_pump, added_proxy], "target": None}
        out[f"{key} added p50 proxy/pump"] = {"value": ratio, "target": "<= 1.25"}
    if any(c in results for c in TLS_CONFIGS):
        out.update(derived_tls(results))
    return out


THROUGHPUT_KEYS = ("produce_100B", "produce_1KiB", "consume_100B", "consume_1KiB")


def derived_tls(results: dict[str, dict]) -> dict:
    """The TLS proxy against the TLS pump, as derived() compares the plaintext ones: throughput
    (target >= 0.95) and added p50 round trip over direct plaintext (target <= 1.25); then what
    terminating TLS costs each of them in CPU per MB of record values (TLS configuration minus
    its plaintext one: decryption for produce, encryption for consume)."""
    out: dict = {}
    direct, pump, proxy = (results.get(c, {}) for c in ("direct", "byte-pump", "kafka-quota-proxy"))
    pump_tls, proxy_tls = (results.get(c, {}) for c in TLS_CONFIGS)
    for key in THROUGHPUT_KEYS:
        px, pp = _get(proxy_tls, (key, "records_per_s")), _get(pump_tls, (key, "records_per_s"))
        out[f"{key} proxy-tls/pump-tls"] = {"value": px / pp if px and pp else None, "target": ">= 0.95"}
    for key in ("rtt_api_versions", "rtt_produce"):
        d, p, x = (_get(r, (key, "p50_us")) for r in (direct, pump_tls, proxy_tls))
        ratio = None
        if None not in (d, p, x):
            added_pump, added_proxy = p - d, x - d
            ratio = added_proxy / added_pump if added_pump > 0 else None
            out[f"{key} added p50 us (pump-tls, proxy-tls)"] = {"value": [added_pump, added_proxy], "target": None}
        out[f"{key} added p50 proxy-tls/pump-tls"] = {"value": ratio, "target": "<= 1.25"}
    for key, field in (("rtt_api_versions", "mid_cpu_us_per_request"), ("rtt_produce", "mid_cpu_us_per_request"),
                       ("produce_1KiB", "server_cpu_ms_per_mb"), ("consume_1KiB", "server_cpu_ms_per_mb")):
        px, pp = _get(proxy_tls, (key, field)), _get(pump_tls, (key, field))
        out[f"{key} mid CPU proxy-tls/pump-tls"] = {"value": px / pp if px and pp else None, "target": None}
    for key in THROUGHPUT_KEYS:
        cost = []
        for tls_result, plain_result in ((pump_tls, pump), (proxy_tls, proxy)):
            t, pl = _get(tls_result, (key, "server_cpu_ms_per_mb")), _get(plain_result, (key, "server_cpu_ms_per_mb"))
            cost.append(t - pl if t is not None and pl is not None else None)
        if any(c is not None for c in cost):
            out[f"{key} TLS mid CPU ms/MB (pump, proxy)"] = {"value": cost, "target": None, "format": ".2f"}
    return out


def table(results: dict[str, dict], configs: list[str]) -> str:
    width = 27
    col = 22
    lines = []
    head = "metric".ljust(width) + "".join(c.rjust(col) for c in configs)
    lines.append(head)
    lines.append("-" * len(head))
    direct = results.get("direct", {})
    for label, path, _unit, _higher in ROWS:
        cells = []
        any_value = False
        for c in configs:
            r = results.get(c, {})
            v = _get(r, path)
            if "error" in r and v is None:
                cells.append("FAILED".rjust(col))
                continue
            d = _get(direct, path)
            text = _fmt(v, _unit)
            any_value = any_value or v is not None
            if v is not None and d and c != "direct" and _unit not in ("%", "cpu"):
                text += f" ({v / d:.2f}x)"
            cells.append(text.rjust(col))
        if any_value:
            lines.append(label.ljust(width) + "".join(cells))
    lines.append("")
    lines.append("(x) = ratio to direct. 'mid' = the process between client and broker; CPU% is of one core;")
    lines.append("'mid CPU' per request/record/MB = its CPU time divided by the work (robust to noise);")
    lines.append("'other' = everything else on the machine during that run (background noise).")
    if any(c in configs for c in TLS_CONFIGS):
        lines.append("*-tls: TLS from the client to the intermediary, plaintext to the broker. 'TLS mid CPU ms/MB' =")
        lines.append("the intermediary's CPU ms per MB of record values over TLS minus the same without TLS.")
    lines.append("")
    key_width = 50
    lines.append("derived".ljust(key_width) + "value".rjust(16) + "   target")
    for key, item in derived(results).items():
        v = item["value"]
        if isinstance(v, list):
            text = " / ".join("-" if x is None else format(x, item.get("format", ".0f")) for x in v)
        else:
            text = "-" if v is None else f"{v:.3f}"
        target = item["target"] or ""
        if v is None and not target:
            continue
        verdict = ""
        if v is not None and not isinstance(v, list) and target:
            ok = v >= float(target.split()[-1]) if target.startswith(">=") else v <= float(target.split()[-1])
            verdict = "  ok" if ok else "  MISSED"
        lines.append(key.ljust(key_width) + text.rjust(16) + f"   {target}{verdict}")
    for c in configs:
        if "error" in results.get(c, {}):
            lines.append(f"\n{c} FAILED: {results[c]['error']}")
        if "rtt_error" in results.get(c, {}):
            lines.append(f"\n{c} round trips FAILED: {results[c]['rtt_error']}")
    return "\n".join(lines)


def environment() -> dict:
    import confluent_kafka

    tansu = tansu_binary()
    try:
        tansu_version = subprocess.run([tansu, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        tansu_version = None
    try:
        import uvloop
        uv = uvloop.__version__
    except ImportError:
        uv = None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "tansu": tansu_version,
        "librdkafka": confluent_kafka.libversion()[0],
        "confluent_kafka": confluent_kafka.version()[0],
        "uvloop": uv,
        "openssl": ssl.OPENSSL_VERSION,
    }


def _metadata_sizes(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
    """The partition counts of the metadata phase: --metadata-partitions, else the default sizes
    when --configs is not given (the full run), else none."""
    counts = args.metadata_partitions
    if counts is None:
        sizes = metadata_scale.QUICK_SIZES if args.quick else metadata_scale.FULL_SIZES
        counts = "none" if args.configs is not None else ",".join(map(str, sizes))
    try:
        return metadata_scale.parse_sizes(counts)
    except ValueError as exc:
        p.error(f"--metadata-partitions: {exc}")


def _without_missing_haproxy(p: argparse.ArgumentParser, args: argparse.Namespace, configs: list[str]) -> None:
    """Without haproxy installed, its configuration is an error when asked for by name and
    left out of the default set (with a warning)."""
    if "haproxy" not in configs or haproxy_binary() is not None:
        return
    if args.configs is not None:
        p.error("--configs haproxy: haproxy is not installed (apt-get install haproxy; make bench does it as root)")
    configs.remove("haproxy")
    log("haproxy is not installed: the haproxy configuration is left out (apt-get install haproxy)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="about three and a half minutes instead of ten")
    p.add_argument("--configs", help=f"comma-separated subset of {','.join(CONFIGS)} (default all; 'none': only "
                                     "the workers phase)")
    p.add_argument("--baseline", type=Path, metavar="DIR",
                   help=f"also run the proxy of another work tree as '{BASELINE}' (e.g. the commit before a change)")
    p.add_argument("--repeats", type=int, help="produce/consume repetitions per size (median reported)")
    p.add_argument("--partitions", type=int, help="partitions per benchmark topic (default 1)")
    p.add_argument("--idle-connections", type=int, help="connections for the memory test (0 skips it)")
    p.add_argument("--idempotent", action="store_true",
                   help="idempotent producers, so proxy-with-quotas checks a producer id on every batch")
    p.add_argument("--profile", action="store_true",
                   help="record py-spy speedscope profiles of Python intermediaries during the first produce run")
    p.add_argument("--noise-threshold", type=float, default=25.0,
                   help="CPU%% (of one core) used by other processes above which a run counts as noisy")
    p.add_argument("--noise-budget", type=float,
                   help="seconds the run may spend waiting for quiet / repeating noisy runs (default 120, quick 20)")
    p.add_argument("--pin-round-trips", nargs="?", const=str(max(os.sched_getaffinity(0))), metavar="CPUS",
                   help="run the round trips' byte pump and proxies on these CPUs (taskset list; default: "
                        "the last CPU this process may use); throughput runs stay unpinned")
    p.add_argument("--workers", metavar="COUNTS",
                   help="also compare the proxy with these worker counts (workers: N) and the byte pump under "
                        "--producers concurrent clients, in a table of its own (bench.workers); default 1,2 "
                        "when --configs is not given, else none; 'none' skips it")
    p.add_argument("--producers", type=int, help="concurrent clients of the workers phase (default 4)")
    p.add_argument("--metadata-partitions", metavar="COUNTS",
                   help="also measure all-topics Metadata with these partition counts on the broker, direct, "
                        "through the byte pump and the proxy (bench.metadata_scale); default 2000,20000,200000 "
                        "(--quick: 2000,20000) when --configs is not given, else none; 'none' skips it")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "latest.json", help="JSON results file")
    p.add_argument("--workdir", type=Path, help="where logs and configs go (default: a temp dir)")
    args = p.parse_args(argv)

    plan = QUICK if args.quick else FULL
    overrides = {k: v for k, v in (("repeats", args.repeats), ("partitions", args.partitions),
                                   ("idle_connections", args.idle_connections),
                                   ("idempotent", args.idempotent or None)) if v is not None}
    if overrides:
        plan = Plan(**{**plan.__dict__, **overrides})
    from . import workers  # it imports this module's pieces

    configs = [c.strip() for c in (args.configs or ",".join(CONFIGS)).split(",") if c.strip() not in ("", "none")]
    counts = args.workers if args.workers is not None else ("1,2" if args.configs is None else "none")
    worker_counts = [] if counts.strip() in ("", "none") else [int(n) for n in counts.split(",")]
    if any(n < 1 for n in worker_counts):
        p.error("--workers: counts of 1 or more")
    if worker_counts and 1 not in worker_counts:
        worker_counts.insert(0, 1)  # the ratios are taken against one worker
    load = workers.QUICK_LOAD if args.quick else workers.FULL_LOAD
    if args.producers is not None:
        if args.producers < 1:
            p.error("--producers: 1 or more")
        load = workers.LoadPlan(**{**load.__dict__, "producers": args.producers})
    md_sizes = _metadata_sizes(p, args)
    if args.baseline is not None:
        global _baseline_checkout
        _baseline_checkout = args.baseline.resolve()
        if not (_baseline_checkout / "proxy" / "__main__.py").exists():
            p.error(f"--baseline {args.baseline}: no proxy/ package there")
        if configs and BASELINE not in configs:  # not with --configs none (another phase only)
            configs.append(BASELINE)
    unknown = set(configs) - set(CONFIGS) - ({BASELINE} if args.baseline is not None else set())
    if unknown:
        p.error(f"unknown configurations: {', '.join(sorted(unknown))}")
    _without_missing_haproxy(p, args, configs)

    soft, hard = raise_nofile()
    need = 3 * plan.idle_connections + 200
    if soft < need:
        log(f"warning: open-files limit {soft} (hard {hard}) is below the ~{need} the memory test needs")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kqp-bench-"))
    profile_dir = None
    if args.profile:
        profile_dir = args.out.parent / "profiles"
        profile_dir.mkdir(parents=True, exist_ok=True)
    log(f"plan {plan}; logs in {workdir}; open files limit {soft}")

    started = time.time()
    quiet = Quiet(args.noise_threshold, args.noise_budget if args.noise_budget is not None
                  else (20.0 if args.quick else 120.0))
    if args.pin_round_trips and not shutil.which("taskset"):
        p.error("--pin-round-trips needs taskset (util-linux)")
    results = run_all(configs, plan, workdir, profile_dir, quiet, args.pin_round_trips) if configs else {}
    worker_results = workers.run_workers(worker_counts, load, workdir, quiet) if worker_counts else {}
    md_plan = metadata_scale.MetadataPlan()
    md_results = (metadata_scale.run_sizes(md_sizes, md_plan, workdir, _baseline_checkout, quiet.wait)
                  if md_sizes else {})

    report = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": time.time() - started,
        "quick": args.quick,
        "plan": plan.__dict__,
        "round_trip_intermediaries_pinned_to": args.pin_round_trips,
        "environment": environment(),
        "open_files_limit": [soft, hard],
        "noise": {"threshold_pct": quiet.threshold_pct, "waited_s": quiet.waited_s, "retries": quiet.retries},
        "results": results,
        "derived": derived(results),
    }
    if worker_counts:
        report["workers"] = workers.report(worker_results, worker_counts, load)
    if md_sizes:
        report["metadata"] = metadata_scale.report(md_results, md_plan)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    if configs:
        print(table(results, configs))
    if worker_counts:
        print(("\n" if configs else "") + workers.table(worker_results, worker_counts, load))
    if md_sizes:
        print(("\n" if configs or worker_counts else "") + metadata_scale.table(md_results))
    if args.pin_round_trips:
        print(f"\nround trips: the pump and this proxy pinned to CPU(s) {args.pin_round_trips}")
    print(f"\n{len(configs)} configurations, {len(worker_results)} in the workers phase and {len(md_sizes)} metadata "
          f"sizes in {report['duration_s']:.0f}s; JSON: {args.out}")
    md_failed = any("error" in r or any("error" in c for c in r["configs"].values()) for r in md_results.values())
    failed = md_failed or any("error" in r or "rtt_error" in r for r in (*results.values(), *worker_results.values()))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
