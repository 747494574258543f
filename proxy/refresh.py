"""The proxy's own metadata refresh: learns brokers from the bootstrap servers.

Runs at start (so a client that connects straight to a broker port after a proxy restart is
served) and then periodically (so brokers added later get listeners).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from struct import Struct

from kafka.protocol.admin import DescribeConfigsRequest
from kafka.protocol.metadata import ApiVersionsRequest, MetadataRequest

from protocol.apis import SPECS, ApiKey
from protocol.headers import response_body_offset
from protocol.messages import decode_response

from .cluster import Cluster
from .stats import ProxyStats

log = logging.getLogger(__name__)
_INT32 = Struct(">i")
_CLIENT_ID = "kafka-quota-proxy"


async def _round_trip(reader, writer, request, correlation_id: int):
    request.with_header(correlation_id=correlation_id, client_id=_CLIENT_ID)
    writer.write(bytes(request.encode(header=True, framed=True)))
    await writer.drain()
    (size,) = _INT32.unpack(await reader.readexactly(4))
    frame = await reader.readexactly(size)
    key, version = request.API_KEY, request.API_VERSION
    return decode_response(key, version, memoryview(frame)[response_body_offset(frame, key, version):])


async def fetch_brokers(address: tuple[str, int], timeout_s: float) -> list[tuple[int, str, int]]:
    """Asks one broker for the cluster's brokers: ApiVersions v0, then Metadata for no topics."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(*address), timeout_s)
    try:
        async with asyncio.timeout(timeout_s):
            versions = await _round_trip(reader, writer, ApiVersionsRequest[0](), 1)
            ranges = {e.api_key: (e.min_version, e.max_version) for e in versions.api_keys}
            lo, hi = ranges.get(ApiKey.METADATA, (0, 0))
            version = min(hi, SPECS[ApiKey.METADATA].max_version)
            if version < max(lo, 1):
                raise ConnectionError(f"broker offers no usable Metadata version ({lo}-{hi})")
            # An empty topic list asks for brokers only (null would mean every topic).
            request = MetadataRequest[version](topics=[], allow_auto_topic_creation=False)
            metadata = await _round_trip(reader, writer, request, 2)
            return [(b.node_id, b.host, b.port) for b in metadata.brokers]
    finally:
        writer.close()


async def fetch_topics(address: tuple[str, int], names: list[str], ids: list, timeout_s: float):
    """Metadata for the given topic names and ids (ids need Metadata v10+); returns the
    response's topics."""
    return (await fetch_topic_metadata(address, names, ids, timeout_s)).topics


async def fetch_topic_metadata(address: tuple[str, int], names: list[str], ids: list, timeout_s: float):
    """The MetadataResponse (brokers and topics) for the given topic names and ids."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(*address), timeout_s)
    try:
        async with asyncio.timeout(timeout_s):
            versions = await _round_trip(reader, writer, ApiVersionsRequest[0](), 1)
            ranges = {e.api_key: (e.min_version, e.max_version) for e in versions.api_keys}
            version = min(ranges.get(ApiKey.METADATA, (0, 0))[1], SPECS[ApiKey.METADATA].max_version)
            T = MetadataRequest[version].MetadataRequestTopic
            topics = [T(name=n, topic_id=uuid.UUID(int=0)) for n in names]
            if ids and version >= 10:
                topics += [T(name=None, topic_id=i) for i in ids]
            request = MetadataRequest[version](topics=topics, allow_auto_topic_creation=False)
            return await _round_trip(reader, writer, request, 2)
    finally:
        writer.close()


async def fetch_num_partitions(address: tuple[str, int], node_id: int, timeout_s: float) -> int | None:
    """The broker's ``num.partitions`` (what CreateTopics with NumPartitions = -1 gets)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(*address), timeout_s)
    try:
        async with asyncio.timeout(timeout_s):
            R = DescribeConfigsRequest[1].DescribeConfigsResource
            resource = R(resource_type=4, resource_name=str(node_id), configuration_keys=["num.partitions"])
            request = DescribeConfigsRequest[1](resources=[resource], include_synonyms=False)
            resp = await _round_trip(reader, writer, request, 3)
            for result in resp.results:
                for c in result.configs or ():
                    if c.name == "num.partitions" and c.value and c.value.strip().isdigit():
                        return int(c.value)
            return None
    finally:
        writer.close()


async def refresh_once(cluster: Cluster, stats: ProxyStats, timeout_s: float) -> bool:
    """Tries each bootstrap server once; True when one answered."""
    for attempt in range(len(cluster.bootstrap)):
        address = cluster.upstream_address(None, attempt)
        try:
            brokers = await fetch_brokers(address, timeout_s)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
            stats.metadata_refreshes["failure"] += 1
            log.warning("metadata refresh from %s:%d failed: %s", *address, exc or type(exc).__name__)
            continue
        stats.metadata_refreshes["success"] += 1
        for node_id, host, port in brokers:
            cluster.advertise(node_id, host, port)
        return True
    return False
