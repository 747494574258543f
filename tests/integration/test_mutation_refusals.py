"""KIP-599: a topic Kafka refuses for its own reason is never charged and never answered 89.

Kafka's controller validates each topic before it charges the controller mutation quota
(``ReplicationControlManager.createTopic`` / ``createPartitions`` / ``deleteTopic`` call
``applyPartitionChangeQuota`` after their checks), so an existing name, an invalid partition
count or replication factor, a topic that does not exist (to delete or extend) gets its own error
and costs nothing. The sequences here are the ones an operator sent to Apache Kafka 4.0 and to
the proxy (R = 1 partition/s, Kafka's default windows 11 x 1 s, so the burst is 11 and a new
bucket is full); Kafka 4.0's codes are the expected ones.

Tansu is the real broker. It refuses an existing name (36) but creates a topic with replication
factor 5 on its one broker, an illegal name or 0 partitions (probed with Tansu 0.6: all error 0),
so the row "replication factor 5 on a one-broker cluster" of Kafka's table runs against the
scripted cluster (tests/support/scripted_broker.py), which refuses what Kafka's replica placer
cannot place; the same scripted cluster stands in for Kafka where a broker must answer
CreatePartitions (Tansu has none) or a CreateTopicPolicy refusal.

Exact codes are read from raw responses (kafka-python's request classes over a plain socket).
A response carrying a throttle mutes its connection (KIP-219), so every request expected to get
89 goes on a connection of its own.
"""

from __future__ import annotations

import time

import pytest
from kafka.protocol.admin import CreatePartitionsRequest, CreateTopicsRequest, DeleteTopicsRequest

from protocol.apis import ApiKey
from tests.integration.test_controller_mutation import ZERO_UUID, Wire, broker_topics, codes, has_bucket, tokens_read
from tests.support.inproc import InProcessProxy
from tests.support.scripted_broker import Script, ScriptedCluster
from tests.support.scripted_handlers import HANDLERS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

RATE = 1  # partitions per second
BURST = 11  # Q x 11 windows x 1 s
WINDOWS = {"controller_quota_window_num": 11, "controller_quota_window_size_seconds": 1}
QUOTAS = [{"user": "<default>", "client_id": "streams-*", "controller_mutation_rate": RATE}]
THROTTLED = 89
UNKNOWN_TOPIC_OR_PARTITION = 3
INVALID_TOPIC_EXCEPTION = 17
TOPIC_ALREADY_EXISTS = 36
INVALID_PARTITIONS = 37
INVALID_REPLICATION_FACTOR = 38
INVALID_REQUEST = 42
POLICY_VIOLATION = 44
SLACK = 0.3  # tokens: refill while a request is on its way (1 token/s) and clock granularity


def create(version: int, *topics: tuple[str, int, int], validate_only: bool = False):
    """CreateTopics of (name, partitions, replication factor) entries."""
    T = CreateTopicsRequest[version].CreatableTopic
    return CreateTopicsRequest[version](
        topics=[T(name=n, num_partitions=p, replication_factor=rf, assignments=[], configs=[]) for n, p, rf in topics],
        timeout_ms=10_000, validate_only=validate_only)


def delete_v6(*names: str):
    D = DeleteTopicsRequest[6].DeleteTopicState
    return DeleteTopicsRequest[6](topics=[D(name=n, topic_id=ZERO_UUID) for n in names], timeout_ms=10_000)


def create_partitions_v3(**counts: int):
    T = CreatePartitionsRequest[3].CreatePartitionsTopic
    return CreatePartitionsRequest[3](topics=[T(name=n.replace("_", "-"), count=c, assignments=None)
                                              for n, c in counts.items()], timeout_ms=10_000, validate_only=False)


def call(address, client_id: str, request):
    """One request on a connection of its own (a throttled answer mutes only that one)."""
    with Wire(address, client_id) as w:
        resp, _ = w.call(request)
    return resp


