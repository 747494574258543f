"""A scripted Kafka cluster, for what no real broker here can stage.

Tansu is the real broker the tests use; this script exists only for scenarios Tansu cannot
stage on demand: a partition leader that moves (NOT_LEADER_OR_FOLLOWER with KIP-951
``CurrentLeader`` + ``NodeEndpoints``), an old broker without KIP-951 fields (advertise
Produce < v10 / Fetch < v16, or ``leader_hints=False``), chosen per-partition errors, a broker
that throttles on its own, a broker that hangs. It is built on ``protocol/`` (framing, header
parsing) and kafka-python's schema classes, and speaks real Kafka to real clients.

:class:`ScriptedCluster` runs N brokers (node ids 1..N by default, each on its own
``127.0.0.1`` port picked by the OS) sharing one :class:`Script` and one set of topics. Each
broker answers ApiVersions, Metadata, FindCoordinator (v4+ batched), DescribeCluster, Produce
(acks=0: no response), Fetch, ListOffsets, InitProducerId, CreateTopics and DeleteTopics (the
handlers live in :mod:`tests.support.scripted_handlers`). Requests on a connection are answered
one at a time, in order, as Kafka does, so pipelined requests work. Every request is recorded
(:class:`ReceivedRequest`) for assertions.

Use it as ``async with ScriptedCluster(...) as cluster`` in the test's event loop, or
``with ScriptedCluster(...).threaded() as cluster`` for synchronous clients.
"""

from __future__ import annotations

import asyncio
import itertools
import struct
import threading
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kafka.protocol.metadata import ApiVersionsResponse

if TYPE_CHECKING:
    from kafka.protocol.api_message import ApiMessage

from protocol.apis import SPECS, ApiKey
from protocol.frames import FrameError, FrameReader, frame
from protocol.headers import (
    HeaderError,
    encode_response_header,
    parse_request_header,
    response_header_is_flexible,
    skip_tagged_fields,
)
from protocol.messages import DecodeError, decode_request, encode_body
from tests.support.scripted_handlers import HANDLERS, UNSUPPORTED_VERSION, default_api_versions


@dataclass
class Partition:
    leader: int
    leader_epoch: int = 0
    batches: list[tuple[int, int, bytes]] = field(default_factory=list)  # (base, last offset, batch)
    next_offset: int = 0


@dataclass
class Topic:
    name: str
    topic_id: uuid.UUID
    partitions: list[Partition]


@dataclass(frozen=True)
class ReceivedRequest:
    node_id: int  # the broker that received it
    connection: int  # a number per accepted connection, cluster-wide
    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None
    body: Any  # the decoded kafka-python request
    # The request exactly as it arrived (header included, size prefix not).
    raw: bytes = field(default=b"", repr=False, compare=False)


class Close:
    """A handler result: close the connection without answering."""


# A handler's answer: a response message, raw bytes written as they are (size prefix
# included, so partial frames are possible), None for no answer, or Close.
Handler = Callable[["ScriptedBroker", ReceivedRequest], "ApiMessage | bytes | type[Close] | Awaitable[Any] | None"]


@dataclass
class Script:
    """What every broker of the cluster does. Tests may change it while the cluster runs."""

    api_versions: dict[int, tuple[int, int]] = field(default_factory=default_api_versions)
    controller_id: int | None = None  # None: the first node
    cluster_id: str = "scripted-cluster"
    coordinators: dict[str, int] = field(default_factory=dict)  # key -> node id (default controller)
    coordinator_errors: dict[str, int] = field(default_factory=dict)  # key -> error code
    produce_errors: dict[tuple[str, int], int] = field(default_factory=dict)
    # api key -> error codes answered to that API's next requests, one per request, in order (then
    # the usual answers): InitProducerId and FindCoordinator answer it whole; Produce, Fetch and
    # ListOffsets for every partition, CreateTopics for every topic (none created), Metadata for
    # every topic a request names (one naming none takes none). For an error that never stops,
    # a long list. Real brokers answer these while a new cluster starts, which Tansu never does.
    next_errors: dict[int, list[int]] = field(default_factory=dict)
    fetch_errors: dict[tuple[str, int], int] = field(default_factory=dict)
    leader_hints: bool = True  # KIP-951 CurrentLeader + NodeEndpoints on Produce v10+ / Fetch v16+
    throttle_time_ms: dict[int, int] = field(default_factory=dict)  # api key -> the broker's own throttle
    hang_on: set[int] = field(default_factory=set)  # api keys after which a connection never answers
    handlers: dict[int, Handler] = field(default_factory=dict)  # api key -> custom handler
    # api key -> request class, for APIs neither kafka-python nor protocol/ has a schema for
    request_classes: dict[int, Any] = field(default_factory=dict)
    default_partitions: int = 1  # num.partitions, for CreateTopics with -1
    fetch_wait_cap_ms: int = 100  # an empty Fetch waits min(max_wait_ms, this) for data


