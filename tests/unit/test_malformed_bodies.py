"""A malformed body ends as a ProtocolError, never as any other exception.

The (API key, version) pairs come from the filter chain of a proxy with every quota, the rate
limiters and the usage log on (its filters' ``api_keys``, ``response_api_keys``,
``request_since`` and ``response_since``), plus every response version, since the connection
rewrites ``throttle_time_ms`` in any response a quota throttled. For each, a valid body is built
with kafka-python's classes (every field set, two entries in every array, real record batches),
then cut short (every point, or a seeded sample of them), bit-flipped (seeded) and given lying
lengths (each int16 / int32 / varint length of the body, and each batch length, set to null,
negative, huge and off by one). Each variant goes through every entry point the connection calls
for that API and version: header parsing, each filter of the chain, the acks read of a Produce,
the chunk and stream routes, ``throttle_time_ms``, and what a partly rejected CreateTopics /
CreatePartitions / DeleteTopics leaves for its response. Only a ProtocolError may come out.
"""

from __future__ import annotations

import asyncio
import base64
import random
import struct
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import ClassVar

import pytest
from kafka.record import MemoryRecordsBuilder

from config import parse_config
from config.engines import quota_manager_for
from protocol.apis import API_FAMILIES, SPECS, ApiKey
from protocol.errors import ProtocolError
from protocol.fetch import throttled_fetch_body
from protocol.headers import (
    encode_response_header,
    parse_request_header,
    response_correlation_id,
    response_header_is_flexible,
)
from protocol.messages import DecodeError, UnknownVersionError, decode_request, decode_response, encode_body
from protocol.produce import produce_acks, produce_error_response
from protocol.throttle import has_throttle_field, throttle_of, with_throttle
from proxy.app.server import ProxyServer
from proxy.cluster.topics import TopicCache
from proxy.dataplane.connection import ClientConnection
from proxy.dataplane.filters.api import Defer, FilterContext, Forward, Hold
from proxy.dataplane.filters.api_versions import ApiVersionsFilter
from proxy.dataplane.filters.controller_mutation import STRICT_SINCE, ControllerMutationFilter
from proxy.dataplane.filters.sasl import SaslFilter
from proxy.dataplane.inflight import InFlight
from proxy.dataplane.routes import STREAM_SCANS, StreamRoute

TOPIC = "orders"
TOPIC_ID = uuid.UUID("6c9b2c1e-3d5f-4a8e-9b0c-1d2e3f405162")
NODE_ID = 1  # the broker the client connection is on
LEADER = 2  # the leader the proxy's caches know for every partition
PARTITION = 2  # every int32 the builder sets is 2 (partition index, node id, ...)
SASL_TOKENS = {
    "PLAIN": b"\x00alice\x00secret",
    "SCRAM-SHA-256": b"n,,n=alice,r=fyko+d2lbbFgONRv9qkxdawL",
    "OAUTHBEARER": b"n,,\x01auth=Bearer eyJhbGciOiJub25lIn0.eyJzdWIiOiJhbGljZSJ9.\x01\x01",
}
CUTS = 96  # truncations per body (every cut point of a shorter body)
FLIPS = 48  # single-bit flips per body


def config(tmp_path):
    every_quota = {kind: 1 for kind in (
        "request_rate", "producer_byte_rate", "consumer_byte_rate", "controller_mutation_rate",
        "producer_ids_rate", "producer_record_rate", "consumer_record_rate", "producer_batch_rate")}
    return parse_config({
        "upstream": {"bootstrap_servers": ["127.0.0.1:1"]},
        "listen": {"bootstrap_port": 0, "broker_port_base": 0},
        "metrics": {"enabled": False},
        "usage_log": {"directory": str(tmp_path)},
        "quotas": [{"user": "<default>", **every_quota}],
    })


# -- valid bodies --------------------------------------------------------------------------------


def batch(records: int = 2, pid: int = 4001) -> bytes:
    b = MemoryRecordsBuilder(2, 0, 1 << 20, offset=0, producer_id=pid, producer_epoch=0, base_sequence=0)
    for i in range(records):
        b.append(timestamp=1_700_000_000_000 + i, key=b"k%d" % i, value=b"v%d" % i, headers=[])
    b.close()
    return bytes(b.buffer())


