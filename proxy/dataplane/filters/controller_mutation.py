"""KIP-599 controller mutation quota on CreateTopics, CreatePartitions and DeleteTopics.

Each topic is charged the partitions it creates or deletes: CreateTopics its NumPartitions,
else its assignments, else the broker's ``num.partitions``; CreatePartitions the new count
minus the current one; DeleteTopics the topic's partition count. ValidateOnly is never charged.

Only what Kafka would charge is charged (``ReplicationControlManager`` validates a topic before
``applyPartitionChangeQuota``): a topic Kafka refuses for its own reason (a duplicate, an invalid
name, one that exists or does not, bad partitions, replication factor or assignments; see
proxy.dataplane.filters.mutation_checks) costs nothing and is never answered THROTTLING_QUOTA_EXCEEDED.
What the proxy knows before forwarding (the request, the topic cache, the brokers it has seen)
it judges at once; before it would refuse a topic, it asks the broker for the topics' metadata
afresh, so a topic another client just created is answered TOPIC_ALREADY_EXISTS, not 89. What
only the broker knows (its CreateTopicPolicy, topic configs, authorization) shows in its answer:
a charge for a topic it did not create, extend or delete is given back when the response comes,
and a topic the proxy expected refused but the broker created is charged then.

Strict versions (CreateTopics v6+, CreatePartitions v3+, DeleteTopics v5+) are checked topic
by topic in request order; admitted topics are forwarded in a rewritten request, rejected ones
are answered THROTTLING_QUOTA_EXCEEDED and merged back in the original order. A topic Kafka
refuses for its own reason is forwarded for the broker to answer, unless the principal is in
debt at its turn: then the proxy answers Kafka's refusal itself, so a broker laxer than Kafka
never creates it uncharged. Older versions are permissive: everything is forwarded, the response
carries the throttle and the client is muted (Kafka's PermissiveControllerMutationQuota).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import uuid
from collections.abc import Collection, Iterator, Sequence
from typing import Any

from protocol import errors
from protocol.apis import STRICT_SINCE, ApiKey
from protocol.headers import RequestHeader, response_body_offset
from protocol.messages import decode_request, decode_response, encode_body
from proxy.cluster.offload import decode_response_off_loop, is_big, off_loop
from proxy.cluster.refresh import fetch_num_partitions, fetch_topics
from proxy.cluster.topics import TopicCache
from proxy.dataplane.filters import mutation_answers as answers
from proxy.dataplane.filters import mutation_checks as checks
from proxy.dataplane.filters.api import Answer, Defer, FilterContext, FilterSpec, Forward, Frame, Hold
from proxy.dataplane.filters.mutation_topics import Charges, Strike, Topic, Topics
from proxy.dataplane.filters.quotas import now_ms
from proxy.dataplane.filters.shadow import applied, enforced, note_shadow
from proxy.dataplane.inflight import InFlight, NoteKey
from quotas import CONTROLLER_MUTATION_RATE, QuotaManager

log = logging.getLogger(__name__)

# A request of more topics is read (what the proxy knows of each topic), and answered when the
# proxy answers it whole, in the decode thread (proxy.cluster.offload); the broker's answer is
# learned from this many topics at a time between turns of the event loop.
BIG_TOPICS = 1000


class _Validation(enum.Enum):
    ONLY = "validate_only"  # a ValidateOnly request: its response must not teach the topic cache anything


VALIDATE_ONLY = _Validation.ONLY
# What a request noted for its response: its charges, settled against the broker's answer.
_NOTE: NoteKey[Charges | _Validation] = NoteKey("controller_mutation")
# A big request forwarded without the topics it refused: its answer is merged in the decode thread.
_MERGE: NoteKey[tuple[Topics, int]] = NoteKey("controller_mutation_merge")


class ControllerMutationFilter:
    spec = FilterSpec(request_keys=frozenset(STRICT_SINCE), response_keys=frozenset(STRICT_SINCE))

    def __init__(self, manager: QuotaManager, topics: TopicCache, fallback_num_partitions: int, timeout_s: float,
                 count_all: bool = False) -> None:
        self.manager = manager
        self.topics = topics
        self.fallback_num_partitions = fallback_num_partitions
        self.timeout_s = timeout_s
        # The usage log counts partition mutations whether or not a quota applies.
        self.count_all = count_all

    # -- request side -----------------------------------------------------------------------

    def on_request(self, ctx: FilterContext, header: RequestHeader, frame: Frame,
                   entry: InFlight) -> Answer | Forward | Defer | None:
        if header.body_offset < 0:
            return None
        body = memoryview(frame)[header.body_offset :]
        if is_big(body):  # thousands of topics: decoded off the loop (proxy.cluster.offload)
            return Defer(self._decoded_off_loop(ctx, header, frame, entry, body))
        return self._on_decoded(ctx, header, frame, entry, decode_request(header.api_key, header.api_version, body))

    async def _decoded_off_loop(self, ctx: FilterContext, header: RequestHeader, frame: Frame, entry: InFlight,
                                body: memoryview) -> Answer | Forward | Defer | None:
        brokers = frozenset(ctx.cluster.brokers)
        req, topics = await off_loop(self._read, header.api_key, header.api_version, body, brokers)
        return self._on_decoded(ctx, header, frame, entry, req, topics)

    def _read(self, key: int, version: int, body: memoryview, brokers: Collection[int]) -> tuple[Any, Topics]:
        """In the decode thread: the request, and its topics as the proxy knows them now (the
        topic cache is only read, one key at a time)."""
        req = decode_request(key, version, body)
        return req, (Topics() if getattr(req, "validate_only", False) else self._topics(key, version, req, brokers))

    async def _read_topics(self, key: int, version: int, req: Any, brokers: Collection[int],
                           looked_up: bool = False) -> Topics:
        """:meth:`_topics` (``looked_up``: :meth:`_looked_up`); for many topics, in the decode thread."""
        read = self._looked_up if looked_up else self._topics
        if len(req.topic_names if key == ApiKey.DELETE_TOPICS and version < 6 else req.topics) <= BIG_TOPICS:
            return read(key, version, req, brokers)
        return await off_loop(read, key, version, req, frozenset(brokers))

    def _looked_up(self, key: int, version: int, req: Any, brokers: Collection[int]) -> Topics:
        """The request's topics once the broker was asked: a topic still not known does not exist."""
        topics = self._topics(key, version, req, brokers)
        for t in topics:
            if t.mutations is None:
                t.mutations = 0
                if t.refusal is None and key != ApiKey.CREATE_TOPICS:
                    # Not found: deleting it or adding partitions to it fails, and costs nothing.
                    t.refusal = (checks.create_partitions_refusal(t.item, None, duplicate=False)
                                 if key == ApiKey.CREATE_PARTITIONS
                                 else checks.delete_topic_refusal(not t.name, False, duplicate=False))
        return topics.sum_up()

    def _on_decoded(self, ctx: FilterContext, header: RequestHeader, frame: Frame, entry: InFlight,
                    req: Any, topics: Topics | None = None) -> Answer | Forward | Defer | None:
        if getattr(req, "validate_only", False):
            _NOTE.set(entry, VALIDATE_ONLY)
            return None  # KIP-599: validation is not a mutation
        user, client_id = ctx.session.principal, header.client_id or ""
        limited = self.manager.resolve(user, client_id, CONTROLLER_MUTATION_RATE) is not None
        if not limited and not self.count_all:
            return None
        if topics is None:
            topics = self._topics(header.api_key, header.api_version, req, ctx.cluster.brokers)
        if topics.unknown:
            return Defer(self._after_lookup(ctx, header, frame, req, entry, limited, refresh=False))
        return self._decide(ctx, header, frame, req, entry, topics, limited, looked_up=False)

    def _topics(self, key: int, version: int, req: Any, brokers: Collection[int]) -> Topics:
        """The request's topics as the proxy knows them now: what each would cost, and what
        Kafka would refuse before charging."""
        out = Topics()
        if key == ApiKey.CREATE_TOPICS:
            twice = checks.duplicates([t.name for t in req.topics])
            for t in req.topics:
                refusal = checks.create_topic_refusal(t, duplicate=t.name in twice,
                                                      exists=self.topics.count(t.name) is not None, brokers=brokers)
                n = t.num_partitions if t.num_partitions != -1 else (len(t.assignments) or None)
                if n is None:
                    n = self.topics.num_partitions_default  # None until known: looked up first
                out.append(Topic(t, t.name, None, max(n, 0) if n is not None else None, refusal))
        elif key == ApiKey.CREATE_PARTITIONS:
            twice = checks.duplicates([t.name for t in req.topics])
            for t in req.topics:
                current = self.topics.count(t.name)
                topic = Topic(t, t.name, None, None if current is None else max(t.count - current, 0))
                if current is not None or t.name in twice:
                    topic.refusal = checks.create_partitions_refusal(t, current, duplicate=t.name in twice)
                out.append(topic)
        elif version >= 6:  # DeleteTopics by name or by id
            names = [t.name for t in req.topics if t.name]
            ids = [t.topic_id for t in req.topics if not t.name and t.topic_id is not None and t.topic_id.int]
            twice = checks.duplicates(names) | checks.duplicates(ids)
            for t in req.topics:
                topic_id = t.topic_id if t.topic_id is not None and t.topic_id.int else None
                out.append(self._delete_topic(t, t.name, topic_id, twice))
        else:
            twice = checks.duplicates(list(req.topic_names))
            for name in req.topic_names:
                out.append(self._delete_topic(name, name, None, twice))
        return out.sum_up()

    def _delete_topic(self, item: Any, name: str | None, topic_id: uuid.UUID | None,
                      twice: Collection[str | uuid.UUID]) -> Topic:
        count = self.topics.count(name, topic_id)
        topic = Topic(item, name, topic_id, count)
        if (name or topic_id) in twice:
            topic.refusal = checks.delete_topic_refusal(not name, True, duplicate=True)
        return topic

    async def _after_lookup(self, ctx: FilterContext, header: RequestHeader, frame: Frame, req: Any, entry: InFlight,
                            limited: bool, refresh: bool) -> Answer | Forward | Defer | None:
        """Learns what the decision needs from the broker, then decides: the partition counts
        and the broker's ``num.partitions`` not known yet, or (``refresh``) the metadata of
        every topic of the request afresh, before any is refused."""
        key = header.api_key
        topics = await self._read_topics(key, header.api_version, req, ctx.cluster.brokers)
        # Every topic whose state the cache gave (or could not give), in one Metadata request;
        # else those whose cost is not known.
        names, ids = (topics.asked_names, topics.asked_ids) if refresh or limited else (
            topics.unknown_names, topics.unknown_ids)
        address = ctx.cluster.upstream_address(None, 0)
        try:
            if key == ApiKey.CREATE_TOPICS and self.topics.num_partitions_default is None and topics.unknown:
                node_id = next(iter(ctx.cluster.brokers), 0)
                default = await fetch_num_partitions(ctx.cluster.dialer, address, node_id, self.timeout_s)
                self.topics.num_partitions_default = default
            if names or (ids and key == ApiKey.DELETE_TOPICS):
                for n, t in enumerate(await fetch_topics(ctx.cluster.dialer, address, names, ids, self.timeout_s), 1):
                    if n % BIG_TOPICS == 0:
                        await asyncio.sleep(0)  # the cache learns a slice at a time; other clients go on
                    if t.error_code == 0:
                        self.topics.put(t.name, len(t.partitions), getattr(t, "topic_id", None))
                    elif t.error_code == checks.UNKNOWN_TOPIC_OR_PARTITION and t.name:
                        self.topics.forget(t.name)  # gone since the cache learned it
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
            ctx.cluster.dialer.log_failure("partition_lookup", logging.WARNING, "cannot look up partition counts at "
                                           "%s:%d: %s", *address, exc or type(exc).__name__)
        if self.topics.num_partitions_default is None and key == ApiKey.CREATE_TOPICS:
            self.topics.num_partitions_default = self.fallback_num_partitions
        refreshed = await self._read_topics(key, header.api_version, req, ctx.cluster.brokers, looked_up=True)
        return self._decide(ctx, header, frame, req, entry, refreshed, limited, looked_up=True)

    def _decide(self, ctx: FilterContext, header: RequestHeader, frame: Frame, req: Any, entry: InFlight,
                topics: Topics, limited: bool, looked_up: bool) -> Answer | Forward | Defer | None:
        entry.mutations = topics.mutations
        user, client_id = ctx.session.principal, header.client_id or ""
        _NOTE.set(entry, Charges(user, client_id, limited, topics))
        if not limited:
            return None
        now = now_ms()
        strict = header.api_version >= STRICT_SINCE[header.api_key]
        if not looked_up and self._would_refuse(user, client_id, topics, now, strict):
            # Before refusing or throttling anything, what the broker says of these topics now.
            return Defer(self._after_lookup(ctx, header, frame, req, entry, limited, refresh=True))
        if not strict:
            return self._permissive(ctx, entry, topics, user, client_id, now)
        strike = Strike(enforced(self.manager.resolve(user, client_id, CONTROLLER_MUTATION_RATE)) is not None)
        if len(topics) > BIG_TOPICS:
            return Defer(self._strict_in_slices(ctx, header, frame, req, entry, topics, strike, now))
        for _ in self._strict(user, client_id, topics, strike, now):
            pass
        return self._outcome(ctx, header, frame, req, entry, topics, strike)

    async def _strict_in_slices(self, ctx: FilterContext, header: RequestHeader, frame: Frame, req: Any,
                                entry: InFlight, topics: Topics, strike: Strike,
                                now: int) -> Answer | Forward | Defer | None:
        """:meth:`_strict` a slice of topics at a time: other clients go on between (another
        request of the same principal may be charged between two slices, as Kafka's request
        handler threads charge concurrent requests)."""
        user, client_id = ctx.session.principal, header.client_id or ""
        for _ in self._strict(user, client_id, topics, strike, now):
            await asyncio.sleep(0)
        return self._outcome(ctx, header, frame, req, entry, topics, strike)

    def _strict(self, user: str, client_id: str, topics: Topics, strike: Strike, now: int) -> Iterator[None]:
        """StrictControllerMutationQuota, topic by topic in the request's order (KIP-599): each
        charged while tokens remain, refused THROTTLING_QUOTA_EXCEEDED once they do not; one
        Kafka would refuse anyway is answered its refusal while in debt. Yields every
        BIG_TOPICS topics."""
        in_debt: dict[str | uuid.UUID | None, bool] = {}  # a duplicate shares its first entry's fate
        debt_now: bool | None = None  # whether in debt now; read again only after a charge
        for n, t in enumerate(topics, 1):
            if n % BIG_TOPICS == 0:
                yield
            if t.refusal is not None:
                key = t.name or t.topic_id
                if key not in in_debt:
                    if debt_now is None:
                        debt_now = strike.enforcing and (self.manager.tokens(user, client_id, CONTROLLER_MUTATION_RATE,
                                                                             now) or 0.0) < 0
                    in_debt[key] = debt_now
                if in_debt[key]:
                    strike.refuse(t, t.refusal)  # Kafka's own answer, never forwarded: see the module docstring
                else:
                    strike.admitted.append(t)
                continue
            if not t.mutations:
                strike.admitted.append(t)
                continue
            decision = self.manager.try_admit(user, client_id, CONTROLLER_MUTATION_RATE, t.mutations, now)
            if decision.admitted:
                debt_now = None
                t.charged = t.mutations
                strike.admitted.append(t)
            elif decision.shadow:  # forwarded uncharged; noted below, once for the request
                strike.admitted.append(t)
                strike.shadow_refused += 1
                strike.shadow_throttle = max(strike.shadow_throttle, decision.throttle_ms)
            else:
                strike.refuse(t, checks.Refusal(errors.THROTTLING_QUOTA_EXCEEDED, answers.THROTTLED_MESSAGE))
                strike.throttle = max(strike.throttle, decision.throttle_ms)

    def _outcome(self, ctx: FilterContext, header: RequestHeader, frame: Frame, req: Any, entry: InFlight,
                 topics: Topics, strike: Strike) -> Answer | Forward | Defer | None:
        """The decision once every topic is decided: forwarded as it is, answered whole by the
        proxy, or forwarded without the topics it refused (their answers merged into the broker's)."""
        admitted, throttle = strike.admitted, strike.throttle
        if strike.shadow_refused:
            note_shadow(ctx, entry, CONTROLLER_MUTATION_RATE, strike.shadow_throttle,
                        f"{strike.shadow_refused} of {len(topics)} topics")
        if len(admitted) == len(topics):
            return None  # StrictControllerMutationQuota: no rejection, no throttle
        entry.rejected = strike.rejected
        if not admitted:
            if len(topics) > BIG_TOPICS:
                return Defer(_off_loop_answer(header, topics, throttle))
            return Answer(answers.whole_answer(header, topics, throttle), throttle_ms=throttle)
        if len(topics) > BIG_TOPICS:
            return Defer(_off_loop_forward(header, frame, req, entry, topics, admitted, throttle))
        _keep_only(header.api_key, header.api_version, req, admitted)
        return Forward(bytes(frame[: header.body_offset]) + encode_body(req), throttle_ms=throttle,
                       on_response=lambda response: answers.merged(entry, response, topics, throttle))

    def _permissive(self, ctx: FilterContext, entry: InFlight, topics: Topics, user: str, client_id: str,
                    now: int) -> Forward | Defer | None:
        """PermissiveControllerMutationQuota: every topic forwarded, the ones Kafka would create
        charged together, throttled while in debt."""
        if not entry.mutations:
            return None
        decided = self.manager.record(user, client_id, CONTROLLER_MUTATION_RATE, entry.mutations, now)
        throttle = applied(ctx, entry, CONTROLLER_MUTATION_RATE, decided).throttle_ms
        if len(topics) > BIG_TOPICS:
            return Defer(_charged_off_loop(topics, throttle))
        _mark_charged(topics)
        return Forward(throttle_ms=throttle) if throttle else None

    def _would_refuse(self, user: str, client_id: str, topics: Topics, now: int, strict: bool) -> bool:
        """Whether a decision on what the proxy knows now would answer any topic itself (89, or
        a refusal while in debt) or, permissive, throttle the request; charges nothing."""
        tokens = self.manager.tokens(user, client_id, CONTROLLER_MUTATION_RATE, now)
        if tokens is None or not topics:
            return False
        # Strict: tokens only fall, so some topic finds them below 0 at its turn (refused, or
        # answered its refusal by the proxy) iff they are below 0 before the last one's.
        return tokens - (topics.but_last if strict else topics.mutations) < 0

    # -- response side: settle the charges, keep the partition counts current ----------------

    def on_response(self, ctx: FilterContext, entry: InFlight, frame: Frame) -> Frame | Hold:
        note = _NOTE.get(entry)
        if note is VALIDATE_ONLY:
            return frame
        offset = response_body_offset(frame, entry.api_key, entry.api_version)
        body = memoryview(frame)[offset:]
        if is_big(body) or _MERGE.get(entry) is not None:
            return Hold(self._learned_off_loop(entry, frame, body, note))
        resp = decode_response(entry.api_key, entry.api_version, body)
        self._learn_results(entry, getattr(resp, answers.RESULTS[entry.api_key]), note)
        return frame

    async def _learned_off_loop(self, entry: InFlight, frame: Frame, body: memoryview,
                                note: Charges | _Validation | None) -> Frame:
        resp = await decode_response_off_loop(entry.api_key, entry.api_version, body)
        results = getattr(resp, answers.RESULTS[entry.api_key])
        for start in range(0, len(results), BIG_TOPICS):
            if start:
                await asyncio.sleep(0)  # the response waits (Hold); other clients do not
            self._learn_results(entry, results[start : start + BIG_TOPICS], note)
        merge = _MERGE.get(entry)
        if merge is None:
            return frame
        # The broker's answer to the topics forwarded, with the proxy's to the others.
        merged = await off_loop(_encoded_answer, entry.api_key, entry.api_version, merge[0], resp, merge[1])
        return bytes(frame[: len(frame) - len(body)]) + merged

    def _learn_results(self, entry: InFlight, results: Sequence[Any], note: Charges | _Validation | None) -> None:
        """What the broker's answer tells: partition counts to keep or forget, charges to settle."""
        if entry.api_key == ApiKey.CREATE_PARTITIONS:
            for t in results:
                if t.error_code == 0:
                    self.topics.forget(t.name)  # the new count is learned at the next lookup
        elif entry.api_key == ApiKey.CREATE_TOPICS:
            for t in results:
                if t.error_code == 0 and getattr(t, "num_partitions", -1) > 0:
                    self.topics.put(t.name, t.num_partitions, getattr(t, "topic_id", None))
        else:
            for t in results:
                if t.error_code == 0 and t.name:
                    self.topics.forget(t.name)
        if isinstance(note, Charges):
            self._settle(entry, note, results)

    def _settle(self, entry: InFlight, charges: Charges, results: Sequence[Any]) -> None:
        """What the broker did, charged; what it refused, given back (only the topics it was sent)."""
        now = None
        for r in results:
            t = charges.topics.by_name.get(r.name) if r.name else None
            if t is None and getattr(r, "topic_id", None) is not None:
                t = charges.topics.by_id.get(r.topic_id)
            if t is None or t.answer is not None:
                continue
            done = checks.charged(entry.api_key, r.error_code)
            if t.charged and not done:
                amount, t.charged = t.charged, 0
                entry.mutations -= amount
                if charges.limited:
                    now = now or now_ms()
                    self.manager.unrecord(charges.user, charges.client_id, CONTROLLER_MUTATION_RATE, amount, now)
            elif (not t.charged and t.refusal is not None and r.error_code == 0
                  and entry.api_key == ApiKey.CREATE_TOPICS):
                # Created although Kafka would have refused it (a cache gone stale, a broker laxer
                # than Kafka): charged now, so the next request pays for it.
                created = getattr(r, "num_partitions", -1)
                amount = t.charged = created if created > 0 else (t.mutations or 0)
                entry.mutations += amount
                if charges.limited and amount:
                    now = now or now_ms()
                    self.manager.charge(charges.user, charges.client_id, CONTROLLER_MUTATION_RATE, amount, now)