class ScriptedBroker:
    """One node: its own listening socket, answering from the cluster's script and topics."""

    def __init__(self, cluster: ScriptedCluster, node_id: int) -> None:
        self.cluster = cluster
        self.node_id = node_id
        self.host = "127.0.0.1"
        self.port = 0
        self.connections_accepted = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    @property
    def open_connections(self) -> int:
        return len(self._writers)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def close_connections(self) -> None:
        """Drops every client connection (the listener stays open), like a broker restart."""
        for w in list(self._writers):
            w.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        self._writers.add(writer)
        self.connections_accepted += 1
        conn = next(self.cluster._connection_ids)
        frames = FrameReader(2**31 - 1)
        hung = False
        try:
            while data := await reader.read(65536):
                for f in frames.feed(data):
                    if hung:
                        self._record(conn, bytes(f))  # a hung broker still reads
                        continue
                    answer = await self._answer(conn, bytes(f))
                    if answer is Close:
                        return
                    if answer is _HANG:
                        hung = True
                    elif answer is not None:
                        writer.write(answer)
                await writer.drain()
        except (FrameError, HeaderError, DecodeError, ConnectionError):
            pass
        except asyncio.CancelledError:
            pass  # stop() cancels connections still waiting (an empty Fetch)
        except Exception as exc:  # a bug in the script or a handler: fail the test at exit
            self.cluster.errors.append(exc)
        finally:
            self._writers.discard(writer)
            self._tasks.discard(task)
            writer.close()

    def _record(self, conn: int, data: bytes) -> ReceivedRequest:
        header = parse_request_header(data)
        spec = SPECS.get(header.api_key)
        body = None  # not decoded: an API or version kafka-python does not know
        extra = self.cluster.script.request_classes.get(header.api_key)
        if extra is not None and header.api_version <= extra.max_version:
            # An API protocol/ does not know has no body offset there: request header v2 (these
            # classes are flexible), the client id then tagged fields.
            (id_len,) = struct.unpack_from(">h", data, 8)
            start = skip_tagged_fields(data, 10 + max(id_len, 0))
            body = extra.decode(bytes(data[start:]), version=header.api_version)
        elif spec is not None and header.api_version <= spec.max_version:
            body = decode_request(header.api_key, header.api_version, memoryview(data)[header.body_offset :])
        req = ReceivedRequest(self.node_id, conn, header.api_key, header.api_version, header.correlation_id,
                              header.client_id, body, raw=data)
        self.cluster._record(req)
        return req

    async def _answer(self, conn: int, data: bytes):
        req = self._record(conn, data)
        script = self.cluster.script
        key, version = req.api_key, req.api_version
        lo, hi = script.api_versions.get(key, (0, -1))
        if key == ApiKey.API_VERSIONS and not lo <= version <= min(hi, SPECS[key].max_version):
            # Kafka's ApiVersionsRequest.getErrorResponse: v0 body, UNSUPPORTED_VERSION, own range.
            resp = ApiVersionsResponse[0](error_code=UNSUPPORTED_VERSION, api_keys=[
                ApiVersionsResponse.ApiVersion(api_key=key, min_version=lo, max_version=hi)])
            return frame(encode_response_header(req.correlation_id, False) + encode_body(resp))
        if not lo <= version <= hi or req.body is None:
            return Close  # an API or version this broker does not speak: Kafka closes too
        if key in script.hang_on:
            return _HANG
        handler = script.handlers.get(key, HANDLERS.get(key))
        if handler is None:
            return Close
        resp = handler(self, req)
        if asyncio.iscoroutine(resp):
            resp = await resp
        if resp is None or resp is Close or isinstance(resp, (bytes, bytearray)):
            return resp
        throttle = script.throttle_time_ms.get(key)
        if throttle is not None and "throttle_time_ms" in type(resp).fields:
            resp.throttle_time_ms = throttle
        # A request class of the script's own is flexible where its definition says.
        extra = script.request_classes.get(key)
        flexible = response_header_is_flexible(key, version) if extra is None else (
            extra._flexible_versions is not None and version >= extra._flexible_versions[0])
        return frame(encode_response_header(req.correlation_id, flexible) + encode_body(resp))

    def default_response(self, req: ReceivedRequest):
        """The built-in answer to ``req``, for custom handlers that adjust it (Fetch: a coroutine)."""
        return HANDLERS[req.api_key](self, req)


