"""A worker's side of the line to its supervisor (``workers:``, proxy.app.supervisor).

What travels on it, and what it guarantees:

- **Usage, with the fleet's semantics.** Every ``workers.sync_interval_ms`` the worker hands
  what it charged each quota entity (``QuotaManager.take_local_usage``, and the KIP-936
  producer-id tokens) to the supervisor, which passes it to every other worker; each adds its
  siblings' usage to the same samples as its own (``add_remote``), so a principal with
  connections on every worker is held to one quota, throttled by Kafka's formulas on the host's
  rate. With ``fleet:`` on, the fleet's topic carries the usage instead (each worker is a member).
- **Connection admission for the host.** Each new client connection is admitted by the
  supervisor's one ``ConnectionQuotas`` (``max_connections``, per-IP counts and creation rates
  hold for the host); an answer that does not come within ``ADMIT_TIMEOUT_S`` raises
  TimeoutError (the caller decides alone), and an answer to a request given up on is released.
- **Broker ports.** The port serving a broker is the supervisor's to choose (the same for every
  worker; it keeps the port bound while workers come and go): asked once per broker, blocking.
- **Liveness.** A heartbeat every second from the event loop: a loop stuck for
  ``workers.heartbeat_timeout_ms`` gets the worker replaced.
- Requests of the supervisor (``scrape``, ``check``, ``reload``, ``quotas``) go to the handlers
  the worker registered; their answers go back with the request's id.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from config.model import HEARTBEAT_INTERVAL_MS
from proxy.control.quota_store import FileKeys, OverlayStore
from proxy.control.worker_channel import Channel, ChannelError, Message, blocking_request
from quotas.client_quota_admin import QuotaChange, QuotaEntity
from quotas.common import PRODUCER_IDS_RATE
from quotas.connections import Admission
from quotas.manager import QuotaManager
from quotas.producer_ids import ProducerIdQuotaManager

log = logging.getLogger(__name__)

ADMIT_TIMEOUT_S = 2.0
PORT_TIMEOUT_S = 2.0

Handler = Callable[[Message], Awaitable[Message | None]]


def changes_to_json(changes: Iterable[QuotaChange]) -> list[list[Any]]:
    return [[[list(p) for p in c.entity.parts], c.key, c.old, c.new] for c in changes]


def changes_from_json(data: Any) -> list[QuotaChange]:
    """Raises ValueError (or TypeError) for anything that is not a list of changes."""
    out = []
    for parts, key, old, new in data:
        entity = QuotaEntity(tuple((str(t), None if n is None else str(n)) for t, n in parts))
        out.append(QuotaChange(entity, str(key), None if old is None else float(old),
                               None if new is None else float(new)))
    return out


class WorkerLink:
    """See the module docstring. ``manager`` None: the usage is not exchanged here (the fleet's
    topic carries it)."""

    def __init__(self, worker_id: int, channel: Channel, sync_sock: socket.socket | None,
                 sync_interval_ms: int, clock: Callable[[], int]) -> None:
        self.worker_id = worker_id
        self.channel = channel
        self._sync_sock = sync_sock
        self._sync_interval_ms = sync_interval_ms
        self._clock = clock
        self._manager: QuotaManager | None = None
        self._producer_ids: ProducerIdQuotaManager | None = None
        self._ids = itertools.count(1)
        self._admissions: dict[int, asyncio.Future[Admission]] = {}
        self.handlers: dict[str, Handler] = {}
        self.on_lost: Callable[[], None] = lambda: None
        # What each heartbeat reports: None until the worker serves (its loop turns while it starts).
        self.readiness: Callable[[], tuple[bool, str]] | None = None
        self.members = 1
        self.remote_applied = 0
        self._tasks: list[asyncio.Task[None]] = []

    def share_usage(self, manager: QuotaManager, producer_ids: ProducerIdQuotaManager | None) -> None:
        self._manager = manager
        self._producer_ids = producer_ids
        manager.set_fleet(self.members, self._sync_interval_ms)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._receive()), loop.create_task(self._beat())]
        if self._manager is not None:
            self._tasks.append(loop.create_task(self._publish()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def send(self, message: Message) -> None:
        self.channel.send(message)

    # -- admission ------------------------------------------------------------------------

    async def admit(self, ip: str) -> Admission:
        """The host's verdict on a new connection from ``ip``; TimeoutError without one."""
        request_id = next(self._ids)
        future: asyncio.Future[Admission] = asyncio.get_running_loop().create_future()
        self._admissions[request_id] = future
        try:
            if not self.channel.send({"t": "admit", "id": request_id, "ip": ip}):
                raise TimeoutError("the supervisor's channel is closed")
            async with asyncio.timeout(ADMIT_TIMEOUT_S):
                return await future
        finally:
            self._admissions.pop(request_id, None)

    def release(self, ip: str) -> None:
        self.channel.send({"t": "release", "ip": ip})

    def _admitted(self, message: Message) -> None:
        admission = Admission(str(message["verdict"]), int(message.get("delay_ms", 0)))
        future = self._admissions.pop(int(message["id"]), None)
        if future is not None and not future.done():
            future.set_result(admission)
        elif admission.accepted:
            self.release(str(message.get("ip", "")))  # given up on (timed out, or the client left)

    # -- broker ports ---------------------------------------------------------------------

    def broker_port(self, node_id: int, wanted: int) -> int | None:
        """The port every worker serves broker ``node_id`` on (``wanted``, or one the
        supervisor picked for 0); None when the supervisor could not bind it or did not answer."""
        if self._sync_sock is None:
            return None
        try:
            answer = blocking_request(self._sync_sock, {"t": "port", "node": node_id, "port": wanted})
        except (OSError, ChannelError) as exc:
            log.error("the supervisor gave no port for broker %d: %s", node_id, exc)
            return None
        port = answer.get("port")
        if not isinstance(port, int):
            log.error("no port for broker %d: %s", node_id, answer.get("error", "no answer"))
            return None
        return port

    # -- usage ------------------------------------------------------------------------------

    async def _publish(self) -> None:
        manager = self._manager
        assert manager is not None
        interval_s = self._sync_interval_ms / 1000
        while True:
            await asyncio.sleep(interval_s)
            local = manager.take_local_usage(self._clock())
            if self._producer_ids is not None:
                local += self._producer_ids.take_local_usage()
            if local:
                self.channel.send({"t": "usage", "entries": [[k, u, c, a] for (k, u, c), a in local]})

    def _members(self, members: object) -> None:
        """The workers sharing usage now (the quota engines pace bursts by them)."""
        if isinstance(members, int) and members != self.members:
            self.members = max(members, 1)
            if self._manager is not None:
                self._manager.set_fleet(self.members, self._sync_interval_ms)

    def _usage(self, message: Message) -> None:
        manager = self._manager
        self._members(message.get("members"))
        if manager is None:
            return
        now = self._clock()
        for kind, user, client_id, amount in message.get("entries", ()):
            if kind == PRODUCER_IDS_RATE:
                applied = (self._producer_ids is not None and user is not None and client_id is None
                           and self._producer_ids.add_remote(user, float(amount), now))
            else:
                applied = manager.add_remote(kind, user, client_id, float(amount), now)
            self.remote_applied += bool(applied)

    # -- the line -------------------------------------------------------------------------

    async def _beat(self) -> None:
        while True:
            beat: Message = {"t": "beat", "serving": self.readiness is not None}
            if self.readiness is not None:
                beat["ready"], beat["detail"] = self.readiness()
            self.channel.send(beat)
            await asyncio.sleep(HEARTBEAT_INTERVAL_MS / 1000)

    async def _receive(self) -> None:
        try:
            while (message := await self.channel.receive()) is not None:
                self._dispatch(message)
        except ChannelError as exc:
            log.error("the supervisor's channel broke: %s", exc)
        log.warning("the supervisor is gone: this worker stops")
        self.on_lost()

    def _dispatch(self, message: Message) -> None:
        kind = message["t"]
        try:
            if kind == "admitted":
                self._admitted(message)
            elif kind == "usage":
                self._usage(message)
            elif kind in self.handlers:
                asyncio.get_running_loop().create_task(self._answer(kind, message))
            elif kind == "members":
                self._members(message.get("members"))
            else:
                log.warning("the supervisor sent a message of unknown type %r", kind)
        except (KeyError, TypeError, ValueError) as exc:
            log.error("a %s message from the supervisor ignored: %r", kind, exc)

    async def _answer(self, kind: str, message: Message) -> None:
        try:
            answer = await self.handlers[kind](message)
        except Exception:
            log.exception("answering the supervisor's %s failed", kind)
            answer = {"error": f"{kind} failed"}
        if answer is not None and "id" in message:
            self.channel.send({"t": "answer", "id": message["id"], **answer})


class SharedOverlayStore(OverlayStore):
    """``quota_admin.store: memory`` on a host of workers: what one worker commits is sent to the
    others (through the supervisor, which keeps it for workers that start later)."""

    def __init__(self, file_keys: FileKeys | None, link: WorkerLink) -> None:
        super().__init__(file_keys)
        self._link = link

    async def commit(self, changes: Sequence[QuotaChange]) -> None:
        self.apply(changes)
        self._link.send({"t": "quotas", "changes": changes_to_json(changes)})
