"""How long one big frame of each API the proxy inspects holds its event loop.

    python -m bench.stall                                  # 1,000, 10,000 and 50,000 entries, every case
    python -m bench.stall --sizes 100,1000 --cases produce-v9,find-coordinator-v4   # a quick look
    python -m bench.stall --list                           # the cases

The proxy runs one event loop per process: while it decodes, charges or encodes one frame, every
other connection of that process waits. For each case and size (``--sizes``: entries in the
frame; a case stops growing once one request, or making what it needs on the broker, takes over
``--limit-s``, 20 s: Tansu's CreateTopics costs grow with the square of the topics) and for each
target, ``direct`` (Tansu itself) and ``proxy`` (``python -m proxy run`` in front of it), a fresh
Tansu broker (memory storage) is started, with the proxy in front of it for ``proxy``, and
whatever the case needs is made directly on the broker first (topics to list, delete or
produce to). Then, on a raw socket, the case's one big request is sent (encoded beforehand)
and its response read, while another client, a process of its own on its own connection to the
same target, does ApiVersions v0 round trips back to back. Reported: the big request's latency
(send to the response's last byte), and the other client's longest round trip overlapping it:
through the proxy, how long the proxy's loop was held plus what the broker takes; directly,
what the broker and this machine's CPUs give for the same request. Tansu runs a CreateTopics or
DeleteTopics on one of its worker threads to the end, and a connection whose task waits on that
thread waits as long (seen directly too, by chance): so through the proxy the same client also
does, on a second connection at the same time, round trips of an ApiVersions version nobody
knows (v99), which the proxy answers itself without the broker (as Kafka does: v0,
UNSUPPORTED_VERSION). Its longest round trip, the "loop probe", is the proxy's loop alone.
The proxy's CPU time during the request (all its threads) is recorded too.

The proxy's config has a ``quotas:`` entry for the default user and client id with every rate
set far above what the run uses (as bench.run's QUOTAS_NOT_EXCEEDED), so the quota filters,
the controller-mutation (KIP-599) filter among them, do all their work but never throttle; the
client-quota cases (``*-client-quotas-*``) run a proxy with ``quota_admin`` enabled too (store:
the compacted topic on the same Tansu; the anonymous principal an admin), which answers
DescribeClientQuotas and AlterClientQuotas itself. Tansu 0.6 has neither those two APIs nor
CreatePartitions: the ``direct`` figures of those cases are Tansu's answer to an API it does not
know (an error, or a closed connection: see each row's ``outcome``), and through the proxy the
CreatePartitions request is still decoded and charged, the broker's answer still read.

Cases (entries = N):

- ``metadata-v12``: all-topics Metadata v12 over N partitions (topics of 200 partitions);
  the proxy's scanning path, as a reference;
- ``create-topics-v5`` / ``-v7``: N new topics of one partition; ``...-validate``: the same with
  validate_only;
- ``delete-topics-v5`` / ``-v6``: N topics of one partition that exist; ``...-missing``: N that
  do not;
- ``create-partitions-v3``: N existing one-partition topics asked to grow to 2 (Tansu: unsupported);
  ``...-missing``: N topics that do not exist (the proxy asks the broker for their metadata);
- ``find-coordinator-v4``: N group keys (key_type 0);
- ``produce-v9``: one topic of N partitions, one tiny record batch in each, acks=1;
- ``describe-client-quotas-v1``: N filter components (user, exact match);
- ``alter-client-quotas-v1``: N entries, one user each, producer_byte_rate set (over 10,000, Kafka
  and the proxy refuse the whole request, POLICY_VIOLATION, once it is decoded and validated);
- ``describe-client-quotas-v1-all``: after an (untimed) Alter of N entries through the proxy,
  a Describe of everything (no components): a response of N entities encoded by the proxy.

Results go to bench/results/stall.json (``--json``), a table to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import array
import json
import multiprocessing
import os
import platform
import selectors
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kafka.protocol.admin import (
    AlterClientQuotasRequest,
    AlterClientQuotasResponse,
    CreatePartitionsRequest,
    CreatePartitionsResponse,
    CreateTopicsRequest,
    CreateTopicsResponse,
    DeleteTopicsRequest,
    DeleteTopicsResponse,
    DescribeClientQuotasRequest,
    DescribeClientQuotasResponse,
)
from kafka.protocol.metadata import (
    ApiVersionsRequest,
    FindCoordinatorRequest,
    FindCoordinatorResponse,
    MetadataRequest,
    MetadataResponse,
)
from kafka.protocol.producer import ProduceRequest, ProduceResponse
from kafka.record import MemoryRecordsBuilder

from proxy.app.local_broker import LocalTansu, tansu_version

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "stall.json"
SIZES = (1000, 10000, 50000)
LIMIT_S = 20.0
TARGETS = ("direct", "proxy")
SETUP_TOPICS_PER_REQUEST = 1000
METADATA_PARTITIONS_PER_TOPIC = 200
REQUEST_TIMEOUT_MS = 120_000
ALTER_CHUNK = 10_000  # Kafka's QuorumController.MAX_RECORDS_PER_USER_OP: changes in one Alter at most
SOCKET_TIMEOUT_S = 300.0

# Every quota the proxy has set far above what this benchmark asks (as bench.run's
# QUOTAS_NOT_EXCEEDED), so that the quota filters run but never throttle.
QUOTAS_NOT_EXCEEDED: list[dict[str, Any]] = [
    {"user": "<default>", "client_id": "<default>",
     "producer_byte_rate": 1_000_000_000_000, "consumer_byte_rate": 1_000_000_000_000,
     "request_rate": 1_000_000_000, "controller_mutation_rate": 1_000_000,
     "producer_record_rate": 1_000_000_000, "producer_batch_rate": 1_000_000_000,
     "consumer_record_rate": 1_000_000_000},
    {"user": "<default>", "producer_ids_rate": 1_000_000},
]
QUOTA_ADMIN = {"enabled": True, "principals": ["ANONYMOUS"], "describe": "admins"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- raw sockets -----------------------------------------------------------------------------------


def _recv_exact(sock: socket.socket, n: int, buf: bytearray) -> None:
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:n], n - got)
        if k == 0:
            raise ConnectionError("connection closed by the peer")
        got += k


class Conn:
    """One plaintext socket; one request at a time."""

    def __init__(self, address: tuple[str, int], client_id: str = "bench-stall",
                 timeout_s: float = SOCKET_TIMEOUT_S) -> None:
        self.sock = socket.create_connection(address, timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.client_id = client_id
        self.corr = 0
        self.buf = bytearray(1 << 16)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Conn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def frame(self, request: Any) -> bytes:
        """``request`` encoded with the next correlation id (size prefix included)."""
        self.corr += 1
        request.with_header(correlation_id=self.corr, client_id=self.client_id)
        return bytes(request.encode(header=True, framed=True))

    def send(self, frame: bytes) -> None:
        self.sock.sendall(frame)

    def receive(self) -> bytes:
        """One response frame, without its size prefix (correlation id first)."""
        _recv_exact(self.sock, 4, self.buf)
        size = int(struct.unpack_from(">i", self.buf)[0])
        if size > len(self.buf):
            self.buf = bytearray(size)
        _recv_exact(self.sock, size, self.buf)
        if struct.unpack_from(">i", self.buf)[0] != self.corr:
            raise RuntimeError("correlation id mismatch")
        return bytes(self.buf[:size])

    def call(self, request: Any, response_class: Any) -> Any:
        self.send(self.frame(request))
        return response_class.decode(self.receive(), version=request.API_VERSION, header=True)


def api_versions_v0() -> Any:
    return ApiVersionsRequest[0]()


# --- the other client ------------------------------------------------------------------------------


UNKNOWN_API_VERSIONS_VERSION = 99
WARMUP = 50


def _api_versions_frame(version: int) -> bytearray:
    """An ApiVersions request frame, correlation id at offset 8. v0 from kafka-python; a version
    nobody knows by hand (header v2, empty body), which the proxy answers itself, as Kafka does
    (v0, UNSUPPORTED_VERSION), and Tansu answers by closing the connection."""
    if version <= ApiVersionsRequest.max_version:
        request = ApiVersionsRequest[version]()
        request.with_header(correlation_id=0, client_id="bench-stall-other")
        return bytearray(request.encode(header=True, framed=True))
    cid = b"bench-stall-loop"
    body = struct.pack(">hhih", 18, version, 0, len(cid)) + cid + b"\x00\x00"
    return bytearray(struct.pack(">i", len(body)) + body)


def _other_client(address: tuple[str, int], versions: dict[str, int], stop: Any, conn: Any) -> None:
    """Child process: for each probe (name -> ApiVersions version), a connection of its own with
    round trips back to back on it, all at once (one selector), until ``stop`` is set. Sends
    ("ready", b"") once every probe has done WARMUP round trips, then ("samples", {probe:
    (start, end) CLOCK_MONOTONIC ns of each round trip after the warm-up, packed int64 pairs})
    (a round trip still waiting at the stop counts as ending then) or ("error", what)."""
    clock = time.monotonic_ns
    buf = bytearray(1 << 16)
    sel = selectors.DefaultSelector()
    socks: list[socket.socket] = []
    probes: dict[str, dict[str, Any]] = {}
    try:
        for name, version in versions.items():
            s = socket.create_connection(address, timeout=SOCKET_TIMEOUT_S)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            socks.append(s)
            probes[name] = {"sock": s, "frame": _api_versions_frame(version), "corr": 0, "t0": 0,
                            "samples": array.array("q")}
            sel.register(s, selectors.EVENT_READ, name)

        def send(p: dict[str, Any]) -> None:
            p["corr"] += 1
            struct.pack_into(">i", p["frame"], 8, p["corr"])
            p["t0"] = clock()
            p["sock"].sendall(p["frame"])

        for p in probes.values():
            send(p)
        ready = False
        while not stop.value:
            for key, _ in sel.select(0.05):
                p = probes[key.data]
                _recv_exact(p["sock"], 4, buf)
                _recv_exact(p["sock"], struct.unpack_from(">i", buf)[0], buf)
                t1 = clock()
                if struct.unpack_from(">i", buf)[0] != p["corr"]:
                    raise RuntimeError("correlation id mismatch")
                if p["corr"] > WARMUP:
                    p["samples"].extend((p["t0"], t1))
                send(p)
            if not ready and all(p["corr"] > WARMUP + 1 for p in probes.values()):
                ready = True
                conn.send(("ready", b""))
        end = clock()
        for p in probes.values():  # the round trip under way
            if p["corr"] > WARMUP:
                p["samples"].extend((p["t0"], end))
        conn.send(("samples", {name: p["samples"].tobytes() for name, p in probes.items()}))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        for s in socks:
            s.close()


class OtherClient:
    """:func:`_other_client` in a spawned process."""

    def __init__(self, address: tuple[str, int], versions: dict[str, int]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.stop_flag = ctx.RawValue("b", 0)
        self.parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_other_client, args=(address, versions, self.stop_flag, child), daemon=True)
        self.proc.start()
        child.close()
        if not self.parent.poll(60):
            self.proc.kill()
            raise RuntimeError("the other client did not start")
        kind, what = self.parent.recv()
        if kind != "ready":
            raise RuntimeError(f"the other client failed: {what}")

    def finish(self) -> dict[str, list[tuple[int, int]]]:
        self.stop_flag.value = 1
        if not self.parent.poll(SOCKET_TIMEOUT_S):
            self.proc.kill()
            raise RuntimeError("the other client did not stop")
        kind, data = self.parent.recv()
        self.proc.join(10)
        if kind != "samples":
            raise RuntimeError(f"the other client failed: {data}")
        out = {}
        for name, packed in data.items():
            a = array.array("q")
            a.frombytes(packed)
            out[name] = list(zip(a[0::2], a[1::2]))
        return out

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def cpu_ns(pid: int) -> int | None:
    """CPU time (user + system) of every live thread of ``pid`` so far, in ns: the run time the
    scheduler keeps per thread (/proc/PID/task/TID/schedstat); None once the process is gone."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread exited meanwhile
    return total