class Bucket:
    """Reads an entity's tokens and says what was charged since, the refill taken out. The proxy
    refilled the bucket to some instant between the clock readings around each read, so the
    refill between two reads, and so the charge, is known to lie in an interval."""

    def __init__(self, proxy, client_id: str) -> None:
        self.proxy, self.client_id = proxy, client_id
        self.tokens, self.read_from, self.read_to = self._read()

    def _read(self) -> tuple[float, float, float]:
        if has_bucket(self.proxy, self.client_id):
            return tokens_read(self.proxy, self.client_id)
        # An entity charged nothing yet has no bucket: a new one is full, whenever it is made.
        now = time.monotonic()
        return BURST, now, now

    def charged_since(self) -> tuple[float, float]:
        """(least, most) charged since the last read. The refill is Q × the time between the two
        refills, less the time the bucket spent full, which it can only reach after (BURST − K)/Q."""
        before, before_from, before_to = self.tokens, self.read_from, self.read_to
        self.tokens, self.read_from, self.read_to = self._read()
        shortest_s, longest_s = max(self.read_from - before_to, 0.0), self.read_to - before_from
        least_refill, most_refill = min(RATE * shortest_s, BURST - before), RATE * longest_s
        return before + least_refill - self.tokens, before + most_refill - self.tokens


def assert_charged(bucket: Bucket, expected: float, apart: float) -> None:
    """``expected`` was charged since the bucket's last read; ``apart``: how far the nearest wrong
    charge is (a topic charged that should not be, or the reverse), which the interval must exclude."""
    least, most = bucket.charged_since()
    assert least - 1e-9 <= expected <= most + 1e-9, f"charged between {least:.3f} and {most:.3f}, not {expected}"
    assert most - least < apart, f"charged between {least:.3f} and {most:.3f}: too slow to tell {expected} from " \
                                 f"{apart} more or less"


@pytest.fixture
def proxy(tansu):
    with InProcessProxy([tansu.bootstrap], quotas=QUOTAS, quota_windows=WINDOWS) as p:
        yield p


def existing_on_broker(address, name: str, partitions: int) -> None:
    """Creates ``name`` on the broker itself: another instance of the application made it, the
    proxy's own topic cache has never seen it."""
    assert codes(call(address, "elsewhere", create(7, (name, partitions, 1)))) == [0]


# -- Kafka 4.0's table ----------------------------------------------------------------------------


def test_the_kafka_table_against_tansu_existing_topics_cost_nothing(tansu, proxy):
    """The rows Tansu can stage, in order: an existing 6-partition topic three times is answered
    36 each time (with the bug: 36, 36, 89); two new topics (6 + 4) are both created (bug: 0, 89);
    the existing topic again 36; a new 1-partition topic 0. Only the 11 partitions created are
    charged."""
    broker = (tansu.host, tansu.port)
    existing_on_broker(broker, "changelog", 6)
    with Wire(proxy.address, "streams-app") as w:
        for _ in range(3):
            resp, _ = w.call(create(7, ("changelog", 6, 1)))
            assert codes(resp) == [TOPIC_ALREADY_EXISTS] and resp.throttle_time_ms == 0
        bucket = Bucket(proxy, "streams-app")
        assert bucket.tokens >= BURST - SLACK, "an existing topic was charged"
        resp, _ = w.call(create(7, ("orders", 6, 1), ("payments", 4, 1)))
        assert codes(resp) == [0, 0] and resp.throttle_time_ms == 0
        resp, _ = w.call(create(7, ("changelog", 6, 1)))
        assert codes(resp) == [TOPIC_ALREADY_EXISTS]
        resp, _ = w.call(create(7, ("audit", 1, 1)))
        assert codes(resp) == [0] and resp.throttle_time_ms == 0
        assert_charged(bucket, 11, apart=6)  # not the existing topic's 6
    assert {n: p for n, p in broker_topics(broker).items() if n != "changelog"} == {"orders": 6, "payments": 4,
                                                                                   "audit": 1}


