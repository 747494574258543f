"""``kafka-quota-proxy demo``: a local broker with the proxy in front, used for real.

Starts Tansu on loopback, the proxy in front of it (usage log on), creates a topic through the
proxy, produces and consumes records with kafka-python, shows a topic storm and a producer
restart loop being held back, then turns generated multi-tenant usage into a report with the
PySpark pipeline, prints what happened and where to look, and keeps broker and proxy running
until Ctrl-C (or ``--duration``). Its files (usage log, sample usage, report) are in a temporary
directory it names at the start and removes when it exits, unless ``--keep``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, cast

from config import parse_config
from protocol.headers import response_body_offset
from protocol.messages import decode_response
from proxy.app.local_broker import LocalTansu
from proxy.app.server import ProxyServer

if TYPE_CHECKING:
    import socket

# kafka-python ships no types: its requests and decoded responses are Any here.

TOPIC = "demo-events"
RECORDS = 5_000
PRODUCER_IDS_PER_MINUTE = 5
SAMPLE_TENANTS = 20  # steady tenants of the sample usage the report runs on


class _ClientRound(TypedDict):
    produced: int
    produce_s: float
    consumed: int


class _StormRound(TypedDict):
    admitted: int
    rejected: int
    throttle_ms: int
    waited_ms: float


class _RestartRound(TypedDict):
    producer_id: int
    error: int
    throttle_ms: int
    waited_ms: float


def _client_round(bootstrap: str) -> _ClientRound:
    from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
    from kafka.admin import NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="demo-admin")
    admin.create_topics([NewTopic(TOPIC, num_partitions=3, replication_factor=1)])
    start = time.monotonic()
    producer = KafkaProducer(bootstrap_servers=bootstrap, client_id="demo-producer", linger_ms=5)
    for i in range(RECORDS):
        producer.send(TOPIC, key=str(i % 10).encode(), value=f"event {i}".encode())
    producer.flush()
    produced_s = time.monotonic() - start
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, client_id="demo-consumer",
        auto_offset_reset="earliest", consumer_timeout_ms=3000,
    )
    consumer.assign([TopicPartition(TOPIC, p) for p in range(3)])
    consumed = 0
    for _ in consumer:
        consumed += 1
        if consumed == RECORDS:
            break
    consumer.close()
    producer.close()
    admin.close()
    return {"produced": RECORDS, "produce_s": produced_s, "consumed": consumed}


def _topic_storm(bootstrap: str, rounds: int = 6, per_round: int = 10, partitions: int = 2) -> list[_StormRound]:
    """A tenant ("storm") creating topics in a loop with CreateTopics v7 (strict, KIP-599)."""
    import socket

    from kafka.protocol.admin import CreateTopicsRequest

    host, port = bootstrap.rsplit(":", 1)
    seen: list[_StormRound] = []
    with socket.create_connection((host, int(port)), timeout=30) as s:
        for r in range(rounds):
            T = CreateTopicsRequest[7].CreatableTopic
            topics = [T(name=f"storm-{r}-{i}", num_partitions=partitions, replication_factor=1,
                        assignments=[], configs=[]) for i in range(per_round)]
            req = CreateTopicsRequest[7](topics=topics, timeout_ms=10_000, validate_only=False)
            sent = time.monotonic()
            resp = _round_trip(s, req, r, "storm")
            waited_ms = (time.monotonic() - sent) * 1000
            errors = [t.error_code for t in resp.topics]
            seen.append({"admitted": errors.count(0), "rejected": errors.count(89),
                         "throttle_ms": resp.throttle_time_ms, "waited_ms": waited_ms})
    return seen


def _round_trip(sock: socket.socket, request: Any, correlation_id: int, client_id: str) -> Any:
    """One request on a blocking socket; the decoded response."""
    import socket
    import struct

    request.with_header(correlation_id=correlation_id, client_id=client_id)
    sock.sendall(bytes(request.encode(header=True, framed=True)))
    (size,) = struct.unpack(">i", sock.recv(4, socket.MSG_WAITALL))
    frame = sock.recv(size, socket.MSG_WAITALL)
    key, version = request.API_KEY, request.API_VERSION
    return decode_response(key, version, memoryview(frame)[response_body_offset(frame, key, version):])


def _restart_loop(bootstrap: str, restarts: int = 8) -> list[_RestartRound]:
    """A producer that restarts in a loop (KIP-936): every restart asks the broker for a new
    producer id (InitProducerId) and produces one idempotent batch with it."""
    import socket

    from kafka.protocol.producer import ProduceRequest
    from kafka.protocol.producer.transaction import InitProducerIdRequest
    from kafka.record import MemoryRecordsBuilder

    host, port = bootstrap.rsplit(":", 1)
    seen: list[_RestartRound] = []
    for r in range(restarts):
        with socket.create_connection((host, int(port)), timeout=30) as s:
            init = _round_trip(s, InitProducerIdRequest[4](transactional_id=None, transaction_timeout_ms=60_000,
                                                            producer_id=-1, producer_epoch=-1),
                               1, f"restarting-{r}")
            builder = MemoryRecordsBuilder(2, 0, 1 << 16, producer_id=init.producer_id,
                                           producer_epoch=init.producer_epoch, base_sequence=0)
            builder.append(timestamp=None, key=None, value=b"hello from restart %d" % r, headers=[])
            builder.close()
            T = ProduceRequest[9].TopicProduceData
            topic = T(name=TOPIC, partition_data=[T.PartitionProduceData(index=0, records=bytes(builder.buffer()))])
            sent = time.monotonic()
            resp = _round_trip(s, ProduceRequest[9](transactional_id=None, acks=1, timeout_ms=10_000,
                                                    topic_data=[topic]), 2, f"restarting-{r}")
            part = resp.responses[0].partition_responses[0]
            seen.append({"producer_id": init.producer_id, "error": part.error_code,
                         "throttle_ms": resp.throttle_time_ms, "waited_ms": (time.monotonic() - sent) * 1000})
    return seen


def _metric_lines(url: str, prefixes: tuple[str, ...]) -> list[str]:
    """The samples of these families, less the per-kind counters still at 0 (seven kinds, four
    families: most of them are 0 in the demo, and the ones that moved are what it shows)."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return [line for line in text.splitlines()
            if line.startswith(prefixes) and not ("_total{kind=" in line and line.endswith(" 0.0"))]