SCALARS = {"int8": 2, "int16": 2, "uint16": 2, "int32": PARTITION, "int64": 2, "float64": 1.5, "bool": False,
           "uuid": TOPIC_ID, "string": TOPIC, "bytes": b"opaque", "records": batch() + batch(1, pid=4002),
           "bitfield": {1, 3}}
# Values that take a filter past its first check: topics big enough for the controller mutation
# quota to reject the second one, acks=-1 (a response follows), a SCRAM server-final message.
OVERRIDES = {"acks": -1, "num_partitions": 20, "count": 40, "host": "b2.internal", "auth_bytes": b"v=signature"}
# How the partitions of a response fared (a top-level error code is always 0: it changes how
# some bodies are read): each shape takes the leader-hint filter down another path.
SHAPES = {
    "moved without hint": {"error_code": 6, "leader_id": -1},  # NOT_LEADER_OR_FOLLOWER: the proxy fills one in
    "moved with hint": {"error_code": 6, "leader_id": LEADER},  # the broker's hint is learned
    "nothing moved": {"error_code": 0, "leader_id": LEADER},  # scanned only; a Fetch may stream
}
REQUEST_SHAPE = SHAPES["moved without hint"]


def value(field, version: int, shape: dict, nested: bool):
    if field.is_struct_array():
        return [message(field.data_class, version, shape, nested=True) for _ in range(2)]
    if field.is_struct():
        return message(field.data_class, version, shape, nested=True)
    if field.is_array():
        return [SCALARS[field.array_of.type_str]] * 2
    if field.name in shape and (nested or field.name != "error_code"):
        return shape[field.name]
    if field.name == "error_code":
        return 0
    return OVERRIDES.get(field.name, SCALARS[field.type_str])


def message(cls, version: int, shape: dict, nested: bool = False, **fields):
    """``cls`` at ``version`` with every field that version has set."""
    values = {name: value(f, version, shape, nested) for name, f in cls.fields.items() if f.for_version_q(version)}
    values.update(fields)
    return cls(**values) if nested else cls[version](**values)


def request_frame(key: int, version: int, mechanism: str = "PLAIN") -> tuple[bytes, int]:
    """A request frame (no size prefix) and where its body starts. A version above what the
    proxy knows gets the body of the highest one it knows."""
    known = min(version, SPECS[key].max_version)
    fields = {"auth_bytes": SASL_TOKENS[mechanism]} if key == ApiKey.SASL_AUTHENTICATE else {}
    if key == ApiKey.SASL_HANDSHAKE:
        fields["mechanism"] = mechanism
    req = message(SPECS[key].request, known, REQUEST_SHAPE, **fields)
    body = encode_body(req)
    assert decode_request(key, known, body) is not None
    req.with_header(correlation_id=7, client_id="fuzz")
    frame = bytearray(req.encode(header=True))
    frame[2:4] = version.to_bytes(2, "big")
    return bytes(frame), len(frame) - len(body)


def two_valid_topics(frame: bytes, body_offset: int) -> bytes:
    """A generated CreateTopics / CreatePartitions / DeleteTopics ``frame`` whose two topics are
    ones Kafka would not refuse for their own reason (two names, no manual assignment), so the
    controller mutation quota decides them."""
    header = parse_request_header(frame)
    req = decode_request(header.api_key, header.api_version, frame[body_offset:])
    if header.api_key == ApiKey.DELETE_TOPICS and header.api_version < 6:
        req.topic_names = [f"{TOPIC}-{i}" for i in range(len(req.topic_names))]
    for i, t in enumerate(getattr(req, "topics", ())):
        t.name = f"{TOPIC}-{i}"
        if header.api_key == ApiKey.CREATE_TOPICS:
            t.name, t.assignments = f"new-{TOPIC}-{i}", []
        elif header.api_key == ApiKey.CREATE_PARTITIONS:
            t.assignments = None
    return frame[:body_offset] + encode_body(req)


def response_frame(key: int, version: int, shape: dict) -> tuple[bytes, int]:
    known = min(version, SPECS[key].max_version)
    body = encode_body(message(SPECS[key].response, known, shape))
    assert decode_response(key, known, body) is not None
    head = encode_response_header(7, response_header_is_flexible(key, version))
    return head + body, len(head)


# -- where a body's lengths are ------------------------------------------------------------------


