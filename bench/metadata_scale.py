"""All-topics Metadata at scale: what an intermediary costs on a response of 200,000 partitions.

    python -m bench.metadata_scale                                # 2,000, 20,000 and 200,000 partitions
    python -m bench.metadata_scale --partitions 2000,20000        # a quick look
    python -m bench.metadata_scale --baseline /tmp/base           # another work tree's proxy too
    python -m bench.run --configs none --metadata-partitions 2000,20000,200000   # the same, from bench.run

For each size a fresh Tansu broker (memory storage) gets its topics straight from raw
CreateTopics requests (1,000 topics a request) as topics of ``--partitions-per-topic``
partitions (5), or of more where that would make over ``--max-topics`` topics (4,000: Tansu's
CreateTopics slows down with the square of the topics it holds). In front
of that one broker run a byte pump (no rewriting, not advertised: only latency and CPU matter
here), this project's proxy and, with ``--baseline DIR``, the proxy of another work tree. On one
raw socket per configuration (``direct`` too), all-topics Metadata v12 requests (topics null)
are sent one at a time:

- **quiet pass**: ``requests`` of them (15; after ``max_pass_s`` at least ``min_requests``), nothing
  else running: the median latency from the send to the response's last byte, and the
  intermediary's and the broker's CPU per request (``procs.CpuClock``), the former also per
  partition;
- **busy pass**: ``busy_requests`` more (5) while another client, a process of its own on its
  own connection through the same intermediary, does ApiVersions round trips back to back: its
  longest round trip overlapping a Metadata request (an intermediary that handles the big
  response in one go holds every other connection up meanwhile). Kept apart from the quiet pass
  so that the CPU per request is the Metadata's alone.

Each size checks once that the responses through the proxies list the same topics, with the
same partition counts, as the broker's own (decoded with kafka-python's MetadataResponse[12]).
"""

from __future__ import annotations

import argparse
import array
import json
import multiprocessing
import socket
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kafka.protocol.admin import CreateTopicsRequest, CreateTopicsResponse
from kafka.protocol.metadata import MetadataRequest, MetadataResponse

from . import clients
from .procs import CpuClock, Launcher, Proc, system_busy_seconds

FULL_SIZES = (2000, 20000, 200000)
QUICK_SIZES = (2000, 20000)
CONFIGS = ("direct", "byte-pump", "kafka-quota-proxy")
BASELINE = "proxy-baseline"
PROXIES = ("kafka-quota-proxy", BASELINE)
TOPICS_PER_REQUEST = 1000
# Tansu's CreateTopics costs grow with the square of the topics it holds, so a size is made of
# topics of partitions_per_topic partitions up to MAX_TOPICS topics, of more partitions above that.
MAX_TOPICS = 4000

# The goals printed next to the figures (for the proxies).
GOAL_LATENCY_X_DIRECT = 1.2
GOAL_CPU_US_PER_PARTITION = 2.0
GOAL_OTHER_CLIENT_MS_OVER_DIRECT = 25.0


