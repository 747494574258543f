"""The quota store (``store: topic``) on a cluster that is still starting: what a new Kafka
cluster answers before it is ready is retried, as Kafka's producer retries it, within
``quota_admin.write_deadline_ms``; what retrying would not change is answered at once.

Brokers: the scripted cluster (tests.support.scripted_broker), since Tansu never answers these
codes: a new Kafka 4 cluster answers InitProducerId COORDINATOR_LOAD_IN_PROGRESS (14) until its
controller hands out producer ids, older ones COORDINATOR_NOT_AVAILABLE (15) or NOT_COORDINATOR
(16); CreateTopics NOT_CONTROLLER (41); a topic just created is not in every broker's metadata
yet (UNKNOWN_TOPIC_OR_PARTITION), nor led yet (LEADER_NOT_AVAILABLE, NOT_LEADER_OR_FOLLOWER).
The client is real: the project's ``kafka-quota-proxy quotas`` CLI, or raw AlterClientQuotas
requests where many go at once. Timings are only bounds a deadline guarantees, with margins.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml
from kafka.record import MemoryRecords

from proxy.app.cli import main
from tests.integration.test_client_quota_api import AdminConnection, set_
from tests.support.inproc import InProcessProxy
from tests.support.scripted_broker import ScriptedCluster
from tests.support.scripted_handlers import INIT_PRODUCER_ID, LIST_OFFSETS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PRODUCE, FETCH, METADATA, CREATE_TOPICS = 0, 1, 3, 19
TOPIC = "__kqp_client_quotas"
ALICE = (("user", "alice"),)
FIRST_PRODUCER_ID = 1000  # the scripted cluster's first


def instance(cluster: ScriptedCluster, deadline_ms: int = 20_000) -> InProcessProxy:
    return InProcessProxy(cluster.bootstrap_servers, quota_admin={
        "enabled": True, "principals": ["ANONYMOUS"], "write_deadline_ms": deadline_ms}).start()


def cli(capsys, p: InProcessProxy, *argv: str) -> tuple[int, str, float]:
    """(exit status, stdout, seconds) of ``kafka-quota-proxy quotas ARGV`` against ``p``."""
    start = time.monotonic()
    status = main(["quotas", argv[0], "--bootstrap-server", p.bootstrap, *argv[1:]])
    elapsed_s = time.monotonic() - start
    return status, capsys.readouterr().out, elapsed_s


def set_alice(capsys, p: InProcessProxy, value: int = 1048576) -> tuple[int, str, float]:
    return cli(capsys, p, "set", "--user", "alice", "--add", f"producer_byte_rate={value}")


def alice(capsys, p: InProcessProxy) -> dict | None:
    """alice's quotas as Describe shows them (None: none)."""
    status, out, _ = cli(capsys, p, "describe", "--user", "alice")
    assert status == 0, out
    found = [e for e in yaml.safe_load(out)["quotas"] if e.get("user") == "alice"]
    return {k: v for k, v in found[0].items() if k != "user"} if found else None


def audited(caplog) -> list[str]:
    return [r.getMessage().split(": ", 1)[1] for r in caplog.records if r.name == "proxy.audit"]


def batches(cluster: ScriptedCluster) -> list[tuple[int, int]]:
    """(producer id, base sequence) of every Produce the cluster received, in order."""
    out = []
    for req in cluster.call(lambda: list(cluster.requests_for(PRODUCE))):
        batch = MemoryRecords(bytes(req.body.topic_data[0].partition_data[0].records)).next_batch()
        out.append((batch.producer_id, batch.base_sequence))
    return out


def count(cluster: ScriptedCluster, api_key: int) -> int:
    return cluster.call(lambda: len(cluster.requests_for(api_key)))


def wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("code", [14, 15, 16])
def test_the_first_alter_on_a_new_cluster_is_written_once_init_producer_id_answers(code, capsys, caplog):
    caplog.set_level(logging.INFO, logger="proxy.audit")
    with ScriptedCluster(brokers=1).threaded() as cluster:
        cluster.script.next_errors[INIT_PRODUCER_ID] = [code] * 3
        p = instance(cluster)
        try:
            status, out, _elapsed_s = set_alice(capsys, p)
            assert (status, out) == (0, "user=alice: ok\n")
            assert alice(capsys, p) == {"producer_byte_rate": 1048576}
            assert audited(caplog) == ["user=alice producer_byte_rate (none) -> 1048576"]
            assert count(cluster, INIT_PRODUCER_ID) == 4
            assert p.metric("kqp_quota_store_write_retries_total") == 3
            assert p.metric("kqp_quota_store_errors_total", op="write") == 0
            # Written once, under the id the fourth InitProducerId gave, from sequence 0.
            assert batches(cluster) == [(FIRST_PRODUCER_ID, 0)]
        finally:
            p.stop()


