"""The usage log end to end: the proxy process in front of the real Tansu broker, kafka-python
clients under their own client ids, then the Parquet files the proxy wrote, read with pyarrow.

The proxy runs with ``usage_log.interval_seconds: 1`` so a run spans several intervals (rows
of one key are summed over all of them) and is stopped with SIGTERM, which must write the
partial interval. Unauthenticated clients are user ANONYMOUS.
"""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from proxy.observability.usage_log import COUNTER_COLUMNS, SCHEMA_VERSION, arrow_schema
from tests.support.polling import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

PRODUCE, FETCH, CREATE_TOPICS, DELETE_TOPICS = 0, 1, 19, 20
RECORDS = 500
PARTITIONS = 3
COUNTERS = COUNTER_COLUMNS


def _usage_config(directory: Path, **extra) -> dict:
    return {"usage_log": {"directory": str(directory), "interval_seconds": 1, "proxy_name": "it"}, **extra}


def _stop_cleanly(p) -> None:
    exit_code = p.stop()
    log = p.log_text()
    assert exit_code == 0, log[-5000:]
    assert "Traceback" not in log and "usage log: cannot write" not in log, log[-5000:]


def _read_usage(directory: Path) -> list[dict]:
    files = sorted(directory.rglob("*.parquet"))
    assert files, f"no usage file under {directory}"
    hidden = [p for p in directory.rglob("*") if p.name.startswith(".")]
    assert hidden == [], f"temporary files left behind: {hidden}"
    rows = []
    for path in files:
        rel = path.relative_to(directory).parts
        assert len(rel) == 3 and rel[0].startswith("date=") and rel[1].startswith("hour="), path
        table = pq.read_table(path)
        assert table.schema.equals(arrow_schema(), check_metadata=True), path
        for r in table.to_pylist():
            assert (r["schema_version"], r["proxy"], r["interval_seconds"]) == (SCHEMA_VERSION, "it", 1), r
            start = r["interval_start"]
            assert start.utcoffset().total_seconds() == 0
            assert rel[:2] == (f"date={start:%Y-%m-%d}", f"hour={start:%H}"), (path, r)
            assert rel[2].startswith(f"usage-{int(start.timestamp())}-it-"), (path, r)
            rows.append(r)
    return rows


def _totals(rows: list[dict]) -> dict[tuple[str, str, int], dict]:
    """(user, client id, api key) -> counters summed over every interval (throttle max: max)."""
    out: dict = defaultdict(lambda: dict.fromkeys(COUNTERS, 0))
    for r in rows:
        t = out[(r["user"], r["client_id"], r["api_key"])]
        for c in COUNTERS:
            t[c] = max(t[c], r[c]) if c == "throttle_time_ms_max" else t[c] + r[c]
    return dict(out)


def test_usage_log_counts_what_real_clients_did(tansu, proxy, tmp_path):
    from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
    from kafka.structs import TopicPartition

    usage_dir = tmp_path / "usage"
    p = proxy([tansu.bootstrap], extra_config=_usage_config(usage_dir))
    topic = f"usage-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=p.bootstrap, client_id="usage-admin", request_timeout_ms=10_000)
    try:
        admin.create_topics({topic: {"num_partitions": PARTITIONS, "replication_factor": 1}})

        producer = KafkaProducer(bootstrap_servers=p.bootstrap, client_id="usage-producer",
                                 enable_idempotence=True, acks="all", linger_ms=5)
        futures = [producer.send(topic, key=f"k{i}".encode(), value=b"v" * (i % 100)) for i in range(RECORDS)]
        producer.flush(20)
        assert all(f.get(0).offset >= 0 for f in futures)
        producer.close()

        consumer = KafkaConsumer(bootstrap_servers=p.bootstrap, client_id="usage-consumer",
                                 enable_auto_commit=False, auto_offset_reset="earliest")
        consumer.assign([TopicPartition(topic, i) for i in range(PARTITIONS)])
        received = 0
        deadline = time.monotonic() + 20
        while received < RECORDS and time.monotonic() < deadline:
            received += sum(len(records) for records in consumer.poll(timeout_ms=500).values())
        consumer.close()
        assert received == RECORDS

        admin.delete_topics([topic])
    finally:
        admin.close()
    _stop_cleanly(p)

    rows = _read_usage(usage_dir)
    assert {r["user"] for r in rows} == {"ANONYMOUS"}
    assert {r["fleet"] for r in rows} == {""}  # enforced alone
    totals = _totals(rows)
    produce = totals[("ANONYMOUS", "usage-producer", PRODUCE)]
    assert produce["records"] == RECORDS
    assert produce["batches"] >= PARTITIONS
    assert produce["request_bytes"] > RECORDS  # every record's key and value went through
    assert produce["response_bytes"] > 0
    assert produce["new_producer_ids"] == 1  # one idempotent producer, one producer id
    assert produce["upstream_latency_ms_sum"] > 0
    assert (produce["throttled"], produce["rejected"]) == (0, 0)

    fetch = totals[("ANONYMOUS", "usage-consumer", FETCH)]
    assert fetch["records"] >= RECORDS
    assert fetch["response_bytes"] > produce["request_bytes"] / 2
    assert fetch["upstream_latency_ms_sum"] > 0

    create = totals[("ANONYMOUS", "usage-admin", CREATE_TOPICS)]
    assert (create["requests"], create["partition_mutations"], create["rejected"]) == (1, PARTITIONS, 0)
    delete = totals[("ANONYMOUS", "usage-admin", DELETE_TOPICS)]
    assert (delete["requests"], delete["partition_mutations"]) == (1, PARTITIONS)

    # Nobody else's requests were put on the producer's or the consumer's rows.
    assert {k[1] for k in totals} == {"usage-admin", "usage-producer", "usage-consumer"}
    assert sum(t["records"] for k, t in totals.items() if k[2] == PRODUCE) == RECORDS
    assert sum(t["new_producer_ids"] for t in totals.values()) == 1