_HANG = object()


class ScriptedCluster:
    def __init__(self, brokers: int = 3, *, node_ids: list[int] | None = None,
                 topics: dict[str, int] | None = None, script: Script | None = None) -> None:
        self.script = script or Script()
        ids = node_ids or list(range(1, brokers + 1))
        self.brokers = {n: ScriptedBroker(self, n) for n in ids}
        if self.script.controller_id is None:
            self.script.controller_id = ids[0]
        self.topics: dict[str, Topic] = {}
        self.requests: list[ReceivedRequest] = []
        self.errors: list[Exception] = []  # handler failures; raised when the cluster exits
        self._connection_ids = itertools.count(1)
        self._producer_ids = itertools.count(1000)
        self._waiters: list[tuple[Callable[[ReceivedRequest], bool], int, asyncio.Future]] = []
        self._data_arrived: asyncio.Event | None = None
        for name, partitions in (topics or {}).items():
            self.add_topic(name, partitions)

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> ScriptedCluster:
        self._data_arrived = asyncio.Event()
        for b in self.brokers.values():
            await b.start()
        return self

    async def stop(self) -> None:
        for b in self.brokers.values():
            await b.stop()

    async def __aenter__(self) -> ScriptedCluster:
        return await self.start()

    async def __aexit__(self, exc_type, *exc) -> None:
        await self.stop()
        if exc_type is None:
            self.raise_errors()

    def raise_errors(self) -> None:
        if self.errors:
            raise AssertionError(f"the scripted cluster failed: {self.errors!r}") from self.errors[0]

    def threaded(self) -> ThreadedCluster:
        return ThreadedCluster(self)

    # -- addresses ---------------------------------------------------------------------------

    def broker(self, node_id: int) -> ScriptedBroker:
        return self.brokers[node_id]

    @property
    def bootstrap_servers(self) -> list[str]:
        return [f"{b.host}:{b.port}" for b in self.brokers.values()]

    @property
    def bootstrap(self) -> str:
        """The first broker's ``host:port``."""
        return self.bootstrap_servers[0]

    # -- topics ------------------------------------------------------------------------------

    def add_topic(self, name: str, partitions: int = 1, leaders: list[int] | None = None) -> Topic:
        """A topic whose partition leaders go round the brokers unless ``leaders`` says."""
        nodes = list(self.brokers)
        leaders = leaders or [nodes[(len(self.topics) + p) % len(nodes)] for p in range(partitions)]
        topic = Topic(name, uuid.uuid5(uuid.NAMESPACE_URL, f"scripted/{name}"), [Partition(n) for n in leaders])
        self.topics[name] = topic
        return topic

    def move_leader(self, topic: str, partition: int, node_id: int) -> None:
        """Leadership moves (epoch + 1); the old leader now answers NOT_LEADER_OR_FOLLOWER."""
        p = self.topics[topic].partitions[partition]
        p.leader = node_id
        p.leader_epoch += 1

    def topic_by_id(self, topic_id: uuid.UUID) -> Topic | None:
        return next((t for t in self.topics.values() if t.topic_id == topic_id), None)

    def append(self, partition: Partition, records: bytes | None) -> int:
        """Appends record batches, assigning offsets; returns the first batch's base offset."""
        base = partition.next_offset
        for batch, count in _split_batches(records or b""):
            start = partition.next_offset
            batch = struct.pack(">q", start) + batch[8:]  # baseOffset is outside the CRC
            partition.batches.append((start, start + count - 1, batch))
            partition.next_offset += count
        if self._data_arrived is not None:
            self._data_arrived.set()
            self._data_arrived = asyncio.Event()
        return base

    async def wait_for_data(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._data_arrived.wait(), timeout_s)
        except TimeoutError:
            pass

    # -- recorded requests -------------------------------------------------------------------

    def requests_for(self, api_key: int, node_id: int | None = None) -> list[ReceivedRequest]:
        return [r for r in self.requests if r.api_key == api_key and node_id in (None, r.node_id)]

    async def wait_for_requests(self, api_key: int | None = None, count: int = 1, timeout_s: float = 5.0,
                                predicate: Callable[[ReceivedRequest], bool] | None = None) -> list[ReceivedRequest]:
        """Waits until ``count`` recorded requests match; returns them."""
        def match(r: ReceivedRequest) -> bool:
            return (api_key is None or r.api_key == api_key) and (predicate is None or predicate(r))

        if sum(map(match, self.requests)) < count:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append((match, count, fut))
            try:
                await asyncio.wait_for(fut, timeout_s)
            finally:
                self._waiters = [w for w in self._waiters if w[2] is not fut]
        return [r for r in self.requests if match(r)]

    def _record(self, req: ReceivedRequest) -> None:
        self.requests.append(req)
        for match, count, fut in self._waiters:
            if not fut.done() and sum(map(match, self.requests)) >= count:
                fut.set_result(None)

    # -- things every handler needs ----------------------------------------------------------

    def leader_endpoints(self, cls, node_ids) -> list:
        """KIP-951 NodeEndpoints (of response class ``cls``) for the given leaders."""
        return [cls.NodeEndpoint(node_id=n, host=self.brokers[n].host, port=self.brokers[n].port, rack=None)
                for n in sorted(set(node_ids)) if n in self.brokers]


