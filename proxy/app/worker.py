"""One worker of a host of workers (``workers: N``): a :class:`ProxyServer` started by the
supervisor (proxy.app.supervisor) with the configuration the supervisor has in force, on the
ports the supervisor holds, answering its requests (metrics, reload, quotas) over the channel.

Signals: SIGTERM drains (nothing new accepted; responses owed are sent for up to
``workers.drain_timeout_ms``) and stops; SIGHUP reads the TLS files again (the configuration
file is the supervisor's to read: every worker gets the same bytes); SIGINT is left to the
supervisor, which a terminal's Ctrl-C reaches too. A worker whose supervisor is gone stops.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from dataclasses import replace

from config import ConfigError
from config.loader import parse_config, yaml_document
from config.model import Config
from proxy.app.heap import freeze_start_up_heap, tune_malloc
from proxy.app.server import ProxyServer
from proxy.control.cert_reload import CertificateReloader, watch_certificates
from proxy.control.quota_store import OverlayStore
from proxy.control.worker_channel import Channel, ChannelError, Message
from proxy.control.worker_link import PORT_TIMEOUT_S, WorkerLink, changes_from_json
from proxy.dataplane.filters.quotas import now_ms
from proxy.observability import logs
from proxy.observability.http import MetricsEndpoint

log = logging.getLogger(__name__)


def worker_config(path: str, text: str, bootstrap_port: int) -> Config:
    """The supervisor's configuration, on the bootstrap port it holds. Raises ConfigError."""
    config = parse_config(yaml_document(path, text.encode()))
    return replace(config, listen=replace(config.listen, bootstrap_port=bootstrap_port))


async def run_worker(channel_fd: int, sync_fd: int, log_level: str, log_format: str) -> int:
    channel = await Channel.over(socket.socket(fileno=channel_fd))
    sync = socket.socket(fileno=sync_fd)
    sync.settimeout(PORT_TIMEOUT_S)
    try:
        start = await channel.receive()
    except ChannelError as exc:
        log.error("the supervisor's first message is not one: %s", exc)
        return 2
    if start is None or start["t"] != "start":
        log.error("the supervisor sent no start message")
        return 2
    worker_id = int(start["worker"])
    logs.configure(log_level, log_format, str(worker_id))
    try:
        config = worker_config(str(start["path"]), str(start["config"]), int(start["bootstrap_port"]))
    except ConfigError as exc:
        log.error("invalid configuration: %s", exc)
        return 2
    link = WorkerLink(worker_id, channel, sync, config.workers.sync_interval_ms, now_ms)
    tune_malloc()
    server = ProxyServer(config, worker=link)
    stop = asyncio.Event()
    link.on_lost = stop.set
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, lambda: None)
    certificates = CertificateReloader(server, config.reload.debounce_ms / 1000)
    watching = []
    if certificates.files:
        loop.add_signal_handler(signal.SIGHUP, certificates.reload_now)
        watching.append(loop.create_task(watch_certificates(certificates)))
    else:
        loop.add_signal_handler(signal.SIGHUP, lambda: None)
    _answer(link, server, str(start["path"]))
    link.start()  # heartbeats while the server starts (reading the quota topic may take a while)
    try:
        await server.start()
    except OSError as exc:
        log.error("cannot start: %s", exc)
        await link.stop()
        return 1
    freeze_start_up_heap()
    link.readiness = server.ready  # from now on the heartbeats say "serving"
    log.info("worker %d serving (pid %d)", worker_id, os.getpid())
    await stop.wait()
    log.info("stopping: draining connections")
    for task in watching:
        task.cancel()
    await server.stop(drain_s=config.workers.drain_timeout_ms / 1000)
    await link.stop()
    channel.close()
    return 0


def _answer(link: WorkerLink, server: ProxyServer, path: str) -> None:
    """What this worker answers the supervisor."""
    endpoint = MetricsEndpoint(server.registry, server.health, server.ready, server.config.metrics.max_entity_series)

    async def scrape(_: Message) -> Message:
        return {"text": (await endpoint.render()).decode()}

    async def reload(message: Message) -> Message:
        try:
            config = parse_config(yaml_document(path, str(message["config"]).encode()))
            server.reload(config)
        except ConfigError as exc:
            log.error("reload of %s rejected, the previous configuration stays in force: %s", path, exc)
            return {"ok": False, "error": str(exc)}
        return {"ok": True}

    async def quotas(message: Message) -> None:
        changes = changes_from_json(message["changes"])
        if isinstance(server.quota_store, OverlayStore):  # the topic store shares through its topic
            server.quota_store.apply(changes)
        server.quota_store_changed()

    link.handlers.update(scrape=scrape, reload=reload, quotas=quotas)


def main(argv: list[str] | None = None) -> int:
    """``python -m proxy.app.worker``: how the supervisor starts a worker (not for use by hand)."""
    import argparse

    from proxy.app.cli import run_loop

    p = argparse.ArgumentParser(prog="python -m proxy.app.worker", description="one worker of a proxy's "
                                "supervisor (workers: N); started by the supervisor, not by hand")
    p.add_argument("--channel-fd", type=int, required=True)
    p.add_argument("--sync-fd", type=int, required=True)
    p.add_argument("--log-level", default="info")
    p.add_argument("--log-format", default="text")
    args = p.parse_args(argv)
    logs.configure(args.log_level, args.log_format, "?")  # until the start message names this worker
    return run_loop(run_worker(args.channel_fd, args.sync_fd, args.log_level, args.log_format))


if __name__ == "__main__":
    raise SystemExit(main())