def test_the_kafka_table_row_by_row_against_a_broker_that_validates_as_kafka(tmp_path):
    """All five rows of the table, each row's codes exactly as Kafka 4.0 answered, against the
    scripted cluster (one broker; it refuses an existing name with 36 and a replication factor it
    cannot place with 38, as Kafka's controller does)."""
    with ScriptedCluster(brokers=1, topics={"changelog": 6}).threaded() as cluster, \
            InProcessProxy(cluster.bootstrap_servers, quotas=QUOTAS, quota_windows=WINDOWS) as proxy, \
            Wire(proxy.address, "streams-app") as w:
        rows = [
            ("existing 6-partition topic, three times",
             [create(7, ("changelog", 6, 1))] * 3, [[TOPIC_ALREADY_EXISTS]] * 3),
            ("two new topics (6 + 4 partitions)",
             [create(7, ("orders", 6, 1), ("payments", 4, 1))], [[0, 0]]),
            ("the existing topic again", [create(7, ("changelog", 6, 1))], [[TOPIC_ALREADY_EXISTS]]),
            ("replication factor 5 on a one-broker cluster",
             [create(7, ("replicated", 1, 5))], [[INVALID_REPLICATION_FACTOR]]),
            ("a new 1-partition topic", [create(7, ("audit", 1, 1))], [[0]]),
        ]
        for what, requests, expected in rows:
            got = [codes(w.call(r)[0]) for r in requests]
            assert got == expected, what
        # The refusals reached the broker, which gave its own answers: the proxy answered nothing.
        sent = [t.name for r in cluster.requests_for(ApiKey.CREATE_TOPICS) for t in r.body.topics]
        assert sent.count("changelog") == 4 and "replicated" in sent
        assert proxy.metric("kqp_quota_rejected_total", kind="controller_mutation_rate") == 0


# -- in debt: Kafka's own refusals, not 89 -------------------------------------------------------------


def test_in_debt_a_refused_topic_gets_kafkas_answer_and_never_reaches_a_lax_broker(tansu, proxy):
    """The principal is 9 partitions in debt. Kafka answers an existing name 36, a replication
    factor above the brokers 38, an illegal name 17, 0 partitions 37 — none of them 89 and none
    charged; only a topic it would create gets 89. The existing topic was made on the broker
    behind the proxy's back, so the proxy asks the broker before refusing. Tansu would create
    the invalid ones (it validates none of these): the proxy answers them itself, so none
    reaches it while the principal is in debt."""
    broker = (tansu.host, tansu.port)
    existing_on_broker(broker, "changelog", 6)
    big_sent = time.monotonic()
    assert codes(call(proxy.address, "streams-debt", create(7, ("big", 20, 1)))) == [0]  # K 11 -> -9
    bucket = Bucket(proxy, "streams-debt")
    assert bucket.tokens < -8
    refused = {
        "changelog": (create(7, ("changelog", 6, 1)), TOPIC_ALREADY_EXISTS),
        "replicated": (create(7, ("replicated", 1, 5)), INVALID_REPLICATION_FACTOR),
        "bad name": (create(7, ("bad name", 1, 1)), INVALID_TOPIC_EXCEPTION),
        "empty": (create(7, ("empty", 0, 1)), INVALID_PARTITIONS),
    }
    with Wire(proxy.address, "streams-debt") as w:  # no throttle on these answers: one connection
        for name, (request, code) in refused.items():
            resp, _ = w.call(request)
            assert [(t.name, t.error_code) for t in resp.topics] == [(name, code)]
            assert resp.throttle_time_ms == 0, name  # strict: no rejection, no throttle
    (answer,) = call(proxy.address, "streams-debt", create(7, ("changelog", 6, 1))).topics
    assert answer.error_message == "Topic 'changelog' already exists."  # the proxy's answer, in Kafka's words
    resp = call(proxy.address, "streams-debt", create(7, ("fresh", 1, 1)))
    # −K/Q at the refusal: K was −9 when "big" was charged (after ``big_sent``), refilled since.
    least_ms = 9_000 - (time.monotonic() - big_sent) * 1000
    assert codes(resp) == [THROTTLED] and least_ms - 1 <= resp.throttle_time_ms <= 9_000, (resp.throttle_time_ms,
                                                                                           least_ms)
    resp = call(proxy.address, "streams-debt", create(7, ("changelog", 6, 1), ("fresh", 1, 1), ("replicated", 1, 5)))
    assert codes(resp) == [TOPIC_ALREADY_EXISTS, THROTTLED, INVALID_REPLICATION_FACTOR]
    # A name given twice: ControllerApis answers it once, INVALID_REQUEST, before any charge.
    resp = call(proxy.address, "streams-debt", create(7, ("twice", 1, 1), ("twice", 1, 1), ("fresh", 1, 1)))
    assert [(t.name, t.error_code) for t in resp.topics] == [("twice", INVALID_REQUEST), ("fresh", THROTTLED)]
    assert_charged(bucket, 0, apart=1)  # a refused topic charged: 1 or more
    on_broker = broker_topics(broker)
    assert not {"replicated", "bad name", "empty", "fresh", "twice"} & set(on_broker)


