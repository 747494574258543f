"""The quota store in a compacted topic, against a real Tansu: two proxy instances share the
quotas set through AlterClientQuotas, a restarted instance gets them back, a cluster that
cannot be reached makes an Alter fail retriably while the quotas in force stay, and a deleted
topic is recreated with the quotas in force.
"""

from __future__ import annotations

import os
import statistics
import time
import urllib.request

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient

from proxy.control import quota_topic
from quotas.client_quota_admin import QuotaEntity
from tests.integration.test_client_quota_api import AdminConnection, remove, set_
from tests.support.inproc import InProcessProxy
from tests.support.polling import wait_for
from tests.support.rate_runs import fresh_topic

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

REQUEST_TIMED_OUT = 7
QUOTA = 20 * 1024  # bytes/s
CHANGES = int(os.environ.get("KQP_PROPAGATION_CHANGES", "20"))
FILE_QUOTAS = [{"user": "carol", "request_rate": 100}]
ALICE = (("user", "alice"),)
ANON = (("user", "ANONYMOUS"),)
CAROL = (("user", "carol"),)
ALICE_ENTITY, ANON_ENTITY, CAROL_ENTITY = QuotaEntity(ALICE), QuotaEntity(ANON), QuotaEntity(CAROL)


def instance(bootstrap: str) -> InProcessProxy:
    return InProcessProxy([bootstrap], quotas=FILE_QUOTAS, quota_windows={
        "quota_window_num": 2, "quota_window_size_seconds": 1,  # throttles within a second
    }, quota_admin={"enabled": True, "principals": ["ANONYMOUS"]}).start()


def wait_seen(conn: AdminConnection, entity, expected, what: str, timeout_s: float = 10.0) -> None:
    """Wait until ``conn`` describes ``entity`` as ``expected`` (None: absent); AssertionError after
    ``timeout_s``. How soon is the machine's business: a busy one may take longer than a second."""
    wait_for(lambda: conn.quotas(1).get(entity) == expected, timeout_s, what)


def test_an_alter_through_one_instance_is_in_force_on_the_other_within_a_second(tansu):
    a, b = instance(tansu.bootstrap), instance(tansu.bootstrap)
    try:
        ca, cb = AdminConnection(a.address), AdminConnection(b.address)
        assert ca.alter(1, [(ANON, [set_("producer_byte_rate", QUOTA)])]) == [(ANON, 0, None)]
        assert ca.quotas(1)[ANON] == {"producer_byte_rate": float(QUOTA)}  # read-your-writes on A
        wait_seen(cb, ANON, {"producer_byte_rate": float(QUOTA)}, "B to describe the new quota")
        # B enforces it: a producer through B is throttled to the new rate.
        topic = fresh_topic(tansu, "quota-store-enforced")
        producer = KafkaProducer(bootstrap_servers=b.bootstrap, client_id="through-b", acks=1, linger_ms=5,
                                 batch_size=4096, request_timeout_ms=20_000)
        try:
            start = time.monotonic()
            for i in range(100):  # ~100 KiB at 20 KiB/s: a few seconds
                producer.send(topic, b"x" * 1024, key=b"%d" % i)
            producer.flush(60)
            elapsed_s = time.monotonic() - start
        finally:
            producer.close()
        assert b.metric("kqp_quota_bound", kind="producer_byte_rate", user="ANONYMOUS") == QUOTA
        assert b.metric("kqp_quota_throttled_total", kind="producer_byte_rate") > 0
        # 100 KiB over a 1 s window of 20 KiB/s: at least ~4 s once the first window is spent.
        assert elapsed_s > 2.5, f"100 KiB through B took {elapsed_s:.1f} s at a quota of 20 KiB/s"
        # Propagation (the issue: in force everywhere within one second, on a quiet machine: B's
        # follower long-polls with max_wait_ms 500); 20 changes in CI, KQP_PROPAGATION_CHANGES=100
        # for the closing note's measurement. Every change reaches B; how soon is printed, not
        # asserted: a busy machine delays the follower's wake-ups by what it likes.
        delays = []
        for i in range(CHANGES):
            value = float(1000 + i)
            start = time.monotonic()
            assert ca.alter(1, [(ALICE, [set_("request_rate", value)])]) == [(ALICE, 0, None)]
            wait_seen(cb, ALICE, {"request_rate": value}, f"change {i} to reach B")
            delays.append(time.monotonic() - start)
        print(f"\npropagation A -> B over {len(delays)} changes: p50 {statistics.median(delays) * 1000:.0f} ms, "
              f"max {max(delays) * 1000:.0f} ms")
        assert b.metric("kqp_quota_store_lag_records") == 0
        assert b.metric("kqp_quota_store_last_applied_offset") >= CHANGES
        ca.close()
        cb.close()
    finally:
        a.stop()
        b.stop()


