"""Client-side measurements: produce/consume throughput, request round trips, idle connections.

These run in the benchmark runner process; everything measured (broker, pump, proxies) is a
separate process. ``ca_file`` (where taken): the endpoint terminates TLS and the client trusts
that CA (confluent-kafka with ``security.protocol=SSL``, raw sockets through ``ssl``).
"""

from __future__ import annotations

import os
import resource
import socket
import statistics
import struct
import time
from dataclasses import asdict, dataclass

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from kafka.protocol.metadata import ApiVersionsRequest
from kafka.protocol.producer import ProduceRequest
from kafka.record.memory_records import MemoryRecordsBuilder

from .procs import CpuClock, rss_kib, system_busy_seconds
from .tls import confluent_config, connect


def _bootstrap(address: tuple[str, int]) -> str:
    return f"{address[0]}:{address[1]}"


def create_topic(address: tuple[str, int], topic: str, partitions: int, timeout_s: float = 30.0,
                 ca_file: str | None = None) -> None:
    admin = AdminClient({"bootstrap.servers": _bootstrap(address), **confluent_config(ca_file)})
    futures = admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)],
                                  operation_timeout=timeout_s, request_timeout=timeout_s)
    futures[topic].result(timeout_s)
    # Wait until the topic shows up with a leader for every partition.
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        md = admin.list_topics(topic, timeout=5)
        t = md.topics.get(topic)
        if t is not None and t.error is None and len(t.partitions) == partitions and all(
            p.leader >= 0 for p in t.partitions.values()
        ):
            return
        time.sleep(0.05)
    raise RuntimeError(f"topic {topic} not ready after {timeout_s}s")


def delete_topics(address: tuple[str, int], topics: list[str], timeout_s: float = 30.0,
                  ca_file: str | None = None) -> None:
    """Deletes ``topics`` once their runs are measured: a broker with memory storage (Tansu's, in
    the benches) keeps every record until then, so rounds would add up to the machine's memory."""
    admin = AdminClient({"bootstrap.servers": _bootstrap(address), **confluent_config(ca_file)})
    for future in admin.delete_topics(topics, operation_timeout=timeout_s, request_timeout=timeout_s).values():
        future.result(timeout_s)


@dataclass
class Throughput:
    records: int
    bytes: int
    seconds: float
    errors: int = 0
    server_cpu_s: float | None = None  # CPU time of the intermediary process during the run
    broker_cpu_s: float | None = None  # CPU time of the Tansu broker during the run
    client_cpu_s: float | None = None  # CPU time of this (client) process during the run
    other_cpu_s: float | None = None  # CPU time of everything else on the machine (noise)

    @property
    def records_per_s(self) -> float:
        return self.records / self.seconds if self.seconds else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["records_per_s"] = self.records_per_s
        d["mb_per_s"] = self.mb_per_s
        for name in ("server", "broker", "client", "other"):
            v = d[f"{name}_cpu_s"]
            if v is not None and self.seconds:
                d[f"{name}_cpu_pct"] = 100.0 * v / self.seconds
        if self.server_cpu_s is not None and self.records:
            d["server_cpu_ns_per_record"] = 1e9 * self.server_cpu_s / self.records
            d["server_cpu_ms_per_mb"] = 1e3 * self.server_cpu_s / (self.bytes / 1e6)
        return d


def _self_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class _CpuWatch:
    """CPU seconds used by the intermediary, the broker (both from the scheduler's nanosecond
    run times, see CpuClock) and this process since creation."""

    def __init__(self, pid: int | None, broker_pid: int | None) -> None:
        self.clocks = {k: CpuClock(p) for k, p in (("server", pid), ("broker", broker_pid)) if p}
        self.client_start = _self_cpu()
        self.system_start = system_busy_seconds()

    def fill(self, t: Throughput) -> Throughput:
        for k, clock in self.clocks.items():
            try:
                setattr(t, f"{k}_cpu_s", clock.elapsed())
            except OSError:
                pass
        t.client_cpu_s = _self_cpu() - self.client_start
        ours = t.client_cpu_s + (t.server_cpu_s or 0.0) + (t.broker_cpu_s or 0.0)
        t.other_cpu_s = max(0.0, system_busy_seconds() - self.system_start - ours)
        return t


