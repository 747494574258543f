"""MetadataResponse read in place: its brokers rewritten, its topics walked without objects.

An all-topics Metadata response of a big cluster is megabytes of partitions the proxy never
changes; decoding it into kafka-python objects and encoding it again cost 25 µs a partition of
event-loop time. Here only the broker list (near the front) is decoded and encoded again; the
rest of the body is the broker's bytes. What the proxy learns from the topics (names, ids,
partition counts, leaders and epochs) is read by :class:`TopicWalk`, which walks fixed-width
fields and array lengths a slice of partitions at a time, so the caller can yield between
slices.

Versions v0-v13 (Kafka's MetadataResponse.json): ThrottleTimeMs v3+, Rack v1+, ClusterId v2+,
ControllerId v1+, TopicId v10+, IsInternal v1+, LeaderEpoch v7+, OfflineReplicas v5+,
TopicAuthorizedOperations v8+, ClusterAuthorizedOperations v8-v10, top-level ErrorCode v13+;
flexible (compact lengths, tagged fields) from v9.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from struct import Struct
from struct import error as struct_error
from typing import NamedTuple

from .frames import Buffer
from .headers import HeaderError, read_uvarint, skip_tagged_fields
from .scan import ScanError

MAX_VERSION = 13
FIRST_FLEXIBLE = 9
_INT16 = Struct(">h")
_INT32 = Struct(">i")
_PARTITION_WITH_EPOCH = Struct(">hiii")  # error code, index, leader id, leader epoch (v7+)
_PARTITION = Struct(">hii")  # before v7: no leader epoch
_SHORT = (HeaderError, struct_error, IndexError, UnicodeDecodeError)

Advertise = Callable[[int, str, int], tuple[str, int]]


class MetadataBroker(NamedTuple):
    node_id: int
    host: str
    port: int
    rack: bytes  # the Rack field as the broker encoded it (v1+; empty before): copied as it is
    tagged: bytes  # the broker's tagged fields (flexible versions; empty before): copied as they are


class MetadataHead(NamedTuple):
    """The front of a MetadataResponse body: everything up to its topics."""

    brokers: tuple[MetadataBroker, ...]
    brokers_at: int  # where the brokers array (its length) starts
    brokers_end: int  # where it ends: ClusterId, ControllerId and the topics follow
    topics_at: int  # where the topics array (its length) starts


def _check_version(version: int) -> None:
    if not 0 <= version <= MAX_VERSION:
        raise ScanError(f"MetadataResponse v{version}: the proxy reads v0 to v{MAX_VERSION}")


def _array_len(body: Buffer, pos: int, flexible: bool) -> tuple[int, int]:
    """An array's length (-1: null) and the position after it."""
    if flexible:
        n, pos = read_uvarint(body, pos)
        return n - 1, pos
    return _INT32.unpack_from(body, pos)[0], pos + 4


def _string(body: Buffer, pos: int, flexible: bool) -> tuple[int, int]:
    """A string's (or nullable string's) length in bytes (-1: null) and where its bytes start."""
    if flexible:
        n, pos = read_uvarint(body, pos)
        return n - 1, pos
    return _INT16.unpack_from(body, pos)[0], pos + 2


def _end_of(pos: int, length: int, body: Buffer) -> int:
    end = pos + max(length, 0)
    if end > len(body):
        raise ScanError(f"a length of {length} at {pos} runs past the body's {len(body)} bytes")
    return end


