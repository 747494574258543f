"""What Kafka's controller refuses before it charges the controller mutation quota (KIP-599).

Kafka validates each topic of a CreateTopics, CreatePartitions or DeleteTopics request first and
charges the quota only for a topic it would then create, extend or delete
(``ReplicationControlManager.createTopic`` / ``createPartitions`` / ``deleteTopic`` call
``applyPartitionChangeQuota`` after their checks; ``ControllerApis`` answers duplicates before
the controller sees them). A topic refused for its own reason costs nothing and is never answered
THROTTLING_QUOTA_EXCEEDED.

Pure: these functions judge a topic from what the proxy knows (the request, the topic cache, the
brokers it has seen) and do no I/O. ``None`` means "nothing known against it", never "valid": a
check only the broker can make (a CreateTopicPolicy, a topic config, authorization) shows in its
answer, and :func:`charged` says which answers mean Kafka charged nothing.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any, NamedTuple

from protocol.apis import ApiKey

# org.apache.kafka.common.protocol.Errors
UNKNOWN_TOPIC_OR_PARTITION = 3
REQUEST_TIMED_OUT = 7
INVALID_TOPIC_EXCEPTION = 17
TOPIC_AUTHORIZATION_FAILED = 29
TOPIC_ALREADY_EXISTS = 36
INVALID_PARTITIONS = 37
INVALID_REPLICATION_FACTOR = 38
INVALID_REPLICA_ASSIGNMENT = 39
INVALID_REQUEST = 42
TOPIC_DELETION_DISABLED = 73
UNKNOWN_TOPIC_ID = 100

_MAX_NAME_LENGTH = 249  # org.apache.kafka.common.internals.Topic.MAX_NAME_LENGTH
_LEGAL_NAME = re.compile(r"[a-zA-Z0-9._-]+")

THROTTLING_QUOTA_EXCEEDED = 89

# CreatePartitions codes Kafka answers before it charges (ControllerApis, createPartitions): an
# unknown topic, no increase, not authorized, a duplicate, the quota itself. A bad assignment
# found by placement comes after the charge, and stays charged, as in Kafka.
_PARTITIONS_UNCHARGED = frozenset({UNKNOWN_TOPIC_OR_PARTITION, TOPIC_AUTHORIZATION_FAILED, INVALID_PARTITIONS,
                                   INVALID_REQUEST, UNKNOWN_TOPIC_ID, THROTTLING_QUOTA_EXCEEDED})


# Refusals the proxy judges from its topic cache (which may be stale): asked of the broker afresh
# before the proxy answers one itself.
CACHE_CODES = frozenset({UNKNOWN_TOPIC_OR_PARTITION, TOPIC_ALREADY_EXISTS, INVALID_PARTITIONS,
                         INVALID_REPLICA_ASSIGNMENT, UNKNOWN_TOPIC_ID})


class Refusal(NamedTuple):
    """Kafka's own answer to a topic it refuses before charging: its error code and message."""

    error_code: int
    message: str


def charged(api_key: int, error_code: int) -> bool:
    """Whether Kafka charged the quota for a topic it answered ``error_code`` (the proxy refunds
    a charge when not). CreateTopics and DeleteTopics charge only what they create or delete (a
    timeout may have done it: it stays charged); CreatePartitions charges after its first checks."""
    if error_code in (0, REQUEST_TIMED_OUT):
        return True
    if api_key == ApiKey.CREATE_PARTITIONS:
        return error_code not in _PARTITIONS_UNCHARGED
    return False


def duplicates(names: list[str | None]) -> set[str]:
    """Names given more than once (ControllerApis answers each INVALID_REQUEST)."""
    seen: set[str] = set()
    twice: set[str] = set()
    for name in names:
        if name is not None:
            (twice if name in seen else seen).add(name)
    return twice


def create_topic_refusal(topic: Any, *, duplicate: bool, exists: bool, brokers: Collection[int]) -> Refusal | None:
    """What Kafka answers a CreateTopics entry it refuses before charging, in Kafka's order
    (``ControllerApis.createTopics``, ``ReplicationControlManager.createTopics`` / ``createTopic``);
    None when nothing the proxy knows refuses it. ``brokers``: the node ids seen (empty: unknown)."""
    name = topic.name
    if duplicate:
        return Refusal(INVALID_REQUEST, "Duplicate topic name.")
    bad_name = _name_refusal(name)
    if bad_name is not None:
        return Refusal(INVALID_TOPIC_EXCEPTION, bad_name)
    if exists:
        return Refusal(TOPIC_ALREADY_EXISTS, f"Topic '{name}' already exists.")
    if topic.assignments:
        return _assignment_refusal(topic, brokers)
    if topic.replication_factor < -1 or topic.replication_factor == 0:
        return Refusal(INVALID_REPLICATION_FACTOR,
                       "Replication factor must be larger than 0, or -1 to use the default value.")
    if topic.num_partitions < -1 or topic.num_partitions == 0:
        return Refusal(INVALID_PARTITIONS, "Number of partitions was set to an invalid non-positive value.")
    if brokers and topic.replication_factor > len(brokers):
        # The replica placer (StripedReplicaPlacer) cannot place more replicas than brokers.
        return Refusal(INVALID_REPLICATION_FACTOR,
                       f"Unable to replicate the partition {topic.replication_factor} time(s): The target "
                       f"replication factor of {topic.replication_factor} cannot be reached because only "
                       f"{len(brokers)} broker(s) are registered.")
    return None