def _keep_only(key: int, version: int, req: Any, admitted: list[Topic]) -> None:
    """``req`` without the topics refused."""
    items = [t.item for t in admitted]
    if key == ApiKey.DELETE_TOPICS and version < 6:
        req.topic_names = items
    else:
        req.topics = items


def _mark_charged(topics: Topics) -> None:
    """Permissive: every topic Kafka would not refuse charged its mutations."""
    for t in topics:
        if t.refusal is None:
            t.charged = t.mutations or 0


async def _charged_off_loop(topics: Topics, throttle: int) -> Forward | None:
    await off_loop(_mark_charged, topics)
    return Forward(throttle_ms=throttle) if throttle else None


async def _off_loop_answer(header: RequestHeader, topics: Topics, throttle: int) -> Answer:
    return Answer(await off_loop(answers.whole_answer, header, topics, throttle), throttle_ms=throttle)


async def _off_loop_forward(header: RequestHeader, frame: Frame, req: Any, entry: InFlight, topics: Topics,
                            admitted: list[Topic], throttle: int) -> Forward:
    """The request without the topics refused, made and encoded in the decode thread (and its
    answer merged there: see on_response)."""
    body = await off_loop(_kept_and_encoded, header.api_key, header.api_version, req, admitted)
    _MERGE.set(entry, (topics, throttle))
    return Forward(bytes(frame[: header.body_offset]) + body, throttle_ms=throttle)


def _kept_and_encoded(key: int, version: int, req: Any, admitted: list[Topic]) -> bytes:
    _keep_only(key, version, req, admitted)
    return encode_body(req)


def _encoded_answer(key: int, version: int, topics: Topics, upstream: Any, throttle: int) -> bytes:
    return encode_body(answers.response(key, version, topics, upstream, throttle))
