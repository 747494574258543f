"""What Kafka refuses before charging the controller mutation quota (proxy.dataplane.filters.mutation_checks),
case by case in Kafka's order, and which answers mean Kafka charged nothing."""

from __future__ import annotations

import pytest
from kafka.protocol.admin import CreatePartitionsRequest, CreateTopicsRequest

from protocol.apis import ApiKey
from proxy.dataplane.filters import mutation_checks as checks

T = CreateTopicsRequest[7].CreatableTopic
A = T.CreatableReplicaAssignment
P = CreatePartitionsRequest[3].CreatePartitionsTopic
BROKERS = {1, 2, 3}
BAD_ASSIGNMENT = checks.INVALID_REPLICA_ASSIGNMENT


def topic(name="orders", partitions=3, rf=2, assignments=()):
    return T(name=name, num_partitions=partitions, replication_factor=rf, assignments=list(assignments), configs=[])


def code(t, duplicate=False, exists=False, brokers=BROKERS):
    refusal = checks.create_topic_refusal(t, duplicate=duplicate, exists=exists, brokers=brokers)
    return None if refusal is None else refusal.error_code


@pytest.mark.parametrize("t,expected", [
    (topic(), None),
    (topic(partitions=-1, rf=-1), None),  # the broker's defaults
    (topic(name=""), checks.INVALID_TOPIC_EXCEPTION),
    (topic(name=".."), checks.INVALID_TOPIC_EXCEPTION),
    (topic(name="a" * 250), checks.INVALID_TOPIC_EXCEPTION),
    (topic(name="a" * 249), None),
    (topic(name="bad name"), checks.INVALID_TOPIC_EXCEPTION),
    (topic(name="ok.name_with-all9"), None),
    (topic(rf=0), checks.INVALID_REPLICATION_FACTOR),
    (topic(rf=-2), checks.INVALID_REPLICATION_FACTOR),
    (topic(rf=4), checks.INVALID_REPLICATION_FACTOR),  # more replicas than the 3 brokers
    (topic(partitions=0), checks.INVALID_PARTITIONS),
    (topic(partitions=-5), checks.INVALID_PARTITIONS),
    (topic(rf=0, partitions=0), checks.INVALID_REPLICATION_FACTOR),  # Kafka checks the factor first
    (topic(partitions=-1, rf=-1, assignments=[A(partition_index=0, broker_ids=[1, 2]),
                                              A(partition_index=1, broker_ids=[2, 3])]), None),
    (topic(assignments=[A(partition_index=0, broker_ids=[1])]), checks.INVALID_REQUEST),  # rf not -1
    (topic(partitions=1, rf=-1, assignments=[A(partition_index=0, broker_ids=[1])]), checks.INVALID_REQUEST),
    (topic(partitions=-1, rf=-1, assignments=[A(partition_index=0, broker_ids=[1]),
                                              A(partition_index=0, broker_ids=[2])]), BAD_ASSIGNMENT),
    (topic(partitions=-1, rf=-1, assignments=[A(partition_index=0, broker_ids=[])]), BAD_ASSIGNMENT),
    (topic(partitions=-1, rf=-1, assignments=[A(partition_index=0, broker_ids=[1, 1])]),
     BAD_ASSIGNMENT),
    (topic(partitions=-1, rf=-1, assignments=[A(partition_index=0, broker_ids=[9])]), BAD_ASSIGNMENT),
    (topic(partitions=-1, rf=-1, assignments=[A(partition_index=0, broker_ids=[1]),
                                              A(partition_index=1, broker_ids=[1, 2])]), BAD_ASSIGNMENT),
    (topic(partitions=-1, rf=-1, assignments=[A(partition_index=1, broker_ids=[1])]), BAD_ASSIGNMENT),
])
def test_create_topic_refusals_follow_kafkas_checks(t, expected):
    assert code(t) == expected


def test_a_duplicate_or_an_existing_name_comes_before_every_other_check():
    bad = topic(name="bad name", rf=0)
    assert code(bad, duplicate=True) == checks.INVALID_REQUEST  # ControllerApis, before the controller
    assert code(topic(rf=0), exists=True) == checks.TOPIC_ALREADY_EXISTS
    assert code(bad, exists=True) == checks.INVALID_TOPIC_EXCEPTION  # the name is validated first
    refusal = checks.create_topic_refusal(topic(name="changelog"), duplicate=False, exists=True, brokers=BROKERS)
    assert refusal.message == "Topic 'changelog' already exists."


def test_with_no_broker_known_the_replication_factor_and_broker_ids_are_the_brokers_to_judge():
    assert code(topic(rf=7), brokers=set()) is None
    assert code(topic(partitions=-1, rf=-1, assignments=[A(partition_index=0, broker_ids=[9])]), brokers=set()) is None


@pytest.mark.parametrize("count,current,assignments,expected", [
    (5, 2, None, None),
    (5, None, None, checks.UNKNOWN_TOPIC_OR_PARTITION),
    (2, 2, None, checks.INVALID_PARTITIONS),
    (1, 2, None, checks.INVALID_PARTITIONS),
    (4, 2, [P.CreatePartitionsAssignment(broker_ids=[1])], BAD_ASSIGNMENT),  # 2 new, 1 given
    (4, 2, [P.CreatePartitionsAssignment(broker_ids=[1]), P.CreatePartitionsAssignment(broker_ids=[2])], None),
])
def test_create_partitions_refusals(count, current, assignments, expected):
    t = P(name="orders", count=count, assignments=assignments)
    refusal = checks.create_partitions_refusal(t, current, duplicate=False)
    assert (refusal and refusal.error_code) == expected
    assert checks.create_partitions_refusal(t, current, duplicate=True).error_code == checks.INVALID_REQUEST


def test_delete_topic_refusals():
    assert checks.delete_topic_refusal(False, True, duplicate=False) is None
    assert checks.delete_topic_refusal(False, False, duplicate=False).error_code == checks.UNKNOWN_TOPIC_OR_PARTITION
    assert checks.delete_topic_refusal(True, False, duplicate=False).error_code == checks.UNKNOWN_TOPIC_ID
    assert checks.delete_topic_refusal(True, True, duplicate=True).message == "Duplicate topic id."


def test_duplicates_are_the_names_given_twice():
    assert checks.duplicates(["a", "b", "a", None, None, "c", "a"]) == {"a"}


@pytest.mark.parametrize("key", [ApiKey.CREATE_TOPICS, ApiKey.DELETE_TOPICS, ApiKey.CREATE_PARTITIONS])
def test_what_kafka_charged_by_the_answer(key):
    assert checks.charged(key, 0) and checks.charged(key, checks.REQUEST_TIMED_OUT)  # done, or may be
    for refused in (checks.UNKNOWN_TOPIC_OR_PARTITION, checks.INVALID_PARTITIONS, checks.INVALID_REQUEST,
                    checks.TOPIC_AUTHORIZATION_FAILED, 89):
        assert not checks.charged(key, refused)
    # Placement comes after CreatePartitions' charge (ReplicationControlManager.createPartitions).
    assert checks.charged(key, BAD_ASSIGNMENT) == (key == ApiKey.CREATE_PARTITIONS)
    assert checks.charged(key, checks.INVALID_REPLICATION_FACTOR) == (key == ApiKey.CREATE_PARTITIONS)