def test_a_restarted_instance_comes_back_with_the_same_quotas(tansu):
    a = instance(tansu.bootstrap)
    try:
        ca = AdminConnection(a.address)
        assert ca.alter(1, [(ALICE, [set_("consumer_byte_rate", 4096), set_("request_rate", 5)]),
                            (CAROL, [remove("request_rate")])]) == [(ALICE, 0, None), (CAROL, 0, None)]
        assert ca.alter(1, [(ALICE, [remove("request_rate")])]) == [(ALICE, 0, None)]
        before = ca.quotas(1)
        ca.close()
    finally:
        a.stop()
    assert before[ALICE] == {"consumer_byte_rate": 4096.0} and CAROL not in before  # the file's, masked
    c = instance(tansu.bootstrap)
    try:
        assert c.server.ready()[0], c.server.ready()[1]
        cc = AdminConnection(c.address)
        assert cc.quotas(1) == before
        cc.close()
    finally:
        c.stop()


def healthz(p: InProcessProxy) -> str:
    with urllib.request.urlopen("http://{}:{}/healthz".format(*p.server.metrics_address), timeout=5) as resp:
        return resp.read().decode()


def test_a_cluster_out_of_reach_fails_the_alter_retriably_and_keeps_the_quotas(relay_tansu):
    a = instance(relay_tansu.bootstrap)
    try:
        ca = AdminConnection(a.address)
        assert ca.alter(1, [(ALICE, [set_("request_rate", 10)])]) == [(ALICE, 0, None)]
        relay_tansu.relay.cut()
        answered = ca.alter(1, [(ALICE, [set_("request_rate", 20)])])
        assert [(e, code) for e, code, _ in answered] == [(ALICE, REQUEST_TIMED_OUT)]
        assert "could not be written" in answered[0][2]
        assert ca.quotas(1)[ALICE] == {"request_rate": 10.0}
        assert a.run(lambda: [r.values for r in a.server.rules_in_force if r.user == "alice"]) == [
            {"request_rate": 10.0}]
        assert a.metric("kqp_quota_store_errors_total", op="write") >= 1
        wait_for(lambda: a.metric("kqp_quota_store_errors_total", op="read") >= 1, what="the follower's read error")
        assert "failing: read: " in healthz(a) and "write: " in healthz(a)
        relay_tansu.relay.restore()
        deadline = time.monotonic() + 10
        while True:  # the producer connection is opened again at the next Alter
            answered = ca.alter(1, [(ALICE, [set_("request_rate", 30)])])
            if answered == [(ALICE, 0, None)] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert answered == [(ALICE, 0, None)]
        assert ca.quotas(1)[ALICE] == {"request_rate": 30.0}
        wait_for(lambda: "failing" not in healthz(a), what="/healthz to stop saying failing")
        ca.close()
    finally:
        a.stop()


