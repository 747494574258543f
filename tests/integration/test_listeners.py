"""Per-broker listeners: opened from the proxy's own metadata refresh, before any client asks."""

from __future__ import annotations

import socket
import struct

import pytest
from kafka.protocol.metadata import MetadataRequest, MetadataResponse

from tests.support.inproc import InProcessProxy
from tests.support.tansu import TansuBroker as LocalTansu
from tests.support.wire import api_versions, read_frame, request_bytes

pytestmark = pytest.mark.integration


def test_broker_port_served_straight_after_start_without_a_bootstrap_round():
    # A client that cached a broker address from before a proxy restart connects to it directly.
    with LocalTansu() as tansu, InProcessProxy([tansu.bootstrap]) as proxy:
        node_ports = proxy.run(lambda: dict(proxy.server.cluster.node_ports))
        assert len(node_ports) == 1
        (node_id, port), = node_ports.items()
        assert proxy.metric("kqp_requests_total") == 0  # no client traffic yet
        assert api_versions(("127.0.0.1", port)).error_code == 0
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(request_bytes(MetadataRequest[9](topics=None, allow_auto_topic_creation=False), 3))
            frame = read_frame(s)
        assert struct.unpack(">i", frame[:4])[0] == 3
        resp = MetadataResponse.decode(memoryview(frame)[5:], version=9)  # header v1: corr id + tags
        assert [(b.node_id, b.host, b.port) for b in resp.brokers] == [(node_id, "127.0.0.1", port)]
        assert proxy.metric("kqp_metadata_refreshes_total", outcome="success") >= 1
        assert proxy.metric("kqp_broker_listeners") == 1
