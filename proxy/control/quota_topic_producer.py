"""The proxy's own producer (the quota store's, proxy.control.quota_topic_store, and the fleet's usage
reports, proxy.control.fleet): idempotent where the broker can be (KIP-98), acks=all, to one partition
of one topic. One call of :meth:`PartitionProducer.send`
is one attempt; the store decides whether to try again (proxy.cluster.kafka_retry).

Producer id and sequences follow Kafka's idempotent producer (``TransactionManager``, ``Sender``):

- The producer id comes from InitProducerId without a transactional id, once, and belongs to
  the producer, not to a connection: a batch sent again on a new connection (the leader moved,
  the broker closed an idle connection) keeps its producer id, epoch and base sequence, so a
  broker that already appended it answers with the first copy's offset instead of appending it
  twice. The sequence moves on only once a batch is acknowledged.
- A new producer id (sequences from 0 again) comes after an answer saying the broker lost track
  of this one (UNKNOWN_PRODUCER_ID, OUT_OF_ORDER_SEQUENCE_NUMBER, INVALID_PRODUCER_EPOCH), and
  after a write given up with its batch in doubt (:meth:`PartitionProducer.forget`), so that a
  sequence is never sent again with other records.
- A broker without InitProducerId gets plain acks=all batches.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import kafka.errors
from kafka.protocol.producer import ProduceRequest
from kafka.protocol.producer.transaction import InitProducerIdRequest
from kafka.record import MemoryRecordsBuilder

from proxy.cluster.dialer import BrokerDialer, OwnConnection
from proxy.cluster.offload import off_loop
from proxy.cluster.refresh import topic_metadata

# OUT_OF_ORDER_SEQUENCE_NUMBER, INVALID_PRODUCER_EPOCH, UNKNOWN_PRODUCER_ID: the broker lost track
# of the producer id (its state expired, the log was truncated); Kafka's idempotent producer
# takes a new epoch or id and sends again (TransactionManager, KIP-360).
_NEW_PRODUCER_ID = frozenset({45, 47, 59})
_SEQUENCE_SPAN = 1 << 31  # DefaultRecordBatch.incrementSequence wraps past Integer.MAX_VALUE

Records = list[tuple[bytes, bytes | None]]  # (key, value) of each record of one batch
# Batches of more records are built in the decode thread (proxy.cluster.offload): kafka-python's
# builder takes about 10 µs a record (a 10,000-entry Alter: 0.1 s of the event loop otherwise).
BIG_BATCH_RECORDS = 256


class StoreError(ConnectionError):
    """The broker answered the store with an error. ``retriable``: Kafka's clients would try
    again (a RetriableException); ``reconnect``: ask for the partition's leader again first (an
    InvalidMetadataException); ``new_producer_id``: take a new producer id first."""

    def __init__(self, text: str, *, retriable: bool = True, reconnect: bool = False,
                 new_producer_id: bool = False) -> None:
        super().__init__(text)
        self.retriable = retriable
        self.reconnect = reconnect
        self.new_producer_id = new_producer_id


def broker_error(api: str, code: int, detail: str = "") -> StoreError:
    """``<api> answered <Kafka's error name> (<code>)[: detail]``, retriable as Kafka's clients
    would retry it (kafka-python's ``retriable`` mirrors Kafka's RetriableException)."""
    cls = kafka.errors.for_code(code)
    name = cls.__name__.removesuffix("Error")
    return StoreError(f"{api} answered {name} ({code}){': ' + detail if detail else ''}",
                      retriable=bool(cls.retriable) or code in _NEW_PRODUCER_ID,
                      reconnect=bool(cls.invalid_metadata), new_producer_id=code in _NEW_PRODUCER_ID)


def build_batch(records: Records, compression_type: int, producer_id: int, epoch: int, sequence: int,
                now_ms: int) -> bytes:
    """``records`` as one record batch (v2); idempotent from ``sequence`` when ``producer_id`` >= 0."""
    builder = MemoryRecordsBuilder(2, compression_type, 1 << 30, producer_id=producer_id, producer_epoch=epoch,
                                   base_sequence=sequence if producer_id >= 0 else -1)
    for key, value in records:
        builder.append(timestamp=now_ms, key=key, value=value, headers=[])
    builder.close()
    return bytes(builder.buffer())


class PartitionProducer:
    """Writes batches to ``topic``-``partition`` (see the module docstring)."""

    def __init__(self, topic: str, dialer: BrokerDialer, timeout_s: float,
                 leader: Callable[[], Awaitable[tuple[str, int]]], inspect: Callable[[Any], object],
                 partition: int = 0, compression_type: int = 0) -> None:
        self.topic = topic
        self.partition = partition
        self.compression_type = compression_type  # Kafka's codec ids: 0 none, 1 gzip
        self.last_batch_bytes = 0  # the last batch sent, as it went on the wire
        self._dialer = dialer
        self._timeout_s = timeout_s
        self._leader = leader  # where the partition's leader is now (a Metadata request)
        self._inspect = inspect  # raises when a Metadata answer says the topic is gone
        self._conn: OwnConnection | None = None
        self.state: tuple[int, int, int] | None = None  # producer id, epoch, next sequence (None: ask)

    async def send(self, records: Records, check_topic: bool = False) -> int:
        """One attempt at writing ``records`` as one batch; the offset of the first. Raises
        StoreError for an error answer, OSError and the like for a connection that failed.
        ``check_topic``: first ask whether the topic still exists (a broker may acknowledge a
        write to a deleted topic)."""
        conn = await self._connection()
        if check_topic:
            self._inspect(await topic_metadata(conn, [self.topic], []))
        producer_id, epoch, sequence = self.state or (-1, -1, 0)
        version = min(conn.api_versions.get(ProduceRequest.API_KEY, (0, 0))[1], 9)
        if version < 3:
            raise StoreError(f"the broker offers no Produce version >= 3 ({version})", retriable=False)
        args = (records, self.compression_type, producer_id, epoch, sequence, int(time.time() * 1000))
        batch = build_batch(*args) if len(records) <= BIG_BATCH_RECORDS else await off_loop(build_batch, *args)
        T = ProduceRequest[version].TopicProduceData
        self.last_batch_bytes = len(batch)
        part_data = T.PartitionProduceData(index=self.partition, records=batch)
        data = T(name=self.topic, partition_data=[part_data])
        resp = await conn.round_trip(ProduceRequest[version](transactional_id=None, acks=-1,
                                                             timeout_ms=int(self._timeout_s * 1000),
                                                             topic_data=[data]))
        part = resp.responses[0].partition_responses[0]
        if part.error_code:
            raise broker_error("Produce", part.error_code, part.error_message or "")
        if producer_id >= 0:
            self.state = (producer_id, epoch, (sequence + len(records)) % _SEQUENCE_SPAN)
        return int(part.base_offset)

    def failed(self, exc: BaseException) -> None:
        """What an attempt's failure means for the next one: a new connection (to the leader as
        it is then) unless the broker answered on this one and its leader did not move; a new
        producer id when the broker lost track of this one."""
        if isinstance(exc, StoreError) and exc.new_producer_id:
            self.forget()
        elif not isinstance(exc, StoreError) or exc.reconnect:
            self.close()

    def forget(self) -> None:
        """Closes the connection and drops the producer id: the next batch starts a new producer
        (for a batch in doubt, or a partition that is not the one written so far)."""
        self.close()
        self.state = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    async def _connection(self) -> OwnConnection:
        if self._conn is None:
            self._conn = await self._dialer.open(await self._leader(), self._timeout_s)
        if self.state is None:
            self.state = await self._init_producer_id(self._conn)
        return self._conn

    async def _init_producer_id(self, conn: OwnConnection) -> tuple[int, int, int]:
        _lo, hi = conn.api_versions.get(InitProducerIdRequest.API_KEY, (-1, -1))
        if hi < 0:
            return -1, -1, 0  # before KIP-98: not idempotent, acks=all in any case
        init: Any = await conn.round_trip(InitProducerIdRequest[min(hi, 4)](
            transactional_id=None, transaction_timeout_ms=60_000, producer_id=-1, producer_epoch=-1))
        if init.error_code:
            # A new KRaft cluster answers COORDINATOR_LOAD_IN_PROGRESS until the controller gives the
            # broker a block of producer ids (RPCProducerIdManager); older ones may answer the other
            # COORDINATOR_* codes: all retriable, as Kafka's Sender retries them.
            raise broker_error("InitProducerId", init.error_code)
        return int(init.producer_id), int(init.producer_epoch), 0
