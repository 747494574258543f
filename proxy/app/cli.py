"""``kafka-quota-proxy``: run, check-config, demo, report, generate-usage, quotas."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Protocol, cast

from config import ConfigError, load_config
from config.model import Config
from config.validation import one_error
from proxy.cluster.dialer import BrokerDialer
from proxy.control.cert_reload import CertificateReloader, watch_certificates
from proxy.control.reload_watch import ConfigFile, ConfigWatcher, read_config_file, watch_config
from proxy.identity.tls import server_tls
from proxy.observability import logs
from proxy.observability.stats import ProxyStats

log = logging.getLogger(__name__)


_DESCRIPTION = ("A Kafka-protocol proxy that enforces Kafka's quotas in front of any Kafka cluster. "
                "Every subcommand has its own --help.")
_EPILOG = ("make test and make demo install it into .venv: run 'source .venv/bin/activate' to have "
           "kafka-quota-proxy on the PATH, or 'pip install .' in an environment of your own. "
           "config/example.yaml is a configuration to start from, with every section and key.")


def package_version() -> str:
    """The installed package's version; from a source tree that was never installed, the one its
    pyproject.toml declares; "unknown" when neither can be read."""
    from importlib import metadata

    try:
        return metadata.version("kafka-quota-proxy")
    except metadata.PackageNotFoundError:
        pass
    import tomllib

    try:
        with (Path(__file__).resolve().parents[2] / "pyproject.toml").open("rb") as f:
            project = tomllib.load(f).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return "unknown"
    if project.get("name") != "kafka-quota-proxy" or not isinstance(project.get("version"), str):
        return "unknown"
    version: str = project["version"]  # a str, checked above
    return version


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kafka-quota-proxy", description=_DESCRIPTION, epilog=_EPILOG)
    p.add_argument("--version", action="version", version=f"%(prog)s {package_version()}",
                   help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the proxy with a configuration file")
    run.add_argument("--config", required=True, help="YAML configuration file")
    run.add_argument("--ready-file", help="write listening addresses here as JSON once serving")
    check = sub.add_parser("check-config", help="validate a configuration file and exit",
                           description="Validate a configuration file as a start would (its TLS files and "
                                       "secrets too) and list every error in it; exit 2 if there is one.")
    check.add_argument("file", help="YAML configuration file")
    demo = sub.add_parser("demo", help="start a local broker with the proxy in front and show it at work")
    demo.add_argument("--duration", type=float, default=None, help="seconds to keep running (default: until Ctrl-C)")
    demo.add_argument("--no-report", dest="report", action="store_false",
                      help="skip the PySpark report on generated usage (saves about a minute)")
    demo.add_argument("--verbose", action="store_true",
                      help="show the proxy's, the client libraries' and Spark's own logs too")
    demo.add_argument("--keep", action="store_true",
                      help="keep its files (usage log, sample usage, report) when it exits; it says where")
    from pipeline import generate, report

    report.add_arguments(sub.add_parser(
        "report", help="turn a usage log into demand tables, recommended quotas, a what-if replay and "
                       "an HTML report (PySpark)"))
    generate.add_arguments(sub.add_parser("generate-usage", help="write sample multi-tenant usage to try report on"))
    from proxy.app import quotas_cli

    quotas_cli.add_arguments(sub.add_parser(
        "quotas", help="describe, set, delete, apply or export a running proxy's quotas (quota_admin)"))
    for sp in (run, demo):
        sp.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="least severe log lines shown (info)")
        sp.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="log lines as text or as one JSON object each (text)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "check-config":
        return check_config(args.file)
    if args.command == "report":
        from pipeline.report import main as report_main

        return report_main(args)
    if args.command == "quotas":
        from proxy.app.quotas_cli import main as quotas_main

        return quotas_main(args)
    if args.command == "generate-usage":
        from pipeline.generate import main as generate_main

        return generate_main(args)
    if args.command == "demo":
        from proxy.app.demo import run_demo

        # The demo prints its own lines; the logs of everything it runs only with --verbose.
        logs.configure(args.log_level if args.verbose else "error", args.log_format)
        if not args.verbose:
            # kafka-python logs its own clients' shutdown at ERROR ("Metadata refresh: failed
            # Cancelled" when a client closes mid-refresh); the demo reports what they did itself.
            logging.getLogger("kafka").setLevel(logging.CRITICAL)
        return run_loop(run_demo(args.duration, args.report, verbose=args.verbose, keep=args.keep))
    logs.configure(args.log_level, args.log_format)
    try:
        loaded = read_config_file(args.config)  # read once: the watcher knows the bytes in force
    except ConfigError as exc:
        return _invalid(exc, args.config)
    from proxy.app.supervisor import supervise, worker_count

    if worker_count(loaded.config.workers.count) > 1:
        logs.configure(args.log_level, args.log_format, "supervisor")
        return run_loop(supervise(loaded, args.ready_file, args.log_level, args.log_format))
    try:
        return run_loop(serve(loaded.config, args.ready_file, loaded))
    except ConfigError as exc:  # a rate limiter refused its configuration at start
        return _invalid(exc, args.config)


def check_config(file: str) -> int:
    """``check-config``: every error of ``file`` on stderr (exit 2), or "ok" (exit 0). The file's
    TLS files and secrets are read as a start reads them."""
    try:
        config = load_config(file)
    except ConfigError as exc:
        return _invalid(exc, file)
    errors: list[ConfigError] = []
    if config.listen.tls is not None:
        try:
            server_tls(config.listen.tls)  # the files exist and load, the key matches, the rules parse
        except ConfigError as exc:
            errors.extend(exc.errors)
    try:
        BrokerDialer(config.upstream, ProxyStats())  # upstream.tls's files, upstream.sasl's secret
    except ConfigError as exc:
        errors.extend(exc.errors)
    if errors:
        return _invalid(one_error(errors), file)
    print(f"{file}: ok")
    return 0


def _invalid(exc: ConfigError, file: str) -> int:
    """Prints ``exc`` for an operator, always naming ``file``: one line (``FILE: YAML path:
    message``), or with several errors one line each under a line naming the file."""
    if len(exc.errors) == 1:
        # An error of the file as a whole (unreadable, not YAML) already names it.
        where = "" if Path(exc.path) == Path(file) else f"{file}: "
        print(f"invalid configuration: {where}{exc}", file=sys.stderr)
    else:
        print(f"invalid configuration: {len(exc.errors)} errors in {file}", file=sys.stderr)
        for error in exc.errors:
            print(f"  {error}", file=sys.stderr)
    return 2


def run_loop(coro: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


async def serve(config: Config, ready_file: str | None, loaded: ConfigFile | None = None) -> int:
    """Runs the proxy until SIGINT / SIGTERM; with ``loaded`` (the file ``config`` came from),
    changes of that file are applied (:class:`ConfigWatcher`) and SIGHUP reloads it; the TLS
    files are read again when they change and on SIGHUP (:class:`CertificateReloader`)."""
    from proxy.app.heap import freeze_start_up_heap, tune_malloc
    from proxy.app.server import ProxyServer

    tune_malloc()
    server = ProxyServer(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watching: list[asyncio.Task[None]] = []
    on_sighup: list[Callable[[], bool]] = []
    if loaded is not None:
        watcher = ConfigWatcher(server, loaded)
        on_sighup.append(watcher.reload_now)
        watching.append(loop.create_task(watch_config(watcher)))
    certificates = CertificateReloader(server, config.reload.debounce_ms / 1000)
    if certificates.files:
        on_sighup.append(certificates.reload_now)
        watching.append(loop.create_task(watch_certificates(certificates)))
    if on_sighup:
        loop.add_signal_handler(signal.SIGHUP, lambda: [reload() for reload in on_sighup])
    try:
        await server.start()
    except OSError as exc:
        log.error("cannot start: %s", exc)
        return 1
    freeze_start_up_heap()
    if ready_file:
        write_ready_file(ready_file, server)
    await stop.wait()
    log.info("stopping")
    for task in watching:
        task.cancel()
    await server.stop(drain_s=config.workers.drain_timeout_ms / 1000)
    return 0


class Listening(Protocol):
    bootstrap_address: tuple[str, int] | None
    metrics_address: tuple[str, int] | None


def write_ready_file(path: str, server: Listening, workers: list[int] | None = None) -> None:
    """Where ``server`` (a proxy, or a supervisor with the pids of its ``workers``) listens, as
    JSON in ``path``, written whole: a reader sees the old file or the new one, never half of
    one (a temporary file in the same directory, renamed over it)."""
    # bootstrap_address is set once start() returned.
    info: dict[str, Any] = {"pid": os.getpid(), "bootstrap": list(cast("tuple[str, int]", server.bootstrap_address))}
    info["metrics"] = list(server.metrics_address) if server.metrics_address else None
    if workers is not None:
        info["workers"] = workers
    tmp = Path(f"{path}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)