def read_metadata_head(body: Buffer, version: int) -> MetadataHead:
    """The brokers of a MetadataResponse body and where its topics start. Raises
    :class:`ScanError` for a body that does not hold them."""
    _check_version(version)
    flexible = version >= FIRST_FLEXIBLE
    try:
        pos = 4 if version >= 3 else 0  # throttle_time_ms
        brokers_at = pos
        count, pos = _array_len(body, pos, flexible)
        if count < 0:
            raise ScanError("the broker list is null")
        brokers = []
        for _ in range(count):
            (node_id,) = _INT32.unpack_from(body, pos)
            size, start = _string(body, pos + 4, flexible)
            if size < 0:
                raise ScanError("a broker's host is null")
            end = _end_of(start, size, body)
            host = bytes(body[start:end]).decode("utf-8")
            (port,) = _INT32.unpack_from(body, end)
            pos = end + 4
            rack_at = pos
            if version >= 1:
                size, start = _string(body, pos, flexible)
                pos = _end_of(start, size, body)
            rack = bytes(body[rack_at:pos])
            tagged_at = pos
            if flexible:
                pos = skip_tagged_fields(body, pos)
            brokers.append(MetadataBroker(node_id, host, port, rack, bytes(body[tagged_at:pos])))
        brokers_end = pos
        if version >= 2:  # ClusterId, nullable
            size, start = _string(body, pos, flexible)
            pos = _end_of(start, size, body)
        if version >= 1:
            pos += 4  # ControllerId
        if pos > len(body):
            raise ScanError("the body ends before its topics")
        return MetadataHead(tuple(brokers), brokers_at, brokers_end, pos)
    except _SHORT as exc:
        raise ScanError(f"malformed MetadataResponse v{version}: {exc!r}") from exc


def _encode_string(value: bytes, flexible: bool) -> bytes:
    if flexible:
        return _uvarint(len(value) + 1) + value
    return _INT16.pack(len(value)) + value


def _uvarint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_brokers(brokers: tuple[MetadataBroker, ...], version: int) -> bytes:
    """The brokers array as a MetadataResponse of ``version`` encodes it."""
    flexible = version >= FIRST_FLEXIBLE
    parts = [_uvarint(len(brokers) + 1) if flexible else _INT32.pack(len(brokers))]
    for b in brokers:
        parts += (_INT32.pack(b.node_id), _encode_string(b.host.encode("utf-8"), flexible), _INT32.pack(b.port),
                  b.rack, b.tagged)
    return b"".join(parts)


def rewrite_metadata_body(body: Buffer, version: int, advertise: Advertise,
                          prefix: Buffer = b"") -> tuple[bytes, MetadataHead]:
    """``prefix`` (a response header, say) and the body with every broker's host and port
    replaced by ``advertise(node id, host, port)``; every other byte is the broker's. Returns
    it with the head as the broker sent it (the brokers' own addresses)."""
    head = read_metadata_head(body, version)
    rewritten = tuple(b._replace(host=host, port=port) for b in head.brokers
                      for host, port in (advertise(b.node_id, b.host, b.port),))
    view = memoryview(body)
    brokers = encode_brokers(rewritten, version)
    return b"".join((prefix, view[: head.brokers_at], brokers, view[head.brokers_end :])), head


class MetadataTopic(NamedTuple):
    """One topic of a MetadataResponse, as :class:`TopicWalk` reads it."""

    error_code: int
    name: str | None  # null from v12 (a topic asked for by an id the broker does not know)
    topic_id: bytes | None  # the 16 bytes of its id (v10+; all zeros: none), None before v10
    # (error code, partition index, leader id, leader epoch) of each partition, in the
    # response's order, four ints each; epoch -1 before v7.
    partitions: array[int]

    @property
    def partition_count(self) -> int:
        return len(self.partitions) // 4


