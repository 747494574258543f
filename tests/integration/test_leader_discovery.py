"""KIP-951 leader discovery through the proxy, against the scripted cluster.

Tansu runs a single node and cannot move a leader, so these tests use the scripted cluster
(tests/support/scripted_broker.py): three brokers, node ids 1, 5 and 9, whose partition
leaders move on demand. Brokers either send KIP-951's ``CurrentLeader`` + ``NodeEndpoints``
(``Script()``, like Kafka 3.7+) or nothing (``Script(leader_hints=False)``, like brokers
before 3.7). Covered:

(a) a broker's hint reaches the client with ``NodeEndpoints`` pointing at the proxy listener
    for the new leader, the address Metadata through the proxy gives for that node id;
(b) brokers without hints: an expedited metadata refresh, then hints filled in by the proxy
    (never naming the broker that refused; nothing filled with ``fill_hints: false``);
(c) a stale Metadata response after a move does not roll the proxy's leader cache back;
(d) uplift: Produce v10 / Fetch v16 offered over brokers that stop at v9 / v15, requests sent
    down byte for byte apart from the version, responses passed back unchanged;
(e) a real KIP-951 client (librdkafka) through the proxy follows a moved leader with no
    Metadata request, with hints from the brokers and with hints filled in by the proxy.

Which clients here implement KIP-951 (read from their installed sources, and observed here):

* librdkafka 2.16 (confluent-kafka 2.16.1): yes, for Produce (v10) and Fetch (v16), producer
  and consumer (the bundled library has rd_kafka_buf_read_CurrentLeader and
  rd_kafka_buf_read_NodeEndpoints, and sends Produce v10 / Fetch v16 here). It reads
  ``CurrentLeader`` and ``NodeEndpoints``, takes a leader whose epoch is newer than its own at once ("updated with
  leader N and epoch E"), moves the partition to that node and retries there without a
  Metadata request. A failure that carries no hint makes it ask for the topic's Metadata.
  One race, seen in a few percent of moves here (producer; not seen for the consumer): the
  broker thread that got the error also marks the partition's leader unavailable and starts
  a "fast leader query". If that runs after the hint was applied, librdkafka sends a Metadata
  request for the topic ("partition leader query"), and sometimes (debug log: hint applied,
  then "broker unavailable: produce: Not leader for partition", "Starting fast leader query")
  holds the retry, already moved to the new leader, until that Metadata answer is in. The
  producer tests hold client Metadata answers for HOLD_S to tell the cases apart, and require
  every move to be one or the other, and at least one move of each series to be the first.
* kafka-python 3.0.12: the producer no (sender.py caps Produce at v9; NOT_LEADER_OR_FOLLOWER
  only requests a metadata update). The consumer in part: fetcher.py caps Fetch at v12; from a
  v12+ response it applies a ``CurrentLeader`` with a newer epoch
  (``ClusterMetadata.update_partition_leader``), but it knows no ``NodeEndpoints`` and still
  requests a metadata update on every such error. The proxy fills hints only into Fetch v16+,
  so kafka-python's consumer gets broker hints only.
* aiokafka 0.14: no (Produce up to v8, Fetch up to v11, no ``CurrentLeader``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

import pytest
from kafka.protocol.consumer import FetchRequest
from kafka.protocol.metadata import ApiVersionsRequest, MetadataRequest
from kafka.protocol.producer import ProduceRequest
from kafka.record import MemoryRecords, MemoryRecordsBuilder

from config.model import LeaderDiscovery
from protocol import errors
from protocol.apis import ApiKey
from protocol.frames import frame as size_prefixed
from protocol.headers import encode_response_header, response_body_offset, response_header_is_flexible
from protocol.messages import decode_response, encode_body
from tests.support.inproc import InProcessProxy
from tests.support.kafka_messages import make
from tests.support.scripted_broker import Script, ScriptedCluster
from tests.support.scripted_handlers import default_api_versions
from tests.support.wire import api_versions, read_frame, request_bytes

pytestmark = pytest.mark.integration

NODE_IDS = [1, 5, 9]
NOT_LEADER = errors.NOT_LEADER_OR_FOLLOWER
FENCED = errors.FENCED_LEADER_EPOCH
PROXY_CLIENT_ID = "kafka-quota-proxy"  # the client id of the proxy's own requests to brokers


# -- the stack: scripted cluster + proxy --------------------------------------------------------


@contextlib.contextmanager
def _stack(script: Script, topics: dict[str, list[int]], **sections):
    """Scripted brokers 1, 5, 9 with ``topics`` (name -> leader per partition), the proxy in front."""
    with ScriptedCluster(node_ids=NODE_IDS, script=script).threaded() as cluster:
        for name, leaders in topics.items():
            cluster.call(cluster.add_topic, name, len(leaders), leaders)
        with InProcessProxy(cluster.bootstrap_servers, **sections) as proxy:
            yield cluster, proxy


# A failure without a hint is answered at once, not held for the expedited refresh it starts.
NO_HINT_WAIT = {"hint_wait_ms": 0}
HINT_WAIT_S = LeaderDiscovery().hint_wait_ms / 1000  # the default hold


# -- raw Kafka requests -------------------------------------------------------------------------


@dataclass
class Reply:
    sent: bytes  # the request as the client wrote it (size prefix included)
    frame: bytes  # the response as the client read it (size prefix not)
    resp: Any  # the response decoded at the request's version


class Client:
    """One connection to a proxy address; one request at a time."""

    def __init__(self, address: tuple[str, int], client_id: str = "ld-client") -> None:
        self.sock = socket.create_connection(address, timeout=10)
        self.client_id = client_id
        self.frames: list[bytes] = []  # every response it read
        self._correlation = itertools.count(1)

    def call(self, request) -> Reply:
        sent = request_bytes(request, next(self._correlation), self.client_id)
        self.sock.sendall(sent)
        frame = read_frame(self.sock)
        assert frame is not None, "the proxy closed the connection"
        assert frame[:4] == sent[8:12], "correlation id"
        self.frames.append(frame)
        key, version = request.API_KEY, request.API_VERSION
        body = memoryview(frame)[response_body_offset(frame, key, version):]
        return Reply(sent, frame, decode_response(key, version, body))

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()


def _metadata_request():
    return MetadataRequest[12](topics=None, allow_auto_topic_creation=False)


def _client_metadata(address) -> tuple[dict[int, tuple[str, int]], dict[str, Any], Any]:
    """A client's Metadata through the proxy: node id -> the address it gets, topic ids, response."""
    with Client(address, "ld-metadata") as c:
        resp = c.call(_metadata_request()).resp
    return {b.node_id: (b.host, b.port) for b in resp.brokers}, {t.name: t.topic_id for t in resp.topics}, resp