def produce(address: tuple[str, int], topic: str, record_size: int, max_records: int,
            max_seconds: float, watch_pid: int | None = None, broker_pid: int | None = None,
            linger_ms: int = 5, idempotent: bool = False, ca_file: str | None = None) -> Throughput:
    """Produce up to ``max_records`` values of ``record_size`` bytes (stops early after
    ``max_seconds``) and flush; throughput counts delivered records from first send to flush."""
    delivered = [0, 0]  # ok, failed

    def on_delivery(err, _msg) -> None:
        delivered[1 if err is not None else 0] += 1

    producer = Producer({
        "bootstrap.servers": _bootstrap(address),
        "linger.ms": linger_ms,
        "acks": "all",
        "compression.type": "none",
        "queue.buffering.max.messages": 500_000,
        "queue.buffering.max.kbytes": 512 * 1024,
        "enable.idempotence": idempotent,
        **confluent_config(ca_file),
    })
    # Warm up: metadata + connection to the leader, outside the timed part.
    producer.produce(topic, b"w" * record_size, on_delivery=on_delivery)
    if producer.flush(30) != 0:
        raise RuntimeError("warm-up record not delivered")
    delivered[0] = delivered[1] = 0
    value = os.urandom(record_size)
    produce_ = producer.produce
    poll = producer.poll
    cpu = _CpuWatch(watch_pid, broker_pid)
    t0 = time.perf_counter()
    deadline = t0 + max_seconds
    sent = 0
    while sent < max_records:
        try:
            produce_(topic, value, on_delivery=on_delivery)
        except BufferError:
            poll(0.005)
            continue
        sent += 1
        if sent % 2000 == 0:
            poll(0)
            if time.perf_counter() >= deadline:
                break
    remaining = producer.flush(60)
    elapsed = time.perf_counter() - t0
    result = cpu.fill(Throughput(records=delivered[0], bytes=delivered[0] * record_size,
                                 seconds=elapsed, errors=delivered[1]))
    if remaining:
        raise RuntimeError(f"{remaining} records still undelivered after flush")
    return result


def consume(address: tuple[str, int], topic: str, partitions: int, expected: int,
            timeout_s: float = 60.0, watch_pid: int | None = None,
            broker_pid: int | None = None, ca_file: str | None = None) -> Throughput:
    """Read ``expected`` records from the beginning of every partition with assign().

    The clock starts when the first batch of records reaches the application (so consumer
    start-up, ListOffsets and the first fetch are not counted) and those first records are not
    counted either. librdkafka's fetch queue is sized so it never backs off (its default
    ``fetch.queue.backoff.ms`` of 1 s would otherwise dominate the measurement).
    """
    consumer = Consumer({
        "bootstrap.servers": _bootstrap(address),
        "group.id": f"bench-{topic}",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "fetch.max.bytes": 52428800,
        "max.partition.fetch.bytes": 10485760,
        "fetch.wait.max.ms": 100,
        "queued.min.messages": 1_000_000,
        "queued.max.messages.kbytes": 1_048_576,
        "fetch.queue.backoff.ms": 1,
        **confluent_config(ca_file),
    })
    try:
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        deadline = time.perf_counter() + timeout_s
        cpu = t0 = None
        records = nbytes = 0
        total = 0
        while total < expected:
            if time.perf_counter() > deadline:
                raise RuntimeError(f"consumed only {total} of {expected} records in {timeout_s}s")
            msgs = consumer.consume(num_messages=10000, timeout=0.5)
            if not msgs:
                continue
            for msg in msgs:
                err = msg.error()
                if err is not None:
                    raise KafkaException(err)
            total += len(msgs)
            if t0 is None:  # first batch: start the clock, do not count it
                t0 = time.perf_counter()
                cpu = _CpuWatch(watch_pid, broker_pid)
                continue
            records += len(msgs)
            nbytes += sum(len(m.value()) for m in msgs)
        elapsed = time.perf_counter() - t0
        return cpu.fill(Throughput(records=records, bytes=nbytes, seconds=elapsed))
    finally:
        consumer.close()


# --- raw-socket round trips -------------------------------------------------------------------


def _recv_exact(sock: socket.socket, n: int, buf: bytearray) -> None:
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:n], n - got)
        if k == 0:
            raise ConnectionError("peer closed")
        got += k


def _frame_template(request, client_id: str = "bench-rtt") -> bytearray:
    request.with_header(correlation_id=0, client_id=client_id)
    return bytearray(request.encode(header=True, framed=True))


def api_versions_frame(version: int = 3) -> bytearray:
    if version >= 3:
        req = ApiVersionsRequest[version](client_software_name="bench", client_software_version="1")
    else:
        req = ApiVersionsRequest[version]()
    return _frame_template(req)


def produce_frame(topic: str, value_size: int = 100, version: int = 8, acks: int = 1) -> bytearray:
    builder = MemoryRecordsBuilder(magic=2, compression_type=0, batch_size=1 << 20)
    builder.append(int(time.time() * 1000), None, b"r" * value_size)
    builder.close()
    records = bytes(builder.buffer())
    Req = ProduceRequest[version]
    req = Req(
        transactional_id=None, acks=acks, timeout_ms=30000,
        topic_data=[Req.TopicProduceData(name=topic, partition_data=[
            Req.TopicProduceData.PartitionProduceData(index=0, records=records)])],
    )
    return _frame_template(req)


@dataclass
class RoundTrips:
    n: int
    p50_us: float
    p99_us: float
    mean_us: float
    min_us: float

    def as_dict(self) -> dict:
        return asdict(self)