def _sample_report(workdir: Path, verbose: bool) -> list[str]:
    """Generated usage of 20 steady tenants plus a noisy neighbour, a topic storm and a restart
    loop through ``kafka-quota-proxy report``."""
    import importlib.util

    from pipeline.generate import NOISY, RESTARTS, STORM, generate

    sample = workdir / "sample-usage"
    rows = generate(sample, principals=SAMPLE_TENANTS, hours=2)
    # Say what is counted: the report's lines count principals (user / client id), and "the other
    # N principals" of an outlier line are those of its quota kind, not the 20 tenants.
    print(f"\ngenerated {rows:,} usage rows over 2 hours in {sample}")
    print(f"   {SAMPLE_TENANTS + 3} principals: {SAMPLE_TENANTS} steady tenants (half produce, half consume), "
          f"a noisy neighbour ({NOISY[0]}), a topic storm ({STORM[0]}) and a producer restart loop ({RESTARTS[0]})")
    if importlib.util.find_spec("pyspark") is None or shutil.which("java") is None:
        print("   (report skipped: it needs the pipeline extra and Java 17 — "
              "pip install 'kafka-quota-proxy[pipeline]', apt-get install openjdk-17-jre-headless)")
        return []
    from pipeline.errors import UsageError
    from pipeline.report import Options, run_report

    spark_log = workdir / "spark.log"
    print("running the report on it with Spark (local[*]), about a minute"
          + (", its progress below:" if verbose else f"; Spark's own output goes to {spark_log}"))
    try:
        with contextlib.nullcontext() if verbose else _stderr_to(spark_log):
            try:
                result = run_report(Options(usage=str(sample), out=workdir / "sample-report", quiet=not verbose))
            finally:
                _stop_spark()  # its JVM and Python workers need not outlive the report
    except UsageError as exc:
        print(f"   report failed: {exc}; Spark's own output is in {spark_log}")
        return []
    for line in result.headlines:
        print(f"   {line}")
    print(f"   report: {result.files['html']}")
    print(f"   recommended quotas: {result.files['recommended_quotas']}")
    return [f"report on the sample: {result.files['html']}",
            f"recommended quotas: {result.files['recommended_quotas']}"]


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """File descriptor 2 goes to ``path`` meanwhile: the JVM Spark starts writes its banner and
    warnings there, not between the demo's lines."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _stop_spark() -> None:
    """Stops the session and the JVM behind it (SparkSession.stop leaves the py4j gateway's JVM,
    some 700 MB, running until this process exits)."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    session = SparkSession.getActiveSession()
    if session is not None:
        session.stop()
    gateway = SparkContext._gateway
    if gateway is None:
        return
    proc = getattr(gateway, "proc", None)  # pyspark.java_gateway.launch_gateway keeps the JVM's Popen here
    with contextlib.suppress(Exception):
        gateway.shutdown()
    if proc is not None:
        with contextlib.suppress(Exception):
            proc.stdin.close()  # the gateway server exits when its stdin closes
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.terminate()
            proc.wait(timeout=10)
    SparkContext._gateway = None
    SparkContext._jvm = None