def test_in_debt_deleting_a_topic_that_does_not_exist_is_answered_3_not_89(tansu, proxy):
    """DeleteTopics v6 (strict): a topic that does not exist deletes nothing, costs nothing and
    is answered UNKNOWN_TOPIC_OR_PARTITION, in debt or not; an existing one in debt gets 89."""
    broker = (tansu.host, tansu.port)
    existing_on_broker(broker, "victim", 3)
    bucket = Bucket(proxy, "streams-del")
    resp = call(proxy.address, "streams-del", delete_v6("ghost"))
    assert [(t.name, t.error_code) for t in resp.responses] == [("ghost", UNKNOWN_TOPIC_OR_PARTITION)]
    assert_charged(bucket, 0, apart=1)
    assert codes(call(proxy.address, "streams-del", create(7, ("big", 20, 1)))) == [0]  # into debt
    bucket.charged_since()
    resp = call(proxy.address, "streams-del", delete_v6("ghost", "victim"))
    assert [(t.name, t.error_code) for t in resp.responses] == [("ghost", UNKNOWN_TOPIC_OR_PARTITION),
                                                                ("victim", THROTTLED)]
    assert_charged(bucket, 0, apart=1)
    assert "victim" in broker_topics(broker)


def test_in_debt_create_partitions_refused_by_kafka_get_its_codes(tmp_path):
    """CreatePartitions v3 (strict, scripted cluster: Tansu has none): no increase (37), a topic
    that does not exist (3) cost nothing, in debt or not; a real increase in debt gets 89."""
    script = Script()
    script.api_versions[ApiKey.CREATE_PARTITIONS] = (0, CreatePartitionsRequest.max_version)
    from tests.integration.test_controller_mutation import _create_partitions
    script.handlers[ApiKey.CREATE_PARTITIONS] = _create_partitions
    with ScriptedCluster(brokers=1, topics={"cp-a": 2}, script=script).threaded() as cluster, \
            InProcessProxy(cluster.bootstrap_servers, quotas=QUOTAS, quota_windows=WINDOWS) as proxy:
        resp = call(proxy.address, "streams-cp", create_partitions_v3(cp_a=2, nope=3))
        assert [r.error_code for r in resp.results] == [INVALID_PARTITIONS, UNKNOWN_TOPIC_OR_PARTITION]
        bucket = Bucket(proxy, "streams-cp")
        assert bucket.tokens >= BURST - SLACK
        assert codes(call(proxy.address, "streams-cp", create(7, ("big", 20, 1)))) == [0]  # into debt
        bucket.charged_since()
        resp = call(proxy.address, "streams-cp", create_partitions_v3(cp_a=1))
        assert [(r.error_code, r.error_message) for r in resp.results] == [
            (INVALID_PARTITIONS, "The topic cp-a currently has 2 partition(s); 1 would not be an increase.")]
        resp = call(proxy.address, "streams-cp", create_partitions_v3(cp_a=2, nope=3, cp_b=4))
        assert [r.error_code for r in resp.results] == [INVALID_PARTITIONS, UNKNOWN_TOPIC_OR_PARTITION,
                                                        UNKNOWN_TOPIC_OR_PARTITION]
        resp = call(proxy.address, "streams-cp", create_partitions_v3(cp_a=5))
        assert [r.error_code for r in resp.results] == [THROTTLED]
        assert_charged(bucket, 0, apart=1)
        assert cluster.call(lambda: len(cluster.topics["cp-a"].partitions)) == 2


