"""``kafka-quota-proxy``: run, check-config, demo."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

from config import ConfigError, load_config

from . import logs

log = logging.getLogger("proxy.cli")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kafka-quota-proxy", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the proxy")
    run.add_argument("--config", required=True, help="YAML configuration file")
    run.add_argument("--ready-file", help="write listening addresses here as JSON once serving")
    check = sub.add_parser("check-config", help="validate a configuration file and exit")
    check.add_argument("file")
    demo = sub.add_parser("demo", help="start a local broker with the proxy in front and use it")
    demo.add_argument("--duration", type=float, default=None, help="seconds to keep running (default: until Ctrl-C)")
    demo.add_argument("--no-report", dest="report", action="store_false",
                      help="skip the PySpark report on generated usage (saves about a minute)")
    from pipeline import generate, report

    report.add_arguments(sub.add_parser(
        "report", help="turn a usage log into demand tables, recommended quotas, a what-if replay and "
                       "an HTML report (PySpark)"))
    generate.add_arguments(sub.add_parser("generate-usage", help="write sample multi-tenant usage for report"))
    for sp in (run, demo):
        sp.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
        sp.add_argument("--log-format", default="text", choices=["text", "json"])
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "check-config":
        try:
            load_config(args.file)
        except ConfigError as exc:
            print(f"invalid configuration: {exc}", file=sys.stderr)
            return 2
        print(f"{args.file}: ok")
        return 0
    if args.command == "report":
        from pipeline.report import main as report_main

        return report_main(args)
    if args.command == "generate-usage":
        from pipeline.generate import main as generate_main

        return generate_main(args)
    logs.configure(args.log_level, args.log_format)
    if args.command == "demo":
        from .demo import run_demo

        return _run(run_demo(args.duration, args.report))
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"invalid configuration: {exc}", file=sys.stderr)
        return 2
    try:
        return _run(serve(config, args.ready_file, args.config))
    except ConfigError as exc:  # a rate limiter refused its configuration at start
        print(f"invalid configuration: {exc}", file=sys.stderr)
        return 2


def _run(coro) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def reload_from(path: str, server) -> bool:
    """Re-reads ``path``; a valid file replaces the quotas, an invalid one is logged and ignored."""
    try:
        config = load_config(path)
    except ConfigError as exc:
        log.error("reload of %s rejected, the previous configuration stays in force: %s", path, exc)
        return False
    try:
        server.reload(config)
    except ConfigError as exc:
        log.error("reload of %s rejected, the previous configuration stays in force: %s", path, exc)
        return False
    return True


async def watch_config(path: str, server, interval_s: float = 1.0) -> None:
    """Reloads when the file's modification time or size changes (no inotify needed)."""

    def signature():
        try:
            st = os.stat(path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    last = signature()
    while True:
        await asyncio.sleep(interval_s)
        current = signature()
        if current is not None and current != last:
            last = current
            reload_from(path, server)


async def serve(config, ready_file: str | None, config_path: str | None = None) -> int:
    from .server import ProxyServer

    server = ProxyServer(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if config_path is not None:
        loop.add_signal_handler(signal.SIGHUP, reload_from, config_path, server)
        watcher = loop.create_task(watch_config(config_path, server))
    try:
        await server.start()
    except OSError as exc:
        log.error("cannot start: %s", exc)
        return 1
    if ready_file:
        write_ready_file(ready_file, server)
    await stop.wait()
    log.info("stopping")
    if config_path is not None:
        watcher.cancel()
    await server.stop()
    return 0


def write_ready_file(path: str, server) -> None:
    info = {"pid": os.getpid(), "bootstrap": list(server.bootstrap_address)}
    info["metrics"] = list(server.metrics_address) if server.metrics_address else None
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(path)