def test_a_fleet_member_notes_its_fleets_usage_topic_and_logs_only_its_own_clients(tansu, proxy, tmp_path):
    """``fleet: {enabled: true}``: every row carries the fleet's usage topic; the fleet's own
    producer and follower (the proxy's own connections to the topic) are not in the log."""
    from kafka import KafkaProducer

    usage_dir = tmp_path / "usage"
    p = proxy([tansu.bootstrap], extra_config=_usage_config(usage_dir, fleet={"enabled": True}))
    producer = KafkaProducer(bootstrap_servers=p.bootstrap, client_id="fleet-producer", acks="all", linger_ms=5)
    topic = f"usage-fleet-{uuid.uuid4().hex[:8]}"
    futures = [producer.send(topic, b"v" * 10) for _ in range(50)]
    producer.flush(20)
    assert all(f.get(0).offset >= 0 for f in futures)
    producer.close()
    # The fleet's own connections write and read its topic meanwhile (a report every 250 ms).
    wait_for(lambda: p.metric_sum("kqp_fleet_reports_sent_total") >= 2, what="the fleet's usage reports")
    _stop_cleanly(p)

    rows = _read_usage(usage_dir)
    assert {r["fleet"] for r in rows} == {"__kqp_quota_usage"}
    totals = _totals(rows)
    assert {k[1] for k in totals} == {"fleet-producer"}
    assert totals[("ANONYMOUS", "fleet-producer", PRODUCE)]["records"] == 50


def test_usage_log_shows_a_rejected_controller_mutation(tansu, proxy, tmp_path):
    """controller_mutation_rate 1 partition/s with 11 one-second windows: the bucket holds 11.
    A first 20-partition CreateTopics is admitted (11 >= 0) and drives it to -9; a second
    CreateTopics right after (kafka-python: v7, strict) is rejected, throttled about 9 s."""
    from kafka import KafkaAdminClient
    from kafka.errors import ThrottlingQuotaExceededError

    usage_dir = tmp_path / "usage"
    extra = _usage_config(
        usage_dir,
        quotas=[{"user": "<default>", "client_id": "usage-storm", "controller_mutation_rate": 1}],
        quota_windows={"controller_quota_window_num": 11, "controller_quota_window_size_seconds": 1},
    )
    p = proxy([tansu.bootstrap], extra_config=extra)
    first, second = (f"usage-storm-{uuid.uuid4().hex[:8]}" for _ in range(2))
    admin = KafkaAdminClient(bootstrap_servers=p.bootstrap, client_id="usage-storm", request_timeout_ms=10_000)
    try:
        sent = time.monotonic()
        admin.create_topics({first: {"num_partitions": 20, "replication_factor": 1}})
        with pytest.raises(ThrottlingQuotaExceededError):
            admin.create_topics({second: {"num_partitions": 1, "replication_factor": 1}})
        refused = time.monotonic()
    finally:
        admin.close()
    assert p.metric_sum("kqp_quota_rejected_total", kind="controller_mutation_rate") == 1
    _stop_cleanly(p)

    create = _totals(_read_usage(usage_dir))[("ANONYMOUS", "usage-storm", CREATE_TOPICS)]
    assert create["requests"] == 2
    assert create["partition_mutations"] == 21  # what was asked for, the rejected topic included
    assert create["rejected"] == 1
    assert create["throttled"] == 1  # the admitted request was not throttled (strict quota)
    # −K/Q at the refusal: K was −9 after the first (charged after ``sent``), refilled at 1/s until
    # the refusal (before ``refused``); whole ms, 1 ms either way.
    least_ms = 9000 - (refused - sent) * 1000
    assert least_ms - 1 <= create["throttle_time_ms_max"] <= 9000, (create["throttle_time_ms_max"], least_ms)
    assert create["throttle_time_ms_sum"] == create["throttle_time_ms_max"]
