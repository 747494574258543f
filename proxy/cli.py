"""``kafka-quota-proxy``: run, check-config, demo, report, generate-usage, quotas."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import NamedTuple

import yaml

from config import ConfigError, load_config, parse_config
from config.model import Config

from . import logs
from .cert_reload import CertificateReloader, watch_certificates
from .dialer import BrokerDialer
from .file_signature import Signature, signature
from .stats import ProxyStats
from .tls import server_tls

log = logging.getLogger(__name__)


_DESCRIPTION = ("A Kafka-protocol proxy that enforces Kafka's quotas in front of any Kafka cluster. "
                "Every subcommand has its own --help.")
_EPILOG = ("After make, run it as .venv/bin/kafka-quota-proxy, or activate the venv first (source "
           ".venv/bin/activate). config/example.yaml is a configuration to start from.")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kafka-quota-proxy", description=_DESCRIPTION, epilog=_EPILOG)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the proxy with a configuration file")
    run.add_argument("--config", required=True, help="YAML configuration file")
    run.add_argument("--ready-file", help="write listening addresses here as JSON once serving")
    check = sub.add_parser("check-config", help="validate a configuration file and exit")
    check.add_argument("file")
    demo = sub.add_parser("demo", help="start a local broker with the proxy in front and show it at work")
    demo.add_argument("--duration", type=float, default=None, help="seconds to keep running (default: until Ctrl-C)")
    demo.add_argument("--no-report", dest="report", action="store_false",
                      help="skip the PySpark report on generated usage (saves about a minute)")
    demo.add_argument("--verbose", action="store_true",
                      help="show the proxy's, the client libraries' and Spark's own logs too")
    from pipeline import generate, report

    report.add_arguments(sub.add_parser(
        "report", help="turn a usage log into demand tables, recommended quotas, a what-if replay and "
                       "an HTML report (PySpark)"))
    generate.add_arguments(sub.add_parser("generate-usage", help="write sample multi-tenant usage to try report on"))
    from . import quotas_cli

    quotas_cli.add_arguments(sub.add_parser(
        "quotas", help="describe, set, delete, apply or export a running proxy's quotas (quota_admin)"))
    for sp in (run, demo):
        sp.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
        sp.add_argument("--log-format", default="text", choices=["text", "json"])
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "check-config":
        try:
            config = load_config(args.file)
            if config.listen.tls is not None:
                server_tls(config.listen.tls)  # the files exist and load, the key matches, the rules parse
            BrokerDialer(config.upstream, ProxyStats())  # upstream.tls's files, upstream.sasl's secret
        except ConfigError as exc:
            print(f"invalid configuration: {exc}", file=sys.stderr)
            return 2
        print(f"{args.file}: ok")
        return 0
    if args.command == "report":
        from pipeline.report import main as report_main

        return report_main(args)
    if args.command == "quotas":
        from .quotas_cli import main as quotas_main

        return quotas_main(args)
    if args.command == "generate-usage":
        from pipeline.generate import main as generate_main

        return generate_main(args)
    if args.command == "demo":
        from .demo import run_demo

        # The demo prints its own lines; the logs of everything it runs only with --verbose.
        logs.configure(args.log_level if args.verbose else "error", args.log_format)
        if not args.verbose:
            # kafka-python logs its own clients' shutdown at ERROR ("Metadata refresh: failed
            # Cancelled" when a client closes mid-refresh); the demo reports what they did itself.
            logging.getLogger("kafka").setLevel(logging.CRITICAL)
        return _run(run_demo(args.duration, args.report, verbose=args.verbose))
    logs.configure(args.log_level, args.log_format)
    try:
        loaded = read_config_file(args.config)  # read once: the watcher knows the bytes in force
    except ConfigError as exc:
        print(f"invalid configuration: {exc}", file=sys.stderr)
        return 2
    try:
        return _run(serve(loaded.config, args.ready_file, loaded))
    except ConfigError as exc:  # a rate limiter refused its configuration at start
        print(f"invalid configuration: {exc}", file=sys.stderr)
        return 2


def _run(coro) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


class ConfigFile(NamedTuple):
    """The configuration file as read once: the configuration, the file's signature just before
    the read (a later write changes it), and the SHA-256 of exactly the bytes parsed."""

    path: str
    config: Config
    signature: Signature | None
    digest: str


def read_config_file(path: str) -> ConfigFile:
    """Reads ``path`` once and parses those bytes. Raises ConfigError naming the YAML path."""
    before = signature(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(path, f"cannot read: {exc.strerror}") from exc
    return ConfigFile(path, parse_config_bytes(path, data), before, hashlib.sha256(data).hexdigest())


def parse_config_bytes(path: str, data: bytes) -> Config:
    """What ``config.load_config`` does with the text it reads, for bytes already read."""
    try:
        return parse_config(yaml.safe_load(data.decode("utf-8")))
    except UnicodeDecodeError as exc:
        raise ConfigError(path, f"not UTF-8: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(path, f"not valid YAML: {exc}") from exc


class ConfigWatcher:
    """Applies changes of the configuration file to a running ``server`` (``server.reload``).

    Guarantees, for changes seen by polling (:meth:`poll_at`):

    * the file is read only after its signature (device, inode, mtime, size) has stayed the same
      for ``reload.debounce_ms`` and again after the read: a file being written in place is not
      read half-written, unless its writer pauses for longer than that;
    * it is read once per change, and applied only when those bytes differ from the ones in force;
    * a missing file is waited for (logged once per disappearance), never applied as empty;
    * with ``reload.require_atomic_rename``, only a file replaced by a rename (a new inode) is
      applied; a change written in place is logged at WARNING and left for SIGHUP;
    * a change that would remove every quota entry is refused with a WARNING: that is what a file
      cut short before ``quotas:`` looks like; SIGHUP applies it if it is meant.

    SIGHUP (:meth:`reload_now`) reads and applies the file at once, none of the above asked. An
    invalid file is logged and leaves the configuration in force. The ``reload:`` settings are
    the ones read at start; a reload does not change them.
    """

    IDLE_POLL_S = 1.0
    MIN_POLL_S = 0.05

    def __init__(self, server, loaded: ConfigFile) -> None:
        self.server = server
        self.path = loaded.path
        settings = loaded.config.reload
        self.debounce_s = settings.debounce_ms / 1000
        self.require_atomic_rename = settings.require_atomic_rename
        self._seen = loaded.signature  # the last signature acted on (None: the file was gone)
        self._digest = loaded.digest  # of the bytes whose configuration is in force
        self._settling: tuple[Signature, float] | None = None  # a change: its signature, seen since
        self._missing = False

    @property
    def poll_interval_s(self) -> float:
        """Seconds to the next poll: shorter while a change settles, so that the debounce, not
        the polling, sets how soon a finished write is applied."""
        if self._settling is None:
            return self.IDLE_POLL_S
        return max(self.debounce_s / 4, self.MIN_POLL_S)

    def poll_at(self, now_s: float) -> bool:
        """One look at the file at monotonic ``now_s``; True when a change was applied."""
        current = signature(self.path)
        if current is None:
            self._on_missing()
            return False
        self._missing = False
        if current == self._seen:
            self._settling = None
            return False
        if self._settling is None or self._settling[0] != current:
            self._settling = (current, now_s)  # a new change, or the same one still being written
        if now_s - self._settling[1] < self.debounce_s:
            return False
        self._settling = None
        previous, self._seen = self._seen, current
        if self.require_atomic_rename and previous is not None and _same_inode(previous, current):
            log.warning("%s written in place; reload.require_atomic_rename is on: send SIGHUP to apply", self.path)
            return False
        return self._apply_stable(current)

    def reload_now(self) -> bool:
        """SIGHUP: reads and applies the file at once, whatever changed (the operator asked)."""
        log.info("SIGHUP: reloading %s", self.path)
        self._settling = None
        try:
            loaded = read_config_file(self.path)
        except ConfigError as exc:
            return self._rejected(exc)
        self._seen = loaded.signature
        return self._apply(loaded)

    def _on_missing(self) -> None:
        if not self._missing:
            log.warning("%s is gone; waiting for it to come back, the configuration in force stays", self.path)
        self._missing = True
        self._seen = self._settling = None  # whatever comes back is a change

    def _apply_stable(self, current: Signature) -> bool:
        try:
            loaded = read_config_file(self.path)
        except ConfigError as exc:
            if signature(self.path) != current:
                return False  # written again while read: the next polls settle the new change
            return self._rejected(exc)
        if loaded.signature != current or signature(self.path) != current:
            return False  # written again meanwhile: the next polls settle the new change
        if loaded.digest == self._digest:
            log.info("%s changed on disk but holds the configuration in force: nothing to reload", self.path)
            return False
        if self.server.config.quotas and not loaded.config.quotas:
            log.warning("reload of %s refused: it removes all %d quota entries, as a file cut short before "
                        "quotas: would; send SIGHUP to apply it", self.path, len(self.server.config.quotas))
            return False
        return self._apply(loaded)

    def _apply(self, loaded: ConfigFile) -> bool:
        try:
            self.server.reload(loaded.config)
        except ConfigError as exc:
            return self._rejected(exc)
        self._digest = loaded.digest
        return True

    def _rejected(self, exc: ConfigError) -> bool:
        log.error("reload of %s rejected, the previous configuration stays in force: %s", self.path, exc)
        return False


def _same_inode(a: Signature, b: Signature) -> bool:
    """True when the path still names the same file: written in place, not replaced by a rename."""
    return (a.device, a.inode) == (b.device, b.inode)


async def watch_config(watcher: ConfigWatcher, clock=time.monotonic) -> None:
    """Polls the file for ever (no inotify needed): every second, faster while a change settles."""
    while True:
        await asyncio.sleep(watcher.poll_interval_s)
        try:
            watcher.poll_at(clock())
        except Exception:  # one failed reload must not end the watching for the proxy's lifetime
            log.exception("reload of %s failed; still watching it", watcher.path)


async def serve(config, ready_file: str | None, loaded: ConfigFile | None = None) -> int:
    """Runs the proxy until SIGINT / SIGTERM; with ``loaded`` (the file ``config`` came from),
    changes of that file are applied (:class:`ConfigWatcher`) and SIGHUP reloads it; the TLS
    files are read again when they change and on SIGHUP (:class:`CertificateReloader`)."""
    from .server import ProxyServer

    server = ProxyServer(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watching: list[asyncio.Task] = []
    on_sighup = []
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
    if ready_file:
        write_ready_file(ready_file, server)
    await stop.wait()
    log.info("stopping")
    for task in watching:
        task.cancel()
    await server.stop()
    return 0


def write_ready_file(path: str, server) -> None:
    info = {"pid": os.getpid(), "bootstrap": list(server.bootstrap_address)}
    info["metrics"] = list(server.metrics_address) if server.metrics_address else None
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(path)
