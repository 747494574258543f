"""The quota store kept in a compacted topic (``quota_admin.topic``): every proxy instance
shares the quotas set through the Admin API, and they outlive restarts.

- **Start.** The topic is created if missing (1 partition, replication factor min(3, brokers),
  ``cleanup.policy=compact``), read from offset 0 to its high watermark, and the overlay put in
  force (``on_change``) before :meth:`TopicStore.start` returns; until then the proxy is not
  ready (:attr:`TopicStore.loaded`). A cluster that cannot be read at start does not stop the
  proxy: the file's quotas are in force, and the store keeps trying, with Kafka's back-off. A
  topic just created that Metadata does not show yet (UNKNOWN_TOPIC_OR_PARTITION before the
  brokers learnt of it) is not taken for deleted: it is created again, which the cluster
  answers TOPIC_ALREADY_EXISTS once it knows it.
- **Follow.** One task fetches from the partition leader with ``max_wait_ms`` 500, so a change
  written by any instance is in force here within a second. Each record replaces its entity's
  overlay (proxy.control.quota_topic), then the rules in force are re-applied, as a reload does
  (entities keep their rate state).
- **Write.** :meth:`TopicStore.commit` writes the touched entities' whole new records as one
  batch, with the proxy's own idempotent producer (proxy.control.quota_topic_producer; acks=all), and
  applies them only once the leader acknowledged: the caller reads its writes. A topic not
  created yet is created first (a new cluster: the first Alter may come before the follower
  created it).
- **Retries** (proxy.cluster.kafka_retry, as Kafka's producer retries until ``delivery.timeout.ms``):
  an error Kafka's clients retry (a new cluster's InitProducerId answering
  COORDINATOR_LOAD_IN_PROGRESS, a leader not elected yet, NOT_ENOUGH_REPLICAS, ...) is retried
  with Kafka's back-off (100 ms doubling to 1 s, jittered) until ``write_deadline_s`` after the
  commit began, or until its caller's own deadline cancels it; a cluster that does not answer
  at all, for ``2 x timeout_s`` in a row; any other error ends the write at once. A write that
  ends so raises :class:`StoreUnavailable` naming the cause (``retriable`` False for an error
  retrying would not change) and changes nothing here; :meth:`TopicStore.write_trouble` says
  meanwhile why a write is taking long. A write whose answer was lost may still land, and is
  then applied by the follower, as in Kafka a timed-out request may have succeeded. Records
  carry the whole entity, so a write repeated under a new producer id is harmless.
- **A deleted topic** (Metadata answers UNKNOWN_TOPIC_OR_PARTITION, or the topic id
  changed: replaced by another of the same name) is noticed when the follower reconnects, at
  least every ``topic_check_s``, and before every write, so a write never lands in a topic
  that is gone. The quotas in force stay; the topic is recreated, read from its start (another
  instance may have recreated and refilled it), and the entities it lacks are written back
  from the quotas in force, so deleting the topic loses nothing. Alters answer
  :class:`StoreUnavailable` until that is done; ``kqp_quota_store_topic_lost_total`` counts it.
- **Failures** are counted in ``kqp_quota_store_errors_total{op=create|read|write}``, logged
  at most once a minute per kind, and named in :meth:`TopicStore.state`; the last quotas read
  stay in force meanwhile.

The proxy's own connections use the upstream settings (TLS, SASL) through the BrokerDialer.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from types import MappingProxyType
from typing import Any

from kafka.protocol.consumer import FetchRequest
from kafka.record import MemoryRecords

from proxy.cluster.brokers import Cluster
from proxy.cluster.dialer import OwnConnection
from proxy.cluster.kafka_retry import FATAL, KAFKA_BACKOFF, RETRIABLE, UNREACHABLE, Retries
from proxy.cluster.offload import off_loop
from proxy.cluster.refresh import topic_metadata
from proxy.control import quota_topic
from proxy.control.quota_store import (
    FileKeys,
    Overlay,
    StoreUnavailable,
    by_entity,
    file_keys_of,
    merge,
    overlay_values,
)
from proxy.control.quota_topic_producer import BIG_BATCH_RECORDS, PartitionProducer, Records, StoreError, broker_error
from proxy.control.topic_admin import bootstrap_metadata, create_topic, end_offset
from quotas.client_quota_admin import QuotaChange, QuotaEntity
from quotas.entities import QuotaRule

log = logging.getLogger(__name__)

# org.apache.kafka.common.protocol.Errors
_UNKNOWN_TOPIC_OR_PARTITION = 3
_FETCH_WAIT_MS = 500  # a change made through another instance is in force within a second
# Records read back are applied this many at a time between turns of the event loop (a record
# is decoded from JSON and compared: about 10 µs).
APPLY_SLICE_RECORDS = 500
_TOPIC_CHECK_S = 5.0  # how often the follower asks whether its topic still exists
WRITE_DEADLINE_S = 25.0  # within the 30 s an admin client waits (request.timeout.ms)
_FAILURES = (OSError, TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError)


class TopicLost(StoreError):
    """The quota topic was deleted or replaced: it is being recreated and refilled."""


def failure_kind(exc: BaseException) -> str:
    """How proxy.cluster.kafka_retry treats ``exc``: an error answer as Kafka's clients do (retried if a
    RetriableException), an answer this code cannot read as fatal, anything else (no answer) as
    the cluster out of reach."""
    if isinstance(exc, StoreError):
        return RETRIABLE if exc.retriable else FATAL
    return FATAL if isinstance(exc, ValueError) else UNREACHABLE


class TopicStore:
    """A :class:`proxy.control.quota_store.QuotaStore` whose overlay is what the topic says."""

    def __init__(self, topic: str, cluster: Cluster, timeout_s: float, on_change: Callable[[], None],
                 file_keys: FileKeys | None = None, write_deadline_s: float = WRITE_DEADLINE_S) -> None:
        self.topic = topic
        self._file_keys = file_keys
        self._cluster = cluster
        self._timeout_s = timeout_s
        self.write_deadline_s = write_deadline_s
        self._on_change = on_change  # puts the merged quotas in force (the server's)
        self._overlay: dict[QuotaEntity, dict[str, float | None]] = {}
        self._applied_at: dict[QuotaEntity, int] = {}  # offset of the record in force, per entity
        self.next_offset = 0  # the next offset the follower reads
        self.high_watermark = 0
        self.last_applied_offset = -1
        self.errors: Counter[str] = Counter()  # op -> failures
        self.bad_records: Counter[str] = Counter()  # reason -> records ignored
        self.last_errors: dict[str, str] = {}  # op -> its last failure, until it next succeeds
        self.loaded = asyncio.Event()
        self._created = False  # the topic is known to exist
        self._seen = False  # Metadata showed it since it was created (until then, it may not have shown yet)
        self._topic_id: uuid.UUID | None = None  # the topic read (None: not known yet, or no ids)
        self._generation = 0  # bumped when the topic is lost: answers about the old one are dropped
        self._restoring: set[QuotaEntity] | None = None  # entities to write back to a recreated topic
        self.topic_lost = 0  # times the topic was found deleted or replaced
        self.topic_check_s = _TOPIC_CHECK_S
        self._writes = asyncio.Lock()
        self._producer = PartitionProducer(topic, cluster.dialer, timeout_s, self._leader, self._inspect)
        self.write_retries = 0  # write attempts retried (Kafka's record-retry-total)
        self._trouble: str | None = None  # why the write under way was retried, for write_trouble
        self._follower: asyncio.Task[None] | None = None
        self._followed = 0  # changes the follower applied (put in force by on_change)

    # -- QuotaStore -----------------------------------------------------------------------

    @property
    def overlay(self) -> Overlay:
        return MappingProxyType({e: MappingProxyType(dict(v)) for e, v in self._overlay.items()})

    def __len__(self) -> int:
        return sum(len(values) for values in self._overlay.values())

    def merged(self, base: Iterable[QuotaRule]) -> dict[QuotaEntity, dict[str, float]]:
        return merge(base, self._overlay)

    def apply(self, changes: Iterable[QuotaChange]) -> None:
        """Records ``changes`` here only (as OverlayStore.apply; nothing is written)."""
        for entity, mine in by_entity(changes).items():
            self._set(entity, self._after(entity, mine), self._applied_at.get(entity, -1))

    def _after(self, entity: QuotaEntity, changes: Iterable[QuotaChange]) -> dict[str, float | None]:
        return overlay_values(self._overlay.get(entity, {}), changes, file_keys_of(self._file_keys, entity))

    async def commit(self, changes: Sequence[QuotaChange]) -> None:
        """QuotaStore.commit: written (retried as the module docstring says), then applied.
        Cancelled (its caller's deadline), it changes nothing here and the write is counted
        as failed, with :meth:`write_trouble` as its cause."""
        async with self._writes:
            followed, generation = self._followed, self._generation
            new = {entity: self._after(entity, mine) for entity, mine in by_entity(changes).items()}
            encode = quota_topic.encode_all  # ``new`` is this call's own: the decode thread may read it
            records = encode(new) if len(new) <= BIG_BATCH_RECORDS else await off_loop(encode, new)
            if self._restoring is not None:
                raise StoreUnavailable(self._being_recreated())
            try:
                base_offset = await self._write(records, generation, check_topic=True)
            except asyncio.CancelledError:
                self._failed("write", StoreError(self.write_trouble() or "no answer before the caller's deadline"))
                raise
            except _FAILURES as exc:
                if self._generation != generation:  # TopicLost, or a producer closed by the follower's
                    raise StoreUnavailable(self._being_recreated()) from exc
                self._failed("write", exc)
                retriable = failure_kind(exc) != FATAL
                raise StoreUnavailable(f"the quota topic {self.topic} could not be written ({_text(exc)}); "
                                       f"nothing changed{', retry later' if retriable else ''}",
                                       retriable=retriable) from exc
            self.last_errors.pop("write", None)
            for i, (entity, values) in enumerate(new.items()):
                self._set(entity, values, base_offset + i)
            if self._followed != followed:
                # Another instance's change was put in force meanwhile, without these: both now.
                self._on_change()

    def write_trouble(self) -> str | None:
        """QuotaStore.write_trouble: the last failure of the write under way, or, until it has
        one, of the write before (given up), and how many attempts of that write failed; None
        once a write succeeds."""
        return self._trouble

    def _being_recreated(self) -> str:
        return (f"the quota topic {self.topic} was deleted; the proxy is recreating it and writing back the quotas "
                "in force; nothing changed, retry later")

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self, wait_s: float) -> None:
        """Starts following the topic; returns once it is read to its end and in force, or
        after ``wait_s`` (the store keeps trying; the proxy is not ready meanwhile)."""
        self._follower = asyncio.get_running_loop().create_task(self._follow())
        try:
            async with asyncio.timeout(wait_s):
                await self.loaded.wait()
        except TimeoutError:
            log.warning("quota topic %s not read within %g s: the file's quotas alone are in force until it is "
                        "(%s)", self.topic, wait_s, self._errors_text() or "no answer yet")

    async def stop(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)
        self._producer.close()

    def state(self) -> tuple[bool, str]:
        """(loaded, a line for /healthz and /readyz)."""
        lag = max(self.high_watermark - self.next_offset, 0)
        where = f"quota store {self.topic}: "
        if not self.loaded.is_set():
            return False, where + f"not read yet ({self._errors_text() or 'reading'})"
        line = f"read to offset {self.next_offset}, lag {lag}"
        if self._restoring is not None:
            line = (f"topic deleted, recreating it and writing back {len(self._restoring)} entities "
                    f"(the quotas in force stay); " + line)
        if self.last_errors:
            line += f"; failing: {self._errors_text()}"
        return True, where + line

    def _errors_text(self) -> str:
        return ", ".join(f"{op}: {text}" for op, text in sorted(self.last_errors.items()))

    # -- reading --------------------------------------------------------------------------

    async def _follow(self) -> None:
        failures = 0  # in a row: Kafka's back-off between attempts
        while True:
            try:
                if not self._created:
                    await self._ensure_topic()
                leader = await self._leader()
                generation = self._generation
                async with await self._cluster.dialer.open(leader, self._timeout_s) as conn:
                    async with asyncio.timeout(self._timeout_s):
                        self.high_watermark = await end_offset(conn, self.topic)
                    checked_at = time.monotonic()
                    while True:
                        if time.monotonic() - checked_at >= self.topic_check_s:
                            # A deleted topic may still answer Fetch with nothing (Tansu 0.6 does).
                            async with asyncio.timeout(self._timeout_s):
                                self._inspect(await topic_metadata(conn, [self.topic], []))
                            checked_at = time.monotonic()
                        # Tansu 0.6 answers a Fetch with max_wait_ms 0 with no data at all, even
                        # below the high watermark: the first reads wait a little too.
                        wait_ms = _FETCH_WAIT_MS if self.loaded.is_set() else 50
                        async with asyncio.timeout(self._timeout_s + wait_ms / 1000):
                            await self._fetch_once(conn, wait_ms, generation)
                        self.last_errors.pop("read", None)
                        self.last_errors.pop("create", None)
                        failures = 0
                        if self.next_offset >= self.high_watermark:
                            if self._restoring is not None:
                                await self._restore()
                            if not self.loaded.is_set():
                                log.info("quota topic %s read: %d entities, %d values set or removed through "
                                         "the Admin API", self.topic, len(self._overlay), len(self))
                                self.loaded.set()
            except TopicLost:
                await asyncio.sleep(0.1)  # recreated at once by the next round
            except _FAILURES as exc:
                self._failed("read" if self._created else "create", exc)
                await asyncio.sleep(KAFKA_BACKOFF.delay_s(failures, random.random()))
                failures += 1
            except Exception as exc:  # a broker answer this code did not expect: never a dead follower
                log.exception("quota topic %s: the follower failed", self.topic)
                self._failed("read", exc)
                await asyncio.sleep(KAFKA_BACKOFF.delay_s(failures, random.random()))
                failures += 1

    async def _fetch_once(self, conn: OwnConnection, wait_ms: int, generation: int) -> None:
        version = min(conn.api_versions.get(FetchRequest.API_KEY, (0, 0))[1], 12)  # v13+: topic ids
        if version < 4:
            raise StoreError(f"the broker offers no Fetch version >= 4 ({version})")
        T = FetchRequest[version].FetchTopic
        fp = T.FetchPartition(partition=0, current_leader_epoch=-1, fetch_offset=self.next_offset,
                              last_fetched_epoch=-1, log_start_offset=-1, partition_max_bytes=1 << 20)
        request = FetchRequest[version](replica_id=-1, max_wait_ms=wait_ms, min_bytes=1, max_bytes=1 << 20,
                                        isolation_level=1, session_id=0, session_epoch=-1,
                                        topics=[T(topic=self.topic, partitions=[fp])],
                                        forgotten_topics_data=[], rack_id="")
        resp = await conn.round_trip(request)
        if generation != self._generation:
            raise TopicLost(f"the topic {self.topic} was deleted")  # what was read is the old topic's
        if getattr(resp, "error_code", 0):
            raise broker_error("Fetch", resp.error_code)
        parts = [p for t in resp.responses for p in t.partitions if p.partition_index == 0]
        if not parts:
            return  # Tansu 0.6 answers no partition at all when it has nothing new
        part = parts[0]
        if part.error_code:
            raise broker_error("Fetch", part.error_code)
        self.high_watermark = max(self.high_watermark, part.high_watermark)
        await self._apply_records(bytes(part.records or b""))

    async def _apply_records(self, data: bytes) -> None:
        changed = False
        records = MemoryRecords(data)
        while (batch := records.next_batch()) is not None:
            for n, record in enumerate(batch, 1):
                if record.offset < self.next_offset:
                    continue  # a batch starts before the offset asked for
                changed |= self._apply_record(record.offset, record.key, record.value)
                self.next_offset = record.offset + 1
                self.last_applied_offset = record.offset
                if n % APPLY_SLICE_RECORDS == 0:
                    await asyncio.sleep(0)  # a big batch (another instance's big Alter): other work goes on
            # A batch of aborted or compacted-away records still moves the offset on.
            self.next_offset = max(self.next_offset, getattr(batch, "next_offset", self.next_offset))
        if changed:
            self._followed += 1
            self._on_change()

    def _apply_record(self, offset: int, key: bytes | None, value: bytes | None) -> bool:
        try:
            entity, values = quota_topic.decode(key, value)
        except quota_topic.BadRecord as exc:
            self.bad_records[exc.reason] += 1
            self._cluster.dialer.log_failure("quota_record", logging.WARNING,
                                             "quota topic %s: record at offset %d ignored: %s", self.topic, offset, exc)
            return False
        if self._restoring is not None:
            self._restoring.discard(entity)  # the recreated topic has it: its word stands
        if self._applied_at.get(entity, -1) >= offset:
            return False  # this instance's own write, applied when it was acknowledged
        return self._set(entity, values or {}, offset)

    def _set(self, entity: QuotaEntity, values: dict[str, float | None], offset: int) -> bool:
        """``entity``'s overlay is ``values`` (empty: a tombstone) as of ``offset``; True when
        that changed it."""
        self._applied_at[entity] = offset
        before = self._overlay.get(entity, {})
        if values:
            self._overlay[entity] = dict(values)
        else:
            self._overlay.pop(entity, None)
        return before != values

    # -- writing --------------------------------------------------------------------------

    async def _write(self, records: Records, generation: int, check_topic: bool = False) -> int:
        """Writes ``records`` as one batch, retried (see the module docstring); the offset of
        the first. Raises TopicLost if the topic is lost meanwhile, else the last failure (a
        StoreError naming ``write_deadline_s`` when that passed)."""
        loop = asyncio.get_running_loop()
        retries = Retries(unreachable_s=2 * self._timeout_s)
        deadline = asyncio.timeout(self.write_deadline_s)
        try:
            async with deadline:
                while True:
                    started_at = loop.time()
                    try:
                        async with asyncio.timeout(2 * self._timeout_s):
                            base_offset = await self._attempt(records, check_topic)
                        self._trouble = None
                        return base_offset
                    except TopicLost:
                        raise
                    except _FAILURES as exc:  # Kafka's Sender retries a batch until delivery.timeout.ms
                        if self._generation != generation:
                            raise TopicLost(f"the topic {self.topic} was deleted during the write") from exc
                        self._producer.failed(exc)
                        delay = retries.delay_at(loop.time(), failure_kind(exc), started_at)
                        self._trouble = f"writing {self.topic}: {_text(exc)}; {retries.failures} attempts failed"
                        if delay is None:
                            raise
                        self.write_retries += 1
                        log.debug("quota topic %s: write retried in %.0f ms: %s", self.topic, delay * 1000, _text(exc))
                        await asyncio.sleep(delay)
        except TimeoutError as exc:
            self._producer.forget()  # its batch may yet land: its sequence is never sent with other records
            if not deadline.expired():
                raise
            raise StoreError(f"not written within {self.write_deadline_s:g} s: {self._trouble or 'no answer'}") from exc
        except BaseException:
            self._producer.forget()
            raise

    async def _attempt(self, records: Records, check_topic: bool) -> int:
        if not self._created:
            await self._ensure_topic()  # a new cluster: the first Alter may come before the follower made it
        return await self._producer.send(records, check_topic)

    # -- the topic ------------------------------------------------------------------------

    async def _metadata(self) -> Any:
        return await bootstrap_metadata(self._cluster, self.topic, self._timeout_s)

    async def _leader(self) -> tuple[str, int]:
        return self._inspect(await self._metadata())

    def _inspect(self, metadata: Any) -> tuple[str, int]:
        """The leader of the topic's partition 0 per ``metadata``; raises TopicLost (after
        :meth:`_lost`) when the topic is gone or is not the one read so far."""
        brokers = {b.node_id: (b.host, b.port) for b in metadata.brokers}
        for topic in metadata.topics:
            if topic.name != self.topic:
                continue
            if topic.error_code == _UNKNOWN_TOPIC_OR_PARTITION:
                if self._seen:
                    self._lost("was deleted")
                # Just created: Kafka answers CreateTopics before every broker's MetadataCache has the
                # topic. Created again, it answers TOPIC_ALREADY_EXISTS once the cluster knows it.
                self._created = False
                raise broker_error("Metadata", topic.error_code, f"{self.topic}, just created")
            if topic.error_code:
                raise broker_error("Metadata", topic.error_code, self.topic)
            topic_id = getattr(topic, "topic_id", None)
            topic_id = topic_id if topic_id and topic_id.int else None  # before Metadata v10: no ids
            if self._topic_id is not None and topic_id is not None and topic_id != self._topic_id:
                self._lost("was replaced by a new topic of the same name")
            self._topic_id = self._topic_id or topic_id
            self._seen = True
            for p in topic.partitions:
                if p.partition_index == 0 and p.leader_id in brokers:
                    return brokers[p.leader_id]
        raise StoreError(f"no leader known for {self.topic}-0")

    def _lost(self, what: str) -> None:
        """The topic read so far is gone: keep the quotas in force, read the new one from its
        start, and write back what it lacks (:meth:`_restore`)."""
        self.topic_lost += 1
        self._created, self._topic_id = False, None
        self._generation += 1
        self._restoring = set(self._overlay)
        self.next_offset, self.high_watermark = 0, 0
        self._applied_at.clear()
        self._seen = False
        self._producer.forget()  # its producer id and sequences belonged to the old partition
        log.warning("quota topic %s %s: the quotas in force stay; recreating it and writing back %d entities",
                    self.topic, what, len(self._restoring))
        raise TopicLost(f"the topic {self.topic} {what}")

    async def _restore(self) -> None:
        """Writes back the entities the recreated topic lacks, as they are in force here."""
        async with self._writes:
            entities = [e for e in sorted(self._restoring or (), key=quota_topic.entity_key) if e in self._overlay]
            if entities:
                base_offset = await self._write([quota_topic.encode(e, self._overlay[e]) for e in entities],
                                                self._generation)
                for i, entity in enumerate(entities):
                    self._applied_at[entity] = base_offset + i
            self._restoring = None
            log.warning("quota topic %s is back: %d entities written back (it had the others)", self.topic,
                        len(entities))

    async def _ensure_topic(self) -> None:
        metadata = await self._metadata()
        known = [t for t in metadata.topics if t.name == self.topic]
        if known and known[0].error_code == 0:
            self._created = self._seen = True
            return
        if known and known[0].error_code != _UNKNOWN_TOPIC_OR_PARTITION:
            raise broker_error("Metadata", known[0].error_code, self.topic)
        brokers = {b.node_id: (b.host, b.port) for b in metadata.brokers}
        target = brokers.get(metadata.controller_id) or next(iter(brokers.values()), None)
        if target is None:
            raise StoreError("no broker known to create the quota topic")
        self._seen = False
        code = await create_topic(self._cluster.dialer, target, self.topic, 1, min(3, len(brokers)),
                                  {"cleanup.policy": "compact"}, self._timeout_s)
        if code == 0:
            log.info("created the quota topic %s (compacted, replication factor %d)", self.topic,
                     min(3, len(brokers)))
        self._created = True

    def _failed(self, op: str, exc: BaseException) -> None:
        self.errors[op] += 1
        self.last_errors[op] = _text(exc)
        self._cluster.dialer.log_failure(f"quota_store_{op}", logging.WARNING, "quota topic %s: %s failed: %s; "
                                         "the quotas last read stay in force", self.topic, op, _text(exc))


def _text(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