def topic_contents(bootstrap: str, topic: str) -> dict:
    """What a reader of ``topic`` from its start gets: the last record per entity."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, auto_offset_reset="earliest", consumer_timeout_ms=1500,
                             enable_auto_commit=False)
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek(tp, 0)
        entities: dict = {}
        for message in consumer:
            entity, values = quota_topic.decode(message.key, message.value)
            entities[entity] = values
        return entities
    finally:
        consumer.close()


def test_a_deleted_store_topic_is_recreated_and_the_quotas_in_force_written_back(tansu):
    a, b = instance(tansu.bootstrap), instance(tansu.bootstrap)
    admin = KafkaAdminClient(bootstrap_servers=tansu.bootstrap)
    try:
        # A notices the deletion only through the Alter below (its periodic check is pushed
        # out); B through its periodic check (the default, every 5 s).
        a.run(setattr, a.server.topic_store, "topic_check_s", 3600.0)
        ca, cb = AdminConnection(a.address), AdminConnection(b.address)
        assert ca.alter(1, [(ALICE, [set_("request_rate", 500)]), (ANON, [set_("producer_byte_rate", 1048576)]),
                            (CAROL, [remove("request_rate")])]) == [(ALICE, 0, None), (ANON, 0, None),
                                                                     (CAROL, 0, None)]
        before = ca.quotas(1)
        assert before[ALICE] == {"request_rate": 500.0} and CAROL not in before
        wait_seen(cb, ALICE, {"request_rate": 500.0}, "B to describe alice's quota")
        assert cb.quotas(1) == before

        admin.delete_topics(["__kqp_client_quotas"])
        # Tansu acknowledges a Produce to a deleted topic: the store asks before it writes.
        answered = ca.alter(1, [(ALICE, [set_("request_rate", 600)])])
        assert [(e, code) for e, code, _ in answered] == [(ALICE, REQUEST_TIMED_OUT)]
        assert "was deleted; the proxy is recreating it" in answered[0][2]
        assert a.metric("kqp_quota_store_topic_lost_total") == 1
        # The quotas in force stay on both instances, described and enforced.
        for proxy, conn in ((a, ca), (b, cb)):
            assert conn.quotas(1) == before
            assert proxy.run(lambda p=proxy: [r.values for r in p.server.rules_in_force if r.user == "alice"]) == [
                {"request_rate": 500.0}]

        # The topic is back with every entity in force, the file-masking removal included.
        deadline = time.monotonic() + 15
        while True:
            contents = topic_contents(tansu.bootstrap, "__kqp_client_quotas")
            if contents.keys() >= {ALICE_ENTITY, ANON_ENTITY, CAROL_ENTITY} or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert contents[ALICE_ENTITY] == {"request_rate": 500.0}
        assert contents[ANON_ENTITY] == {"producer_byte_rate": 1048576.0}
        assert contents[CAROL_ENTITY] == {"request_rate": None}
        # B noticed by itself at its periodic check (deleted, or replaced by A's new topic).
        wait_for(lambda: b.metric("kqp_quota_store_topic_lost_total") >= 1, 15, "B to notice the lost topic")
        assert b.metric("kqp_quota_store_topic_lost_total") == 1
        for proxy in (a, b):
            wait_for(lambda p=proxy: "recreating" not in healthz(p), 15, "/healthz to stop saying recreating")

        # Changes flow again both ways.
        assert ca.alter(1, [(ALICE, [set_("request_rate", 700)])]) == [(ALICE, 0, None)]
        wait_seen(cb, ALICE, {"request_rate": 700.0}, "A's change to reach B")
        assert cb.alter(1, [(ANON, [remove("producer_byte_rate")])]) == [(ANON, 0, None)]
        wait_seen(ca, ANON, None, "B's removal to reach A")
        after = ca.quotas(1)
        assert cb.quotas(1) == after
        ca.close()
        cb.close()
    finally:
        admin.close()
        a.stop()
        b.stop()
    # A new instance reads the recreated topic alone and gets the same quotas.
    c = instance(tansu.bootstrap)
    try:
        cc = AdminConnection(c.address)
        assert cc.quotas(1) == after
        cc.close()
    finally:
        c.stop()


def test_removing_the_last_key_writes_a_tombstone_unless_it_masks_the_file(tansu):
    a = instance(tansu.bootstrap)
    try:
        ca = AdminConnection(a.address)
        assert ca.alter(1, [(ALICE, [set_("request_rate", 9)])]) == [(ALICE, 0, None)]
        assert ca.alter(1, [(ALICE, [remove("request_rate")]), (CAROL, [remove("request_rate")])]) == [
            (ALICE, 0, None), (CAROL, 0, None)]
        ca.close()
    finally:
        a.stop()
    # alice's last key, which the file does not set: a tombstone (compaction forgets her); carol's,
    # which the file sets: a record keeping the removal, which masks the file's value.
    contents = topic_contents(tansu.bootstrap, "__kqp_client_quotas")
    assert contents[ALICE_ENTITY] is None
    assert contents[CAROL_ENTITY] == {"request_rate": None}
    b = instance(tansu.bootstrap)
    try:
        cb = AdminConnection(b.address)
        assert ALICE not in cb.quotas(1) and CAROL not in cb.quotas(1)
        cb.close()
    finally:
        b.stop()