class TopicWalk:
    """Walks the topics of a MetadataResponse body, at most a given number of partitions per
    :meth:`step`, so that a body of a million partitions can be read in slices between which
    an event loop runs. The body must not change while it is walked (bytes, or a view of
    bytes). Once :attr:`done`, every byte of the body has been accounted for."""

    def __init__(self, body: Buffer, version: int, topics_at: int) -> None:
        _check_version(version)
        self._body = body
        self._version = version
        self._flexible = version >= FIRST_FLEXIBLE
        try:
            self._topics_left, self._pos = _array_len(body, topics_at, self._flexible)
        except _SHORT as exc:
            raise ScanError(f"malformed MetadataResponse v{version}: {exc!r}") from exc
        if self._topics_left < 0:
            raise ScanError("the topic list is null")
        # The topic being read when a step ended inside its partitions.
        self._open: tuple[int, str | None, bytes | None, int, list[int]] | None = None
        self.done = False
        self.topics_read = 0
        self.partitions_read = 0

    def step(self, max_partitions: int) -> list[MetadataTopic]:
        """Reads on until about ``max_partitions`` partitions have been read (a topic's head
        counts as one) or the body ends; returns the topics completed meanwhile. Raises
        :class:`ScanError` for a body that does not match its schema."""
        try:
            return self._step(max(1, max_partitions))
        except _SHORT as exc:
            raise ScanError(f"malformed MetadataResponse v{self._version}: {exc!r}") from exc

    def _step(self, budget: int) -> list[MetadataTopic]:
        done: list[MetadataTopic] = []
        while budget > 0 and not self.done:
            if self._open is None and self._version >= 10:
                budget = self._whole_topics(budget, done)
                if budget <= 0:
                    break
            if self._open is None:
                if self._topics_left == 0:
                    self._finish()
                    break
                self._open = self._topic_head()
                budget -= 1
            error_code, name, topic_id, left, quads = self._open
            take = min(left, budget)
            self._pos = self._partitions(take, quads)
            budget -= take
            self.partitions_read += take
            left -= take
            if left:
                self._open = (error_code, name, topic_id, left, quads)
                break
            self._open = None
            self._pos = self._topic_tail(self._pos)
            self._topics_left -= 1
            self.topics_read += 1
            done.append(MetadataTopic(error_code, name, topic_id, array("i", quads)))
        return done

    def _whole_topics(self, budget: int, done: list[MetadataTopic]) -> int:
        """The fast path of :meth:`_step` for v10+ (flexible, with topic ids): whole topics
        that fit the budget, read inline (a big cluster's topics are mostly small, and the
        general path's calls per topic cost as much as five partitions). Stops before a topic
        that does not fit; returns the budget left."""
        body, pos, version = self._body, self._pos, self._version
        unpack16 = _INT16.unpack_from
        left = self._topics_left
        read = 0
        while left and budget > 0:
            at = pos
            (error_code,) = unpack16(body, pos)
            n = body[pos + 2]
            if n > 0x7F:
                n, pos = read_uvarint(body, pos + 2)
            else:
                pos += 3
            if n:
                end = pos + n - 1
                if end > len(body):
                    raise ScanError(f"a name of {n - 1} bytes at {pos} runs past the body")
                name: str | None = str(body[pos:end], "utf-8")
                pos = end
            elif version >= 12:
                name = None
            else:
                raise ScanError("a topic's name is null")
            topic_id = bytes(body[pos : pos + 16])
            count = body[pos + 17]  # after the id and IsInternal
            if count > 0x7F:
                count, pos = read_uvarint(body, pos + 17)
            else:
                pos += 18
            count -= 1
            if count < 0:
                raise ScanError(f"topic {name!r}: the partition list is null")
            if count >= budget:
                pos = at  # the general path reads it, in slices
                break
            parts: list[int] = []
            self._pos = pos
            pos = self._partitions(count, parts)
            pos += 4  # TopicAuthorizedOperations
            if body[pos]:
                pos = skip_tagged_fields(body, pos)
            else:
                pos += 1
            done.append(MetadataTopic(error_code, name, topic_id, array("i", parts)))
            budget -= count + 1
            read += count
            left -= 1
        if pos > len(body):
            raise ScanError("the body ends inside a topic")
        self._pos = pos
        self.topics_read += self._topics_left - left
        self._topics_left = left
        self.partitions_read += read
        return budget

    def _topic_head(self) -> tuple[int, str | None, bytes | None, int, list[int]]:
        body, pos, version, flexible = self._body, self._pos, self._version, self._flexible
        (error_code,) = _INT16.unpack_from(body, pos)
        size, start = _string(body, pos + 2, flexible)
        if size < 0 and version < 12:
            raise ScanError("a topic's name is null")
        end = _end_of(start, size, body)
        name = bytes(body[start:end]).decode("utf-8") if size >= 0 else None
        pos = end
        topic_id = None
        if version >= 10:
            topic_id = bytes(body[pos : pos + 16])
            if len(topic_id) != 16:
                raise ScanError("the body ends inside a topic id")
            pos += 16
        if version >= 1:
            pos += 1  # IsInternal
        count, pos = _array_len(body, pos, flexible)
        if count < 0:
            raise ScanError(f"topic {name!r}: the partition list is null")
        self._pos = pos
        return error_code, name, topic_id, count, []

    def _topic_tail(self, pos: int) -> int:
        if self._version >= 8:
            pos += 4  # TopicAuthorizedOperations
        if self._flexible:
            pos = skip_tagged_fields(self._body, pos)
        if pos > len(self._body):
            raise ScanError("the body ends inside a topic")
        return pos

    def _partitions(self, count: int, parts: list[int]) -> int:
        """Reads ``count`` partitions from the current position into ``parts`` (four ints
        each, flat: an array is made of a flat list at twice the speed); returns the
        position after them. The loop every partition of a big cluster goes through: one
        unpack, then the int32 arrays skipped by their lengths (unrolled: this loop is most of
        the cost of a big Metadata response)."""
        body, pos, version = self._body, self._pos, self._version
        if self._flexible:  # v9+: a leader epoch and three compact arrays (replicas, ISR, offline)
            unpack = _PARTITION_WITH_EPOCH.unpack_from
            for _ in range(count):
                parts += unpack(body, pos)
                pos += 14
                n = body[pos]
                if n > 0x7F:
                    n, pos = read_uvarint(body, pos)
                    pos -= 1
                if not n:
                    raise ScanError("a partition's replica list is null")
                pos += 1 + (n - 1) * 4
                n = body[pos]
                if n > 0x7F:
                    n, pos = read_uvarint(body, pos)
                    pos -= 1
                if not n:
                    raise ScanError("a partition's ISR is null")
                pos += 1 + (n - 1) * 4
                n = body[pos]
                if n > 0x7F:
                    n, pos = read_uvarint(body, pos)
                    pos -= 1
                if not n:
                    raise ScanError("a partition's offline replica list is null")
                pos += 1 + (n - 1) * 4
                if body[pos]:
                    pos = skip_tagged_fields(body, pos)
                else:
                    pos += 1
        else:
            with_epoch = version >= 7
            unpack = (_PARTITION_WITH_EPOCH if with_epoch else _PARTITION).unpack_from
            fixed = 14 if with_epoch else 10
            arrays = 3 if version >= 5 else 2
            unpack_int32 = _INT32.unpack_from
            for _ in range(count):
                fields = unpack(body, pos)
                parts += fields if with_epoch else (*fields, -1)
                pos += fixed
                for _ in range(arrays):
                    (n,) = unpack_int32(body, pos)
                    if n < 0:
                        raise ScanError("a partition's replica list is null")
                    pos += 4 + n * 4
        if pos > len(body):
            raise ScanError("the body ends inside a partition")
        return pos

    def _finish(self) -> None:
        pos = self._pos
        if 8 <= self._version <= 10:
            pos += 4  # ClusterAuthorizedOperations
        if self._version >= 13:
            pos += 2  # ErrorCode
        if self._flexible:
            pos = skip_tagged_fields(self._body, pos)
        if pos != len(self._body):
            raise ScanError(f"MetadataResponse v{self._version} ends at {pos}, the body has {len(self._body)} bytes")
        self.done = True


def walk_all(body: Buffer, version: int) -> tuple[MetadataHead, list[MetadataTopic]]:
    """The head and every topic of a body, in one go (for bodies known to be small)."""
    head = read_metadata_head(body, version)
    walk = TopicWalk(body, version, head.topics_at)
    topics: list[MetadataTopic] = []
    while not walk.done:
        topics += walk.step(1 << 30)
    return head, topics