def length_fields(cls, version: int, body: bytes) -> list[list]:
    """[position, "int16" | "int32" | "uvarint", end of what it counts] of every length in
    ``body``: strings, bytes, arrays, tagged-field counts and sizes, and the batch lengths
    inside record sets."""
    found: list[list] = []
    flexible = cls.flexible_version_q(version)
    end = _walk_struct(cls.fields.values(), version, flexible, body, 0, found)
    assert end == len(body), f"{cls.__name__} v{version}: walked {end} of {len(body)} bytes"
    return found


_FIXED = {"int8": 1, "bool": 1, "int16": 2, "uint16": 2, "int32": 4, "bitfield": 4, "int64": 8, "float64": 8,
          "uuid": 16}


def _walk_struct(fields, version, flexible, buf, pos, found) -> int:
    for f in fields:
        if f.for_version_q(version) and not f.tagged_field_q(version):
            pos = _walk_field(f, version, flexible, buf, pos, found)
    if flexible:
        count, pos, counted = _length(buf, pos, "uvarint", found)
        for _ in range(count):
            _tag, pos = _uvarint(buf, pos)
            size, pos, sized = _length(buf, pos, "uvarint", found)
            pos += size
            sized[2] = pos
        counted[2] = pos
    return pos


def _walk_field(f, version, flexible, buf, pos, found) -> int:
    if f.is_array():
        n, pos, counted = _length(buf, pos, "uvarint" if flexible else "int32", found)
        n = n - 1 if flexible else n
        for _ in range(max(n, 0)):
            if f.is_struct_array():
                pos = _walk_struct(f.fields.values(), version, flexible, buf, pos, found)
            else:
                pos = _walk_scalar(f.array_of.type_str, flexible, buf, pos, found)
        counted[2] = pos
        return pos
    if f.is_struct():
        if f.nullable_for_version_q(version):  # kafka-python's null marker for a nullable struct
            pos += 1
            if buf[pos - 1] == 0xFF:
                return pos
        return _walk_struct(f.fields.values(), version, flexible, buf, pos, found)
    return _walk_scalar(f.type_str, flexible, buf, pos, found)


def _walk_scalar(type_str, flexible, buf, pos, found) -> int:
    if type_str in _FIXED:
        return pos + _FIXED[type_str]
    kind = "uvarint" if flexible else ("int16" if type_str == "string" else "int32")
    n, pos, sized = _length(buf, pos, kind, found)
    n = n - 1 if flexible else n
    if type_str == "records" and n > 0:
        at = pos
        while at < pos + n:  # each batch's length (DefaultRecordBatch: base offset, length)
            length = struct.unpack_from(">i", buf, at + 8)[0]
            found.append([at + 8, "int32", at + 12 + length])
            at += 12 + length
    sized[2] = pos + max(n, 0)
    return sized[2]


def _length(buf, pos, kind, found) -> tuple[int, int, list]:
    """Reads a length and notes where it is (the end of what it counts is set by the caller)."""
    entry = [pos, kind, None]
    found.append(entry)
    if kind == "uvarint":
        return (*_uvarint(buf, pos), entry)
    fmt, size = (">h", 2) if kind == "int16" else (">i", 4)
    return struct.unpack_from(fmt, buf, pos)[0], pos + size, entry


def _uvarint(buf, pos) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def _encode_uvarint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# -- malformed variants --------------------------------------------------------------------------


