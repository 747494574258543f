"""The supervisor's side of its workers' lines: what the host shares (proxy.control.worker_link).

Guarantees:

- **One admission for the host.** One :class:`ConnectionQuotas` (Kafka's) decides every new
  client connection of every worker; what a worker admitted is released when it says so, and all
  of it when the worker is gone (a killed worker's connections died with it).
- **Usage reaches every other worker**, with the number of live workers (the quota engines pace
  bursts by it, as the fleet's members). The usage of the last quota window is kept (at most
  ``MAX_REPLAY_ENTRIES`` entries) and handed to a worker that starts, so a replacement starts
  from the host's recent usage, as a fleet member reads the topic from ``now − window``.
- **Quotas set through the Admin API** (``quota_admin.store: memory``) reach every other
  worker, and a worker that starts gets them all: any worker answers a describe alike.
- **Broker ports** are bound here (without listening, ``SO_REUSEPORT``) before any worker serves
  them: every worker serves a broker on the same port, and the port stays the host's while its
  workers come and go.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from config.engines import connection_limits_for
from config.model import Config
from proxy.control.worker_channel import Channel, Message
from quotas.connections import ConnectionQuotas

log = logging.getLogger(__name__)

MAX_REPLAY_ENTRIES = 500_000


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (0: the OS picks) with SO_REUSEPORT, not listening: it
    holds the port for workers that bind it too and listen. Raises OSError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


@dataclass
class WorkerState:
    worker_id: int
    channel: Channel
    last_beat_ms: int
    serving: bool = False  # its listeners are up (said by its heartbeats)
    ready: bool = False
    detail: str = "starting"
    admitted: Counter[str] = field(default_factory=Counter)  # ip -> connections open


class WorkerHub:
    """See the module docstring. ``clock``: monotonic milliseconds."""

    def __init__(self, config: Config, window_ms: int, clock: Callable[[], int]) -> None:
        self._config = config
        self._window_ms = window_ms
        self._clock = clock
        self.workers: dict[int, WorkerState] = {}
        self.admission = ConnectionQuotas(connection_limits_for(config.connections, config.quota_windows))
        self._replay: deque[tuple[int, list[Any]]] = deque()
        self._replay_entries = 0
        self._quotas: dict[tuple[tuple[tuple[str, Any], ...], str], Any] = {}  # (entity, key) -> new value
        self._ports: dict[int, socket.socket] = {}  # node id -> the reserved socket
        self._ids = itertools.count(1)
        self._answers: dict[int, asyncio.Future[Message]] = {}

    # -- workers coming and going ---------------------------------------------------------

    def joined(self, worker_id: int, channel: Channel) -> WorkerState:
        state = self.workers[worker_id] = WorkerState(worker_id, channel, self._clock())
        self._expire_replay()
        for _, entries in self._replay:
            channel.send({"t": "usage", "entries": entries})
        if self._quotas:
            channel.send({"t": "quotas", "changes": [[list(map(list, e)), k, None, v]
                                                     for (e, k), v in self._quotas.items()]})
        self._announce_members()
        return state

    def gone(self, worker_id: int) -> None:
        state = self.workers.pop(worker_id, None)
        if state is None:
            return
        state.channel.close()
        for ip, n in state.admitted.items():
            for _ in range(n):
                self.admission.release(ip)
        self._announce_members()

    def _announce_members(self) -> None:
        for state in self.workers.values():
            state.channel.send({"t": "members", "members": len(self.workers)})

    # -- messages -------------------------------------------------------------------------

    def handle(self, state: WorkerState, message: Message) -> None:
        """One message from ``state``'s worker. Raises KeyError, TypeError or ValueError for a
        malformed one (the caller logs it and goes on)."""
        kind = message["t"]
        if kind == "beat":
            state.last_beat_ms = self._clock()
            state.serving = bool(message.get("serving", True))
            if "ready" in message:
                state.ready = bool(message["ready"])
                state.detail = str(message.get("detail", ""))
        elif kind == "admit":
            self._admit(state, str(message["ip"]), int(message["id"]))
        elif kind == "release":
            ip = str(message["ip"])
            if state.admitted[ip] > 0:
                state.admitted[ip] -= 1
                if not state.admitted[ip]:
                    del state.admitted[ip]
                self.admission.release(ip)
        elif kind == "usage":
            entries = list(message["entries"])
            self._remember(entries)
            self._to_others(state, {"t": "usage", "entries": entries, "members": len(self.workers)})
        elif kind == "quotas":
            for parts, key, _, new in message["changes"]:
                self._quotas[(tuple((str(t), n) for t, n in parts), str(key))] = new
            self._to_others(state, {"t": "quotas", "changes": message["changes"]})
        elif kind == "answer":
            future = self._answers.pop(int(message["id"]), None)
            if future is not None and not future.done():
                future.set_result(message)
        else:
            raise ValueError(f"unknown message type {kind!r}")

    def _admit(self, state: WorkerState, ip: str, request_id: int) -> None:
        admission = self.admission.admit_at(ip, self._clock())
        if admission.accepted:  # a refusal is counted by the worker that closes the connection
            state.admitted[ip] += 1
        state.channel.send({"t": "admitted", "id": request_id, "ip": ip, "verdict": admission.verdict,
                            "delay_ms": admission.delay_ms})

    def _to_others(self, sender: WorkerState, message: Message) -> None:
        for state in self.workers.values():
            if state is not sender:
                state.channel.send(message)

    def _remember(self, entries: list[Any]) -> None:
        self._replay.append((self._clock(), entries))
        self._replay_entries += len(entries)
        self._expire_replay()

    def _expire_replay(self) -> None:
        oldest = self._clock() - self._window_ms
        while self._replay and (self._replay[0][0] < oldest or self._replay_entries > MAX_REPLAY_ENTRIES):
            self._replay_entries -= len(self._replay.popleft()[1])

    # -- asking workers -------------------------------------------------------------------

    async def ask(self, worker_id: int, message: Message, timeout_s: float) -> Message | None:
        """``message`` to one worker and its answer; None when it gave none in ``timeout_s``."""
        state = self.workers.get(worker_id)
        if state is None:
            return None
        request_id = next(self._ids)
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._answers[request_id] = future
        try:
            if not state.channel.send({**message, "id": request_id}):
                return None
            async with asyncio.timeout(timeout_s):
                return await future
        except TimeoutError:
            return None
        finally:
            self._answers.pop(request_id, None)

    async def ask_all(self, message: Message, timeout_s: float) -> dict[int, Message | None]:
        ids = sorted(self.workers)
        answers = await asyncio.gather(*(self.ask(i, message, timeout_s) for i in ids))
        return dict(zip(ids, answers))

    # -- broker ports ---------------------------------------------------------------------

    def port(self, node_id: int, wanted: int) -> Message:
        """The port broker ``node_id`` is served on, reserved here; ``wanted`` 0: the OS picks."""
        sock = self._ports.get(node_id)
        if sock is None:
            try:
                sock = self._ports[node_id] = reserve_port(self._config.listen.host, wanted)
            except OSError as exc:
                log.error("cannot reserve port %d for broker %d: %s", wanted, node_id, exc)
                return {"t": "port", "error": str(exc)}
        port: int = sock.getsockname()[1]
        return {"t": "port", "port": port}

    def close(self) -> None:
        for sock in self._ports.values():
            sock.close()
        self._ports.clear()