@pytest.mark.parametrize("api_key, code, cause", [
    (INIT_PRODUCER_ID, 53, "InitProducerId answered TransactionalIdAuthorizationFailed (53)"),
    (INIT_PRODUCER_ID, 31, "InitProducerId answered ClusterAuthorizationFailed (31)"),
    (CREATE_TOPICS, 29, "CreateTopics answered TopicAuthorizationFailed (29)"),
])
def test_an_error_retrying_would_not_change_is_answered_at_once_with_its_cause(api_key, code, cause, capsys, caplog):
    caplog.set_level(logging.INFO, logger="proxy.audit")
    with ScriptedCluster(brokers=1).threaded() as cluster:
        cluster.script.next_errors[api_key] = [code] * 10_000
        p = instance(cluster, deadline_ms=20_000)
        try:
            status, out, elapsed_s = set_alice(capsys, p)
            assert status == 1
            assert out.startswith("user=alice: UNKNOWN (-1): the quota topic __kqp_client_quotas could not be "
                                  f"written ({cause}"), out
            # At once: not held until the deadline, which cannot fire before its 20 s (nor retried).
            assert elapsed_s < 20, f"answered after {elapsed_s:.1f} s, the deadline being 20 s"
            assert p.metric("kqp_quota_store_write_retries_total") == 0
            assert alice(capsys, p) is None and audited(caplog) == []
        finally:
            p.stop()


def test_an_error_that_never_stops_is_answered_at_the_deadline_with_its_cause(capsys, caplog):
    caplog.set_level(logging.INFO, logger="proxy.audit")
    with ScriptedCluster(brokers=1).threaded() as cluster:
        cluster.script.next_errors[INIT_PRODUCER_ID] = [14] * 10_000
        p = instance(cluster, deadline_ms=2000)
        try:
            status, out, elapsed_s = set_alice(capsys, p)
            assert status == 1
            assert out.startswith("user=alice: REQUEST_TIMED_OUT (7): not recorded within 2 s (writing "
                                  f"{TOPIC}: InitProducerId answered CoordinatorLoadInProgress (14); "), out
            assert 1.9 <= elapsed_s < 2 + 8, elapsed_s
            # Kafka's back-off (100 ms doubling to 1 s): a handful of attempts, never a busy loop.
            assert 2 <= count(cluster, INIT_PRODUCER_ID) <= 12
            assert alice(capsys, p) is None and audited(caplog) == []
            assert p.metric("kqp_quota_store_errors_total", op="write") == 1
            # Once the cluster is ready, the same Alter goes through.
            cluster.call(cluster.script.next_errors[INIT_PRODUCER_ID].clear)
            assert set_alice(capsys, p)[:2] == (0, "user=alice: ok\n")
            assert alice(capsys, p) == {"producer_byte_rate": 1048576}
        finally:
            p.stop()


def test_a_flood_of_alters_while_the_store_retries_is_answered_within_one_deadline():
    with ScriptedCluster(brokers=1).threaded() as cluster:
        cluster.script.next_errors[INIT_PRODUCER_ID] = [14] * 10_000
        p = instance(cluster, deadline_ms=3000)
        try:
            p.run(setattr, p.server.client_quotas, "max_waiting_alters", 3)
            connections = [AdminConnection(p.address) for _ in range(6)]
            barrier = threading.Barrier(len(connections))

            def alter(i: int) -> tuple[list, float, float]:
                barrier.wait()
                start = time.monotonic()
                answered = connections[i].alter(1, [(ALICE, [set_("request_rate", 10 + i)])])
                answered_at = time.monotonic()
                return answered, answered_at - start, answered_at

            with ThreadPoolExecutor(len(connections)) as pool:
                results = list(pool.map(alter, range(len(connections))))
            for conn in connections:
                conn.close()
            assert all([(e, code) for e, code, _ in answered] == [(ALICE, 7)] for answered, _, _ in results), results
            # One writes, three wait (each within its own deadline), two are refused at once (before
            # the store may have had an answer).
            messages = [m for ((_, _, m),), _, _ in results]
            refused = [m for m in messages if m.startswith("3 quota changes are already waiting for the quota store")]
            assert len(refused) == 2, messages
            for message in set(messages) - set(refused):
                assert "InitProducerId answered CoordinatorLoadInProgress (14)" in message, message
            # All sent at once, the four that waited are answered at their deadlines, so together: one
            # held until the write before it ended, then for a deadline of its own, would come at least
            # 3 s after the first. And at the 3 s deadline, not at the 20 s of an unset one.
            timed_out_at = [at for (((_, _, m),), _, at) in results if m not in refused]
            spread_s = max(timed_out_at) - min(timed_out_at)
            assert spread_s < 3, f"the Alters that waited were answered {spread_s:.1f} s apart, the deadline being 3 s"
            slowest_s = max(s for _, s, _ in results)
            assert slowest_s < 3 + 8, f"an Alter was answered after {slowest_s:.1f} s, the deadline being 3 s"
            assert count(cluster, INIT_PRODUCER_ID) <= 30
            assert count(cluster, PRODUCE) == 0
        finally:
            p.stop()