# --- the proxy -------------------------------------------------------------------------------------


class ProxyProc:
    """``python -m proxy run`` with a config of its own, in front of one broker."""

    def __init__(self, upstream: tuple[str, int], extra: dict[str, Any], workdir: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="proxy-", dir=workdir))
        config: dict[str, Any] = {
            "upstream": {"bootstrap_servers": [f"{upstream[0]}:{upstream[1]}"]},
            "listen": {"host": "127.0.0.1", "advertised_host": "127.0.0.1", "bootstrap_port": 0,
                       "broker_port_base": 0, "max_frame_bytes": 104857600},
            "metrics": {"host": "127.0.0.1", "port": 0},
            **extra,
        }
        self.config_path = self.dir / "config.yaml"
        self.config_path.write_text(json.dumps(config, indent=1))  # JSON is YAML
        self.ready_path = self.dir / "ready.json"
        self.log_path = self.dir / "proxy.log"
        self.popen: subprocess.Popen[bytes] | None = None
        self.address: tuple[str, int] = ("", 0)

    def start(self, timeout_s: float = 60.0) -> ProxyProc:
        with open(self.log_path, "wb") as out:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "proxy", "run", "--config", str(self.config_path),
                 "--ready-file", str(self.ready_path), "--log-level", "warning"],
                cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while not self.ready_path.exists():
            if self.popen.poll() is not None:
                raise RuntimeError(f"the proxy exited with {self.popen.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the proxy not ready after {timeout_s} s:\n{self.log_tail()}")
            time.sleep(0.02)
        ready = json.loads(self.ready_path.read_text())
        self.address = (str(ready["bootstrap"][0]), int(ready["bootstrap"][1]))
        with Conn(self.address, timeout_s=30) as c:  # answers ApiVersions (so reaches the broker)
            c.send(c.frame(api_versions_v0()))
            c.receive()
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        popen = self.popen
        if popen is None or popen.poll() is not None:
            return
        popen.send_signal(signal.SIGTERM)
        try:
            popen.wait(20)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(10)