# -- permissive versions: only what is created is charged ----------------------------------------------


def test_a_permissive_request_with_a_refused_topic_charges_only_the_created_ones(tansu, proxy):
    """CreateTopics v5 (permissive: never refused, throttled while in debt). [changelog (exists,
    6), orders (4)]: 4 charged, K 11 -> 7. Again with payments: Kafka charges 4 (K -> 3) and does
    not throttle; charged as sent (10) it would be K -> -3 and a 3 s throttle."""
    broker = (tansu.host, tansu.port)
    existing_on_broker(broker, "changelog", 6)
    bucket = Bucket(proxy, "streams-old")
    with Wire(proxy.address, "streams-old") as w:
        resp, _ = w.call(create(5, ("changelog", 6, 1), ("orders", 4, 1)))
        assert codes(resp) == [TOPIC_ALREADY_EXISTS, 0] and resp.throttle_time_ms == 0
        assert_charged(bucket, 4, apart=6)  # charged as sent: 10
        resp, _ = w.call(create(5, ("changelog", 6, 1), ("payments", 4, 1)))
        assert codes(resp) == [TOPIC_ALREADY_EXISTS, 0] and resp.throttle_time_ms == 0
        assert_charged(bucket, 4, apart=6)  # charged as sent: 10


# -- what only the broker knows: settled against its answer --------------------------------------------


def _policy_create_topics(broker, req):
    """The scripted cluster's CreateTopics behind a CreateTopicPolicy refusing ``policy-*`` (44)."""
    resp = HANDLERS[ApiKey.CREATE_TOPICS](broker, req)
    for t in resp.topics:
        if t.name.startswith("policy-"):
            broker.cluster.topics.pop(t.name, None)
            t.error_code, t.error_message, t.num_partitions = POLICY_VIOLATION, "refused by policy", -1
    return resp


def test_a_topic_the_broker_refuses_for_a_reason_only_it_knows_is_given_back():
    """A CreateTopicPolicy refusal (44) is the broker's alone to know: the proxy charges the topic
    on its way and gives the tokens back when the answer says it was not created."""
    script = Script()
    script.handlers[ApiKey.CREATE_TOPICS] = _policy_create_topics
    with ScriptedCluster(brokers=1, script=script).threaded() as cluster, \
            InProcessProxy(cluster.bootstrap_servers, quotas=QUOTAS, quota_windows=WINDOWS) as proxy:
        bucket = Bucket(proxy, "streams-policy")
        resp = call(proxy.address, "streams-policy", create(7, ("policy-x", 5, 1), ("orders", 2, 1)))
        assert codes(resp) == [POLICY_VIOLATION, 0]
        assert_charged(bucket, 2, apart=5)  # not given back: 7


def test_a_topic_a_lax_broker_creates_although_kafka_would_not_is_charged(tansu, proxy):
    """Out of debt a topic Kafka would refuse is the broker's to answer; Tansu creates a
    replication factor of 5 on its one broker: the 3 partitions it made are charged then."""
    bucket = Bucket(proxy, "streams-lax")
    resp = call(proxy.address, "streams-lax", create(7, ("replicated", 3, 5)))
    assert codes(resp) == [0]
    assert_charged(bucket, 3, apart=3)  # not charged: 0
