"""Share groups (KIP-932) through the proxy, against the scripted cluster: no broker here serves
share groups (Tansu 0.6 does not), so the scripted brokers advertise the share APIs as a Kafka
4.x broker with share groups enabled does.

While the proxy does not carry ShareFetch / ShareAcknowledge, their whole family is hidden: a
share consumer must fail at once (UnsupportedVersionException on ShareGroupHeartbeat) rather
than join its group and then spin on a ShareFetch it may not send. A client that sends one of
them anyway is closed, as Kafka's SocketServer closes a connection sending an API that is not
enabled, and the broker never sees it.
"""

from __future__ import annotations

import logging
import socket
import struct
import time

import pytest
from confluent_kafka import ShareConsumer

from protocol.apis import ApiKey
from tests.support.inproc import InProcessProxy
from tests.support.scripted_broker import Script, ScriptedCluster
from tests.support.scripted_handlers import default_api_versions
from tests.support.wire import api_versions, read_frame

pytestmark = pytest.mark.integration

SHARE_FAMILY = {76: (1, 1), 77: (1, 1), 78: (1, 1), 79: (1, 1)}  # as Kafka 4.1 lists them
SHARE_STATE = {83: (0, 0), 84: (0, 0), 85: (0, 0), 86: (0, 0), 87: (0, 0)}  # broker to broker
SHARE_ADMIN = {90: (0, 0), 91: (0, 0), 92: (0, 0)}  # Describe/Alter/DeleteShareGroupOffsets


@pytest.fixture
def stack():
    script = Script(api_versions={**default_api_versions(), **SHARE_FAMILY, **SHARE_STATE, **SHARE_ADMIN})
    with ScriptedCluster(brokers=1, script=script).threaded() as cluster:
        with InProcessProxy(cluster.bootstrap_servers) as proxy:
            yield cluster, proxy


def flexible_request(api_key: int, api_version: int, correlation_id: int, body: bytes = b"\x00") -> bytes:
    """A request with a v2 header (every share API is flexible from v0): the proxy reads only
    the header of an API it refuses."""
    client_id = b"share-consumer"
    header = struct.pack(">hhih", api_key, api_version, correlation_id, len(client_id)) + client_id + b"\x00"
    return struct.pack(">i", len(header) + len(body)) + header + body


def test_the_share_family_is_hidden_whole_and_the_rest_listed_as_the_broker_does(stack):
    cluster, proxy = stack
    direct = {e.api_key for e in api_versions(cluster.broker(1).address).api_keys}
    assert set(SHARE_FAMILY) <= direct
    through = {e.api_key for e in api_versions(proxy.address).api_keys}
    assert not through & set(SHARE_FAMILY)  # ShareGroupHeartbeat and ShareGroupDescribe too
    # The proxy hides nothing else of what the broker lists (DescribeQuorum is not listed here).
    assert through == direct - set(SHARE_FAMILY)


@pytest.mark.parametrize("api_key", sorted(SHARE_FAMILY))
def test_a_share_request_sent_anyway_closes_the_connection_and_never_reaches_the_broker(stack, api_key):
    cluster, proxy = stack
    with socket.create_connection(proxy.address, timeout=10) as s:
        s.sendall(flexible_request(api_key, 1, 7))
        assert read_frame(s) is None  # closed, nothing answered
    assert proxy.metric("kqp_connections_closed_total", reason="filter_close") == 1
    assert cluster.requests_for(api_key) == []
    # Another client keeps working.
    assert api_versions(proxy.address).error_code == 0
    assert ApiKey.SHARE_FETCH not in {e.api_key for e in api_versions(proxy.address).api_keys}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_librdkafkas_share_consumer_is_told_at_once_and_sends_nothing_of_the_family(stack):
    """confluent-kafka's ShareConsumer (librdkafka 2.16, KIP-932 in preview) through the proxy:
    ShareGroupHeartbeat is not offered, so it never sends one (nor a ShareFetch); librdkafka
    then backs off and asks again (its coordinator query) instead of spinning."""
    cluster, proxy = stack
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