def _records(count: int, tag: bytes = b"r") -> bytes:
    b = MemoryRecordsBuilder(2, 0, 1 << 20)
    for i in range(count):
        b.append(timestamp=1_700_000_000_000 + i, key=None, value=b"%s-%d" % (tag, i), headers=[])
    b.close()
    return bytes(b.buffer())


def _produce(topic: str, index: int, records: bytes, version: int = 10):
    T = ProduceRequest[version].TopicProduceData
    return ProduceRequest[version](transactional_id=None, acks=1, timeout_ms=5000, topic_data=[
        T(name=topic, partition_data=[T.PartitionProduceData(index=index, records=records)])])


def _fetch(topic_id, index: int, offset: int = 0, version: int = 16):
    R = FetchRequest
    part = make(R.FetchTopic.FetchPartition, version, partition=index, current_leader_epoch=-1, fetch_offset=offset,
                last_fetched_epoch=-1, log_start_offset=-1, partition_max_bytes=1 << 20)
    topic = make(R.FetchTopic, version, topic_id=topic_id, partitions=[part])
    return make(R, version, cluster_id=None, max_wait_ms=0, min_bytes=1, max_bytes=1 << 20, isolation_level=0,
                session_id=0, session_epoch=-1, topics=[topic], forgotten_topics_data=[], rack_id="")


def _produced(resp):
    return resp.responses[0].partition_responses[0]


def _fetched(resp):
    return resp.responses[0].partitions[0]


def _hint(partition) -> tuple[int, int] | None:
    """A partition's CurrentLeader as (leader id, epoch), or None when it carries none."""
    leader = partition.current_leader
    if leader is None or leader.leader_id < 0:
        return None
    return leader.leader_id, leader.leader_epoch


def _endpoints(resp) -> list[tuple[int, str, int, str | None]]:
    return [(e.node_id, e.host, e.port, e.rack) for e in resp.node_endpoints or ()]


# -- what the proxy shows -----------------------------------------------------------------------


def _hints(proxy) -> dict[str, float]:
    return {s: proxy.metric("kqp_leader_hints_total", source=s) for s in ("broker", "proxy", "none")}


def _cached_leader(proxy, topic: str, index: int) -> tuple[int, int] | None:
    known = proxy.run(lambda: proxy.server.leaders.leader(topic, index))
    return None if known is None else (known.leader, known.epoch)