def round_trip_samples(address: tuple[str, int], frame: bytearray, n: int, warmup: int = 200,
                       ca_file: str | None = None) -> list[float]:
    """Send the same request ``n`` times, one at a time, on one connection; microseconds each."""
    samples: list[float] = []
    buf = bytearray(1 << 20)
    with connect(address, ca_file) as s:
        clock = time.perf_counter_ns
        for i in range(warmup + n):
            struct.pack_into(">i", frame, 8, i)  # correlation id: size(4) key(2) version(2)
            t0 = clock()
            s.sendall(frame)
            _recv_exact(s, 4, buf)
            size = struct.unpack_from(">i", buf)[0]
            _recv_exact(s, size, buf)
            t1 = clock()
            if struct.unpack_from(">i", buf)[0] != i:
                raise RuntimeError("correlation id mismatch")
            if i >= warmup:
                samples.append((t1 - t0) / 1000.0)
    return samples


def summarize(samples: list[float]) -> RoundTrips:
    samples = sorted(samples)
    n = len(samples)
    return RoundTrips(n=n, p50_us=samples[n // 2], p99_us=samples[min(n - 1, int(n * 0.99))],
                      mean_us=statistics.fmean(samples), min_us=samples[0])


def round_trips(address: tuple[str, int], frame: bytearray, n: int, warmup: int = 200) -> RoundTrips:
    return summarize(round_trip_samples(address, frame, n, warmup))


RTT_BLOCK = 200
RTT_WARMUP = 200


def interleaved_request_count(n: int, block: int = RTT_BLOCK, warmup: int = RTT_WARMUP) -> int:
    """Requests sent to each endpoint by :func:`interleaved_round_trips`, warm-up included."""
    return block * (-(-warmup // block) + -(-n // block))


def interleaved_round_trips(addresses: dict[str, tuple[str, int]], frame: bytearray, n: int,
                            block: int = RTT_BLOCK, warmup: int = RTT_WARMUP,
                            ca_files: dict[str, str | None] | None = None) -> dict[str, list[float]]:
    """Round trips against several endpoints at once: ``block`` sequential requests on one,
    then the next, and so on until each has ``n`` samples. Interleaving in small blocks puts
    every endpoint under the same background load, which matters on a shared machine.
    ``ca_files``: the endpoints that terminate TLS, with the CA to trust."""
    ca_files = ca_files or {}
    samples: dict[str, list[float]] = {name: [] for name in addresses}
    buf = bytearray(1 << 20)
    socks: dict[str, socket.socket] = {}
    try:
        for name, address in addresses.items():
            socks[name] = connect(address, ca_files.get(name))
        clock = time.perf_counter_ns
        corr = 0
        rounds = -(-n // block)
        warm_rounds = -(-warmup // block)
        for r in range(warm_rounds + rounds):
            for name, s in socks.items():
                out = samples[name]
                for _ in range(block):
                    corr += 1
                    struct.pack_into(">i", frame, 8, corr)
                    t0 = clock()
                    s.sendall(frame)
                    _recv_exact(s, 4, buf)
                    _recv_exact(s, struct.unpack_from(">i", buf)[0], buf)
                    t1 = clock()
                    if struct.unpack_from(">i", buf)[0] != corr:
                        raise RuntimeError(f"{name}: correlation id mismatch")
                    if r >= warm_rounds:
                        out.append((t1 - t0) / 1000.0)
    finally:
        for s in socks.values():
            s.close()
    return {name: v[:n] for name, v in samples.items()}


# --- idle connections -------------------------------------------------------------------------


@dataclass
class IdleMemory:
    connections: int
    rss_before_kib: int
    rss_after_kib: int
    per_connection_bytes: float
    open_seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


def idle_connection_memory(address: tuple[str, int], pid: int, n: int = 1000, settle_s: float = 1.0,
                           silent: bool = False, ca_file: str | None = None) -> IdleMemory:
    """Open ``n`` connections, one ApiVersions round trip on each (so the upstream connection
    exists), keep them open, and report the RSS growth of ``pid`` per connection. ``silent``:
    send nothing on them (a client connected and idle from the start; over TLS, the handshake
    is done and nothing sent after it)."""
    frame = api_versions_frame(3)
    buf = bytearray(1 << 16)
    # Warm-up: a few connections opened and closed, so first-use allocations are not counted.
    for i in range(5):
        with connect(address, ca_file, timeout=10, nodelay=False) as s:
            struct.pack_into(">i", frame, 8, i)
            s.sendall(frame)
            _recv_exact(s, 4, buf)
            _recv_exact(s, struct.unpack_from(">i", buf)[0], buf)
    time.sleep(settle_s)
    before = rss_kib(pid)
    socks: list[socket.socket] = []
    t0 = time.perf_counter()
    try:
        for i in range(n):
            s = connect(address, ca_file, nodelay=False)
            socks.append(s)
            if silent:
                continue
            struct.pack_into(">i", frame, 8, i)
            s.sendall(frame)
            _recv_exact(s, 4, buf)
            _recv_exact(s, struct.unpack_from(">i", buf)[0], buf)
        opened = time.perf_counter() - t0
        time.sleep(settle_s)
        after = rss_kib(pid)
    finally:
        for s in socks:
            s.close()
    return IdleMemory(connections=n, rss_before_kib=before, rss_after_kib=after,
                      per_connection_bytes=(after - before) * 1024 / n, open_seconds=opened)
