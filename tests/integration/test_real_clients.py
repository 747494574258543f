"""Real clients through the real proxy process to a real broker, and nobody goes around it.

Tansu listens on its own port but advertises a counting relay, and the proxy's upstream is the
relay: a client that learned a broker address the proxy failed to rewrite would connect to the
relay itself, and the relay records which process opened every connection it accepted.

Each client library creates a 3-partition topic, produces 10,000 records, reads them all back
(kafka-python and aiokafka with assign(); confluent-kafka in a consumer group with subscribe(),
which costs Tansu's ~20 s rebalance) and deletes the topic.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import time
import uuid

import pytest

from proxy.app import procnet
from tests.support.proxy_process import sum_samples

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

RECORDS = 10_000
PARTITIONS = 3


def _records(prefix: str) -> list[tuple[bytes, bytes]]:
    return [(f"{prefix}-key-{i}".encode(), f"{prefix}-value-{i}-{'x' * (i % 50)}".encode()) for i in range(RECORDS)]


def _topic(client: str) -> str:
    return f"real-{client}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def stack(relay_tansu, proxy):
    """(broker behind relay, proxy process whose upstream is the relay)."""
    p = proxy([relay_tansu.bootstrap])
    yield relay_tansu, p
    # SIGTERM stops the proxy cleanly, and anything it logged as an error or a traceback is a
    # failure even if the clients coped.
    exit_code = p.stop()
    log = p.log_text()
    assert exit_code == 0, log[-5000:]
    assert "Traceback" not in log and "level=ERROR" not in log, log[-5000:]


def _assert_only_the_proxy_reached_the_broker(relay_tansu, proxy_proc) -> None:
    relay = relay_tansu.relay
    assert relay.connections_from(proxy_proc.pid), "no connection reached the broker through the proxy"
    assert relay.escapes(proxy_proc.pid) == []


def _assert_content(received: list[tuple[int, bytes, bytes]], sent: list[tuple[bytes, bytes]]) -> None:
    assert len(received) == len(sent)
    assert sorted((k, v) for _, k, v in received) == sorted(sent)
    # Within a partition, records come back in the order they were produced.
    index = {k: i for i, (k, _) in enumerate(sent)}
    for partition in range(PARTITIONS):
        order = [index[k] for p, k, _ in received if p == partition]
        assert order == sorted(order), f"partition {partition} out of order"
    assert {p for p, _, _ in received} == set(range(PARTITIONS)), "records did not spread over partitions"


def _assert_metrics_moved(before: dict, after: dict) -> None:
    def delta(name: str, **labels) -> float:
        return sum_samples(after, name, **labels) - sum_samples(before, name, **labels)

    for api in ("Produce", "Fetch", "Metadata", "CreateTopics", "DeleteTopics"):
        assert delta("kqp_requests_total", api=api) > 0, f"no {api} request counted"
    # acks=all: every Produce request has a response, and all of them are done by now.
    assert delta("kqp_responses_total", api="Produce") == delta("kqp_requests_total", api="Produce")
    assert delta("kqp_request_latency_seconds_count", api="Produce") > 0
    assert delta("kqp_bytes_total", direction="client_to_upstream") > RECORDS * 20
    assert delta("kqp_bytes_total", direction="upstream_to_client") > RECORDS * 20
    assert delta("kqp_decode_failures_total") == 0
    assert delta("kqp_upstream_connect_failures_total") == 0
    assert delta("kqp_frames_rejected_total") == 0


# -- kafka-python -----------------------------------------------------------------------------


def test_kafka_python(stack):
    from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
    from kafka.structs import TopicPartition

    relay_tansu, proxy_proc = stack
    before = proxy_proc.metrics()
    topic, sent = _topic("kafka-python"), _records("kp")
    admin = KafkaAdminClient(bootstrap_servers=proxy_proc.bootstrap, client_id="it-kp-admin")
    try:
        admin.create_topics({topic: {"num_partitions": PARTITIONS, "replication_factor": 1}})

        producer = KafkaProducer(bootstrap_servers=proxy_proc.bootstrap, client_id="it-kp-producer",
                                 acks="all", linger_ms=5)
        futures = [producer.send(topic, key=k, value=v) for k, v in sent]
        producer.flush(60)
        assert all(f.get(0).offset >= 0 for f in futures)
        producer.close()

        consumer = KafkaConsumer(bootstrap_servers=proxy_proc.bootstrap, client_id="it-kp-consumer",
                                 enable_auto_commit=False, auto_offset_reset="earliest")
        consumer.assign([TopicPartition(topic, p) for p in range(PARTITIONS)])
        received = []
        deadline = time.monotonic() + 60
        while len(received) < RECORDS and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=1000).values():
                received.extend((r.partition, r.key, r.value) for r in records)
        consumer.close()
        _assert_content(received, sent)
    finally:
        admin.delete_topics([topic])
        assert topic not in admin.list_topics()
        admin.close()

    _assert_only_the_proxy_reached_the_broker(relay_tansu, proxy_proc)
    _assert_metrics_moved(before, proxy_proc.metrics())


# -- confluent-kafka (librdkafka) ------------------------------------------------------------


@pytest.mark.slow
def test_confluent_kafka_with_consumer_group(stack):
    from confluent_kafka import Consumer, KafkaException, Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    relay_tansu, proxy_proc = stack
    before = proxy_proc.metrics()
    topic, sent = _topic("confluent"), _records("ck")
    admin = AdminClient({"bootstrap.servers": proxy_proc.bootstrap, "client.id": "it-ck-admin"})
    admin.create_topics([NewTopic(topic, num_partitions=PARTITIONS, replication_factor=1)])[topic].result(30)
    try:
        errors = []

        def on_delivery(err, msg):
            if err is not None:
                errors.append(err)

        producer = Producer({"bootstrap.servers": proxy_proc.bootstrap, "client.id": "it-ck-producer",
                             "acks": "all", "linger.ms": 5, "enable.idempotence": False})
        for k, v in sent:
            while True:
                try:
                    producer.produce(topic, key=k, value=v, on_delivery=on_delivery)
                    break
                except BufferError:
                    producer.poll(0.1)
            producer.poll(0)
        assert producer.flush(60) == 0
        assert errors == []

        consumer = Consumer({
            "bootstrap.servers": proxy_proc.bootstrap, "client.id": "it-ck-consumer",
            "group.id": f"it-ck-group-{uuid.uuid4().hex[:8]}", "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        })
        consumer.subscribe([topic])
        received = []
        deadline = time.monotonic() + 90  # includes Tansu's slow group join
        while len(received) < RECORDS and time.monotonic() < deadline:
            for msg in consumer.consume(num_messages=1000, timeout=1.0):
                if msg.error():
                    raise KafkaException(msg.error())
                received.append((msg.partition(), msg.key(), msg.value()))
        assert {tp.partition for tp in consumer.assignment()} == set(range(PARTITIONS))
        consumer.commit(asynchronous=False)
        consumer.close()
        _assert_content(received, sent)
    finally:
        admin.delete_topics([topic])[topic].result(30)
    assert topic not in admin.list_topics(timeout=10).topics

    _assert_only_the_proxy_reached_the_broker(relay_tansu, proxy_proc)
    after = proxy_proc.metrics()
    _assert_metrics_moved(before, after)
    for api in ("FindCoordinator", "JoinGroup", "SyncGroup", "OffsetCommit"):
        assert sum_samples(after, "kqp_requests_total", api=api) > sum_samples(before, "kqp_requests_total", api=api)


ROUND = 300  # records of 4 KiB: 1.2 MiB a round, five rounds


def test_large_fetch_responses_stream_through_intact(stack):
    """Fetch v16 responses of a few hundred KiB go to librdkafka as they arrive (the leader
    and endpoint filters tell from their heads that nothing moved), byte for byte."""
    from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic

    relay_tansu, proxy_proc = stack
    before = proxy_proc.metrics()
    topic = _topic("stream")
    sent = [(f"k-{i}".encode(), (f"v-{i}-".encode() * 200)[:4096]) for i in range(1500)]  # 6 MiB
    admin = AdminClient({"bootstrap.servers": proxy_proc.bootstrap, "client.id": "it-stream-admin"})
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(30)
    try:
        producer = Producer({"bootstrap.servers": proxy_proc.bootstrap, "client.id": "it-stream-producer",
                             "acks": "all", "linger.ms": 5})
        consumer = Consumer({"bootstrap.servers": proxy_proc.bootstrap, "client.id": "it-stream-consumer",
                             "group.id": "unused", "enable.auto.commit": False,
                             "fetch.max.bytes": 1 << 20, "max.partition.fetch.bytes": 1 << 20})
        consumer.assign([TopicPartition(topic, 0, 0)])
        received = []
        deadline = time.monotonic() + 60
        # In rounds of 1.2 MiB, each fetched before the next is written: several large responses.
        # A response streams only when the first chunk the proxy reads of it holds its head, and
        # how the bytes are cut into chunks on the way is the machine's doing: with the whole
        # 6 MiB in one response, a busy machine had it assembled instead in 2 of 15 runs.
        for start in range(0, len(sent), ROUND):
            for k, v in sent[start:start + ROUND]:
                producer.produce(topic, key=k, value=v)
                producer.poll(0)
            assert producer.flush(60) == 0
            while len(received) < start + ROUND and time.monotonic() < deadline:
                for msg in consumer.consume(num_messages=500, timeout=1.0):
                    if msg.error():
                        raise KafkaException(msg.error())
                    received.append((msg.key(), msg.value()))
        consumer.close()
        assert received == sent
    finally:
        admin.delete_topics([topic])[topic].result(30)
    after = proxy_proc.metrics()
    streamed = sum_samples(after, "kqp_responses_streamed_total", api="Fetch") - sum_samples(
        before, "kqp_responses_streamed_total", api="Fetch")
    versions = {dict(labels)["version"] for (name, labels), _ in after.items()
                if name == "kqp_responses_total" and dict(labels).get("api") == "Fetch"}
    assert max(map(int, versions)) >= 16, versions  # librdkafka speaks Fetch v16+ through the proxy
    fetches = sum_samples(after, "kqp_responses_total", api="Fetch") - sum_samples(before, "kqp_responses_total",
                                                                                  api="Fetch")
    assert streamed > 0, f"none of {fetches:.0f} Fetch responses was streamed"
    assert sum_samples(after, "kqp_decode_failures_total") == sum_samples(before, "kqp_decode_failures_total")
    _assert_only_the_proxy_reached_the_broker(relay_tansu, proxy_proc)


# -- aiokafka ---------------------------------------------------------------------------------


def test_aiokafka(stack):
    relay_tansu, proxy_proc = stack
    before = proxy_proc.metrics()
    topic, sent = _topic("aiokafka"), _records("ak")
    received = asyncio.run(asyncio.wait_for(_aiokafka_round_trip(proxy_proc.bootstrap, topic, sent), 120))
    _assert_content(received, sent)
    _assert_only_the_proxy_reached_the_broker(relay_tansu, proxy_proc)
    _assert_metrics_moved(before, proxy_proc.metrics())


async def _aiokafka_round_trip(bootstrap: str, topic: str, sent):
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, client_id="it-ak-admin")
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=PARTITIONS, replication_factor=1)])
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, client_id="it-ak-producer",
                                    acks="all", linger_ms=5)
        await producer.start()
        try:
            futures = [await producer.send(topic, key=k, value=v) for k, v in sent]
            await producer.flush()
            assert all(m.offset >= 0 for m in await asyncio.gather(*futures))
        finally:
            await producer.stop()

        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, client_id="it-ak-consumer",
                                    enable_auto_commit=False, auto_offset_reset="earliest")
        await consumer.start()
        received = []
        try:
            consumer.assign([TopicPartition(topic, p) for p in range(PARTITIONS)])
            while len(received) < len(sent):
                batches = await consumer.getmany(timeout_ms=1000, max_records=2000)
                for records in batches.values():
                    received.extend((r.partition, r.key, r.value) for r in records)
        finally:
            await consumer.stop()
    finally:
        await admin.delete_topics([topic])
        assert topic not in await admin.list_topics()
        await admin.close()
    return received


# -- kcat -------------------------------------------------------------------------------------

_KCAT_BROKER = re.compile(r"^\s*broker (-?\d+) at (\S+):(\d+)", re.MULTILINE)


def test_kcat_metadata_shows_only_proxy_addresses(stack):
    from kafka import KafkaAdminClient

    if shutil.which("kcat") is None:
        pytest.fail("kcat is not installed: apt-get install kcat (make test does this as root)")
    relay_tansu, proxy_proc = stack
    topic = _topic("kcat")
    admin = KafkaAdminClient(bootstrap_servers=proxy_proc.bootstrap, client_id="it-kcat-admin")
    try:
        admin.create_topics({topic: {"num_partitions": PARTITIONS, "replication_factor": 1}})
        out = subprocess.run(["kcat", "-L", "-b", proxy_proc.bootstrap, "-m", "10"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        brokers = _KCAT_BROKER.findall(out.stdout)
        assert brokers, out.stdout
        for node_id, host, port in brokers:
            port = int(port)
            assert host == "127.0.0.1", out.stdout
            assert port not in (relay_tansu.broker.port, relay_tansu.relay.port), out.stdout
            # The advertised port is one the proxy process itself listens on.
            assert procnet.listening_inodes(port) & procnet.socket_inodes(proxy_proc.pid), (
                f"broker {node_id} advertised at port {port}, which the proxy does not listen on\n{out.stdout}"
            )
        assert f'topic "{topic}" with {PARTITIONS} partitions' in out.stdout, out.stdout
        leaders = {int(n) for n in re.findall(r"partition \d+, leader (-?\d+)", out.stdout)}
        assert leaders <= {int(n) for n, _, _ in brokers}

        # And a small produce/consume with kcat through the proxy's broker port.
        lines = "".join(f"kcat-{i}\n" for i in range(100))
        produced = subprocess.run(["kcat", "-P", "-b", proxy_proc.bootstrap, "-t", topic, "-p", "0"],
                                  input=lines, capture_output=True, text=True, timeout=30)
        assert produced.returncode == 0, produced.stderr
        consumed = subprocess.run(["kcat", "-C", "-b", proxy_proc.bootstrap, "-t", topic, "-p", "0",
                                   "-o", "beginning", "-e", "-q"],
                                  capture_output=True, text=True, timeout=30)
        assert consumed.returncode == 0, consumed.stderr
        assert consumed.stdout == lines
    finally:
        admin.delete_topics([topic])
        admin.close()

    _assert_only_the_proxy_reached_the_broker(relay_tansu, proxy_proc)