def variants(body: bytes, lengths: list[list], rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """(what was done, the malformed body): cut short, bit-flipped, lying lengths, null or
    empty where the schema says otherwise, and one byte too many."""
    cuts = range(len(body)) if len(body) <= CUTS else sorted(rng.sample(range(len(body)), CUTS))
    for cut in cuts:
        yield f"cut at {cut}", body[:cut]
    for _ in range(FLIPS if body else 0):
        pos, bit = rng.randrange(len(body)), rng.randrange(8)
        flipped = bytearray(body)
        flipped[pos] ^= 1 << bit
        yield f"bit {bit} of byte {pos} flipped", bytes(flipped)
    for pos, kind, end in lengths:
        for lie, replaced in _lies(body, pos, kind):
            yield f"{kind} length at {pos} set to {lie}", replaced
        for name, encoded in _null_and_empty(kind):
            yield f"{kind} length at {pos} made {name}, what it counted dropped", body[:pos] + encoded + body[end:]
    yield "a byte too many", body + b"\x00"


def _lies(body: bytes, pos: int, kind: str) -> Iterator[tuple[int | str, bytes]]:
    """The length at ``pos`` replaced, what it counts left where it was."""
    if kind == "uvarint":
        actual, end = _uvarint(body, pos)
        for lie in sorted({0, 1, actual + 1, max(actual - 1, 0), 2**31 - 1, 2**32 - 1}):
            yield lie, body[:pos] + _encode_uvarint(lie) + body[end:]
        yield "a 6-byte varint", body[:pos] + b"\xff" * 5 + b"\x01" + body[end:]
        return
    fmt, top = (">h", 2**15 - 1) if kind == "int16" else (">i", 2**31 - 1)
    (actual,) = struct.unpack_from(fmt, body, pos)
    for lie in sorted({-1, -2, -(top + 1), top, actual + 1, actual - 1}):
        if -(top + 1) <= lie <= top:
            patched = bytearray(body)
            struct.pack_into(fmt, patched, pos, lie)
            yield lie, bytes(patched)


def _null_and_empty(kind: str) -> tuple[tuple[str, bytes], ...]:
    if kind == "uvarint":  # compact: N + 1, 0 for null
        return ("null", b"\x00"), ("empty", b"\x01")
    width = 2 if kind == "int16" else 4
    return ("null", b"\xff" * width), ("empty", b"\x00" * width)


# -- the proxy the variants go through ---------------------------------------------------------


class EveryTopic(TopicCache):
    """Knows a partition count for every topic but the new ones (named ``new-…``): the
    controller mutation filter decides at once (a lookup would need a broker)."""

    def count(self, name=None, topic_id=None):
        return None if name and name.startswith("new-") else 20


class Cluster:
    """The proxy's view of the brokers, without opening a listener per node."""

    brokers: ClassVar[dict[int, tuple[str, int]]] = {NODE_ID: ("b1.internal", 9092),
                                                     LEADER: ("b2.internal", 9093)}

    def advertise(self, node_id, host, port):
        return "proxy.example", 19000

    def upstream_address(self, node_id, attempt):
        return "b1.internal", 9092

    class dialer:
        @staticmethod
        async def open(address, timeout_s):
            raise ConnectionRefusedError("no broker in this test")

        @staticmethod
        def log_failure(*args):
            pass


class Proxy:
    """A proxy with every filter on, whose entry points are called as the connection calls them."""

    def __init__(self, tmp_path) -> None:
        self.config = config(tmp_path)
        self.server = ProxyServer(self.config)
        self.chain = self.server.chain
        self.server.leaders.observe(TOPIC, PARTITION, LEADER, 9, 0.0)
        self.server.leaders.learn_id(TOPIC_ID, TOPIC)
        for f in self.chain._request_filters + self.chain._response_filters:
            if hasattr(f, "topics"):
                f.topics = EveryTopic()
                f.topics.num_partitions_default = 3
            if hasattr(f, "refresher"):
                f.refresher = None  # no expedited metadata refresh: it needs a broker
        self.failures: Counter = Counter()
        self.examples: dict = {}
        self.apis: dict = {}
        self.calls = 0

    def conn(self, mechanism: str | None = None) -> FilterContext:
        """What a connection hands its filters."""
        ctx = ClientConnection(self.server.env, NODE_ID).ctx
        ctx.cluster = Cluster()
        ctx.session.sasl_mechanism = mechanism
        return ctx

    def call(self, where: str, what: str, fn, *args):
        """Runs one entry point; anything but a ProtocolError is a failure, and so is any
        exception on a valid body of a version the proxy knows. Failures are noted by entry
        point, exception type and the function of the proxy that raised it."""
        self.calls += 1
        allowed = () if what == "valid" else ProtocolError
        try:
            return _settle(fn(*args))
        except allowed:
            return None
        except Exception as exc:  # the point of the test: noted, reported together below
            key = (where, type(exc).__name__, _raised_in(exc))
            self.failures[key] += 1
            self.examples.setdefault(key, f"{what}: {exc!r}")
            self.apis.setdefault(key, set()).add(what.split(",")[0])
            return None

    # -- requests

    def request_filters(self, key: int, version: int) -> tuple:
        since, filters = self.chain.request.get(key, self.chain.request_all)
        return filters if version >= since else ()

    def on_request(self, key: int, version: int, frame: bytes, what: str, mechanism: str | None) -> None:
        header = self.call("parse_request_header", what, parse_request_header, frame)
        if header is None:
            return
        conn, entry = self.conn(mechanism), InFlight(header.correlation_id, key, version, 0.0, len(frame))
        for f in self.request_filters(key, version):
            self.call(f"{type(f).__name__}.on_request", what, f.on_request, conn, header, frame, entry)
        if key == ApiKey.PRODUCE and header.body_offset >= 0:
            self.call("produce_acks", what, produce_acks, frame, header.body_offset, version)

    # -- responses

    def response_filters(self, key: int, version: int) -> tuple:
        since, filters = self.chain.response.get(key, (0, ()))
        return filters if version >= since else ()

    def on_response(self, key: int, version: int, frame: bytes, what: str, strict_hook) -> None:
        self.call("response_correlation_id", what, response_correlation_id, frame)
        conn, entry = self.conn("SCRAM-SHA-256"), InFlight(7, key, version, 0.0, 100)
        conn.session.claimed_principal = "alice"
        for f in self.response_filters(key, version):
            self.call(f"{type(f).__name__}.on_response", what, f.on_response, conn, entry, frame)
        since, route = self.chain.response_route.get(key, (0, None))
        if route is not None and not isinstance(route, StreamRoute) and version >= since:
            chunk = struct.pack(">i", len(frame)) + frame
            self.call("on_response_chunk", what, route, conn, InFlight(7, key, version, 0.0, 100), chunk)
        if key in STREAM_SCANS:
            self.stream(key, version, frame, what, conn)
        if strict_hook is not None:
            self.call("InFlight.on_response (strict)", what, strict_hook, frame)
        self.call("with_throttle", what, with_throttle, key, version, frame, 60_000)
        self.call("throttle_of", what, throttle_of, key, version, frame)

    def stream(self, key: int, version: int, frame: bytes, what: str, conn) -> None:
        """The stream route the API's filters that offer it would take, from the first version
        they all look at (proxy.dataplane.routes.StreamRoute; with no quota or limiter on, they are the
        API's only filters)."""
        filters = tuple(f for f in self.response_filters(key, version) if f.spec.stream)
        if not filters or version < min(f.spec.response_since.get(key, 0) for f in filters):
            return
        route = StreamRoute(filters, STREAM_SCANS[key])
        chunk = struct.pack(">i", len(frame)) + frame
        entry = InFlight(7, key, version, 0.0, 100)
        start = self.call("StreamRoute.hold_from", what, route.hold_from, conn, entry, chunk, len(frame))
        if start is not None:
            self.call("StreamRoute.tail_unchanged", what, route.tail_unchanged, conn, entry, chunk[start:])

    def strict_hook(self, key: int, version: int):
        """What a strict CreateTopics / CreatePartitions / DeleteTopics whose second topic was
        rejected leaves on its entry for the response (a fresh quota: the first is admitted)."""
        if version < STRICT_SINCE.get(key, 2**15) or version > SPECS[key].max_version:
            return None
        (mutations,) = (f for f in self.request_filters(key, version) if type(f).__name__ == "ControllerMutationFilter")
        saved, mutations.manager = mutations.manager, quota_manager_for(self.config)
        try:
            frame = two_valid_topics(*request_frame(key, version))
            header = parse_request_header(frame)
            entry = InFlight(header.correlation_id, key, version, 0.0, len(frame))
            decision = mutations.on_request(self.conn(), header, frame, entry)
            if isinstance(decision, Defer):  # the fresh lookup before a refusal, failing here
                decision = asyncio.run(decision.decision)
            assert isinstance(decision, Forward)
        finally:
            mutations.manager = saved
        assert decision.on_response is not None
        return decision.on_response

    def report(self) -> str:
        return "\n".join(f"{n:6d} x {where}: {exc} from {raised_in}, e.g. {self.examples[key]}"
                          f"\n         in {', '.join(sorted(self.apis[key]))}"
                          for key, n in self.failures.most_common() for where, exc, raised_in in [key])


def _raised_in(exc: BaseException) -> str:
    """The innermost function of the proxy's own code (not kafka-python's, not the test's) that
    the exception went through."""
    tb, found = exc.__traceback__, "?"
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        if ("/protocol/" in path or "/proxy/" in path) and "site-packages" not in path:
            found = f"{tb.tb_frame.f_code.co_name} ({path.rsplit('/', 2)[-2]}/{path.rsplit('/', 1)[-1]})"
        tb = tb.tb_next
    return found


def _settle(decision):
    """Closes the coroutine of a Defer or Hold (what it waits for needs a broker)."""
    if isinstance(decision, Defer):
        decision.decision.close()
    elif isinstance(decision, Hold):
        decision.frame.close()
    return decision


# -- which (API key, version) pairs --------------------------------------------------------------


def request_pairs(chain) -> list[tuple[int, int]]:
    """Every API and version some request filter sees, and one version past what the proxy knows.
    An API the proxy has no schema for is refused by its header alone (a hidden API family,
    see test_hidden_apis_are_refused_by_their_header): no body of it is read."""
    return sorted((key, v) for key, (since, filters) in chain.request.items() if filters and key in SPECS
                  for v in range(since, SPECS[key].max_version + 2))


def response_pairs(chain) -> list[tuple[int, int]]:
    """Every API and version some response filter sees, and every one whose response carries
    throttle_time_ms (the connection raises it when a quota throttled the request); each with
    one version past what the proxy knows."""
    filtered = {(key, v) for key, (since, filters) in chain.response.items() if filters
                for v in range(since, SPECS[key].max_version + 2)}
    throttled = {(key, v) for key in SPECS for v in range(SPECS[key].max_version + 2) if has_throttle_field(key, v)}
    return sorted(filtered | throttled)


def body_variants(cls, key: int, version: int, frame: bytes, body_offset: int, side: str):
    body = frame[body_offset:]
    rng = random.Random(f"{side}-{key}-{version}")
    lengths = length_fields(cls, min(version, SPECS[key].max_version), body)
    for what, malformed in variants(body, lengths, rng):
        yield f"{SPECS[key].name}{side} v{version}, {what}", frame[:body_offset] + malformed


def _as_is(key: int, version: int) -> str:
    """What the unchanged body is: valid, or of a version the proxy knows no schema for (which
    may be refused, as a ProtocolError)."""
    return "valid" if version <= SPECS[key].max_version else f"{SPECS[key].name} v{version}, unknown version"


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    return Proxy(tmp_path_factory.mktemp("usage"))


def test_the_pairs_come_from_the_filters_and_cover_what_they_decode(proxy):
    requests, responses = request_pairs(proxy.chain), response_pairs(proxy.chain)
    filtered = {key for key, (_, fs) in proxy.chain.request.items() if any(f.spec.request_keys is not None for f in fs)}
    assert {ApiKey.PRODUCE, ApiKey.SASL_AUTHENTICATE, ApiKey.CREATE_TOPICS, ApiKey.API_VERSIONS} <= filtered
    assert {(key, SPECS[key].max_version) for key in filtered if key in SPECS} <= set(requests)
    assert {ApiKey.FETCH, ApiKey.METADATA, ApiKey.DESCRIBE_CLUSTER, ApiKey.SASL_HANDSHAKE} <= set(proxy.chain.response)
    assert len(requests) > 250 and len(responses) > 250


def test_hidden_apis_are_refused_by_their_header(proxy):
    unknown = {key for key, (_, fs) in proxy.chain.request.items() if fs and key not in SPECS}
    assert unknown <= set().union(*API_FAMILIES)
    api_versions = next(f for f in proxy.chain.request[ApiKey.API_VERSIONS][1] if isinstance(f, ApiVersionsFilter))
    assert unknown <= api_versions.hidden


def test_malformed_request_bodies_raise_only_protocol_errors(proxy):
    proxy.failures.clear()
    proxy.calls = 0
    for key, version in request_pairs(proxy.chain):
        mechanisms = SASL_TOKENS if key == ApiKey.SASL_AUTHENTICATE else ("PLAIN",)
        for mechanism in mechanisms:
            frame, offset = request_frame(key, version, mechanism)
            proxy.on_request(key, version, frame, _as_is(key, version), mechanism)
            for what, malformed in body_variants(SPECS[key].request, key, version, frame, offset, " request"):
                proxy.on_request(key, version, malformed, what, mechanism)
    assert proxy.calls > 100_000
    assert not proxy.failures, "\n" + proxy.report()


def test_malformed_response_bodies_raise_only_protocol_errors(proxy):
    proxy.failures.clear()
    proxy.calls = 0
    for key, version in response_pairs(proxy.chain):
        hook = proxy.strict_hook(key, version) if key in STRICT_SINCE else None
        for shape_name, shape in SHAPES.items():
            frame, offset = response_frame(key, version, shape)
            proxy.on_response(key, version, frame, _as_is(key, version), hook)
            for what, malformed in body_variants(SPECS[key].response, key, version, frame, offset,
                                                 f" response ({shape_name})"):
                proxy.on_response(key, version, malformed, what, hook)
    assert proxy.calls > 100_000
    assert not proxy.failures, "\n" + proxy.report()


# -- what the fuzzing found, one case each ------------------------------------------------------


def test_a_null_the_schema_does_not_allow_is_a_decode_error():
    # kafka-python writes None as a null and reads a -1 length as None anywhere; Kafka's own
    # readers refuse a null where the schema has none ("non-nullable field ... was serialized as null").
    req = message(SPECS[ApiKey.SASL_AUTHENTICATE].request, 2, REQUEST_SHAPE, auth_bytes=None)
    with pytest.raises(DecodeError, match="auth_bytes is null"):
        decode_request(ApiKey.SASL_AUTHENTICATE, 2, encode_body(req))
    resp = message(SPECS[ApiKey.METADATA].response, 1, SHAPES["nothing moved"])
    resp.topics[1].partitions = None
    with pytest.raises(DecodeError, match=r"topics\.partitions is null"):
        decode_response(ApiKey.METADATA, 1, encode_body(resp))
    # Where the schema allows a null, it is read as one.
    produce = message(SPECS[ApiKey.PRODUCE].request, 9, REQUEST_SHAPE, transactional_id=None)
    assert decode_request(ApiKey.PRODUCE, 9, encode_body(produce)).transactional_id is None


def test_a_version_without_a_schema_is_refused_not_guessed():
    frame, offset = request_frame(ApiKey.CREATE_TOPICS, SPECS[ApiKey.CREATE_TOPICS].max_version)
    with pytest.raises(UnknownVersionError):
        decode_request(ApiKey.CREATE_TOPICS, SPECS[ApiKey.CREATE_TOPICS].max_version + 1, frame[offset:])
    with pytest.raises(UnknownVersionError):
        produce_error_response(7, SPECS[ApiKey.PRODUCE].max_version + 1, [(TOPIC, [0])], 89, 100)
    with pytest.raises(UnknownVersionError):
        throttled_fetch_body(SPECS[ApiKey.FETCH].max_version + 1, 100, None)


def test_a_jwt_nested_deeper_than_the_stack_claims_no_principal(proxy):
    payload = base64.urlsafe_b64encode(b"[" * 100_000).rstrip(b"=")
    token = b"n,,\x01auth=Bearer e30." + payload + b".\x01\x01"
    req = message(SPECS[ApiKey.SASL_AUTHENTICATE].request, 2, REQUEST_SHAPE, auth_bytes=token)
    req.with_header(correlation_id=7, client_id="fuzz")
    frame = bytes(req.encode(header=True))
    conn = proxy.conn("OAUTHBEARER")
    header = parse_request_header(frame)
    assert SaslFilter().on_request(conn, header, frame, InFlight(7, header.api_key, 2, 0.0)) is None
    assert conn.session.claimed_principal is None


def test_a_negative_partition_count_gives_no_tokens_back(proxy):
    # CreateTopics v5 is permissive (KIP-599): the topics are charged together. Charged as is,
    # -1_000_000 partitions would refill the bucket and hide the 30 of the other topic.
    R = SPECS[ApiKey.CREATE_TOPICS].request[5]
    T = R.CreatableTopic
    req = R(topics=[T(name=name, num_partitions=n, replication_factor=1, assignments=[], configs=[])
                    for name, n in (("new-a", -1_000_000), ("new-b", 30))], timeout_ms=100, validate_only=False)
    req.with_header(correlation_id=7, client_id="fuzz")
    frame = bytes(req.encode(header=True))
    header = parse_request_header(frame)
    entry = InFlight(7, header.api_key, 5, 0.0)
    f = ControllerMutationFilter(quota_manager_for(proxy.config), EveryTopic(), 1, 1.0)
    decision = f.on_request(proxy.conn(), header, frame, entry)
    if isinstance(decision, Defer):  # the fresh lookup before a throttle, failing here
        decision = asyncio.run(decision.decision)
    assert isinstance(decision, Forward) and decision.frame is None  # forwarded as it is
    assert entry.mutations == 30
    assert decision.throttle_ms > 0  # 30 partitions against a burst of 11: in debt