async def run_demo(duration_s: float | None, report: bool = True, verbose: bool = False,
                   keep: bool = False) -> int:
    # Whatever fails, a proxy that was made is stopped, the broker is stopped, and the files go
    # (unless --keep).
    async with contextlib.AsyncExitStack() as cleanup:
        broker = await asyncio.to_thread(LocalTansu().start)
        cleanup.callback(broker.stop)
        print(f"Tansu broker (pid {broker.pid}) on {broker.bootstrap}")
        workdir = Path(tempfile.mkdtemp(prefix="kqp-demo-"))
        cleanup.callback(_leave, workdir, keep)
        print(f"files of this demo in {workdir} " + ("(kept when it exits: --keep)" if keep
                                                     else "(removed when it exits; --keep keeps them)"))
        config = parse_config({
            "upstream": {"bootstrap_servers": [broker.bootstrap]},
            "listen": {"bootstrap_port": 0, "broker_port_base": 0},
            "metrics": {"port": 0},
            "quotas": [
                # KIP-599: the "storm" tenant may create or delete 4 partitions per second (burst 44).
                {"user": "<default>", "client_id": "storm", "controller_mutation_rate": 4},
                # KIP-936: every user may introduce 5 new producer ids per minute.
                {"user": "<default>", "producer_ids_rate": PRODUCER_IDS_PER_MINUTE},
            ],
            "producer_id_quota": {"producer_id_quota_window_size_seconds": 60},
            "usage_log": {"directory": str(workdir / "usage"), "interval_seconds": 2, "proxy_name": "demo"},
        })
        server = ProxyServer(config)
        cleanup.push_async_callback(server.stop)
        await server.start()
        # Both set by start() (the demo's config keeps metrics on).
        bootstrap = "{}:{}".format(*cast("tuple[str, int]", server.bootstrap_address))
        metrics_url = "http://{}:{}/metrics".format(*cast("tuple[str, int]", server.metrics_address))
        print(f"kafka-quota-proxy on {bootstrap}  (broker ports: {server.cluster.node_ports})")
        result = await asyncio.to_thread(_client_round, bootstrap)
        print(
            f"through the proxy: created topic {TOPIC!r}, produced {result['produced']} records "
            f"in {result['produce_s']:.2f} s, consumed {result['consumed']} back"
        )
        print("\ntenant 'storm' (controller_mutation_rate 4/s, burst 44) creates 10 topics x 2 "
              "partitions per request, back to back:")
        storm = await asyncio.to_thread(_topic_storm, bootstrap)
        for i, r in enumerate(storm):
            print(f"   request {i + 1}: {r['admitted']:2d} admitted, {r['rejected']:2d} rejected with "
                  f"THROTTLING_QUOTA_EXCEEDED, throttle_time_ms={r['throttle_ms']}, "
                  f"answered after {r['waited_ms']:.0f} ms")
        print(f"\na producer restarting in a loop (producer_ids_rate {PRODUCER_IDS_PER_MINUTE} new ids per "
              "minute; the demo's own producer already used one):")
        restarts = await asyncio.to_thread(_restart_loop, bootstrap)
        for i, restart in enumerate(restarts):
            # The broker hands out the id (InitProducerId); the proxy judges the Produce that uses it.
            outcome = "written" if restart["error"] == 0 else (
                "refused with THROTTLING_QUOTA_EXCEEDED (nothing written)" if restart["error"] == 89
                else f"error {restart['error']}")
            print(f"   restart {i + 1}: new producer id {restart['producer_id']} from the broker; its first Produce "
                  f"{outcome}, throttle_time_ms={restart['throttle_ms']}, answered after {restart['waited_ms']:.0f} ms")
        lines = await asyncio.to_thread(
            _metric_lines, metrics_url,
            ("kqp_requests_total", "kqp_bytes_total", "kqp_quota_", "kqp_producer_ids_tokens",
             "kqp_producer_ids_new", "kqp_producer_ids_rejected", "kqp_producer_ids_live_layers"),
        )
        print("proxy metrics after the round (counters by quota kind at 0 left out):")
        for line in lines:
            print("   ", line)
        reported = await asyncio.to_thread(_sample_report, workdir, verbose) if report else []
        print(f"\nThe proxy's own usage log (every 2 s) is in {workdir / 'usage'}")
        print(f"a report on it:\n   {_tool()} report --usage {workdir / 'usage'} --out {workdir / 'live-report'}")
        print("\nSummary:")
        print(f"   {result['consumed']:,} of {RECORDS:,} records produced and consumed back through the proxy")
        print(f"   topic storm (controller_mutation_rate): {sum(r['admitted'] for r in storm)} topics created, "
              f"{sum(r['rejected'] for r in storm)} refused with THROTTLING_QUOTA_EXCEEDED")
        print(f"   restart loop (producer_ids_rate): {sum(r['error'] == 0 for r in restarts)} producers wrote, "
              f"{sum(r['error'] == 89 for r in restarts)} were refused")
        for line in reported:
            print(f"   {line}")
        # Each address on a line of its own, nothing touching it: it is copied from here.
        print("\nPoint any Kafka client at this bootstrap address:")
        print(f"   {bootstrap}")
        print("Metrics and health:")
        print(f"   {metrics_url}")
        print(f"   {metrics_url.replace('/metrics', '/healthz')}")
        await _wait(duration_s)
        return 0 if result["consumed"] == RECORDS else 1


def _leave(workdir: Path, keep: bool) -> None:
    """The demo's files go with it, unless ``--keep``: then it says where they are."""
    if keep:
        print(f"Kept the demo's files: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)


def _tool() -> str:
    """How to run this tool again from here: .venv/bin/kafka-quota-proxy after make, not a bare
    name that may not be on PATH."""
    here = Path(sys.argv[0])
    if here.name == "kafka-quota-proxy" and here.exists():
        relative = os.path.relpath(here)
        return relative if not relative.startswith("..") else str(here)
    return f"{Path(sys.executable)} -m proxy"


async def _wait(duration_s: float | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print("Running" + (f" for {duration_s:g} s" if duration_s else " until Ctrl-C") + ".")
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stop.wait(), duration_s)