def _name_refusal(name: str | None) -> str | None:
    """org.apache.kafka.common.internals.Topic.validate."""
    if not name:
        return "Topic name is illegal, it can't be empty"
    if name in (".", ".."):
        return "Topic name cannot be \".\" or \"..\""
    if len(name) > _MAX_NAME_LENGTH:
        return f"Topic name is illegal, it can't be longer than {_MAX_NAME_LENGTH} characters, topic name: {name}"
    if not _LEGAL_NAME.fullmatch(name):
        return (f"Topic name \"{name}\" is illegal, it contains a character other than ASCII alphanumerics, "
                "'.', '_' and '-'")
    return None


def _assignment_refusal(topic: Any, brokers: Collection[int]) -> Refusal | None:
    """ReplicationControlManager.createTopic with manual assignments (validateManualPartitionAssignment)."""
    if topic.replication_factor != -1:
        return Refusal(INVALID_REQUEST, "A manual partition assignment was specified, but replication factor was "
                                        "not set to -1.")
    if topic.num_partitions != -1:
        return Refusal(INVALID_REQUEST, "A manual partition assignment was specified, but numPartitions was not "
                                        "set to -1.")
    indexes: set[int] = set()
    replicas: int | None = None
    for a in topic.assignments:
        if a.partition_index in indexes:
            return Refusal(INVALID_REPLICA_ASSIGNMENT,
                           f"Found multiple manual partition assignments for partition {a.partition_index}")
        indexes.add(a.partition_index)
        ids = list(a.broker_ids)
        if not ids:
            return Refusal(INVALID_REPLICA_ASSIGNMENT, "The manual partition assignment includes an empty replica "
                                                       "list.")
        if len(set(ids)) != len(ids):
            twice = next(b for b in ids if ids.count(b) > 1)
            return Refusal(INVALID_REPLICA_ASSIGNMENT,
                           f"The manual partition assignment includes the broker {twice} more than once.")
        unknown = [b for b in ids if brokers and b not in brokers]
        if unknown:
            return Refusal(INVALID_REPLICA_ASSIGNMENT, f"The manual partition assignment includes broker "
                                                       f"{unknown[0]}, but no such broker is registered.")
        if replicas is not None and len(ids) != replicas:
            return Refusal(INVALID_REPLICA_ASSIGNMENT,
                           f"The manual partition assignment includes a partition with {len(ids)} replica(s), but "
                           f"this is not consistent with previous partitions, which have {replicas} replica(s).")
        replicas = len(ids)
    if indexes != set(range(len(indexes))):
        return Refusal(INVALID_REPLICA_ASSIGNMENT, "partitions should be a consecutive 0-based integer sequence")
    return None


def create_partitions_refusal(topic: Any, current: int | None, *, duplicate: bool) -> Refusal | None:
    """What Kafka answers a CreatePartitions entry it refuses before charging
    (``ReplicationControlManager.createPartitions``); ``current``: the topic's partition count
    (None: the topic does not exist)."""
    if duplicate:
        return Refusal(INVALID_REQUEST, "Duplicate topic name.")
    if current is None:
        return Refusal(UNKNOWN_TOPIC_OR_PARTITION, "This server does not host this topic-partition.")
    if topic.count == current:
        return Refusal(INVALID_PARTITIONS, f"Topic already has {current} partition(s).")
    if topic.count < current:
        return Refusal(INVALID_PARTITIONS, f"The topic {topic.name} currently has {current} partition(s); "
                                           f"{topic.count} would not be an increase.")
    if topic.assignments is not None and len(topic.assignments) != topic.count - current:
        return Refusal(INVALID_REPLICA_ASSIGNMENT, f"Attempted to add {topic.count - current} additional "
                                                   f"partition(s), but only {len(topic.assignments)} assignment(s) "
                                                   "were specified.")
    return None


def delete_topic_refusal(by_id: bool, exists: bool, *, duplicate: bool) -> Refusal | None:
    """What Kafka answers a DeleteTopics entry it refuses before charging (``ControllerApis.deleteTopics``)."""
    if duplicate:
        return Refusal(INVALID_REQUEST, "Duplicate topic id." if by_id else "Duplicate topic name.")
    if not exists:
        if by_id:
            return Refusal(UNKNOWN_TOPIC_ID, "This server does not host this topic ID.")
        return Refusal(UNKNOWN_TOPIC_OR_PARTITION, "This server does not host this topic-partition.")
    return None