class ThreadedCluster:
    """Runs a :class:`ScriptedCluster` on its own event loop in a thread, for sync clients."""

    def __init__(self, cluster: ScriptedCluster) -> None:
        self.cluster = cluster
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="scripted-cluster", daemon=True)

    def __enter__(self) -> ThreadedCluster:
        self._thread.start()
        self.run(self.cluster.start())
        return self

    def __exit__(self, exc_type, *exc) -> None:
        try:
            self.run(self.cluster.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()
        if exc_type is None:
            self.cluster.raise_errors()

    def run(self, coro, timeout_s: float = 30.0):
        """Runs a coroutine on the cluster's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def call(self, fn: Callable, *args):
        """Runs ``fn(*args)`` on the cluster's loop (to change the script or topics safely)."""
        async def call():
            return fn(*args)
        return self.run(call())

    def wait_for_requests(self, api_key: int | None = None, count: int = 1, timeout_s: float = 5.0,
                          predicate=None) -> list[ReceivedRequest]:
        return self.run(self.cluster.wait_for_requests(api_key, count, timeout_s, predicate), timeout_s + 5)

    def __getattr__(self, name: str):
        return getattr(self.cluster, name)


def _split_batches(records: bytes):
    """Yields (batch bytes, record count) for each batch (v2) or message (v0/v1) in a record set."""
    pos = 0
    while pos + 17 <= len(records):
        size = 12 + struct.unpack_from(">i", records, pos + 8)[0]
        batch = records[pos : pos + size]
        magic = batch[16]
        count = struct.unpack_from(">i", batch, 23)[0] + 1 if magic >= 2 else 1
        yield batch, count
        pos += size
