"""``workers: N``: N worker processes (proxy.app.worker) behind the same listeners, and this
supervisor, which serves nothing itself but holds the host together.

What it guarantees:

- **One address.** The bootstrap port and every broker port are bound here first (SO_REUSEPORT,
  not listening: proxy.control.worker_hub.reserve_port), then by every worker, which accept on
  them each on its own event loop; the kernel spreads new connections over the workers.
- **Workers kept up.** A worker that exits, or whose heartbeat stops for
  ``workers.heartbeat_timeout_ms`` (it is killed), is started again: at once after a long life,
  after 0.5, 1, 2, 4 s when it keeps dying within ``QUICK_EXIT_S`` of its start; after
  ``MAX_QUICK_EXITS`` such exits in a row the supervisor stops every worker and exits 1. A killed
  worker loses only its own connections.
- **Signals.** SIGTERM or SIGINT: every worker drains (stops accepting, answers what is in flight
  for up to ``workers.drain_timeout_ms``) and stops, then the supervisor exits 0; a worker still
  running ``STOP_GRACE_S`` after that is killed. SIGHUP: the configuration file is read here once,
  checked as a start checks it (a rate limiter refusing its settings included), and only then
  its very bytes go to every worker, so a broken file is refused for all alike and never half
  applied; the TLS files are read again by each worker.
- **A true ready file.** With ``--ready-file``, once every worker serves, the file names the
  supervisor's pid, the addresses and the workers' pids; it is rewritten (whole: a reader never
  sees half of it) each time a worker is started again, so its ``workers`` are the pids running.
- **One view.** ``/metrics`` merges every worker's (proxy.observability.host_metrics) with this
  process's own (``kqp_workers``, restarts, connection admission); ``/healthz`` is ok while every
  worker is running and heartbeating; ``/readyz`` is ready when every worker is ready.
- **The host's limits and quotas**: connection admission, quota usage and the Admin API's memory
  store are shared through proxy.control.worker_hub.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from config.engines import quota_manager_for
from config.model import Config
from proxy.app.cli import write_ready_file
from proxy.app.server import close_limiter, rate_limiters_for
from proxy.control.reload_watch import ConfigFile, ConfigWatcher, watch_config
from proxy.control.worker_channel import Channel, ChannelError
from proxy.control.worker_hub import WorkerHub, WorkerState, reserve_port
from proxy.observability.host_metrics import merge_expositions
from proxy.observability.http import MetricsEndpoint

log = logging.getLogger(__name__)

QUICK_EXIT_S = 10.0  # a worker that exits sooner after its start did not get going
MAX_QUICK_EXITS = 5
SCRAPE_TIMEOUT_S = 5.0
RELOAD_TIMEOUT_S = 10.0
STOP_GRACE_S = 5.0


def worker_count(count: int) -> int:
    """``workers.count``, with 0 (``auto``) the number of cores this process may run on."""
    return count or len(os.sched_getaffinity(0))


def _monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


@dataclass
class Slot:
    worker_id: int
    process: asyncio.subprocess.Process | None = None
    started_at_s: float = 0.0
    quick_exits: int = 0
    restarts: int = 0
    state: WorkerState | None = None


class Supervisor:
    """See the module docstring."""

    def __init__(self, loaded: ConfigFile, log_level: str = "info", log_format: str = "text",
                 ready_file: str | None = None) -> None:
        self.loaded = loaded
        self.ready_file = ready_file
        self._ready_written = False  # written first once every worker serves, then kept true
        self.config = loaded.config
        self.count = worker_count(self.config.workers.count)
        self._log = (log_level, log_format)
        w = self.config.quota_windows
        window_ms = 1000 * max(w.quota_window_num * w.quota_window_size_seconds,
                               w.controller_quota_window_num * w.controller_quota_window_size_seconds)
        self.hub = WorkerHub(self.config, window_ms, _monotonic_ms)
        self.slots = [Slot(i) for i in range(self.count)]
        self.stopping = False
        self.gave_up = asyncio.Event()
        self.registry = CollectorRegistry()
        self.registry.register(_SupervisorCollector(self))
        self.bootstrap_address: tuple[str, int] | None = None
        self.metrics_address: tuple[str, int] | None = None
        self._bootstrap: socket.socket | None = None
        self._http: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._loading: ConfigFile | None = None

    # -- starting and stopping ------------------------------------------------------------

    async def start(self, wait_s: float = 60.0) -> None:
        """Binds the ports, starts every worker and waits (up to ``wait_s``) until each is
        serving. Raises OSError when a port cannot be bound."""
        listen = self.config.listen
        self._bootstrap = reserve_port(listen.host, listen.bootstrap_port)
        self.bootstrap_address = self._bootstrap.getsockname()[:2]
        if self.config.metrics.enabled:
            m = self.config.metrics
            endpoint = _HostMetricsEndpoint(self, m.max_entity_series)
            self._http = await endpoint.start_server(m.host, m.port)
            self.metrics_address = self._http.sockets[0].getsockname()[:2]
            log.info("metrics of %d workers on http://%s:%d/metrics", self.count, *self.metrics_address)
        for slot in self.slots:
            await self._spawn(slot)
        self._spawn_task(self._watch_heartbeats())
        deadline = time.monotonic() + wait_s
        while not all(s.state is not None and s.state.serving for s in self.slots) and time.monotonic() < deadline:
            if self.gave_up.is_set():
                return
            await asyncio.sleep(0.05)
        log.info("%d workers serving on %s:%d", self.count, *self.bootstrap_address)

    async def stop(self) -> None:
        """Every worker drains and stops (SIGTERM); one still running after the drain deadline
        and ``STOP_GRACE_S`` is killed."""
        self.stopping = True
        running = [s.process for s in self.slots if s.process is not None and s.process.returncode is None]
        for process in running:
            process.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(self.config.workers.drain_timeout_ms / 1000 + STOP_GRACE_S):
                await asyncio.gather(*(p.wait() for p in running))
        except TimeoutError:
            for process in running:
                if process.returncode is None:
                    log.error("worker pid %d did not stop in time: killed", process.pid)
                    process.kill()
            await asyncio.gather(*(p.wait() for p in running))
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._http is not None:
            self._http.close()
        self.hub.close()
        if self._bootstrap is not None:
            self._bootstrap.close()

    def worker_pids(self) -> list[int]:
        """The pid of each slot's latest worker process, in slot order."""
        return [s.process.pid for s in self.slots if s.process is not None]

    def write_ready_file(self) -> None:
        """Writes the ready file (when there is one) with the workers' pids now; after the first
        write, every worker restart calls it again."""
        if self.ready_file is None:
            return
        write_ready_file(self.ready_file, self, workers=self.worker_pids())
        self._ready_written = True

    def signal_workers(self, sig: int) -> None:
        for slot in self.slots:
            if slot.process is not None and slot.process.returncode is None:
                slot.process.send_signal(sig)

    # -- workers --------------------------------------------------------------------------

    async def _spawn(self, slot: Slot) -> None:
        assert self.bootstrap_address is not None
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        sync_parent, sync_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        level, fmt = self._log
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "proxy.app.worker", "--channel-fd", str(child.fileno()),
                "--sync-fd", str(sync_child.fileno()), "--log-level", level, "--log-format", fmt,
                pass_fds=(child.fileno(), sync_child.fileno()))
        finally:
            child.close()
            sync_child.close()
        slot.process = process
        slot.started_at_s = time.monotonic()
        channel = await Channel.over(parent)
        sync = await Channel.over(sync_parent)
        channel.send({"t": "start", "worker": slot.worker_id, "config": self.loaded.data.decode(),
                      "path": self.loaded.path, "bootstrap_port": self.bootstrap_address[1]})
        slot.state = self.hub.joined(slot.worker_id, channel)
        log.info("worker %d started (pid %d)", slot.worker_id, process.pid)
        self._spawn_task(self._serve(slot.state))
        self._spawn_task(self._serve_ports(sync))
        self._spawn_task(self._watch(slot, process))

    async def _serve(self, state: WorkerState) -> None:
        try:
            while (message := await state.channel.receive()) is not None:
                try:
                    self.hub.handle(state, message)
                except (KeyError, TypeError, ValueError) as exc:
                    log.error("worker %d sent a bad %s message: %r", state.worker_id, message.get("t"), exc)
        except ChannelError as exc:
            log.error("worker %d's channel broke: %s", state.worker_id, exc)

    async def _serve_ports(self, sync: Channel) -> None:
        try:
            while (message := await sync.receive()) is not None:
                sync.send(self.hub.port(int(message.get("node", -1)), int(message.get("port", 0))))
        except (ChannelError, TypeError, ValueError) as exc:
            log.error("a worker's port request broke its channel: %s", exc)
        sync.close()

    async def _watch(self, slot: Slot, process: asyncio.subprocess.Process) -> None:
        code = await process.wait()
        self.hub.gone(slot.worker_id)
        slot.state = None
        if self.stopping:
            return
        lived_s = time.monotonic() - slot.started_at_s
        slot.quick_exits = slot.quick_exits + 1 if lived_s < QUICK_EXIT_S else 0
        how = f"killed by signal {-code}" if code < 0 else f"exited with {code}"
        if slot.quick_exits >= MAX_QUICK_EXITS:
            log.error("worker %d %s, %d times in a row within %g s of its start: giving up, stopping every "
                      "worker", slot.worker_id, how, slot.quick_exits, QUICK_EXIT_S)
            self.gave_up.set()
            return
        log.error("worker %d (pid %d) %s after %.1f s: starting it again", slot.worker_id, process.pid, how,
                  lived_s)
        await self._restart(slot)

    async def _restart(self, slot: Slot) -> None:
        """Starts ``slot``'s worker again, after the back-off its quick exits earned; a start
        that fails (no process could be made) counts as a quick exit."""
        while not self.stopping:
            if slot.quick_exits:
                await asyncio.sleep(0.5 * 2 ** (slot.quick_exits - 1))
            if self.stopping:
                return
            try:
                await self._spawn(slot)
            except OSError as exc:
                slot.quick_exits += 1
                log.error("worker %d could not be started: %s", slot.worker_id, exc)
                if slot.quick_exits >= MAX_QUICK_EXITS:
                    self.gave_up.set()
                    return
                continue
            slot.restarts += 1
            if self._ready_written:  # its pid changed: the file must not name a dead worker
                try:
                    self.write_ready_file()
                except OSError as exc:  # the worker serves all the same
                    log.error("ready file %s not rewritten: %s", self.ready_file, exc)
            return

    async def _watch_heartbeats(self) -> None:
        timeout_ms = self.config.workers.heartbeat_timeout_ms
        while True:
            await asyncio.sleep(0.5)
            now = _monotonic_ms()
            for slot in self.slots:
                state, process = slot.state, slot.process
                if state is None or process is None or process.returncode is not None:
                    continue
                if now - state.last_beat_ms > timeout_ms:
                    log.error("worker %d (pid %d) sent no heartbeat for %d ms: killing it", slot.worker_id,
                              process.pid, now - state.last_beat_ms)
                    state.last_beat_ms = now  # killed once; its exit restarts it
                    process.kill()

    def _spawn_task(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- reload (a ConfigWatcher's server) ------------------------------------------------

    def reload(self, config: Config) -> None:
        """Checks ``config`` as a worker would apply it (ConfigError: refused, for every worker),
        then sends the file's bytes to each."""
        loaded = self._loading
        assert loaded is not None and loaded.config is config
        for limiter in rate_limiters_for(config, quota_manager_for(config)):  # a refusal raises
            close_limiter(limiter)
        self.loaded = loaded
        self.config = config
        self._spawn_task(self._send_reload(loaded))

    async def _send_reload(self, loaded: ConfigFile) -> None:
        answers = await self.hub.ask_all({"t": "reload", "config": loaded.data.decode()}, RELOAD_TIMEOUT_S)
        for worker_id, answer in sorted(answers.items()):
            if answer is None or not answer.get("ok"):
                log.error("worker %d did not apply the reload: %s", worker_id,
                          "no answer" if answer is None else answer.get("error"))
        log.info("reload of %s sent to %d workers", loaded.path, len(answers))

    # -- health ---------------------------------------------------------------------------

    def health(self) -> tuple[bool, str]:
        lines = []
        ok = True
        for slot in self.slots:
            running = (slot.state is not None and slot.state.serving and slot.process is not None
                       and slot.process.returncode is None)
            ok = ok and running
            pid = slot.process.pid if slot.process is not None else "-"
            lines.append(f"worker {slot.worker_id} (pid {pid}): {'running' if running else 'not running'}")
        return ok, ("ok" if ok else "not serving") + f"; {self.count} workers; " + "; ".join(lines)

    def ready(self) -> tuple[bool, str]:
        ok = True
        lines = []
        for slot in self.slots:
            state = slot.state
            ready = state is not None and state.ready
            ok = ok and ready
            lines.append(f"worker {slot.worker_id}: {state.detail if state is not None else 'not running'}")
        return ok, ("ready" if ok else "not ready") + f"; {self.count} workers; " + "; ".join(lines)


class HostConfigWatcher(ConfigWatcher):
    """The supervisor's watcher: the file read once here, its bytes what every worker gets."""

    server: Supervisor

    def _apply(self, loaded: ConfigFile) -> bool:
        self.server._loading = loaded
        try:
            return super()._apply(loaded)
        finally:
            self.server._loading = None


class _HostMetricsEndpoint(MetricsEndpoint):
    def __init__(self, supervisor: Supervisor, max_entity_series: int) -> None:
        super().__init__(supervisor.registry, supervisor.health, supervisor.ready, max_entity_series)
        self._supervisor = supervisor

    async def render(self) -> bytes:
        own = await super().render()
        answers = await self._supervisor.hub.ask_all({"t": "scrape"}, SCRAPE_TIMEOUT_S)
        texts = [str(a["text"]) for _, a in sorted(answers.items()) if a is not None and "text" in a]
        return merge_expositions([own, *texts])


class _SupervisorCollector:
    def __init__(self, supervisor: Supervisor) -> None:
        self._s = supervisor

    def collect(self) -> Iterator[Metric]:
        s = self._s
        yield GaugeMetricFamily("kqp_workers", "Worker processes configured", value=s.count)
        yield GaugeMetricFamily("kqp_workers_running", "Worker processes running and heartbeating",
                                value=sum(1 for slot in s.slots if slot.state is not None and slot.state.serving))
        yield CounterMetricFamily("kqp_worker_restarts", "Workers started again after they exited or hung",
                                  value=sum(slot.restarts for slot in s.slots))
        yield GaugeMetricFamily("kqp_connection_quota_ips", "IPs with connections open or a creation rate "
                                "tracked", value=s.hub.admission.tracked_ips)


async def supervise(loaded: ConfigFile, ready_file: str | None, log_level: str, log_format: str) -> int:
    """Runs a host of workers until SIGTERM or SIGINT (exit 0) or until they cannot be kept up
    (exit 1); changes of the configuration file are applied, SIGHUP reloads it."""
    supervisor = Supervisor(loaded, log_level, log_format, ready_file)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watcher = HostConfigWatcher(supervisor, loaded)

    def sighup() -> None:
        watcher.reload_now()
        supervisor.signal_workers(signal.SIGHUP)  # the TLS files

    loop.add_signal_handler(signal.SIGHUP, sighup)
    try:
        await supervisor.start()
    except OSError as exc:
        log.error("cannot start: %s", exc)
        await supervisor.stop()
        return 1
    watching = loop.create_task(watch_config(watcher))
    if not supervisor.gave_up.is_set():
        supervisor.write_ready_file()
    gave_up = loop.create_task(supervisor.gave_up.wait())
    stopped = loop.create_task(stop.wait())
    await asyncio.wait([gave_up, stopped], return_when=asyncio.FIRST_COMPLETED)
    log.info("stopping %d workers", supervisor.count)
    watching.cancel()
    gave_up.cancel()
    stopped.cancel()
    await supervisor.stop()
    return 1 if supervisor.gave_up.is_set() else 0