# --- setup on the broker ---------------------------------------------------------------------------


def create_topics(address: tuple[str, int], sizes: list[tuple[str, int]]) -> float:
    """Topics (name, partitions) made with CreateTopics v7 requests of SETUP_TOPICS_PER_REQUEST
    topics; returns the seconds it took."""
    C = CreateTopicsRequest[7]
    t0 = time.monotonic()
    with Conn(address, "bench-stall-setup") as conn:
        for start in range(0, len(sizes), SETUP_TOPICS_PER_REQUEST):
            topics = [C.CreatableTopic(name=name, num_partitions=n, replication_factor=1, assignments=[], configs=[])
                      for name, n in sizes[start:start + SETUP_TOPICS_PER_REQUEST]]
            resp = conn.call(C(topics=topics, timeout_ms=REQUEST_TIMEOUT_MS, validate_only=False),
                             CreateTopicsResponse)
            failed = [(t.name, t.error_code, t.error_message) for t in resp.topics if t.error_code]
            if failed:
                raise RuntimeError(f"setup: CreateTopics failed for {len(failed)} topics, e.g. {failed[:3]}")
    return time.monotonic() - t0


def topic_names(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i:06d}" for i in range(n)]


def tiny_batch() -> bytes:
    builder = MemoryRecordsBuilder(magic=2, compression_type=0, batch_size=1 << 16)
    builder.append(timestamp=int(time.time() * 1000), key=None, value=b"stall", headers=[])
    builder.close()
    return bytes(builder.buffer())


