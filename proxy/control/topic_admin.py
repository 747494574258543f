"""What the proxy's own topics (the quota store's, the fleet's) ask of the cluster, on the proxy's
own connections: a topic's metadata from a bootstrap server, the topic made, and the end of its
partition 0.

Guarantees: ``bootstrap_metadata`` tries each bootstrap server once, in order, and raises the
last failure when none answers; ``create_topic`` returns 0 or TOPIC_ALREADY_EXISTS (another
instance made it first) and raises a StoreError naming any other error code.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kafka.protocol.admin import CreateTopicsRequest
from kafka.protocol.consumer import ListOffsetsRequest

from proxy.cluster.brokers import Cluster
from proxy.cluster.dialer import BrokerDialer, OwnConnection
from proxy.cluster.refresh import fetch_topic_metadata
from proxy.control.quota_topic_producer import StoreError, broker_error

log = logging.getLogger(__name__)

TOPIC_ALREADY_EXISTS = 36  # org.apache.kafka.common.protocol.Errors


async def bootstrap_metadata(cluster: Cluster, topic: str, timeout_s: float) -> Any:
    """Metadata for ``topic`` (kafka-python's response) from the first bootstrap server that answers."""
    attempts = len(cluster.bootstrap)
    for attempt in range(attempts):
        address = cluster.upstream_address(None, attempt)
        try:
            return await fetch_topic_metadata(cluster.dialer, address, [topic], [], timeout_s)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
            if attempt == attempts - 1:
                raise
            log.debug("quota topic metadata from %s:%d failed: %s", *address, exc)
    raise ConnectionError("no bootstrap server")


async def create_topic(dialer: BrokerDialer, target: tuple[str, int], topic: str, partitions: int,
                       replication_factor: int, configs: dict[str, str], timeout_s: float) -> int:
    """Creates ``topic`` with ``configs`` through the broker at ``target`` (the controller,
    where known); the error code, 0 or TOPIC_ALREADY_EXISTS (another instance made it first)."""
    async with await dialer.open(target, timeout_s) as conn:
        version = min(conn.api_versions.get(CreateTopicsRequest.API_KEY, (0, 0))[1], 7)
        T = CreateTopicsRequest[version].CreatableTopic
        C = T.CreatableTopicConfig
        creatable = T(name=topic, num_partitions=partitions, replication_factor=replication_factor, assignments=[],
                      configs=[C(name=name, value=value) for name, value in configs.items()])
        resp = await conn.round_trip(CreateTopicsRequest[version](topics=[creatable], timeout_ms=int(timeout_s * 1000),
                                                                  validate_only=False))
    code: int = resp.topics[0].error_code
    if code not in (0, TOPIC_ALREADY_EXISTS):
        raise broker_error("CreateTopics", code, resp.topics[0].error_message or topic)
    return code


async def end_offset(conn: OwnConnection, topic: str) -> int:
    """The end of ``topic``'s partition 0 (ListOffsets, latest)."""
    version = min(conn.api_versions.get(ListOffsetsRequest.API_KEY, (0, 0))[1], 5)
    if version < 1:
        raise StoreError(f"the broker offers no ListOffsets version >= 1 ({version})")
    T = ListOffsetsRequest[version].ListOffsetsTopic
    p = T.ListOffsetsPartition(partition_index=0, current_leader_epoch=-1, timestamp=-1)  # -1: latest
    resp = await conn.round_trip(ListOffsetsRequest[version](replica_id=-1, isolation_level=1,
                                                             topics=[T(name=topic, partitions=[p])]))
    for answered in resp.topics:
        for part in answered.partitions:
            if part.partition_index == 0:
                if part.error_code:
                    raise broker_error("ListOffsets", part.error_code)
                return int(part.offset)
    raise StoreError("ListOffsets answered nothing for partition 0")
