"""The proxy's own metadata refresh: learns brokers from the bootstrap servers.

Runs at start (so a client that connects straight to a broker port after a proxy restart is
served) and then periodically (so brokers added later get listeners).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from kafka.protocol.admin import DescribeConfigsRequest
from kafka.protocol.metadata import MetadataRequest

from protocol.apis import SPECS, ApiKey
from proxy.cluster.brokers import Cluster
from proxy.cluster.dialer import BrokerDialer, OwnConnection
from proxy.cluster.offload import off_loop
from proxy.observability.stats import ProxyStats

log = logging.getLogger(__name__)
# A Metadata request naming more topics than this is encoded off the event loop
# (proxy.cluster.offload): about 3 µs a topic.
BIG_TOPIC_LIST = 1_000

# kafka-python ships no types: its decoded responses (and their topic entries) are Any here.


async def fetch_brokers(dialer: BrokerDialer, address: tuple[str, int], timeout_s: float) -> list[tuple[int, str, int]]:
    """Asks one broker for the cluster's brokers: Metadata for no topics."""
    async with await dialer.open(address, timeout_s) as conn, asyncio.timeout(timeout_s):
        lo, hi = conn.api_versions.get(ApiKey.METADATA, (0, 0))
        version = min(hi, SPECS[ApiKey.METADATA].max_version)
        if version < max(lo, 1):
            raise ConnectionError(f"broker offers no usable Metadata version ({lo}-{hi})")
        # An empty topic list asks for brokers only (null would mean every topic).
        request = MetadataRequest[version](topics=[], allow_auto_topic_creation=False)
        metadata = await conn.round_trip(request)
        return [(b.node_id, b.host, b.port) for b in metadata.brokers]


async def fetch_topics(dialer: BrokerDialer, address: tuple[str, int], names: list[str], ids: list[uuid.UUID],
                       timeout_s: float) -> Any:
    """Metadata for the given topic names and ids (ids need Metadata v10+); returns the
    response's topics."""
    return (await fetch_topic_metadata(dialer, address, names, ids, timeout_s)).topics


async def fetch_topic_metadata(dialer: BrokerDialer, address: tuple[str, int], names: list[str], ids: list[uuid.UUID],
                               timeout_s: float) -> Any:
    """The MetadataResponse (brokers and topics) for the given topic names and ids."""
    async with await dialer.open(address, timeout_s) as conn, asyncio.timeout(timeout_s):
        return await topic_metadata(conn, names, ids)


async def topic_metadata(conn: OwnConnection, names: list[str], ids: list[uuid.UUID]) -> Any:
    """The MetadataResponse for the given topic names and ids, asked on an open connection
    (never creating a topic)."""
    return await conn.round_trip(await _topics_request(conn, names, ids), big=len(names) + len(ids) > BIG_TOPIC_LIST)


async def fetch_topic_metadata_body(dialer: BrokerDialer, address: tuple[str, int], names: list[str],
                                    ids: list[uuid.UUID], timeout_s: float) -> tuple[memoryview, int]:
    """The MetadataResponse body for the given topic names and ids, not decoded, with its
    version: for protocol.metadata_scan, when the topics may be many."""
    async with await dialer.open(address, timeout_s) as conn, asyncio.timeout(timeout_s):
        request = await _topics_request(conn, names, ids)
        return await conn.round_trip_body(request, big=len(names) + len(ids) > BIG_TOPIC_LIST), request.API_VERSION


async def _topics_request(conn: OwnConnection, names: list[str], ids: list[uuid.UUID]) -> Any:
    """The Metadata request for these topics; made in the decode thread when they are many
    (about 0.8 µs a topic), as it is encoded there."""
    version = min(conn.api_versions.get(ApiKey.METADATA, (0, 0))[1], SPECS[ApiKey.METADATA].max_version)
    if len(names) + len(ids) > BIG_TOPIC_LIST:
        return await off_loop(_metadata_request, version, names, ids)
    return _metadata_request(version, names, ids)


def _metadata_request(version: int, names: list[str], ids: list[uuid.UUID]) -> Any:
    T = MetadataRequest[version].MetadataRequestTopic
    topics = [T(name=n, topic_id=uuid.UUID(int=0)) for n in names]
    if ids and version >= 10:
        topics += [T(name=None, topic_id=i) for i in ids]
    return MetadataRequest[version](topics=topics, allow_auto_topic_creation=False)


async def fetch_num_partitions(dialer: BrokerDialer, address: tuple[str, int], node_id: int,
                               timeout_s: float) -> int | None:
    """The broker's ``num.partitions`` (what CreateTopics with NumPartitions = -1 gets)."""
    async with await dialer.open(address, timeout_s) as conn, asyncio.timeout(timeout_s):
        R = DescribeConfigsRequest[1].DescribeConfigsResource
        resource = R(resource_type=4, resource_name=str(node_id), configuration_keys=["num.partitions"])
        resp = await conn.round_trip(DescribeConfigsRequest[1](resources=[resource], include_synonyms=False))
        for result in resp.results:
            for c in result.configs or ():
                if c.name == "num.partitions" and c.value and c.value.strip().isdigit():
                    return int(c.value)
        return None


async def refresh_once(cluster: Cluster, stats: ProxyStats, timeout_s: float) -> bool:
    """Tries each bootstrap server once; True when one answered."""
    for attempt in range(len(cluster.bootstrap)):
        address = cluster.upstream_address(None, attempt)
        try:
            brokers = await fetch_brokers(cluster.dialer, address, timeout_s)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
            stats.metadata_refreshes["failure"] += 1
            cluster.dialer.log_failure("refresh", logging.WARNING, "metadata refresh from %s:%d failed: %s", *address,
                                       exc or type(exc).__name__)
            continue
        stats.metadata_refreshes["success"] += 1
        for node_id, host, port in brokers:
            cluster.advertise(node_id, host, port)
        return True
    return False
