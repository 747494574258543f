"""Regenerates the golden wire captures in ``tests/golden/frames/`` (see README.md here).

    .venv/bin/python -m tests.golden.capture

Starts the real broker (Tansu) behind a frame-capturing relay and lets real clients
(kafka-python and confluent-kafka) produce a known set of records to fresh topics through it,
then consume two of those topics. Every frame between client and broker passes the relay;
the ProduceRequest frames and two FetchResponse frames per consumed topic are written out
without their 4-byte size prefix, with a manifest of what the client was asked to send.

Every expectation in the manifest comes from what the clients were told to do (and, for the
producer id and epoch, from the broker's InitProducerId answer), never from the frame itself.
Before anything is written each frame is decoded independently with kafka-python's own
classes and checked against those expectations; any disagreement aborts the run and leaves
the existing files untouched. This is not a pytest module; it needs the extra codec packages
listed in the README for kafka-python's snappy, lz4 and zstd.
"""

from __future__ import annotations

import asyncio
import io
import json
import struct
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.threaded_server import ThreadedServer, pipe

HERE = Path(__file__).resolve().parent
FRAMES_DIR = HERE / "frames"
MANIFEST = FRAMES_DIR / "manifest.json"

PARTITION = 0
CODEC_IDS = {"none": 0, "gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}
CASE_CODECS = ("none", "gzip", "lz4", "zstd", "snappy")
LEGACY_API_VERSION = (0, 10, 1)
LEGACY_CODECS = ("none", "gzip")
API_PRODUCE, API_FETCH, API_METADATA, API_INIT_PRODUCER_ID = 0, 1, 3, 22
TIMEOUT_S = 30.0

# Seven records with distinct keys and values; two carry headers (none for the legacy cases:
# message format v1 has no headers).
RECORDS: tuple[tuple[bytes, bytes, tuple[tuple[str, bytes], ...]], ...] = tuple(
    (
        b"key-%d" % i,
        b"value-%d:" % i + b"golden " * (i + 1),
        {1: (("trace-id", b"t-1"),), 4: (("trace-id", b"t-4"), ("origin", b"golden"))}.get(i, ()),
    )
    for i in range(7)
)


def records_for(legacy: bool) -> tuple[tuple[bytes, bytes, tuple[tuple[str, bytes], ...]], ...]:
    return tuple((k, v, ()) for k, v, _ in RECORDS) if legacy else RECORDS


# -- the relay ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    seq: int
    connection: int
    direction: str  # "request" (client to broker) or "response"
    api_key: int  # for a response: the api key of the request it answers (-1 if unknown)
    api_version: int
    correlation_id: int
    data: bytes  # the frame without its 4-byte size prefix


class CapturingRelay(ThreadedServer):
    """A TCP relay that forwards bytes unchanged and records every whole Kafka frame it sees.

    Runs its own event loop on a background thread. Requests are recorded before they are
    forwarded, so a response can always be matched to its request's api key and version.
    """

    thread_name = "capturing-relay"

    def __init__(self, host: str = "127.0.0.1") -> None:
        super().__init__(host)
        self._frames: list[Frame] = []
        self._next_connection = 0

    def mark(self) -> int:
        with self._lock:
            return len(self._frames)

    def since(self, mark: int) -> list[Frame]:
        with self._lock:
            return list(self._frames[mark:])

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with self._lock:
            connection = self._next_connection
            self._next_connection += 1
        try:
            upstream = await self._connect_target()
            if upstream is None:
                return
            up_reader, up_writer = upstream
            pending: dict[int, tuple[int, int]] = {}
            try:
                await asyncio.gather(
                    pipe(reader, up_writer, self._recorder(connection, "request", pending)),
                    pipe(up_reader, writer, self._recorder(connection, "response", pending)),
                )
            finally:
                up_writer.close()
        finally:
            writer.close()

    def _recorder(self, connection: int, direction: str, pending: dict[int, tuple[int, int]]):
        """Records every whole frame of one direction as its bytes pass (before they go on)."""
        buf = bytearray()

        def on_data(data: bytes) -> None:
            buf.extend(data)
            self._take_frames(connection, direction, buf, pending)

        return on_data

    def _take_frames(self, connection: int, direction: str, buf: bytearray,
                     pending: dict[int, tuple[int, int]]) -> None:
        while len(buf) >= 4:
            (size,) = struct.unpack_from(">i", buf, 0)
            if len(buf) < 4 + size:
                return
            data = bytes(buf[4 : 4 + size])
            del buf[: 4 + size]
            if direction == "request":
                api_key, api_version, correlation_id = struct.unpack_from(">hhi", data, 0)
                pending[correlation_id] = (api_key, api_version)
            else:
                (correlation_id,) = struct.unpack_from(">i", data, 0)
                api_key, api_version = pending.pop(correlation_id, (-1, -1))
            with self._lock:
                self._frames.append(
                    Frame(len(self._frames), connection, direction, api_key, api_version, correlation_id, data)
                )


# -- cases ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    client: str  # "kafka-python" or "confluent-kafka"
    idempotent: bool
    codec: str
    legacy: bool = False  # kafka-python with api_version=(0, 10, 1): message format v1

    @property
    def name(self) -> str:
        if self.legacy:
            return f"kafka-python-v0.10.1-{self.codec}"
        short = "kafka-python" if self.client == "kafka-python" else "confluent"
        return f"{short}-{'idem' if self.idempotent else 'plain'}-{self.codec}"

    @property
    def topic(self) -> str:
        return f"golden-{self.name}"

    @property
    def acks(self) -> int:
        return -1 if self.idempotent else 1

    @property
    def magic(self) -> int:
        return 1 if self.legacy else 2


@dataclass
class Outcome:
    case: Case
    frames: list[Frame] = field(default_factory=list)
    delivery_errors: list[str] = field(default_factory=list)
    error: str | None = None  # the client failed before or while producing


def all_cases() -> list[Case]:
    cases = [Case(client, idem, codec)
             for client in ("kafka-python", "confluent-kafka")
             for idem in (False, True)
             for codec in CASE_CODECS]
    cases += [Case("kafka-python", False, codec, legacy=True) for codec in LEGACY_CODECS]
    return cases


# Topics consumed for the FetchResponse captures: one uncompressed, one compressed.
FETCH_CASES = ("kafka-python-plain-none", "confluent-idem-zstd")
CONSUMERS = ("kafka-python", "confluent-kafka")


def client_versions() -> dict[str, str]:
    import confluent_kafka
    import kafka

    return {
        "kafka-python": kafka.__version__,
        "confluent-kafka": f"{confluent_kafka.__version__} (librdkafka {confluent_kafka.libversion()[0]})",
    }


def codec_package_versions() -> dict[str, str | None]:
    """The optional packages kafka-python's snappy, lz4 and zstd codecs came from."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("lz4", "zstandard", "python-snappy", "cramjam"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def kafka_python_codec_missing(codec: str) -> str | None:
    from kafka import codec as kcodec

    checks = {"none": True, "gzip": kcodec.has_gzip(), "snappy": kcodec.has_snappy(),
              "lz4": kcodec.has_lz4(), "zstd": kcodec.has_zstd()}
    packages = {"snappy": "python-snappy (or cramjam)", "lz4": "lz4", "zstd": "zstandard"}
    if checks[codec]:
        return None
    return f"kafka-python has no {codec} codec here: pip install {packages[codec]}"


def create_topics(bootstrap: str, topics: list[str]) -> None:
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="golden-admin", request_timeout_ms=10000)
    try:
        admin.create_topics([NewTopic(t, num_partitions=1, replication_factor=1) for t in topics])
    finally:
        admin.close()


def produce_kafka_python(bootstrap: str, case: Case, outcome: Outcome) -> None:
    from kafka import KafkaProducer

    config = dict(
        bootstrap_servers=bootstrap,
        client_id=f"golden-{case.name}",
        acks=case.acks,
        enable_idempotence=case.idempotent,
        compression_type=None if case.codec == "none" else case.codec,
        linger_ms=1000,
        batch_size=65536,
        request_timeout_ms=10000,
        delivery_timeout_ms=20000,
    )
    if not case.idempotent:
        config["retries"] = 0  # one ProduceRequest even when the broker refuses it
    if case.legacy:
        config["api_version"] = LEGACY_API_VERSION
    producer = KafkaProducer(**config)
    try:
        futures = [
            producer.send(case.topic, key=k, value=v, headers=list(h), partition=PARTITION)
            for k, v, h in records_for(case.legacy)
        ]
        producer.flush(timeout=TIMEOUT_S)
        for f in futures:
            try:
                f.get(timeout=TIMEOUT_S)
            except Exception as exc:  # the broker's refusal is part of what is recorded
                outcome.delivery_errors.append(repr(exc))
    finally:
        producer.close(timeout=5)


def produce_confluent(bootstrap: str, case: Case, outcome: Outcome) -> None:
    from confluent_kafka import Producer

    producer = Producer({
        "bootstrap.servers": bootstrap,
        "client.id": f"golden-{case.name}",
        "acks": "all" if case.idempotent else "1",
        "enable.idempotence": case.idempotent,
        "compression.type": case.codec,
        "linger.ms": 1000,
        "message.timeout.ms": 20000,
    })

    def delivered(err, _msg) -> None:
        if err is not None:
            outcome.delivery_errors.append(str(err))

    for k, v, h in records_for(case.legacy):
        producer.produce(case.topic, key=k, value=v, headers=list(h) or None, partition=PARTITION,
                         on_delivery=delivered)
    left = producer.flush(TIMEOUT_S)
    if left:
        outcome.delivery_errors.append(f"{left} messages still queued after flush")


def run_case(relay: CapturingRelay, case: Case) -> Outcome:
    outcome = Outcome(case)
    mark = relay.mark()
    try:
        if case.client == "kafka-python":
            produce_kafka_python(relay.bootstrap, case, outcome)
        else:
            produce_confluent(relay.bootstrap, case, outcome)
    except Exception as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    time.sleep(0.2)  # let the relay record the last responses
    outcome.frames = relay.since(mark)
    return outcome


def consume_kafka_python(bootstrap: str, topic: str, expected: int) -> int:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, client_id=f"golden-consumer-{topic}", group_id=None,
                             enable_auto_commit=False, fetch_max_wait_ms=200, request_timeout_ms=10000)
    got = 0
    try:
        tp = TopicPartition(topic, PARTITION)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        deadline = time.monotonic() + TIMEOUT_S
        while got < expected and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                got += len(batch)
    finally:
        consumer.close()
    return got


def consume_confluent(bootstrap: str, topic: str, expected: int) -> int:
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "client.id": f"golden-consumer-{topic}",
                         "group.id": f"golden-{topic}", "enable.auto.commit": False, "fetch.wait.max.ms": 200})
    got = 0
    try:
        consumer.assign([TopicPartition(topic, PARTITION, OFFSET_BEGINNING)])
        deadline = time.monotonic() + TIMEOUT_S
        while got < expected and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                got += 1
    finally:
        consumer.close()
    return got


# -- decoding with kafka-python (independent of the project's own parser) -------------------


class Disagreement(AssertionError):
    """A captured frame that does not say what the client was asked to send."""


def _expect(what: str, actual, expected) -> None:
    if actual != expected:
        raise Disagreement(f"{what}: frame says {actual!r}, expected {expected!r}")


def kp_request(frame: bytes, api_key: int, api_version: int):
    """kafka-python's decode of a request frame: (message, header length)."""
    from kafka.protocol.consumer import FetchRequest
    from kafka.protocol.producer import ProduceRequest

    cls = {API_PRODUCE: ProduceRequest, API_FETCH: FetchRequest}[api_key]
    stream = io.BytesIO(frame)
    header = cls.parse_header(stream, version=api_version)
    _expect("header api key", header.request_api_key, api_key)
    _expect("header api version", header.request_api_version, api_version)
    body = frame[stream.tell():]
    message = decode_whole(cls, body, api_version)
    message._header = None  # a decoded message has no header slot; encode() reads it
    _expect("re-encoded body", bytes(message.encode(version=api_version)), body)
    return message, stream.tell()


def kp_response(frame: bytes, api_key: int, api_version: int):
    """kafka-python's decode of a response frame: (message, header length)."""
    from kafka.protocol.consumer import FetchResponse
    from kafka.protocol.metadata import MetadataResponse
    from kafka.protocol.producer import InitProducerIdResponse, ProduceResponse

    cls = {API_PRODUCE: ProduceResponse, API_FETCH: FetchResponse, API_METADATA: MetadataResponse,
           API_INIT_PRODUCER_ID: InitProducerIdResponse}[api_key]
    stream = io.BytesIO(frame)
    cls.parse_header(stream, version=api_version)
    message = decode_whole(cls, frame[stream.tell():], api_version)
    return message, stream.tell()


def decode_whole(cls, body: bytes, version: int):
    """kafka-python's decode of a body that must be consumed to its last byte."""
    flexible = cls.flexible_version_q(version)
    decode_from = cls._struct.compiled_decode_from(version, compact=flexible, tagged=flexible, data_class=cls[None])
    message, end = decode_from(memoryview(body), 0)
    _expect(f"bytes left after {cls.__name__} v{version}", len(body) - end, 0)
    return message


def decode_record_set(raw: bytes, *, partial_tail: bool = False) -> list[dict]:
    """Each batch (for message format 0/1: each top-level message) with its records."""
    from kafka.record import MemoryRecords
    from kafka.record.default_records import DefaultRecordBatch

    records = MemoryRecords(bytes(raw))
    batches = []
    while (batch := records.next_batch()) is not None:
        if isinstance(batch, DefaultRecordBatch) and not batch.validate_crc():
            raise Disagreement("batch CRC does not match")
        items = list(batch)
        if isinstance(batch, DefaultRecordBatch):
            pid, epoch, seq = batch.producer_id, batch.producer_epoch, batch.base_sequence
            count = batch.records_count
            _expect("records_count field vs records decoded", count, len(items))
        else:
            pid = epoch = seq = -1
            for r in items:
                if not r.validate_crc():
                    raise Disagreement("legacy message CRC does not match")
        batches.append({
            "magic": batch.magic,
            "compression": batch.compression_type,
            "producer_id": pid,
            "producer_epoch": epoch,
            "base_sequence": seq,
            "records": [(r.key, r.value, tuple((k, bytes(v)) for k, v in (r.headers or ()))) for r in items],
        })
    if not partial_tail and records.valid_bytes() != len(raw):
        raise Disagreement(f"{len(raw) - records.valid_bytes()} bytes after the last whole batch")
    return batches


def check_record_set(raw: bytes, entry: dict, *, partial_tail: bool = False) -> None:
    batches = decode_record_set(raw, partial_tail=partial_tail)
    _expect("batches", len(batches), entry["batches"])
    decoded = [r for b in batches for r in b["records"]]
    _expect("records", len(decoded), entry["records"])
    sent = records_for(entry["magic"] < 2)
    _expect("keys, values and headers", decoded, [(k, v, h) for k, v, h in sent])
    for b in batches:
        _expect("magic", b["magic"], entry["magic"])
        _expect("compression", b["compression"], entry["compression"])
        _expect("producer_id", b["producer_id"], entry["producer_id"])
        _expect("producer_epoch", b["producer_epoch"], entry["producer_epoch"])
    _expect("base_sequence", batches[0]["base_sequence"], entry["base_sequence"])


def verify_entry(frame: bytes, entry: dict) -> None:
    """Checks one frame against its manifest entry with kafka-python's classes (and the
    project's header helpers, whose offsets the manifest records). Raises Disagreement."""
    from protocol.headers import parse_request_header, response_body_offset

    api_key, api_version = entry["api_key"], entry["api_version"]
    if entry["kind"] == "produce_request":
        header = parse_request_header(frame)
        _expect("api key", header.api_key, api_key)
        _expect("api version", header.api_version, api_version)
        _expect("protocol.headers body offset", header.body_offset, entry["body_offset"])
        message, header_len = kp_request(frame, api_key, api_version)
        _expect("kafka-python header length", header_len, entry["body_offset"])
        _expect("acks", message.acks, entry["acks"])
        if api_version >= 3:
            _expect("transactional_id", message.transactional_id, None)
        _expect("topics", [t.name for t in message.topic_data], [entry["topic"]])
        parts = message.topic_data[0].partition_data
        _expect("partitions", [p.index for p in parts], [entry["partition"]])
        check_record_set(parts[0].records, entry)
    elif entry["kind"] == "fetch_response":
        _expect("response_body_offset", response_body_offset(frame, api_key, api_version), entry["body_offset"])
        message, header_len = kp_response(frame, api_key, api_version)
        _expect("kafka-python header length", header_len, entry["body_offset"])
        _expect("error_code", message.error_code if api_version >= 7 else 0, 0)
        found = [(t, p) for t in message.responses for p in t.partitions if p.records]
        _expect("partitions with records", len(found), 1)
        topic, part = found[0]
        if api_version < 13:
            _expect("topic", topic.topic, entry["topic"])
        else:
            _expect("topic id", str(topic.topic_id), entry["topic_id"])
        _expect("partition", part.partition_index, entry["partition"])
        _expect("partition error_code", part.error_code, 0)
        check_record_set(part.records, entry, partial_tail=True)
    else:
        raise Disagreement(f"unknown kind {entry['kind']!r}")


# -- assembling the manifest ----------------------------------------------------------------


def request_header_version(api_key: int, api_version: int) -> int:
    from kafka.protocol.consumer import FetchRequest
    from kafka.protocol.producer import ProduceRequest

    cls = {API_PRODUCE: ProduceRequest, API_FETCH: FetchRequest}[api_key]
    return 2 if cls.flexible_version_q(api_version) else 1


def response_header_version(api_key: int, api_version: int) -> int:
    from kafka.protocol.consumer import FetchResponse

    cls = {API_FETCH: FetchResponse}[api_key]
    return 1 if cls.flexible_version_q(api_version) else 0


def producer_identity(outcome: Outcome) -> tuple[int, int]:
    """(producer id, epoch) from the broker's InitProducerId answer to this producer."""
    if not outcome.case.idempotent:
        return -1, -1
    answers = [f for f in outcome.frames if f.direction == "response" and f.api_key == API_INIT_PRODUCER_ID]
    if not answers:
        raise Disagreement(f"{outcome.case.name}: idempotent producer got no InitProducerId response")
    ids = set()
    for f in answers:
        message, _ = kp_response(f.data, API_INIT_PRODUCER_ID, f.api_version)
        if message.error_code == 0:
            ids.add((message.producer_id, message.producer_epoch))
    if len(ids) != 1:
        raise Disagreement(f"{outcome.case.name}: InitProducerId answers {sorted(ids)}")
    return ids.pop()


def produce_answers(outcome: Outcome) -> dict[tuple[int, int], int]:
    """(connection, correlation id) -> the partition error code in the ProduceResponse."""
    answers = {}
    for f in outcome.frames:
        if f.direction == "response" and f.api_key == API_PRODUCE:
            message, _ = kp_response(f.data, API_PRODUCE, f.api_version)
            codes = [p.error_code for t in message.responses for p in t.partition_responses]
            answers[(f.connection, f.correlation_id)] = codes[0] if len(codes) == 1 else codes
    return answers


def base_entry(case: Case, versions: dict[str, str], producer_id: int, producer_epoch: int) -> dict:
    legacy_entries = len(RECORDS) if case.codec == "none" else 1
    return {
        "client": case.client,
        "client_version": versions[case.client],
        "idempotent": case.idempotent,
        "compression": CODEC_IDS[case.codec],
        "compression_name": case.codec,
        "topic": case.topic,
        "partition": PARTITION,
        # What the client was asked to do: one batch of seven records (message format v1:
        # seven top-level messages uncompressed, one wrapper message compressed).
        "batches": legacy_entries if case.legacy else 1,
        "records": len(RECORDS),
        "producer_id": producer_id,
        "producer_epoch": producer_epoch,
        "base_sequence": 0 if case.idempotent else -1,  # a fresh producer's first batch
        "magic": case.magic,
    }


def produce_entries(outcome: Outcome, versions: dict[str, str]) -> list[tuple[dict, bytes]]:
    from protocol.headers import parse_request_header

    case = outcome.case
    requests = [f for f in outcome.frames
                if f.direction == "request" and f.api_key == API_PRODUCE]
    if not requests:
        return []
    pid, epoch = producer_identity(outcome)
    answers = produce_answers(outcome)
    out = []
    for i, f in enumerate(requests):
        name = f"produce_{case.name}" + (f"-{i + 1}" if len(requests) > 1 else "")
        entry = {
            "name": name,
            "file": f"{name}.bin",
            "kind": "produce_request",
            "api_key": API_PRODUCE,
            "api_version": f.api_version,
            "header_version": request_header_version(API_PRODUCE, f.api_version),
            "body_offset": parse_request_header(f.data).body_offset,
            "acks": case.acks,
            **base_entry(case, versions, pid, epoch),
            "legacy_api_version": list(LEGACY_API_VERSION) if case.legacy else None,
            "broker_error_code": answers.get((f.connection, f.correlation_id)),
        }
        out.append((entry, f.data))
    return out


def topic_ids(frames: list[Frame]) -> dict[str, str]:
    """Topic name -> topic id, from the Metadata responses the broker sent this client."""
    ids = {}
    for f in frames:
        if f.direction == "response" and f.api_key == API_METADATA and f.api_version >= 10:
            message, _ = kp_response(f.data, API_METADATA, f.api_version)
            for t in message.topics:
                if t.error_code == 0 and t.name:
                    ids[t.name] = str(t.topic_id)
    return ids


def fetch_entry(frames: list[Frame], consumer: str, producer: Outcome, versions: dict[str, str],
                producer_pid: tuple[int, int]) -> tuple[dict, bytes] | None:
    from protocol.headers import response_body_offset

    for f in frames:
        if f.direction != "response" or f.api_key != API_FETCH:
            continue
        message, _ = kp_response(f.data, API_FETCH, f.api_version)
        if not any(p.records for t in message.responses for p in t.partitions):
            continue
        case = producer.case
        short = "kafka-python" if consumer == "kafka-python" else "confluent"
        name = f"fetch_{short}_{case.name}"
        entry = {
            "name": name,
            "file": f"{name}.bin",
            "kind": "fetch_response",
            "api_key": API_FETCH,
            "api_version": f.api_version,
            "header_version": response_header_version(API_FETCH, f.api_version),
            "body_offset": response_body_offset(f.data, API_FETCH, f.api_version),
            "acks": None,
            **base_entry(case, versions, *producer_pid),
            "client": consumer,
            "client_version": versions[consumer],
            # From Fetch v13 on the response names the topic by id: the one Metadata gave this client.
            "topic_id": topic_ids(frames).get(case.topic) if f.api_version >= 13 else None,
            "producer_client": case.client,
            "produced_by": f"produce_{case.name}",
        }
        return entry, f.data
    return None


# -- main -----------------------------------------------------------------------------------


def main() -> int:
    from tests.support.tansu import TansuBroker, tansu_version

    versions = client_versions()
    cases = all_cases()
    outcomes: dict[str, Outcome] = {}
    skipped: list[dict] = []
    captured: list[tuple[dict, bytes]] = []
    notes: list[str] = []

    relay = CapturingRelay().start()
    try:
        with TansuBroker(advertised_port=relay.port) as broker:
            relay.target = (broker.host, broker.port)
            broker_version = tansu_version()
            create_topics(relay.bootstrap, [c.topic for c in cases])
            for case in cases:
                reason = kafka_python_codec_missing(case.codec) if case.client == "kafka-python" else None
                if reason:
                    print(f"skip {case.name}: {reason}")
                    skipped.append({"case": case.name, "reason": reason})
                    continue
                print(f"producing {case.name} ...", flush=True)
                outcome = run_case(relay, case)
                outcomes[case.name] = outcome
                entries = produce_entries(outcome, versions)
                problems = [p for p in [outcome.error, *outcome.delivery_errors] if p]
                if not entries:
                    reason = "no ProduceRequest was sent" + (f" ({'; '.join(problems[:2])})" if problems else "")
                    print(f"skip {case.name}: {reason}")
                    skipped.append({"case": case.name, "reason": reason})
                    continue
                if problems:
                    note = f"{case.name}: request captured, but the broker or client reported: {problems[0]}"
                    print("  " + note)
                    notes.append(note)
                captured.extend(entries)

            for case_name in FETCH_CASES:
                producer = outcomes.get(case_name)
                if producer is None or producer.delivery_errors or producer.error:
                    reason = f"topic of {case_name} was not produced cleanly"
                    skipped.append({"case": f"fetch {case_name}", "reason": reason})
                    continue
                for consumer in CONSUMERS:
                    print(f"consuming {case_name} with {consumer} ...", flush=True)
                    mark = relay.mark()
                    consume = consume_kafka_python if consumer == "kafka-python" else consume_confluent
                    try:
                        got = consume(relay.bootstrap, producer.case.topic, len(RECORDS))
                    except Exception as exc:
                        got, error = -1, f"{type(exc).__name__}: {exc}"
                    else:
                        error = None
                    time.sleep(0.2)
                    result = fetch_entry(relay.since(mark), consumer, producer, versions,
                                         producer_identity(producer))
                    if result is None:
                        reason = error or f"no FetchResponse with records (consumer saw {got} records)"
                        print(f"skip fetch {case_name} by {consumer}: {reason}")
                        skipped.append({"case": f"fetch {case_name} by {consumer}", "reason": reason})
                        continue
                    if got != len(RECORDS):
                        notes.append(f"fetch {case_name} by {consumer}: consumer saw {got} records")
                    captured.append(result)
    finally:
        relay.stop()

    failures = []
    for entry, data in captured:
        try:
            verify_entry(data, entry)
        except Exception as exc:
            failures.append(f"{entry['name']}: {exc}")
            traceback.print_exc()
    if failures:
        print("\nFRAMES DISAGREE WITH WHAT THE CLIENTS WERE ASKED TO SEND; nothing written:", file=sys.stderr)
        for f in failures:
            print("  " + f, file=sys.stderr)
        return 1

    FRAMES_DIR.mkdir(exist_ok=True)
    for old in FRAMES_DIR.glob("*.bin"):
        old.unlink()
    for entry, data in captured:
        (FRAMES_DIR / entry["file"]).write_bytes(data)
    manifest = {
        "about": "Golden wire captures; regenerate with `.venv/bin/python -m tests.golden.capture` "
                 "(see tests/golden/README.md). Frames are stored without their 4-byte size prefix.",
        "broker": f"Tansu {broker_version}",
        "client_versions": versions,
        "kafka_python_codec_packages": codec_package_versions(),
        "records_sent": [
            {"key": k.decode(), "value": v.decode(), "headers": [[hk, hv.decode()] for hk, hv in h]}
            for k, v, h in RECORDS
        ],
        "legacy_records_sent": "the same keys and values without headers (message format v1 has none)",
        "frames": [entry for entry, _ in captured],
        "skipped": skipped,
        "notes": notes,
    }
    MANIFEST.write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"\nwrote {len(captured)} frames to {FRAMES_DIR}")
    for entry, data in captured:
        print(f"  {entry['file']:<48} v{entry['api_version']:<2} {len(data):>5} B")
    for s in skipped:
        print(f"  skipped {s['case']}: {s['reason']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