# --- the cases -------------------------------------------------------------------------------------


@dataclass
class Env:
    """What a case's setup and request see: the broker, and the proxy when the target is one."""

    broker: tuple[str, int]
    target: tuple[str, int]
    via_proxy: bool
    pids: dict[str, int] = field(default_factory=dict)  # "broker", "proxy": whose CPU is counted
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    name: str
    response: Any  # kafka-python response class
    build: Callable[[int], Any]  # N -> the big request
    setup: Callable[[Env, int], None] | None = None
    quota_admin: bool = False
    note: str = ""


def _metadata_setup(env: Env, n: int) -> None:
    per = METADATA_PARTITIONS_PER_TOPIC
    sizes = [(name, min(per, n - i * per)) for i, name in enumerate(topic_names("md", -(-n // per)))]
    env.notes["setup_s"] = create_topics(env.broker, sizes)
    env.notes["topics"] = len(sizes)


def _metadata(n: int) -> Any:
    return MetadataRequest[12](topics=None, allow_auto_topic_creation=False,
                               include_topic_authorized_operations=False)


def _create_topics(version: int, validate_only: bool) -> Callable[[int], Any]:
    def build(n: int) -> Any:
        C = CreateTopicsRequest[version]
        topics = [C.CreatableTopic(name=name, num_partitions=1, replication_factor=1, assignments=[], configs=[])
                  for name in topic_names("ct", n)]
        return C(topics=topics, timeout_ms=REQUEST_TIMEOUT_MS, validate_only=validate_only)
    return build


def _existing_topics(env: Env, n: int) -> None:
    env.notes["setup_s"] = create_topics(env.broker, [(name, 1) for name in topic_names("t", n)])


def _delete_topics(version: int, prefix: str) -> Callable[[int], Any]:
    def build(n: int) -> Any:
        D = DeleteTopicsRequest[version]
        names = topic_names(prefix, n)
        if version >= 6:
            return D(topics=[D.DeleteTopicState(name=name) for name in names], timeout_ms=REQUEST_TIMEOUT_MS)
        return D(topic_names=names, timeout_ms=REQUEST_TIMEOUT_MS)
    return build


def _create_partitions(prefix: str) -> Callable[[int], Any]:
    def build(n: int) -> Any:
        C = CreatePartitionsRequest[3]
        return C(topics=[C.CreatePartitionsTopic(name=name, count=2, assignments=None)
                         for name in topic_names(prefix, n)],
                 timeout_ms=REQUEST_TIMEOUT_MS, validate_only=False)
    return build


def _find_coordinator(n: int) -> Any:
    return FindCoordinatorRequest[4](key_type=0, coordinator_keys=[f"group-{i:06d}" for i in range(n)])


def _produce_setup(env: Env, n: int) -> None:
    env.notes["setup_s"] = create_topics(env.broker, [("produce", n)])


def _produce(n: int) -> Any:
    P = ProduceRequest[9]
    T = P.TopicProduceData
    batch = tiny_batch()
    parts = [T.PartitionProduceData(index=i, records=batch) for i in range(n)]
    return P(transactional_id=None, acks=1, timeout_ms=30000, topic_data=[T(name="produce", partition_data=parts)])


def _describe_components(n: int) -> Any:
    D = DescribeClientQuotasRequest[1]
    return D(components=[D.ComponentData(entity_type="user", match_type=0, match=f"user-{i:06d}") for i in range(n)],
             strict=False)


def _alter(n: int, first: int = 0) -> Any:
    A = AlterClientQuotasRequest[1]
    E = A.EntryData
    entries = [E(entity=[E.EntityData(entity_type="user", entity_name=f"user-{i:06d}")],
                 ops=[E.OpData(key="producer_byte_rate", value=float(1_000_000 + i), remove=False)])
               for i in range(first, first + n)]
    return A(entries=entries, validate_only=False)


def _describe_all(n: int) -> Any:
    return DescribeClientQuotasRequest[1](components=[], strict=False)


def _alter_first(env: Env, n: int) -> None:
    """N users' quotas altered through the target, untimed, in Alters of ALTER_CHUNK entries (Kafka
    refuses more changes in one: POLICY_VIOLATION, and so does the proxy). Tansu has no
    AlterClientQuotas: on ``direct`` the Describe is what it answers anyway."""
    if not env.via_proxy:
        return
    t0 = time.monotonic()
    errors: Counter[int] = Counter()
    with Conn(env.target, "bench-stall-setup") as conn:
        for first in range(0, n, ALTER_CHUNK):
            resp = conn.call(_alter(min(ALTER_CHUNK, n - first), first), AlterClientQuotasResponse)
            errors.update(e.error_code for e in resp.entries if e.error_code)
    if errors:
        raise RuntimeError(f"setup: AlterClientQuotas errors {dict(errors)}")
    env.notes["setup_s"] = time.monotonic() - t0


CASES: dict[str, Case] = {c.name: c for c in (
    Case("metadata-v12", MetadataResponse, _metadata, _metadata_setup,
         note=f"N partitions, topics of {METADATA_PARTITIONS_PER_TOPIC}"),
    Case("create-topics-v5", CreateTopicsResponse, _create_topics(5, False)),
    Case("create-topics-v5-validate", CreateTopicsResponse, _create_topics(5, True)),
    Case("create-topics-v7", CreateTopicsResponse, _create_topics(7, False)),
    Case("create-topics-v7-validate", CreateTopicsResponse, _create_topics(7, True)),
    Case("delete-topics-v5", DeleteTopicsResponse, _delete_topics(5, "t"), _existing_topics),
    Case("delete-topics-v5-missing", DeleteTopicsResponse, _delete_topics(5, "missing")),
    Case("delete-topics-v6", DeleteTopicsResponse, _delete_topics(6, "t"), _existing_topics),
    Case("delete-topics-v6-missing", DeleteTopicsResponse, _delete_topics(6, "missing")),
    Case("create-partitions-v3", CreatePartitionsResponse, _create_partitions("t"), _existing_topics,
         note="Tansu 0.6 has no CreatePartitions"),
    Case("create-partitions-v3-missing", CreatePartitionsResponse, _create_partitions("missing"),
         note="topics that do not exist; Tansu 0.6 has no CreatePartitions"),
    Case("find-coordinator-v4", FindCoordinatorResponse, _find_coordinator),
    Case("produce-v9", ProduceResponse, _produce, _produce_setup, note="one topic of N partitions, acks=1"),
    Case("describe-client-quotas-v1", DescribeClientQuotasResponse, _describe_components, quota_admin=True,
         note="answered by the proxy; Tansu has no DescribeClientQuotas"),
    Case("alter-client-quotas-v1", AlterClientQuotasResponse, _alter, quota_admin=True,
         note="answered by the proxy; Tansu has no AlterClientQuotas"),
    Case("describe-client-quotas-v1-all", DescribeClientQuotasResponse, _describe_all, _alter_first,
         quota_admin=True, note="after N users altered through the proxy"),
)}


# --- one measurement -------------------------------------------------------------------------------


def error_codes(obj: Any) -> Counter[int]:
    """Every non-zero ``error_code`` anywhere in a decoded response's to_dict()."""
    found: Counter[int] = Counter()
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                if key == "error_code" and isinstance(value, int):
                    if value:
                        found[value] += 1
                elif isinstance(value, (dict, list)):
                    stack.append(value)
        elif isinstance(item, list):
            stack.extend(x for x in item if isinstance(x, (dict, list)))
    return found


def round_trips(samples: list[tuple[int, int]], t0: int, t1: int) -> dict[str, Any]:
    """The round trips overlapping [t0, t1] (their longest) and those before (their median)."""
    during = [(e - s) / 1e6 for s, e in samples if s < t1 and e > t0]
    before = [(e - s) / 1e6 for s, e in samples if e <= t0]
    return {
        "round_trips_during": len(during),
        "max_ms_during": max(during) if during else None,
        "p50_ms_before": statistics.median(before) if before else None,
        "max_ms_before": max(before) if before else None,
    }


def measure(case: Case, n: int, env: Env) -> dict[str, Any]:
    """The big request once on a connection of its own, the other client going meanwhile."""
    out: dict[str, Any] = {}
    request = case.build(n)
    version = request.API_VERSION
    with Conn(env.target) as conn:
        conn.send(conn.frame(api_versions_v0()))  # warm: the proxy's upstream connection is open
        conn.receive()
        frame = conn.frame(request)
        out["frame_bytes"] = len(frame)
        probes = {"api_versions_v0": 0}
        if env.via_proxy:
            probes["loop"] = UNKNOWN_API_VERSIONS_VERSION
        other = OtherClient(env.target, probes)
        try:
            time.sleep(0.3)  # the other client's round trips before, for its p50
            cpu0 = {k: cpu_ns(pid) for k, pid in env.pids.items()}
            t0 = time.monotonic_ns()
            try:
                conn.send(frame)
                body = conn.receive()
                outcome = "answered"
            except (OSError, RuntimeError) as exc:
                body = b""
                outcome = f"{type(exc).__name__}: {exc}"
            t1 = time.monotonic_ns()
            cpu1 = {k: cpu_ns(pid) for k, pid in env.pids.items()}
            time.sleep(0.1)
            samples = other.finish()
        except BaseException:
            other.kill()
            raise
    out["latency_ms"] = (t1 - t0) / 1e6
    for k in env.pids:  # the other client's round trips included
        before_ns, after_ns = cpu0[k], cpu1[k]
        out[f"{k}_cpu_ms"] = None if before_ns is None or after_ns is None else (after_ns - before_ns) / 1e6
    out["outcome"] = outcome
    out["response_bytes"] = len(body) + 4 if body else 0
    if body:
        try:
            resp = case.response.decode(body, version=version, header=True)
            out["error_codes"] = {str(k): v for k, v in sorted(error_codes(resp.to_dict()).items())}
        except Exception as exc:  # what came back is still a response of that size
            out["decode_error"] = f"{type(exc).__name__}: {exc}"
    for probe, key in (("api_versions_v0", "other_client"), ("loop", "loop_probe")):
        if probe in samples:
            out[key] = round_trips(samples[probe], t0, t1)
    return out


def run_one(case: Case, n: int, target: str, workdir: Path) -> dict[str, Any]:
    """A fresh Tansu (and proxy), the case's setup, the measurement."""
    result: dict[str, Any] = {"case": case.name, "n": n, "target": target}
    with LocalTansu() as broker:
        proxy: ProxyProc | None = None
        try:
            broker_address = (broker.host, broker.port)
            if target == "proxy":
                extra: dict[str, Any] = {"quotas": QUOTAS_NOT_EXCEEDED}
                if case.quota_admin:
                    extra["quota_admin"] = QUOTA_ADMIN
                proxy = ProxyProc(broker_address, extra, workdir).start()
            env = Env(broker_address, proxy.address if proxy is not None else broker_address, proxy is not None)
            env.pids["broker"] = broker.pid
            if proxy is not None:
                env.pids["proxy"] = proxy.pid
            if case.setup is not None:
                case.setup(env, n)
            result.update(measure(case, n, env))
            result.update(env.notes)
            if proxy is not None and not proxy.alive():
                result["proxy_exited"] = proxy.log_tail()
            if broker.process is None or broker.process.poll() is not None:
                result["broker_exited"] = broker.log_tail()
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
            if proxy is not None:
                result["proxy_log_tail"] = proxy.log_tail()
        finally:
            if proxy is not None:
                proxy.stop()
    return result


# --- the table -------------------------------------------------------------------------------------


def _ms(value: Any) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _cell(row: dict[str, Any] | None, key: str) -> str:
    if row is None:
        return "-"
    if "error" in row:
        return "ERR"
    if key != "latency_ms":
        return _ms(row.get(key, {}).get("max_ms_during"))
    value = row.get(key)
    return _ms(value) + ("" if row.get("outcome") == "answered" else "*") + ("e" if row.get("error_codes") else "")


def table(rows: list[dict[str, Any]]) -> str:
    by: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        by.setdefault((r["case"], r["n"]), {})[r["target"]] = r
    head = ("case", "N", "frame bytes", "direct ms", "proxy ms", "other max direct", "other max proxy",
            "loop probe max", "proxy CPU ms")
    lines = [head]
    for (name, n), t in by.items():
        d, p = t.get("direct"), t.get("proxy")
        frame = (p or d or {}).get("frame_bytes")
        lines.append((name, f"{n:,}", "-" if frame is None else f"{frame:,}", _cell(d, "latency_ms"),
                      _cell(p, "latency_ms"), _cell(d, "other_client"), _cell(p, "other_client"),
                      _cell(p, "loop_probe"), "-" if p is None or "error" in p else _ms(p.get("proxy_cpu_ms"))))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = []
    for j, line in enumerate(lines):
        text.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
        if j == 0:
            text.append("  ".join("-" * w for w in widths))
    text.append("ms: milliseconds. other max: the other client's longest ApiVersions v0 round trip during the "
                "big request (through the proxy it reaches Tansu too). loop probe max: its longest round trip, "
                f"on a second connection, of ApiVersions v{UNKNOWN_API_VERSIONS_VERSION}, which the proxy answers "
                "without the broker. proxy CPU: the proxy process's CPU time (all threads, both probes' round "
                "trips included) during the big request. e: the response carries error codes (JSON: "
                "error_codes); *: no response (JSON: outcome); ERR: the run failed (JSON: error).")
    return "\n".join(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="entries per frame, growing")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all; see --list)")
    ap.add_argument("--limit-s", type=float, default=LIMIT_S,
                    help="a case stops growing once one request, or its setup on the broker, took longer")
    ap.add_argument("--json", type=Path, default=RESULTS)
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    if args.list:
        for c in CASES.values():
            print(f"{c.name:32} {c.note}")
        return 0
    sizes = sorted(int(s) for s in args.sizes.split(",") if s)
    names = [s for s in args.cases.split(",") if s] or list(CASES)
    unknown = [s for s in names if s not in CASES]
    if unknown:
        ap.error(f"unknown cases {unknown}; --list shows them")
    workdir = Path(tempfile.mkdtemp(prefix="kqp-stall-"))
    started = time.time()
    rows: list[dict[str, Any]] = []
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, "-m", "bench.stall", *(argv or sys.argv[1:])]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "loadavg_at_start": os.getloadavg()},
        "tansu": tansu_version(),
        "sizes": sizes, "limit_s": args.limit_s, "quotas": QUOTAS_NOT_EXCEEDED, "quota_admin": QUOTA_ADMIN,
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    for name in names:
        case = CASES[name]
        for n in sizes:
            slowest = 0.0
            for target in TARGETS:
                r = run_one(case, n, target, workdir)
                rows.append(r)
                report["elapsed_s"] = time.time() - started
                args.json.write_text(json.dumps(report, indent=1))  # so far: an interrupted run keeps it
                other = r.get("other_client", {}).get("max_ms_during")
                loop = r.get("loop_probe", {}).get("max_ms_during")
                log(f"{name} N={n:,} {target}: "
                    + (f"ERROR {r['error']}" if "error" in r else
                       f"{r['latency_ms']:,.1f} ms ({r['outcome']}, errors {r.get('error_codes')}), "
                       f"other client's longest {_ms(other)} ms, loop probe's {_ms(loop)} ms"))
                slowest = max(slowest, r.get("latency_ms", 0.0) / 1000, r.get("setup_s", 0.0))
            if slowest > args.limit_s:
                log(f"{name}: a request or the broker's setup took {slowest:.1f} s at N={n:,}: not grown further")
                break
    print(table(rows))
    log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