def test_a_produce_retried_keeps_its_producer_id_and_sequence(capsys):
    with ScriptedCluster(brokers=1).threaded() as cluster:
        p = instance(cluster)
        try:
            # The leader moved, then the write timed out: the same batch goes again, same sequence
            # (a broker that appended it already answers with its offset instead of appending it twice).
            cluster.call(cluster.script.next_errors.update, {PRODUCE: [6, 7]})
            assert set_alice(capsys, p, 1000)[:2] == (0, "user=alice: ok\n")
            assert batches(cluster) == [(FIRST_PRODUCER_ID, 0)] * 3
            assert set_alice(capsys, p, 2000)[:2] == (0, "user=alice: ok\n")
            assert batches(cluster)[3:] == [(FIRST_PRODUCER_ID, 1)]  # acknowledged: the sequence moved on
            # The broker lost track of the producer: a new producer id, sequences from 0.
            cluster.call(cluster.script.next_errors.update, {PRODUCE: [59]})
            assert set_alice(capsys, p, 3000)[:2] == (0, "user=alice: ok\n")
            assert batches(cluster)[4:] == [(FIRST_PRODUCER_ID, 2), (FIRST_PRODUCER_ID + 1, 0)]
            assert count(cluster, INIT_PRODUCER_ID) == 2
            assert alice(capsys, p) == {"producer_byte_rate": 3000}
            assert p.metric("kqp_quota_store_write_retries_total") == 3
        finally:
            p.stop()


def test_the_first_topic_creation_and_first_read_retry_what_a_new_cluster_answers(capsys):
    with ScriptedCluster(brokers=1).threaded() as cluster:
        script = cluster.script
        script.next_errors.update({CREATE_TOPICS: [41], LIST_OFFSETS: [5], FETCH: [6]})

        def create_topics(broker, req):
            created = broker.default_response(req)
            if any(t.error_code == 0 for t in created.topics):
                # Kafka answers CreateTopics before every broker's metadata shows the topic.
                script.next_errors[METADATA] = [3]
            return created

        script.handlers[CREATE_TOPICS] = create_topics
        p = instance(cluster)
        try:
            assert wait_until(lambda: p.server.ready()[0], 15), p.server.ready()
            assert p.metric("kqp_quota_store_topic_lost_total") == 0  # not taken for deleted
            assert list(cluster.call(lambda: list(cluster.topics))) == [TOPIC]
            assert p.metric("kqp_quota_store_errors_total", op="create") >= 1
            assert p.metric("kqp_quota_store_errors_total", op="read") >= 2
            assert set_alice(capsys, p)[:2] == (0, "user=alice: ok\n")
            assert alice(capsys, p) == {"producer_byte_rate": 1048576}
        finally:
            p.stop()


def test_an_alter_before_the_topic_exists_waits_for_its_creation(capsys):
    with ScriptedCluster(brokers=1).threaded() as cluster:
        cluster.script.next_errors[CREATE_TOPICS] = [41] * 10_000
        p = instance(cluster, deadline_ms=20_000)
        try:
            assert not p.server.ready()[0]
            result: list = []
            alter = threading.Thread(target=lambda: result.append(set_alice(capsys, p)))
            creates = count(cluster, CREATE_TOPICS)
            alter.start()
            cluster.wait_for_requests(CREATE_TOPICS, creates + 2, timeout_s=10)
            cluster.call(cluster.script.next_errors[CREATE_TOPICS].clear)  # the controller is there
            alter.join(30)
            [(status, out, _)] = result
            assert (status, out) == (0, "user=alice: ok\n")
            assert alice(capsys, p) == {"producer_byte_rate": 1048576}
            assert wait_until(lambda: p.server.ready()[0], 10), p.server.ready()
        finally:
            p.stop()