def _wait_until(condition, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _assert_no_broker_address(cluster, *frames: bytes) -> None:
    """No broker host:port (as Kafka encodes an endpoint: host string, then int32 port)."""
    for node_id in NODE_IDS:
        host, port = cluster.broker(node_id).address
        needle = host.encode() + struct.pack(">i", port)
        for f in frames:
            assert needle not in f, f"broker {node_id}'s address {host}:{port} reached a client"


def _assert_proxy_listener(proxy, node_id: int, host: str, port: int) -> None:
    assert (host, port) == ("127.0.0.1", proxy.run(lambda: proxy.server.cluster.node_ports[node_id]))


def _proxy_metadata_requests(cluster, since: int):
    return [r for r in cluster.requests[since:] if r.api_key == ApiKey.METADATA and r.client_id == PROXY_CLIENT_ID]


# -- (a) brokers that send KIP-951 hints ------------------------------------------------------------


def test_broker_hints_reach_the_client_with_proxy_addresses():
    with _stack(Script(), {"orders": [1, 5, 9]}) as (cluster, proxy):
        with Client(proxy.address) as bootstrap:
            md = bootstrap.call(_metadata_request()).resp
        nodes = {b.node_id: (b.host, b.port) for b in md.brokers}
        ids = {t.name: t.topic_id for t in md.topics}
        assert sorted(nodes) == NODE_IDS
        for node_id, (host, port) in nodes.items():
            _assert_proxy_listener(proxy, node_id, host, port)
        with Client(nodes[1]) as old, Client(nodes[9]) as new, Client(nodes[5]) as other:
            for i in range(3):  # a stream of batches to orders-0 while node 1 leads it
                r = old.call(_produce("orders", 0, _records(2, b"a%d" % i)))
                assert (_produced(r.resp).error_code, _produced(r.resp).base_offset) == (0, 2 * i)
                assert _hint(_produced(r.resp)) is None and _endpoints(r.resp) == []
            cluster.call(cluster.move_leader, "orders", 0, 9)  # node 9 leads orders-0 at epoch 1

            r = old.call(_produce("orders", 0, _records(2, b"b")))
            assert _produced(r.resp).error_code == NOT_LEADER
            assert _hint(_produced(r.resp)) == (9, 1)
            assert _endpoints(r.resp) == [(9, *nodes[9], None)]

            f = old.call(_fetch(ids["orders"], 0))
            assert _fetched(f.resp).error_code == NOT_LEADER
            assert _hint(_fetched(f.resp)) == (9, 1)
            assert _endpoints(f.resp) == [(9, *nodes[9], None)]

            # The hinted address is the new leader: the batch goes in after the first three.
            r = new.call(_produce("orders", 0, _records(2, b"b")))
            assert (_produced(r.resp).error_code, _produced(r.resp).base_offset) == (0, 6)

            # FENCED_LEADER_EPOCH is passed on the same way (orders-1 moved from 5 to 1).
            cluster.call(cluster.move_leader, "orders", 1, 1)
            cluster.call(cluster.script.produce_errors.__setitem__, ("orders", 1), FENCED)
            r = other.call(_produce("orders", 1, _records(1)))
            assert _produced(r.resp).error_code == FENCED
            assert _hint(_produced(r.resp)) == (1, 1)
            assert _endpoints(r.resp) == [(1, *nodes[1], None)]

        _assert_no_broker_address(cluster, *bootstrap.frames, *old.frames, *new.frames, *other.frames)
        # Straight to the broker, the same failure names the broker's own address for node 9:
        # what the client got above is the proxy's rewrite of it.
        with Client(cluster.broker(1).address) as direct:
            r = direct.call(_produce("orders", 0, _records(1)))
            assert _hint(_produced(r.resp)) == (9, 1)
            assert _endpoints(r.resp) == [(9, *cluster.broker(9).address, None)]
        assert _hints(proxy) == {"broker": 3, "proxy": 0, "none": 0}
        assert _cached_leader(proxy, "orders", 0) == (9, 1)
        assert _cached_leader(proxy, "orders", 1) == (1, 1)


# -- (b) brokers without hints: the proxy fills them ------------------------------------------------


def test_old_brokers_first_failure_refreshes_then_the_proxy_fills_hints():
    with _stack(Script(leader_hints=False), {"orders": [1, 5, 9]},
                leader_discovery=NO_HINT_WAIT) as (cluster, proxy):
        nodes, ids, _ = _client_metadata(proxy.address)  # the proxy learns orders-0..2 at epoch 0
        assert _cached_leader(proxy, "orders", 0) == (1, 0)
        with Client(nodes[1]) as c1, Client(nodes[5]) as c5, Client(nodes[9]) as c9:
            for _ in range(2):
                assert _produced(c1.call(_produce("orders", 0, _records(2))).resp).error_code == 0
            mark = len(cluster.requests)
            cluster.call(cluster.move_leader, "orders", 0, 9)
            cluster.call(cluster.move_leader, "orders", 1, 1)

            # The first failure: the proxy's cache still names node 1, the broker that refused,
            # so there is nothing it may fill in; it asks for an expedited refresh instead.
            r = c1.call(_produce("orders", 0, _records(2)))
            assert _produced(r.resp).error_code == NOT_LEADER
            assert _hint(_produced(r.resp)) is None and _endpoints(r.resp) == []
            assert _hints(proxy) == {"broker": 0, "proxy": 0, "none": 1}

            _wait_until(lambda: proxy.metric("kqp_metadata_refreshes_total", outcome="expedited") >= 1,
                        "the expedited refresh")
            refreshes = _proxy_metadata_requests(cluster, mark)
            assert [[t.name for t in r.body.topics] for r in refreshes] == [["orders"]]
            assert not [r for r in cluster.requests[mark:] if r.api_key == ApiKey.METADATA
                        and r.client_id != PROXY_CLIENT_ID], "no client asked for metadata"
            assert _cached_leader(proxy, "orders", 0) == (9, 1)
            assert _cached_leader(proxy, "orders", 1) == (1, 1)

            # The same partition again: filled in, with node 9's proxy address.
            r = c1.call(_produce("orders", 0, _records(2)))
            assert _produced(r.resp).error_code == NOT_LEADER
            assert _hint(_produced(r.resp)) == (9, 1)
            assert _endpoints(r.resp) == [(9, *nodes[9], None)]
            # Another partition of the refreshed topic, failing for the first time: filled too.
            r = c5.call(_produce("orders", 1, _records(1)))
            assert _produced(r.resp).error_code == NOT_LEADER
            assert _hint(_produced(r.resp)) == (1, 1)
            assert _endpoints(r.resp) == [(1, *nodes[1], None)]
            # Fetch v16 (topic ids) the same way.
            f = c1.call(_fetch(ids["orders"], 0))
            assert _fetched(f.resp).error_code == NOT_LEADER
            assert _hint(_fetched(f.resp)) == (9, 1)
            assert _endpoints(f.resp) == [(9, *nodes[9], None)]

            r = c9.call(_produce("orders", 0, _records(2)))
            assert (_produced(r.resp).error_code, _produced(r.resp).base_offset) == (0, 4)

        _assert_no_broker_address(cluster, *c1.frames, *c5.frames, *c9.frames)
        assert _hints(proxy) == {"broker": 0, "proxy": 3, "none": 1}
        assert proxy.metric("kqp_metadata_refreshes_total", outcome="expedited") == 1


def test_old_brokers_first_failure_waits_for_the_refresh_by_default():
    """By default (``hint_wait_ms``) a failure the proxy has no hint for is held until the
    expedited refresh it started is in, so even the first failure after a move names the new
    leader. Should the refresh take longer than the wait, it goes back without one, and the
    metrics say so."""
    with _stack(Script(leader_hints=False), {"orders": [1]}) as (cluster, proxy):
        nodes, _, _ = _client_metadata(proxy.address)
        cluster.call(cluster.move_leader, "orders", 0, 5)
        with Client(nodes[1]) as c:
            started = time.monotonic()
            r = c.call(_produce("orders", 0, _records(1)))
            took_s = time.monotonic() - started
        part = _produced(r.resp)
        assert part.error_code == NOT_LEADER
        if _hint(part) is None:  # only when the refresh outlasted the wait
            assert _endpoints(r.resp) == [] and _hints(proxy) == {"broker": 0, "proxy": 0, "none": 1}
            assert took_s >= HINT_WAIT_S
        else:
            assert _hint(part) == (5, 1) and _endpoints(r.resp) == [(5, *nodes[5], None)]
            assert _hints(proxy) == {"broker": 0, "proxy": 1, "none": 0}
        _wait_until(lambda: proxy.metric("kqp_metadata_refreshes_total", outcome="expedited") == 1,
                    "the expedited refresh")
        _assert_no_broker_address(cluster, r.frame)


def test_fetch_of_a_topic_the_proxy_knows_only_by_id():
    """A client that learned the topic id elsewhere (say, before the proxy restarted) fetches by
    id: the proxy refreshes that id, learns the topic, and fills the hint."""
    with _stack(Script(leader_hints=False), {"orders": [1]}, leader_discovery=NO_HINT_WAIT) as (cluster, proxy):
        topic_id = cluster.topics["orders"].topic_id
        node1 = ("127.0.0.1", proxy.run(lambda: proxy.server.cluster.node_ports[1]))
        assert proxy.run(lambda: proxy.server.leaders.name_of(topic_id)) is None
        cluster.call(cluster.move_leader, "orders", 0, 5)
        mark = len(cluster.requests)
        with Client(node1) as c:
            first = c.call(_fetch(topic_id, 0))
            assert _fetched(first.resp).error_code == NOT_LEADER and _hint(_fetched(first.resp)) is None
            _wait_until(lambda: proxy.metric("kqp_metadata_refreshes_total", outcome="expedited") >= 1,
                        "the expedited refresh")
            asked = [(t.name, t.topic_id) for r in _proxy_metadata_requests(cluster, mark) for t in r.body.topics]
            assert asked == [(None, topic_id)]
            second = c.call(_fetch(topic_id, 0))
        node5 = proxy.run(lambda: proxy.server.cluster.node_ports[5])
        assert _fetched(second.resp).error_code == NOT_LEADER
        assert _hint(_fetched(second.resp)) == (5, 1)
        assert _endpoints(second.resp) == [(5, "127.0.0.1", node5, None)]
        assert _hints(proxy) == {"broker": 0, "proxy": 1, "none": 1}
        _assert_no_broker_address(cluster, first.frame, second.frame)


def test_fill_hints_off_leaves_failures_without_hints():
    for leader_hints in (False, True):
        with _stack(Script(leader_hints=leader_hints), {"orders": [1]},
                    leader_discovery={"fill_hints": False}) as (cluster, proxy):
            nodes, ids, _ = _client_metadata(proxy.address)
            cluster.call(cluster.move_leader, "orders", 0, 5)
            _client_metadata(proxy.address)  # another client's Metadata: the proxy knows the move
            assert _cached_leader(proxy, "orders", 0) == (5, 1)
            with Client(nodes[1]) as c:
                replies = [c.call(_produce("orders", 0, _records(1))), c.call(_fetch(ids["orders"], 0)),
                           c.call(_produce("orders", 0, _records(1)))]
            parts = [_produced(replies[0].resp), _fetched(replies[1].resp), _produced(replies[2].resp)]
            assert [p.error_code for p in parts] == [NOT_LEADER] * 3
            if leader_hints:  # a broker's own hint is still passed on (with proxy addresses)
                assert [_hint(p) for p in parts] == [(5, 1)] * 3
                assert [_endpoints(r.resp) for r in replies] == [[(5, *nodes[5], None)]] * 3
                assert _hints(proxy) == {"broker": 3, "proxy": 0, "none": 0}
            else:
                assert [_hint(p) for p in parts] == [None] * 3
                assert [_endpoints(r.resp) for r in replies] == [[]] * 3
                assert _hints(proxy) == {"broker": 0, "proxy": 0, "none": 3}
            _assert_no_broker_address(cluster, *(r.frame for r in replies))


def test_the_refusing_broker_is_never_filled_in_as_leader():
    """Node 1 refuses orders-0 while every Metadata still names node 1 as its leader."""
    script = Script(leader_hints=False)
    with _stack(script, {"orders": [1]}) as (cluster, proxy):
        nodes, ids, _ = _client_metadata(proxy.address)
        cluster.call(script.produce_errors.__setitem__, ("orders", 0), NOT_LEADER)
        cluster.call(script.fetch_errors.__setitem__, ("orders", 0), FENCED)
        mark = len(cluster.requests)
        with Client(nodes[1]) as c:
            first = c.call(_produce("orders", 0, _records(1)))
            _wait_until(lambda: proxy.metric("kqp_metadata_refreshes_total", outcome="expedited") >= 1,
                        "the expedited refresh")
            assert _proxy_metadata_requests(cluster, mark)
            assert _cached_leader(proxy, "orders", 0) == (1, 0)  # the refresh says node 1 as well
            replies = [first, c.call(_produce("orders", 0, _records(1))), c.call(_fetch(ids["orders"], 0))]
        parts = [_produced(replies[0].resp), _produced(replies[1].resp), _fetched(replies[2].resp)]
        assert [p.error_code for p in parts] == [NOT_LEADER, NOT_LEADER, FENCED]
        assert [_hint(p) for p in parts] == [None] * 3
        assert [_endpoints(r.resp) for r in replies] == [[]] * 3
        assert _hints(proxy) == {"broker": 0, "proxy": 0, "none": 3}


# -- (c) stale metadata after a move ----------------------------------------------------------------


def _lagging_metadata(stale: dict[int, tuple[int, int]]):
    """A Metadata handler with which node N still reports ``stale[N]`` = (leader, epoch) for
    orders-0, as a broker that has not heard of a move yet."""

    def metadata(broker, req):
        resp = broker.default_response(req)
        old = stale.get(broker.node_id)
        for t in resp.topics if old else ():
            if t.name == "orders":
                p = t.partitions[0]
                p.leader_id, p.leader_epoch, p.replica_nodes, p.isr_nodes = old[0], old[1], [old[0]], [old[0]]
        return resp

    return metadata


def test_stale_metadata_does_not_roll_the_leader_back():
    stale: dict[int, tuple[int, int]] = {}  # node id -> (leader, epoch) it keeps reporting for orders-0
    script = Script(leader_hints=False, handlers={ApiKey.METADATA: _lagging_metadata(stale)})
    with _stack(script, {"orders": [1]}) as (cluster, proxy):
        nodes, _, _ = _client_metadata(proxy.address)
        assert _cached_leader(proxy, "orders", 0) == (1, 0)
        cluster.call(stale.__setitem__, 1, (1, 0))  # node 1 lags: it still reports itself, epoch 0
        cluster.call(cluster.move_leader, "orders", 0, 5)

        _client_metadata(nodes[5])  # a client's Metadata from an up-to-date node
        assert _cached_leader(proxy, "orders", 0) == (5, 1)
        ignored = proxy.metric("kqp_metadata_cache_stale_ignored_total")

        _, _, resp = _client_metadata(nodes[1])  # and one from the lagging node
        p = resp.topics[0].partitions[0]
        assert (p.leader_id, p.leader_epoch) == (1, 0)  # passed to the client as the broker said
        assert _cached_leader(proxy, "orders", 0) == (5, 1)  # but not taken
        assert proxy.metric("kqp_metadata_cache_stale_ignored_total") == ignored + 1

        with Client(nodes[1]) as c:
            r = c.call(_produce("orders", 0, _records(1)))
        assert _produced(r.resp).error_code == NOT_LEADER
        assert _hint(_produced(r.resp)) == (5, 1)
        assert _endpoints(r.resp) == [(5, *nodes[5], None)]
        assert _hints(proxy) == {"broker": 0, "proxy": 1, "none": 0}
        assert proxy.metric("kqp_metadata_cache_partitions") == 1
        assert proxy.metric("kqp_metadata_cache_age_seconds") >= 0
        _assert_no_broker_address(cluster, r.frame)


def test_a_lagging_broker_is_not_asked_twice_running():
    """The expedited refreshes go round the brokers: when the first one asked still reports the
    old leader, the held response is answered from the next broker's view."""
    stale: dict[int, tuple[int, int]] = {}
    script = Script(leader_hints=False, handlers={ApiKey.METADATA: _lagging_metadata(stale)})
    with _stack(script, {"orders": [1]}, leader_discovery={"hint_wait_ms": 2000}) as (cluster, proxy):
        nodes, _, _ = _client_metadata(proxy.address)
        cluster.call(stale.__setitem__, 1, (1, 0))  # node 1 lags: it still reports itself, epoch 0
        cluster.call(cluster.move_leader, "orders", 0, 5)
        for attempt in range(3):
            with Client(nodes[1]) as c:
                r = c.call(_produce("orders", 0, _records(1)))
            assert _produced(r.resp).error_code == NOT_LEADER
            assert _hint(_produced(r.resp)) == (5, 1), f"attempt {attempt}: no hint from the up-to-date brokers"


# -- (d) uplift: Produce v10 / Fetch v16 over brokers at v9 / v15 -----------------------------------


def _old_api_versions() -> dict[int, tuple[int, int]]:
    versions = default_api_versions()
    versions[ApiKey.PRODUCE] = (3, 9)
    versions[ApiKey.FETCH] = (4, 15)
    return versions


class SentResponses:
    """A Produce / Fetch handler that answers as usual and keeps the bytes it wrote."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, bytes]] = []  # (ReceivedRequest, frame without size prefix)

    async def __call__(self, broker, req):
        resp = broker.default_response(req)
        if asyncio.iscoroutine(resp):
            resp = await resp
        if resp is None:
            return None
        head = encode_response_header(req.correlation_id, response_header_is_flexible(req.api_key, req.api_version))
        out = head + encode_body(resp)
        self.sent.append((req, out))
        return size_prefixed(out)

    def last(self, api_key: int) -> tuple[Any, bytes]:
        return [s for s in self.sent if s[0].api_key == api_key][-1]


def _version_ranges(resp) -> dict[int, tuple[int, int]]:
    return {e.api_key: (e.min_version, e.max_version) for e in resp.api_keys}


def _assert_sent_down_as(received, sent: bytes, version: int) -> None:
    """The broker got the client's request byte for byte, but for the version number."""
    assert received.api_version == version
    client = sent[4:]  # without the size prefix, as the broker recorded it
    assert received.raw[:2] == client[:2]
    assert received.raw[2:4] == version.to_bytes(2, "big")
    assert received.raw[4:] == client[4:]


def _without_hints(resp) -> bytes:
    parts = (p for t in resp.responses for p in getattr(t, "partition_responses", None) or t.partitions)
    for p in parts:
        p.current_leader = None
    resp.node_endpoints = []
    return encode_body(resp)


def _iter_records(raw: bytes):
    records = MemoryRecords(raw)
    while (batch := records.next_batch()) is not None:
        yield from batch


def test_uplift_produce_v10_and_fetch_v16_over_v9_v15_brokers():
    sent = SentResponses()
    script = Script(api_versions=_old_api_versions(), leader_hints=False,
                    handlers={ApiKey.PRODUCE: sent, ApiKey.FETCH: sent})
    with _stack(script, {"orders": [1, 5, 9]}) as (cluster, proxy):
        ranges = _version_ranges(api_versions(proxy.address))
        assert ranges[ApiKey.PRODUCE] == (3, 10) and ranges[ApiKey.FETCH] == (4, 16)
        nodes, ids, _ = _client_metadata(proxy.address)
        with Client(nodes[1]) as c:
            av = c.call(ApiVersionsRequest[3](client_software_name="ld", client_software_version="1"))
            assert _version_ranges(av.resp)[ApiKey.PRODUCE] == (3, 10)
            assert _version_ranges(av.resp)[ApiKey.FETCH] == (4, 16)

            records = _records(3, b"up")
            r = c.call(_produce("orders", 0, records, version=10))
            received, broker_frame = sent.last(ApiKey.PRODUCE)
            _assert_sent_down_as(received, r.sent, 9)
            assert r.frame == broker_frame  # the v9 response body is a v10 body: passed on as it is
            assert (_produced(r.resp).error_code, _produced(r.resp).base_offset) == (0, 0)

            f = c.call(_fetch(ids["orders"], 0, version=16))
            received, broker_frame = sent.last(ApiKey.FETCH)
            _assert_sent_down_as(received, f.sent, 15)
            assert f.frame == broker_frame
            part = _fetched(f.resp)
            assert part.error_code == 0 and part.high_watermark == 3
            assert part.records == records  # the batch as produced (its base offset was 0 already)
            assert [rec.value for rec in _iter_records(part.records)] == [b"up-0", b"up-1", b"up-2"]

            # After a move the old broker's v9 answer carries no hint; the client's v10 answer
            # does: the proxy filled it in, and that is the only difference.
            cluster.call(cluster.move_leader, "orders", 0, 5)
            _client_metadata(proxy.address)  # the proxy learns the move from a client's Metadata
            for key, version, request, partition_of in (
                (ApiKey.PRODUCE, 10, _produce("orders", 0, records, version=10), _produced),
                (ApiKey.FETCH, 16, _fetch(ids["orders"], 0, version=16), _fetched),
            ):
                reply = c.call(request)
                received, broker_frame = sent.last(key)
                _assert_sent_down_as(received, reply.sent, version - 1)
                part = partition_of(reply.resp)
                assert part.error_code == NOT_LEADER
                assert _hint(part) == (5, 1)
                assert _endpoints(reply.resp) == [(5, *nodes[5], None)]
                offset = response_body_offset(reply.frame, key, version)
                assert reply.frame[:offset] == broker_frame[:offset]  # the response header
                assert _without_hints(reply.resp) == broker_frame[offset:]
                _assert_no_broker_address(cluster, reply.frame)

        assert proxy.metric("kqp_uplifted_requests_total", api="Produce") == 2
        assert proxy.metric("kqp_uplifted_requests_total", api="Fetch") == 2
        assert _hints(proxy) == {"broker": 0, "proxy": 2, "none": 0}


def test_uplift_off_advertises_what_the_brokers_have():
    script = Script(api_versions=_old_api_versions(), leader_hints=False)
    with _stack(script, {"orders": [1]}, leader_discovery={"uplift": False}) as (cluster, proxy):
        ranges = _version_ranges(api_versions(proxy.address))
        assert ranges[ApiKey.PRODUCE] == (3, 9) and ranges[ApiKey.FETCH] == (4, 15)
        nodes, ids, _ = _client_metadata(proxy.address)
        with Client(nodes[1]) as c:
            c.call(ApiVersionsRequest[3](client_software_name="ld", client_software_version="1"))
            r = c.call(_produce("orders", 0, _records(1), version=9))
            assert _produced(r.resp).error_code == 0
            f = c.call(_fetch(ids["orders"], 0, version=15))
            assert _fetched(f.resp).error_code == 0
        assert [r.api_version for r in cluster.requests_for(ApiKey.PRODUCE)] == [9]
        assert [r.api_version for r in cluster.requests_for(ApiKey.FETCH)] == [15]
        assert proxy.metric("kqp_uplifted_requests_total", api="Produce") == 0
        assert proxy.metric("kqp_uplifted_requests_total", api="Fetch") == 0


# -- (e) librdkafka, a client that implements KIP-951 ----------------------------------------------

HOLD_S = 1.5  # how long the brokers keep a held client's Metadata answer


class HeldMetadata:
    """A Metadata handler that answers the clients in ``clients`` only after ``hold_s``: a client
    that needed Metadata to find a moved leader would stall that long. As :meth:`stamp`, the
    handler of other APIs, it notes when each request arrived: whether a client waited for
    Metadata is then read from the order of the two, not from how long it took (which a busy
    machine stretches)."""

    def __init__(self) -> None:
        self.clients: frozenset[str] = frozenset()
        self.hold_s = 0.0
        self.held: list[dict] = []  # client_id, received, answered (monotonic seconds)
        self.arrived: list[tuple[float, int, int, str | None]] = []  # (monotonic s, node id, api key, client id)

    def hold(self, cluster, *client_ids: str) -> None:
        def set_hold() -> None:
            self.clients, self.hold_s = frozenset(client_ids), HOLD_S
        cluster.call(set_hold)

    def release(self, cluster) -> None:
        """Stops holding; returns once every held answer has gone out."""
        self.hold(cluster)
        _wait_until(lambda: all(h["answered"] is not None for h in self.held), "held Metadata answers", HOLD_S + 10)

    def stamp(self, broker, req):
        """A handler that notes the request's arrival, then answers as the broker would."""
        self.arrived.append((time.monotonic(), broker.node_id, req.api_key, req.client_id))
        return broker.default_response(req)

    def first_arrival(self, since: float, node_id: int, api_key: int, client_id: str) -> float:
        """When the first ``api_key`` request from ``client_id`` at or after ``since`` reached ``node_id``."""
        return min((t for t, n, k, c in self.arrived if t >= since and (n, k, c) == (node_id, api_key, client_id)),
                   default=math.inf)

    def first_answer(self, since: float, client_id: str) -> float | None:
        """When the first Metadata answer held for ``client_id`` (received at or after ``since``) went out."""
        return min((h["answered"] for h in self.held if h["client_id"] == client_id and h["received"] >= since),
                   default=None)

    async def __call__(self, broker, req):
        if req.client_id in self.clients:
            entry = {"client_id": req.client_id, "received": time.monotonic(), "answered": None}
            self.held.append(entry)
            await asyncio.sleep(self.hold_s)
            entry["answered"] = time.monotonic()
        return broker.default_response(req)


class RdkProducer:
    """A librdkafka producer through the proxy that sends one message at a time to orders-0."""

    def __init__(self, proxy, client_id: str) -> None:
        from confluent_kafka import Producer

        self.client_id = client_id
        self.delivered: list[tuple[Any, int]] = []  # (error, offset)
        self.stats: list[dict] = []
        self.producer = Producer({
            "bootstrap.servers": proxy.bootstrap, "client.id": client_id, "linger.ms": 0, "acks": 1,
            "statistics.interval.ms": 100, "stats_cb": lambda s: self.stats.append(json.loads(s)),
        })

    def send(self, count: int, pause_s: float = 0.02) -> float:
        """Sends ``count`` messages, each delivered before the next; returns the seconds taken by
        the first (produce to delivery report)."""
        first_s = None
        for _ in range(count):
            started = time.monotonic()
            self.producer.produce("orders", b"%s-%d" % (self.client_id.encode(), len(self.delivered)), partition=0,
                                  on_delivery=lambda err, msg: self.delivered.append((err, msg.offset())))
            assert self.producer.flush(10) == 0
            first_s = time.monotonic() - started if first_s is None else first_s
            time.sleep(pause_s)
        return first_s

    def requests(self, cluster, since: int, api_key: int):
        return [r for r in cluster.requests[since:] if r.api_key == api_key and r.client_id == self.client_id]

    def brokers_seen(self) -> dict[int, tuple[str, int, dict]]:
        """From the client's own statistics: node id -> (host, port, requests sent by type)."""
        self.stats.clear()

        def polled() -> bool:
            self.producer.poll(0.05)  # statistics are delivered from poll()
            return bool(self.stats)

        _wait_until(polled, "librdkafka statistics")
        seen = {}
        for b in self.stats[-1]["brokers"].values():
            if b["nodeid"] >= 0:
                host, port = b["nodename"].rsplit(":", 1)
                seen[b["nodeid"]] = (host, int(port), b["req"])
        return seen

    def __enter__(self) -> RdkProducer:
        return self

    def __exit__(self, *exc) -> None:
        self.producer.flush(10)
        self.producer.close()  # before the proxy stops: no reconnecting after the test


MOVES = [5, 9, 1, 5]  # where orders-0's leader goes, one move after another (it starts on node 1)


@dataclass
class Move:
    """What a librdkafka producer did when orders-0's leader moved from ``old`` to ``new``."""

    old: int
    new: int
    produce_nodes: list[int]  # where its Produce requests went, from the move on
    metadata: list  # its Metadata requests from the move on
    retry_s: float  # produce to delivery report of its first message after the move
    retried_at: float  # when its first Produce to the new leader arrived there (monotonic s)
    metadata_answered_at: float | None  # when its first Metadata answer after the move went out

    @property
    def followed_the_hint(self) -> bool:
        """Its retry reached the new leader before any Metadata answer went out to it (they are held
        for HOLD_S), so it did not wait for one."""
        return self.metadata_answered_at is None or self.retried_at < self.metadata_answered_at


def _move_leader(cluster, gate: HeldMetadata, client: RdkProducer, new: int, before_send=None) -> Move:
    old = cluster.topics["orders"].partitions[0].leader
    mark = len(cluster.requests)
    cluster.call(cluster.move_leader, "orders", 0, new)
    if before_send is not None:
        before_send()
    gate.hold(cluster, client.client_id)
    sent = time.monotonic()
    retry_s = client.send(1, pause_s=0)
    client.send(3, pause_s=0.01)
    produce_nodes = [r.node_id for r in client.requests(cluster, mark, ApiKey.PRODUCE)]
    metadata = client.requests(cluster, mark, ApiKey.METADATA)
    gate.release(cluster)
    return Move(old, new, produce_nodes, metadata, retry_s,
                gate.first_arrival(sent, new, ApiKey.PRODUCE, client.client_id),
                gate.first_answer(sent, client.client_id))


def _assert_moves(moves: list[Move]) -> None:
    """Every move: one refused Produce to the old leader, then every Produce to the new one, and
    either the retry went there at once, or (librdkafka's race, see the module doc) it waited
    for the "partition leader query" Metadata it sent right after the refusal. At least one
    move of the series shows the former."""
    for m in moves:
        assert m.produce_nodes[0] == m.old and set(m.produce_nodes[1:]) == {m.new}, m
        assert all([t.name for t in r.body.topics] == ["orders"] for r in m.metadata), m
        if not m.followed_the_hint:  # it waited for a Metadata answer held HOLD_S after it was sent
            assert m.metadata and m.retry_s >= HOLD_S * 0.9, m
    assert any(m.followed_the_hint for m in moves), moves


def _assert_proxy_addresses_only(cluster, proxy, client: RdkProducer) -> None:
    """The client's own view: every broker it talked to is a proxy listener; it sent Produce
    requests to each node the leader moved to; all its messages were delivered."""
    assert all(err is None for err, _ in client.delivered), client.delivered
    seen = client.brokers_seen()
    ports = proxy.run(lambda: dict(proxy.server.cluster.node_ports))
    for node_id in set(MOVES):
        assert seen[node_id][:2] == ("127.0.0.1", ports[node_id]) and seen[node_id][2]["Produce"] > 0
    broker_ports = {cluster.broker(n).address[1] for n in NODE_IDS}
    assert not {port for _, port, _ in seen.values()} & broker_ports


def test_librdkafka_producer_follows_broker_hints():
    gate = HeldMetadata()
    script = Script(handlers={ApiKey.METADATA: gate, ApiKey.PRODUCE: gate.stamp})
    with _stack(script, {"orders": [1]}) as (cluster, proxy), \
            RdkProducer(proxy, "rdk-hinted") as client:
        client.send(5)
        moves = [_move_leader(cluster, gate, client, new) for new in MOVES]
        _assert_moves(moves)
        _assert_proxy_addresses_only(cluster, proxy, client)
        assert [offset for _, offset in client.delivered] == list(range(5 + 4 * len(MOVES)))
        assert _hints(proxy) == {"broker": len(MOVES), "proxy": 0, "none": 0}


@pytest.mark.parametrize("wait", ["no-wait", "default"])
def test_librdkafka_producers_behind_old_brokers(wait):
    """Two librdkafka producers on orders-0 behind brokers without KIP-951. At each move the first
    meets the moved leader first: it gets a hint only if the proxy knows the new leader by then
    (``default``, where the proxy waits for its refresh); without one, librdkafka asks for
    Metadata. The second then gets the hint the proxy fills in from what it learned."""
    sections = {"leader_discovery": NO_HINT_WAIT} if wait == "no-wait" else {}
    gate = HeldMetadata()
    script = Script(leader_hints=False, handlers={ApiKey.METADATA: gate, ApiKey.PRODUCE: gate.stamp})
    with _stack(script, {"orders": [1]}, **sections) as (cluster, proxy), \
            RdkProducer(proxy, "rdk-first") as first, RdkProducer(proxy, "rdk-second") as second:
        first.send(3)
        second.send(3)
        filled_for_first = 0

        def first_meets_the_move() -> None:
            nonlocal filled_for_first
            mark, before = len(cluster.requests), _hints(proxy)
            first.send(1, pause_s=0)
            after = _hints(proxy)
            if after["proxy"] == before["proxy"] + 1:  # the proxy answered with the new leader
                filled_for_first += 1
            else:  # no hint: librdkafka refreshes the topic's metadata itself
                assert after["none"] == before["none"] + 1
                assert [[t.name for t in r.body.topics] for r in first.requests(cluster, mark, ApiKey.METADATA)]
            p = cluster.topics["orders"].partitions[0]
            assert _cached_leader(proxy, "orders", 0) == (p.leader, p.leader_epoch)

        moves = [_move_leader(cluster, gate, second, new, first_meets_the_move) for new in MOVES]
        _assert_moves(moves)
        _assert_proxy_addresses_only(cluster, proxy, second)
        if wait == "no-wait":
            assert filled_for_first == 0
        else:  # held for the proxy's refresh: normally every time (unless it outlasted the wait)
            assert filled_for_first >= 1
        assert _hints(proxy)["proxy"] == len(MOVES) + filled_for_first
        assert _hints(proxy)["broker"] == 0
        delivered = first.delivered + second.delivered
        assert sorted(offset for _, offset in delivered) == list(range(len(delivered)))


@pytest.mark.parametrize("leader_hints", [True, False], ids=["broker-hints", "proxy-hints"])
def test_librdkafka_consumer_follows_the_leader(leader_hints):
    from confluent_kafka import Consumer, TopicPartition

    gate = HeldMetadata()
    script = Script(leader_hints=leader_hints,
                    handlers={ApiKey.METADATA: gate, ApiKey.PRODUCE: gate.stamp, ApiKey.FETCH: gate.stamp})
    with _stack(script, {"orders": [1]}) as (cluster, proxy), RdkProducer(proxy, "rdk-feeder") as producer:
        producer.send(5, pause_s=0)
        consumer = Consumer({"bootstrap.servers": proxy.bootstrap, "client.id": "rdk-consumer", "group.id": "ld",
                             "enable.auto.commit": False, "fetch.wait.max.ms": 50})
        try:
            consumer.assign([TopicPartition("orders", 0, 0)])
            got = _consume(consumer, 5)
            consumer.pause([TopicPartition("orders", 0)])
            time.sleep(0.2)  # the Fetch in flight comes back
            mark = len(cluster.requests)
            cluster.call(cluster.move_leader, "orders", 0, 5)
            if not leader_hints:
                _client_metadata(proxy.address)  # another client's Metadata: the proxy knows the move
                assert _cached_leader(proxy, "orders", 0) == (5, 1)
            producer.send(5, pause_s=0)
            gate.hold(cluster, "rdk-consumer")
            started = time.monotonic()
            consumer.resume([TopicPartition("orders", 0)])
            got += _consume(consumer, 5)
            # Taken before close: a closing librdkafka consumer asks for metadata as its
            # group coordinator connection goes down.
            mine = [r for r in cluster.requests[mark:] if r.client_id == "rdk-consumer"]
        finally:
            consumer.close()
        assert got == [b"rdk-feeder-%d" % i for i in range(10)]
        fetch_nodes = [r.node_id for r in mine if r.api_key == ApiKey.FETCH]
        assert fetch_nodes[0] == 1 and set(fetch_nodes[1:]) == {5}, fetch_nodes
        assert {r.api_version for r in mine if r.api_key == ApiKey.FETCH} == {16}
        gate.release(cluster)
        # It did not wait for Metadata: its Fetch reached the new leader before any Metadata answer
        # (held HOLD_S) went out to it.
        fetched_at = gate.first_arrival(started, 5, ApiKey.FETCH, "rdk-consumer")
        metadata_at = gate.first_answer(started, "rdk-consumer")
        assert metadata_at is None or fetched_at < metadata_at, (fetched_at - started, metadata_at - started)
        assert all([t.name for t in r.body.topics] == ["orders"] for r in mine if r.api_key == ApiKey.METADATA)
        source = "broker" if leader_hints else "proxy"
        assert _hints(proxy)[source] == 2  # the feeder's refused Produce, the consumer's Fetch
        assert _hints(proxy)["none"] == 0


def _consume(consumer, count: int, timeout_s: float = 10.0) -> list[bytes]:
    values, deadline = [], time.monotonic() + timeout_s
    while len(values) < count and time.monotonic() < deadline:
        msg = consumer.poll(0.1)
        if msg is not None:
            assert msg.error() is None, msg.error()
            values.append(msg.value())
    return values
