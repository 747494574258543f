"""kafka-python producing records and reading them back, for tests that only need them to arrive."""

from __future__ import annotations

from kafka import KafkaConsumer, KafkaProducer
from kafka.structs import TopicPartition


def produce_and_read_back(bootstrap: str, topic: str, sent: list[bytes], producer_args: dict | None = None,
                          consumer_args: dict | None = None) -> list[bytes]:
    """Sends ``sent`` to partition 0 of ``topic`` (acks=all, flushed), then reads partition 0 from
    the start until as many records came back or none came for 10 s; the values read, in order.
    ``producer_args`` / ``consumer_args``: more settings (TLS, client id) for each client."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", **(producer_args or {}))
    for value in sent:
        producer.send(topic, value=value, partition=0)
    producer.flush(30)
    producer.close()

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest",
                             consumer_timeout_ms=10_000, **(consumer_args or {}))
    consumer.assign([TopicPartition(topic, 0)])
    received = []
    for record in consumer:
        received.append(record.value)
        if len(received) == len(sent):
            break
    consumer.close()
    return received