@dataclass(frozen=True)
class MetadataPlan:
    requests: int = 15  # quiet pass
    min_requests: int = 5  # ... at least these once it has taken max_pass_s
    max_pass_s: float = 60.0
    busy_requests: int = 5  # busy pass (another client meanwhile)
    partitions_per_topic: int = 5  # at least; more where that would make over MAX_TOPICS topics
    max_topics: int = MAX_TOPICS

    def per_topic(self, partitions: int) -> int:
        return max(self.partitions_per_topic, -(-partitions // self.max_topics))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- raw Kafka requests ---------------------------------------------------------------------------


class RawConnection:
    """One plaintext socket, requests one at a time; responses read into one reused buffer."""

    def __init__(self, address: tuple[str, int], timeout_s: float = 120.0) -> None:
        self.sock = socket.create_connection(address, timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(1 << 20)
        self.corr = 0

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, request: Any) -> int:
        """Send a kafka-python request; returns its correlation id."""
        self.corr += 1
        request.with_header(correlation_id=self.corr, client_id="bench-metadata")
        self.sock.sendall(request.encode(header=True, framed=True))
        return self.corr

    def receive(self) -> int:
        """Read one response into ``self.buf``; returns its size (correlation id at offset 0)."""
        clients._recv_exact(self.sock, 4, self.buf)
        size = int(struct.unpack_from(">i", self.buf)[0])
        if size > len(self.buf):
            self.buf = bytearray(size + (1 << 20))
        clients._recv_exact(self.sock, size, self.buf)
        if struct.unpack_from(">i", self.buf)[0] != self.corr:
            raise RuntimeError("correlation id mismatch")
        return size

    def flexible_body(self, size: int) -> bytes:
        """The body of a flexible response (header v1: correlation id, empty tagged fields)."""
        if self.buf[4] != 0:
            raise RuntimeError("response header with tagged fields")
        return bytes(self.buf[5:size])


def metadata_request() -> Any:
    return MetadataRequest[12](topics=None, allow_auto_topic_creation=False,
                               include_topic_authorized_operations=False)


def create_topics(address: tuple[str, int], partitions: int, per_topic: int, prefix: str = "md",
                  timeout_s: float = 600.0) -> dict[str, Any]:
    """``partitions`` partitions as topics of ``per_topic`` partitions (the last one smaller if
    it does not divide), created with raw CreateTopics v4 requests of TOPICS_PER_REQUEST topics;
    then waits until an all-topics Metadata lists them all. Returns the counts and timings."""
    C = CreateTopicsRequest[4]
    sizes = [per_topic] * (partitions // per_topic) + ([partitions % per_topic] if partitions % per_topic else [])
    t0 = time.monotonic()
    with RawConnection(address, timeout_s) as conn:
        for start in range(0, len(sizes), TOPICS_PER_REQUEST):
            topics = [C.CreatableTopic(name=f"{prefix}-{i}", num_partitions=n, replication_factor=1,
                                       assignments=[], configs=[])
                      for i, n in enumerate(sizes[start:start + TOPICS_PER_REQUEST], start)]
            conn.send(C(topics=topics, timeout_ms=int(timeout_s * 1000), validate_only=False))
            size = conn.receive()
            resp = CreateTopicsResponse[4].decode(bytes(conn.buf[4:size]))  # v4: header v0
            failed = [(t.name, t.error_code, t.error_message) for t in resp.topics if t.error_code]
            if failed:
                raise RuntimeError(f"CreateTopics failed for {len(failed)} topics, e.g. {failed[:3]}")
        created_s = time.monotonic() - t0
        deadline = time.monotonic() + timeout_s
        while True:
            conn.send(metadata_request())
            resp = MetadataResponse[12].decode(conn.flexible_body(conn.receive()))
            seen = sum(len(t.partitions) for t in resp.topics if t.name.startswith(f"{prefix}-"))
            if seen >= partitions or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    if seen < partitions:
        raise RuntimeError(f"only {seen} of {partitions} partitions listed after {timeout_s}s")
    return {"topics": len(sizes), "partitions": partitions, "partitions_per_topic": per_topic,
            "create_s": created_s, "ready_s": time.monotonic() - t0}


def shape(body: bytes) -> dict[str, Any]:
    """Topics and partitions an all-topics Metadata v12 body lists (decoded by kafka-python)."""
    resp = MetadataResponse[12].decode(body)
    per_topic = {t.name: len(t.partitions) for t in resp.topics}
    return {"topics": len(per_topic), "partitions": sum(per_topic.values()), "brokers": len(resp.brokers),
            "per_topic": per_topic}


# --- the other client ----------------------------------------------------------------------------


def _api_versions_loop(address: tuple[str, int], stop: Any, conn: Any) -> None:
    """Child process: ApiVersions round trips back to back on one connection until ``stop`` is
    set; sends back ("samples", (start, end) CLOCK_MONOTONIC nanoseconds of each as packed int64
    pairs), or ("error", what)."""
    frame = clients.api_versions_frame(3)
    buf = bytearray(1 << 16)
    samples = array.array("q")
    clock = time.monotonic_ns
    try:
        with socket.create_connection(address, timeout=120) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            corr = 0
            while True:
                corr += 1
                struct.pack_into(">i", frame, 8, corr)
                t0 = clock()
                s.sendall(frame)
                clients._recv_exact(s, 4, buf)
                clients._recv_exact(s, struct.unpack_from(">i", buf)[0], buf)
                t1 = clock()
                if corr > 100:  # warm-up
                    samples.append(t0)
                    samples.append(t1)
                    if corr == 101:
                        conn.send(("ready", b""))
                if stop.value:
                    break
        conn.send(("samples", samples.tobytes()))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


class OtherClient:
    """Runs :func:`_api_versions_loop` in a spawned process while the caller's requests go on."""

    def __init__(self, address: tuple[str, int]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.stop_flag = ctx.RawValue("b", 0)
        self.parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_api_versions_loop, args=(address, self.stop_flag, child), daemon=True)
        self.proc.start()
        child.close()
        if not self.parent.poll(60):
            raise RuntimeError("the ApiVersions client did not start")
        kind, what = self.parent.recv()
        if kind != "ready":
            raise RuntimeError(f"the ApiVersions client failed: {what}")

    def finish(self) -> list[tuple[int, int]]:
        self.stop_flag.value = 1
        if not self.parent.poll(60):
            self.proc.kill()
            raise RuntimeError("the ApiVersions client did not stop")
        kind, data = self.parent.recv()
        self.proc.join(10)
        if kind != "samples":
            raise RuntimeError(f"the ApiVersions client failed: {data}")
        a = array.array("q")
        a.frombytes(data)
        return list(zip(a[0::2], a[1::2]))


# --- one configuration -----------------------------------------------------------------------------


def settle(pid: int | None, idle_pct: float = 2.0, timeout_s: float = 20.0) -> None:
    """Wait until ``pid`` uses under ``idle_pct`` of a core over 100 ms: work an intermediary does
    after a response has left (what it learns from the topics, in slices) counts for the pass
    it belongs to, and none of the warm-up's counts for the pass."""
    if pid is None:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        clock = CpuClock(pid)
        time.sleep(0.1)
        if clock.elapsed() < idle_pct / 100 * 0.1:
            return


def measure(address: tuple[str, int], mid: Proc | None, broker: Proc, plan: MetadataPlan, partitions: int,
            quiet_wait: Callable[[], None] | None = None) -> tuple[dict[str, Any], bytes]:
    """Both passes on one configuration; returns its figures and the body of its first response."""
    out: dict[str, Any] = {}
    mid_pid = mid.pid if mid is not None else None
    with RawConnection(address) as conn:
        # The warm-up request: the first response through a proxy is the one it learns from
        # (later ones, the same bytes, may cost it less); its latency and CPU are kept apart.
        settle(mid_pid)
        first_clock = CpuClock(mid_pid) if mid_pid is not None else None
        t0 = time.perf_counter_ns()
        conn.send(metadata_request())
        size = conn.receive()
        out["first_ms"] = (time.perf_counter_ns() - t0) / 1e6
        out["response_bytes"] = size + 4
        first = conn.flexible_body(size)
        settle(mid_pid)
        if first_clock is not None:
            out["first_mid_cpu_ms"] = 1e3 * first_clock.elapsed()
            out["first_mid_cpu_us_per_partition"] = 1e3 * out["first_mid_cpu_ms"] / partitions

        if quiet_wait is not None:
            quiet_wait()
        clocks = {k: CpuClock(p.pid) for k, p in (("mid", mid), ("broker", broker)) if p is not None}
        start, busy0, self0 = time.monotonic(), system_busy_seconds(), clients._self_cpu()
        latencies: list[float] = []
        while len(latencies) < plan.requests:
            t0 = time.perf_counter_ns()
            conn.send(metadata_request())
            conn.receive()
            latencies.append((time.perf_counter_ns() - t0) / 1e6)
            if len(latencies) >= plan.min_requests and time.monotonic() - start > plan.max_pass_s:
                break
        elapsed = time.monotonic() - start
        settle(mid_pid)
        cpu = {k: c.elapsed() for k, c in clocks.items()}
        n = len(latencies)
        out.update(requests=n, latency_ms=latencies, p50_ms=statistics.median(latencies), min_ms=min(latencies))
        ours = sum(cpu.values()) + clients._self_cpu() - self0  # the intermediary, the broker, this client
        out["other_cpu_pct"] = max(0.0, 100.0 * (system_busy_seconds() - busy0 - ours) / (time.monotonic() - start))
        out["pass_s"] = elapsed
        if "broker" in cpu:
            out["broker_cpu_ms_per_request"] = 1e3 * cpu["broker"] / n
        if "mid" in cpu:
            out["mid_cpu_ms_per_request"] = 1e3 * cpu["mid"] / n
            out["mid_cpu_us_per_partition"] = 1e6 * cpu["mid"] / n / partitions

        if quiet_wait is not None:
            quiet_wait()
        other = OtherClient(address)
        windows: list[tuple[int, int]] = []
        try:
            time.sleep(0.2)  # some round trips before, for the other client's own p50
            for _ in range(plan.busy_requests):
                w0 = time.monotonic_ns()
                conn.send(metadata_request())
                conn.receive()
                windows.append((w0, time.monotonic_ns()))
        finally:
            samples = other.finish()
    during = sorted((e - s) / 1e6 for s, e in samples if any(s < w1 and e > w0 for w0, w1 in windows))
    before = [(e - s) / 1e6 for s, e in samples if e <= windows[0][0]]
    out["busy_requests"] = len(windows)
    out["busy_p50_ms"] = statistics.median((w1 - w0) / 1e6 for w0, w1 in windows)
    out["other_client"] = {
        "round_trips_during": len(during),
        "max_ms_during": during[-1] if during else None,
        "longest_ms_during": during[-5:][::-1],
        "p50_ms_during": statistics.median(during) if during else None,
        "p50_ms_before": statistics.median(before) if before else None,
    }
    return out, first


# --- one size --------------------------------------------------------------------------------------


def run_size(partitions: int, plan: MetadataPlan, workdir: Path, baseline: Path | None = None,
             quiet_wait: Callable[[], None] | None = None) -> dict[str, Any]:
    """A fresh broker with ``partitions`` partitions, the intermediaries in front of it, every
    configuration measured in turn; the shapes of the responses compared."""
    launcher = Launcher(workdir / f"metadata-{partitions}")
    result: dict[str, Any] = {"partitions": partitions, "configs": {}}
    try:
        broker = launcher.tansu_broker(name="md-tansu-broker")
        made = create_topics(broker.address, partitions, plan.per_topic(partitions))
        result["setup"] = made
        log(f"metadata {partitions:,}: {made['topics']:,} topics created in {made['create_s']:.1f}s")
        mids: dict[str, Proc | None] = {"direct": None}
        mids["byte-pump"] = launcher.byte_pump(broker.address, name="md-byte-pump")
        mids["kafka-quota-proxy"] = launcher.our_proxy(broker.address, name="md-kafka-quota-proxy")
        if baseline is not None:
            mids[BASELINE] = launcher.our_proxy(broker.address, name=f"md-{BASELINE}", checkout=baseline)
        shapes: dict[str, dict[str, Any]] = {}
        for name, mid in mids.items():
            address = broker.address if mid is None else mid.address
            try:
                figures, first = measure(address, mid, broker, plan, partitions, quiet_wait)
                if name == "direct" or name in PROXIES:
                    shapes[name] = shape(first)
                result["configs"][name] = figures
                other = figures["other_client"]["max_ms_during"]
                log(f"metadata {partitions:,} {name}: p50 {figures['p50_ms']:.1f} ms ({figures['requests']} requests)"
                    + (f", mid CPU {figures['mid_cpu_ms_per_request']:.1f} ms/request (the first "
                       f"{figures['first_mid_cpu_ms']:.1f} ms)" if mid is not None else "")
                    + (f", other client's longest round trip {other:.1f} ms" if other is not None else ""))
            except Exception as exc:
                result["configs"][name] = {"error": f"{type(exc).__name__}: {exc}"}
                log(f"metadata {partitions:,} {name}: FAILED: {type(exc).__name__}: {exc}")
                if mid is not None and not mid.alive():
                    result["configs"][name]["log_tail"] = mid.log_tail()
        if "direct" in shapes:
            ref = shapes["direct"]
            result["direct_lists"] = {"topics": ref["topics"], "partitions": ref["partitions"]}
            for name in PROXIES:
                if name in shapes:
                    got = shapes[name]
                    same = got["per_topic"] == ref["per_topic"]
                    result["configs"][name]["same_topics_as_direct"] = same
                    result["configs"][name]["lists"] = {"topics": got["topics"], "partitions": got["partitions"]}
                    if not same:
                        log(f"metadata {partitions:,} {name}: lists {got['topics']} topics / {got['partitions']} "
                            f"partitions, direct {ref['topics']} / {ref['partitions']}: NOT THE SAME")
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        log(f"metadata {partitions:,}: FAILED: {result['error']}")
    finally:
        launcher.close()
    derive(result)
    return result


def derive(result: dict[str, Any]) -> None:
    """Ratios and goal verdicts of the proxies at one size (into ``result['derived']``)."""
    cfg = result["configs"]
    direct, pump = cfg.get("direct", {}), cfg.get("byte-pump", {})
    out: dict[str, Any] = {}
    for name in PROXIES:
        px = cfg.get(name)
        if not px or "p50_ms" not in px:
            continue
        d: dict[str, Any] = {}
        if direct.get("p50_ms"):
            d["latency_x_direct"] = px["p50_ms"] / direct["p50_ms"]
        if pump.get("p50_ms"):
            d["latency_x_pump"] = px["p50_ms"] / pump["p50_ms"]
        d["cpu_us_per_partition"] = px.get("mid_cpu_us_per_partition")
        d["first_cpu_us_per_partition"] = px.get("first_mid_cpu_us_per_partition")
        ours, theirs = px["other_client"]["max_ms_during"], direct.get("other_client", {}).get("max_ms_during")
        if ours is not None and theirs is not None:
            d["other_client_max_ms_over_direct"] = ours - theirs
        d["goals"] = {
            "latency_x_direct": _verdict(d.get("latency_x_direct"), GOAL_LATENCY_X_DIRECT),
            "cpu_us_per_partition": _verdict(d.get("cpu_us_per_partition"), GOAL_CPU_US_PER_PARTITION),
            "first_cpu_us_per_partition": _verdict(d.get("first_cpu_us_per_partition"), GOAL_CPU_US_PER_PARTITION),
            "other_client_max_ms_over_direct": _verdict(d.get("other_client_max_ms_over_direct"),
                                                        GOAL_OTHER_CLIENT_MS_OVER_DIRECT),
        }
        out[name] = d
    result["derived"] = out


def _verdict(value: float | None, limit: float) -> str | None:
    return None if value is None else ("ok" if value <= limit else "MISSED")


def run_sizes(sizes: list[int], plan: MetadataPlan, workdir: Path, baseline: Path | None = None,
              quiet_wait: Callable[[], None] | None = None) -> dict[str, Any]:
    return {str(n): run_size(n, plan, workdir, baseline, quiet_wait) for n in sizes}


def report(results: dict[str, Any], plan: MetadataPlan) -> dict[str, Any]:
    return {
        "plan": asdict(plan),
        "goals": {"latency_x_direct_max": GOAL_LATENCY_X_DIRECT,
                  "proxy_cpu_us_per_partition_max": GOAL_CPU_US_PER_PARTITION,
                  "other_client_max_round_trip_ms_over_direct_max": GOAL_OTHER_CLIENT_MS_OVER_DIRECT},
        "sizes": results,
    }


# --- table -----------------------------------------------------------------------------------------


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table(results: dict[str, Any]) -> str:
    cols = [("partitions", 10), ("configuration", 19), ("resp MB", 8), ("p50 ms", 9), ("/direct", 8), ("/pump", 7),
            ("mid ms/req", 11), ("mid us/part", 12), ("1st us/part", 12), ("broker ms/req", 14),
            ("other max ms", 13), ("(+direct)", 10)]
    head = "".join(name.rjust(w) if i > 1 else name.ljust(w + 1) for i, (name, w) in enumerate(cols))
    lines = ["all-topics Metadata v12, one request at a time. 'mid' = the intermediary's CPU per request (quiet pass);",
             "'1st' = its CPU for the first (warm-up) request, the response a proxy learns from; 'other max' = the",
             "longest ApiVersions round trip of another client through the same intermediary while Metadata",
             "requests were under way (a pass of its own)", "",
             head, "-" * len(head)]
    for size, r in results.items():
        cfg = r.get("configs", {})
        direct, pump = cfg.get("direct", {}), cfg.get("byte-pump", {})
        if "error" in r and not cfg:
            lines.append(f"{int(size):<11,}FAILED: {r['error']}")
            continue
        for name, x in cfg.items():
            if "error" in x:
                lines.append(f"{int(size):<11,}{name:<20}FAILED: {x['error']}")
                continue
            other = x["other_client"]["max_ms_during"]
            d_other = direct.get("other_client", {}).get("max_ms_during")
            cells = [
                f"{int(size):<11,}", f"{name:<20}",
                _f(x["response_bytes"] / 1e6, ".2f").rjust(8),
                _f(x["p50_ms"], ".1f").rjust(9),
                (_f(x["p50_ms"] / direct["p50_ms"], ".2f")
                 if name != "direct" and direct.get("p50_ms") else "").rjust(8),
                (_f(x["p50_ms"] / pump["p50_ms"], ".2f") if name in PROXIES and pump.get("p50_ms") else "").rjust(7),
                _f(x.get("mid_cpu_ms_per_request"), ".1f").rjust(11),
                _f(x.get("mid_cpu_us_per_partition"), ".2f").rjust(12),
                _f(x.get("first_mid_cpu_us_per_partition"), ".2f").rjust(12),
                _f(x.get("broker_cpu_ms_per_request"), ".1f").rjust(14),
                _f(other, ".1f").rjust(13),
                (_f(other - d_other, "+.1f") if name != "direct" and other is not None and d_other is not None
                 else "").rjust(10),
            ]
            lines.append("".join(cells).rstrip())
        if "error" in r:
            lines.append(f"{int(size):<11,}FAILED: {r['error']}")
    lines.append("")
    lines.append(f"goals (proxy): latency <= {GOAL_LATENCY_X_DIRECT} x direct; <= {GOAL_CPU_US_PER_PARTITION} us "
                 f"proxy CPU per partition; other client's longest round trip <= {GOAL_OTHER_CLIENT_MS_OVER_DIRECT:.0f}"
                 " ms over direct's")
    for size, r in results.items():
        for name, d in r.get("derived", {}).items():
            g = d["goals"]
            same = r["configs"][name].get("same_topics_as_direct")
            lists = r["configs"][name].get("lists", {})
            lines.append(
                f"{int(size):>9,} {name:<19} latency {_f(d.get('latency_x_direct'), '.2f')}x direct "
                f"{g['latency_x_direct'] or ''}, {_f(d.get('latency_x_pump'), '.2f')}x pump; "
                f"CPU {_f(d.get('cpu_us_per_partition'), '.2f')} us/partition {g['cpu_us_per_partition'] or ''} "
                f"(first {_f(d.get('first_cpu_us_per_partition'), '.2f')} {g['first_cpu_us_per_partition'] or ''}); "
                f"other client {_f(d.get('other_client_max_ms_over_direct'), '+.1f')} ms "
                f"{g['other_client_max_ms_over_direct'] or ''}; "
                + ("lists the same topics as direct" if same else
                   f"lists {lists.get('topics')} topics / {lists.get('partitions')} partitions, NOT as direct "
                   f"{r.get('direct_lists')}" if same is False else "not compared"))
    return "\n".join(lines)


def parse_sizes(text: str) -> list[int]:
    """'2000,20000' -> [2000, 20000]; 'none' or '' -> []."""
    text = text.strip()
    if text in ("", "none"):
        return []
    sizes = [int(x.replace("_", "")) for x in text.split(",") if x.strip()]
    if any(n < 1 for n in sizes):
        raise ValueError("partition counts of 1 or more")
    return sizes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.metadata_scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--partitions", default=",".join(map(str, FULL_SIZES)), help="comma-separated partition counts")
    p.add_argument("--quick", action="store_true", help=f"sizes {','.join(map(str, QUICK_SIZES))} unless --partitions")
    p.add_argument("--partitions-per-topic", type=int, default=MetadataPlan.partitions_per_topic,
                   help="partitions of each topic (at least; more where that would make over --max-topics)")
    p.add_argument("--max-topics", type=int, default=MAX_TOPICS,
                   help="topics at most (Tansu's CreateTopics slows down with the square of the topics)")
    p.add_argument("--requests", type=int, default=MetadataPlan.requests, help="Metadata requests of the quiet pass")
    p.add_argument("--busy-requests", type=int, default=MetadataPlan.busy_requests,
                   help="Metadata requests while another client does ApiVersions round trips")
    p.add_argument("--baseline", type=Path, metavar="DIR", help=f"also the proxy of another work tree, as '{BASELINE}'")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "metadata_scale.json")
    p.add_argument("--workdir", type=Path)
    args = p.parse_args(argv)
    given = any(a == "--partitions" or a.startswith("--partitions=") for a in (argv or sys.argv[1:]))
    sizes = parse_sizes(args.partitions) if given or not args.quick else list(QUICK_SIZES)
    plan = MetadataPlan(requests=args.requests, busy_requests=args.busy_requests,
                        min_requests=min(MetadataPlan.min_requests, args.requests),
                        partitions_per_topic=args.partitions_per_topic, max_topics=args.max_topics)
    baseline = args.baseline.resolve() if args.baseline is not None else None
    if baseline is not None and not (baseline / "proxy" / "__main__.py").exists():
        p.error(f"--baseline {args.baseline}: no proxy/ package there")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kqp-bench-md-"))
    log(f"metadata sizes {sizes}, {plan}; logs in {workdir}")
    results = run_sizes(sizes, plan, workdir, baseline)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report(results, plan), indent=2))
    print(table(results))
    print(f"\nJSON: {args.out}")
    return 1 if any("error" in r or any("error" in c for c in r["configs"].values()) for r in results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
