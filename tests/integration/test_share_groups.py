"""Share groups (KIP-932) through the proxy, against the scripted cluster: no broker here serves
share groups (Tansu 0.6 does not), so the scripted brokers advertise the share APIs as a Kafka
4.x broker with share groups enabled does, and answer ShareFetch / ShareAcknowledge with bodies
built from Kafka's definitions (protocol.share_messages).

The share APIs are one family (protocol.apis.API_FAMILIES): offered whole when the broker has
all four at versions the proxy speaks (ShareFetch / ShareAcknowledge capped at v1), hidden
whole otherwise, so that a share consumer is never left half-working: it fails at once
(librdkafka: "ShareGroupHeartbeatRequest not supported by broker") instead of joining a group
and spinning on a ShareFetch it may not send.
"""

from __future__ import annotations

import logging
import struct
import time

import pytest
from confluent_kafka import ShareConsumer

from protocol.apis import ApiKey
from tests.support.inproc import InProcessProxy
from tests.support.scripted_broker import Script, ScriptedCluster
from tests.support.scripted_handlers import default_api_versions
from tests.support.wire import api_versions

pytestmark = pytest.mark.integration

SHARE_FAMILY = {76: (1, 1), 77: (1, 1), 78: (1, 1), 79: (1, 1)}  # as Kafka 4.1 lists them
SHARE_STATE = {83: (0, 0), 84: (0, 0), 85: (0, 0), 86: (0, 0), 87: (0, 0)}  # broker to broker
SHARE_ADMIN = {90: (0, 0), 91: (0, 0), 92: (0, 0)}  # Describe/Alter/DeleteShareGroupOffsets


def cluster_with(api_versions: dict[int, tuple[int, int]]):
    script = Script(api_versions={**default_api_versions(), **api_versions})
    return ScriptedCluster(brokers=1, script=script).threaded()


@pytest.fixture
def stack():
    """A broker with share groups whole, and the proxy in front of it."""
    with cluster_with({**SHARE_FAMILY, **SHARE_STATE, **SHARE_ADMIN}) as cluster:
        with InProcessProxy(cluster.bootstrap_servers) as proxy:
            yield cluster, proxy


@pytest.fixture
def half_stack():
    """A broker listing ShareGroupHeartbeat and ShareGroupDescribe but not ShareFetch /
    ShareAcknowledge (the shape a client saw through older proxies), and the proxy."""
    half = {k: v for k, v in SHARE_FAMILY.items() if k in (76, 77)}
    with cluster_with({**half, **SHARE_STATE, **SHARE_ADMIN}) as cluster:
        with InProcessProxy(cluster.bootstrap_servers) as proxy:
            yield cluster, proxy


def flexible_request(api_key: int, api_version: int, correlation_id: int, body: bytes = b"\x00") -> bytes:
    """A request with a v2 header (every share API is flexible from v0)."""
    client_id = b"share-consumer"
    header = struct.pack(">hhih", api_key, api_version, correlation_id, len(client_id)) + client_id + b"\x00"
    return struct.pack(">i", len(header) + len(body)) + header + body


def listed(address) -> dict[int, tuple[int, int]]:
    return {e.api_key: (e.min_version, e.max_version) for e in api_versions(address).api_keys}


def test_the_share_family_is_offered_whole_at_the_versions_the_proxy_speaks(stack):
    cluster, proxy = stack
    direct, through = listed(cluster.broker(1).address), listed(proxy.address)
    assert {k: through[k] for k in SHARE_FAMILY} == SHARE_FAMILY
    assert through == direct  # nothing else hidden or changed (DescribeQuorum is not listed here)


def test_share_fetch_past_v1_is_capped_and_a_broker_needing_v2_hides_the_family():
    newer = {76: (1, 1), 77: (1, 1), 78: (1, 2), 79: (1, 2)}
    with cluster_with(newer) as cluster, InProcessProxy(cluster.bootstrap_servers) as proxy:
        through = listed(proxy.address)
        assert (through[78], through[79]) == ((1, 1), (1, 1)) and (through[76], through[77]) == ((1, 1), (1, 1))
    only_v2 = {76: (1, 1), 77: (1, 1), 78: (2, 2), 79: (1, 1)}
    with cluster_with(only_v2) as cluster, InProcessProxy(cluster.bootstrap_servers) as proxy:
        assert not set(listed(proxy.address)) & set(SHARE_FAMILY)


def test_a_family_the_broker_offers_in_part_is_hidden_whole(half_stack):
    cluster, proxy = half_stack
    direct, through = listed(cluster.broker(1).address), listed(proxy.address)
    assert {76, 77} <= set(direct) and not set(through) & set(SHARE_FAMILY)
    assert through == {k: v for k, v in direct.items() if k not in SHARE_FAMILY}  # share state and admin stay


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_librdkafkas_share_consumer_is_told_at_once_and_sends_nothing_of_the_family(half_stack):
    """confluent-kafka's ShareConsumer (librdkafka 2.16, KIP-932 in preview) through the proxy
    in front of a broker without ShareFetch: ShareGroupHeartbeat is not offered either, so it
    never sends one; librdkafka then backs off and asks again (its coordinator query) instead
    of spinning."""
    cluster, proxy = half_stack
    cluster.call(cluster.add_topic, "orders", 1, [1])
    lines = _Lines()
    logger = logging.getLogger("test.share-consumer")
    logger.addHandler(lines)
    logger.setLevel(logging.DEBUG)
    consumer = ShareConsumer({"bootstrap.servers": proxy.bootstrap, "group.id": "share-group",
                              "debug": "cgrp", "logger": logger})
    try:
        consumer.subscribe(["orders"])
        start = time.monotonic()
        while time.monotonic() - start < 3.0:
            assert len(consumer.poll(0.2)) == 0
    finally:
        consumer.close()
        logger.removeHandler(lines)
    assert any("ShareGroupHeartbeatRequest not supported by broker" in line for line in lines.lines)
    assert all(cluster.requests_for(key) == [] for key in SHARE_FAMILY)
    # Its back-off is about a second: a handful of coordinator lookups in 3 s, not thousands.
    assert 1 <= len(cluster.requests_for(ApiKey.FIND_COORDINATOR)) <= 10
