"""Where an intermediary's share of a round trip goes: every ``data_received`` of the byte pump
and of the proxy timed inside their own processes, under the benchmark's sequential round trips.

    python -m bench.callbacks                   # ApiVersions and Produce(1), 6,000 of each
    python -m bench.callbacks --requests 20000

For each intermediary it prints the median time spent in the client-side callback (a request
comes in and is forwarded), in the broker-side callback (a response comes in and is sent back)
and between the two (the broker's answer, plus two wake-ups). Both processes make the same
system calls, so the difference between their callbacks is the intermediary's own work, with
the cold caches a ping-pong leaves it. Timing costs both the same fraction of a microsecond.

The intermediaries run under ``python -m bench.callbacks wrap OUT -m MODULE ARGS...``, which
times the callbacks and writes their medians to OUT as JSON on SIGUSR1.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from . import clients
from .procs import Launcher

# module run with -m -> (module with main(argv), module with the classes, client side, broker side)
TIMED = {
    "proxy": ("proxy.app.cli", "proxy.dataplane.connection", "ClientConnection", "UpstreamConnection"),
    "bench.byte_pump": ("bench.byte_pump", "bench.byte_pump", "_Client", "_Side"),
}
KEEP = 50_000  # samples kept per side


class Timings:
    def __init__(self) -> None:
        self.client_ns: list[int] = []
        self.broker_ns: list[int] = []
        self.gap_ns: list[int] = []
        self.client_end = 0

    def medians_us(self) -> dict:
        def med(v: list[int]) -> float | None:
            return statistics.median(v[-KEEP:]) / 1000 if v else None

        return {"client_us": med(self.client_ns), "broker_us": med(self.broker_ns), "gap_us": med(self.gap_ns),
                "samples": len(self.client_ns)}


def time_callbacks(classes_module: str, client_name: str, broker_name: str, timings: Timings) -> None:
    """Wraps ``data_received`` of both sides (a class that inherits it is covered by its base)."""
    mod = importlib.import_module(classes_module)
    client_cls, broker_cls = getattr(mod, client_name), getattr(mod, broker_name)
    clock = time.perf_counter_ns
    for cls in {c for c in (client_cls, broker_cls) if "data_received" in vars(c)}:
        original = cls.data_received

        def data_received(self, data, _original=original):
            start = clock()
            client = type(self) is client_cls
            if not client and timings.client_end:
                timings.gap_ns.append(start - timings.client_end)
            _original(self, data)
            end = clock()
            if client:
                timings.client_ns.append(end - start)
                timings.client_end = end
            else:
                timings.broker_ns.append(end - start)

        cls.data_received = data_received


def wrap(argv: list[str]) -> int:
    """``wrap OUT -m MODULE ARGS...``: runs MODULE's main(ARGS) with its callbacks timed."""
    out, dash_m, module, *args = argv
    if dash_m != "-m" or module not in TIMED:
        raise SystemExit(f"usage: wrap OUT -m {{{','.join(TIMED)}}} ARGS...")
    main_module, classes_module, client_name, broker_name = TIMED[module]
    timings = Timings()
    time_callbacks(classes_module, client_name, broker_name, timings)

    def dump(*_) -> None:
        tmp = Path(out).with_suffix(".tmp")
        tmp.write_text(json.dumps(timings.medians_us()))
        tmp.replace(out)

    signal.signal(signal.SIGUSR1, dump)
    return importlib.import_module(main_module).main(args) or 0


def measure(requests: int, workdir: Path) -> dict:
    outs: dict[str, Path] = {}

    def wrapper(name: str) -> list[str]:
        outs[name] = workdir / f"{name}.callbacks.json"
        return ["-m", "bench.callbacks", "wrap", str(outs[name])]

    launcher = Launcher(workdir, python_wrapper=wrapper)
    results: dict = {}
    try:
        # One broker behind both, as bench.run's round trips (no metadata: no advertised listener).
        direct = launcher.tansu_broker()
        clients.create_topic(direct.address, "rtt", 1)
        pump = launcher.byte_pump(direct.address)
        proxy = launcher.our_proxy(direct.address)
        mids = {"byte-pump": pump, "kafka-quota-proxy": proxy}
        for kind, frame in (("ApiVersions", clients.api_versions_frame(3)),
                            ("Produce(1)", clients.produce_frame("rtt"))):
            for out in outs.values():
                out.unlink(missing_ok=True)
            addresses = {"direct": direct.address, **{name: p.address for name, p in mids.items()}}
            rtt = clients.interleaved_round_trips(addresses, frame, requests)
            for p in mids.values():
                os.kill(p.pid, signal.SIGUSR1)
            for name, p in mids.items():
                deadline = time.monotonic() + 10
                while not outs[p.name].exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                results[(kind, name)] = {**json.loads(outs[p.name].read_text()),
                                         "rtt_p50_us": statistics.median(rtt[name]),
                                         "direct_p50_us": statistics.median(rtt["direct"])}
    finally:
        launcher.close()
    return results


def table(results: dict) -> str:
    lines = [f"{'':31}{'round trip p50':>15}{'added':>8}{'client cb':>11}{'broker cb':>11}{'between':>9}  (us)"]
    for (kind, name), r in results.items():
        added = r["rtt_p50_us"] - r["direct_p50_us"]
        lines.append(f"{kind + '  ' + name:<31}{r['rtt_p50_us']:>15.0f}{added:>8.0f}{r['client_us']:>11.1f}"
                     f"{r['broker_us']:>11.1f}{r['gap_us']:>9.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["wrap"]:
        return wrap(argv[1:])
    p = argparse.ArgumentParser(prog="python -m bench.callbacks", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=6000, help="round trips per request kind and intermediary")
    p.add_argument("--workdir", type=Path, help="where logs go (default: a temp dir)")
    args = p.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kqp-callbacks-"))
    print(table(measure(args.requests, workdir)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
