"""KIP-599 controller mutation quota on CreateTopics, CreatePartitions and DeleteTopics.

Each topic is charged the partitions it creates or deletes: CreateTopics its NumPartitions,
else its assignments, else the broker's ``num.partitions``; CreatePartitions the new count
minus the current one; DeleteTopics the topic's partition count. ValidateOnly is never charged.

Strict versions (CreateTopics v6+, CreatePartitions v3+, DeleteTopics v5+) are checked topic
by topic in request order; admitted topics are forwarded in a rewritten request, rejected ones
are answered THROTTLING_QUOTA_EXCEEDED and merged back in the original order. Older versions
are permissive: everything is forwarded, the response carries the throttle and the client is
muted (Kafka's PermissiveControllerMutationQuota).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from protocol import errors
from protocol.apis import SPECS, STRICT_SINCE, ApiKey
from protocol.headers import encode_response_header, response_body_offset
from protocol.messages import decode_request, decode_response, encode_body
from quotas import CONTROLLER_MUTATION_RATE, QuotaManager

from ..refresh import fetch_num_partitions, fetch_topics
from .api import Answer, Defer, FilterSpec, Forward
from .quotas import now_ms
from .shadow import shadow_rejected, shadow_throttled

log = logging.getLogger(__name__)

VALIDATE_ONLY = object()
THROTTLED_MESSAGE = "The throttling quota has been exceeded."  # Kafka's Errors default message


@dataclass
class _Topic:
    item: object  # the request's entry for this topic
    name: str | None
    topic_id: object | None
    mutations: int | None = None  # None: not known yet


class ControllerMutationFilter:
    spec = FilterSpec(request_keys=frozenset(STRICT_SINCE), response_keys=frozenset(STRICT_SINCE))

    def __init__(self, manager: QuotaManager, topics, fallback_num_partitions: int, timeout_s: float,
                 count_all: bool = False) -> None:
        self.manager = manager
        self.topics = topics  # proxy.topics.TopicCache
        self.fallback_num_partitions = fallback_num_partitions
        self.timeout_s = timeout_s
        # The usage log counts partition mutations whether or not a quota applies.
        self.count_all = count_all

    # -- request side -----------------------------------------------------------------------

    def on_request(self, ctx, header, frame, entry):
        if header.body_offset < 0:
            return None
        req = decode_request(header.api_key, header.api_version, memoryview(frame)[header.body_offset :])
        if getattr(req, "validate_only", False):
            entry.note = VALIDATE_ONLY  # its response must not teach the topic cache anything
            return None  # KIP-599: validation is not a mutation
        user, client_id = ctx.session.principal, header.client_id or ""
        limited = self.manager.resolve(user, client_id, CONTROLLER_MUTATION_RATE) is not None
        if not limited and not self.count_all:
            return None
        topics = self._topics(header.api_key, header.api_version, req)
        if any(t.mutations is None for t in topics):
            return Defer(self._after_lookup(ctx, header, frame, req, entry, topics, limited))
        return self._decide(ctx, header, frame, req, entry, topics, limited)

    def _topics(self, key: int, version: int, req) -> list[_Topic]:
        out = []
        if key == ApiKey.CREATE_TOPICS:
            for t in req.topics:
                n = t.num_partitions if t.num_partitions != -1 else (len(t.assignments) or None)
                if n is None:
                    n = self.topics.num_partitions_default  # None until known: looked up first
                elif n < 0:
                    n = 0  # refused by the broker (INVALID_PARTITIONS); charged, it would give tokens back
                out.append(_Topic(t, t.name, None, n))
        elif key == ApiKey.CREATE_PARTITIONS:
            for t in req.topics:
                current = self.topics.count(t.name)
                out.append(_Topic(t, t.name, None, None if current is None else max(t.count - current, 0)))
        elif version >= 6:
            for t in req.topics:
                topic_id = t.topic_id if t.topic_id is not None and t.topic_id.int else None
                out.append(_Topic(t, t.name, topic_id, self.topics.count(t.name, topic_id)))
        else:
            for name in req.topic_names:
                out.append(_Topic(name, name, None, self.topics.count(name)))
        return out

    async def _after_lookup(self, ctx, header, frame, req, entry, topics, limited: bool):
        missing_names = [t.name for t in topics if t.mutations is None and t.name]
        missing_ids = [t.topic_id for t in topics if t.mutations is None and not t.name and t.topic_id]
        address = ctx.cluster.upstream_address(None, 0)
        try:
            if header.api_key == ApiKey.CREATE_TOPICS and self.topics.num_partitions_default is None:
                node_id = next(iter(ctx.cluster.brokers), 0)
                default = await fetch_num_partitions(ctx.cluster.dialer, address, node_id, self.timeout_s)
                self.topics.num_partitions_default = default
            elif missing_names or missing_ids:
                for t in await fetch_topics(ctx.cluster.dialer, address, missing_names, missing_ids, self.timeout_s):
                    if t.error_code == 0:
                        self.topics.put(t.name, len(t.partitions), getattr(t, "topic_id", None))
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            ctx.cluster.dialer.log_failure("partition_lookup", logging.WARNING, "cannot look up partition counts at "
                                           "%s:%d: %s", *address, exc or type(exc).__name__)
        if self.topics.num_partitions_default is None and header.api_key == ApiKey.CREATE_TOPICS:
            self.topics.num_partitions_default = self.fallback_num_partitions
        refreshed = self._topics(header.api_key, header.api_version, req)
        for t in refreshed:
            if t.mutations is None:
                # A topic the broker does not know deletes nothing; a CreatePartitions on it fails.
                t.mutations = 0
        return self._decide(ctx, header, frame, req, entry, refreshed, limited)

    def _decide(self, ctx, header, frame, req, entry, topics: list[_Topic], limited: bool = True):
        entry.mutations = sum(t.mutations for t in topics)
        if not limited:
            return None
        user, client_id = ctx.session.principal, header.client_id or ""
        now = now_ms()
        if header.api_version < STRICT_SINCE[header.api_key]:
            if entry.mutations:
                decision = self.manager.record(user, client_id, CONTROLLER_MUTATION_RATE, entry.mutations, now)
                if decision.throttle_ms:
                    if decision.shadow:
                        shadow_throttled(ctx, entry, CONTROLLER_MUTATION_RATE, decision.throttle_ms)
                        return None
                    return Forward(throttle_ms=decision.throttle_ms)
            return None
        admitted, rejected, throttle = [], [], 0
        shadow_refused, shadow_throttle = 0, 0
        for t in topics:
            if t.mutations == 0:
                admitted.append(t)
                continue
            decision = self.manager.try_admit(user, client_id, CONTROLLER_MUTATION_RATE, t.mutations, now)
            if decision.admitted:
                admitted.append(t)
            elif decision.shadow:
                admitted.append(t)
                shadow_refused += 1
                shadow_throttle = max(shadow_throttle, decision.throttle_ms)
            else:
                rejected.append(t)
                throttle = max(throttle, decision.throttle_ms)
        if shadow_refused:
            shadow_rejected(ctx, entry, CONTROLLER_MUTATION_RATE, shadow_throttle,
                            f"{shadow_refused} of {len(topics)} topics")
        if not rejected:
            return None  # StrictControllerMutationQuota: no rejection, no throttle
        entry.rejected = True
        if not admitted:
            body = encode_body(self._response(header.api_key, header.api_version, topics, None, throttle))
            flexible = SPECS[header.api_key].is_flexible(header.api_version)
            return Answer(encode_response_header(header.correlation_id, flexible) + body, throttle_ms=throttle)
        self._keep_only(header.api_key, header.api_version, req, admitted)
        return Forward(bytes(frame[: header.body_offset]) + encode_body(req), throttle_ms=throttle,
                       on_response=lambda response_frame: self._merge(entry, response_frame, topics, throttle))

    # -- response side: keep the partition counts current -----------------------------------

    def on_response(self, ctx, entry, frame):
        if entry.note is VALIDATE_ONLY:
            return frame
        offset = response_body_offset(frame, entry.api_key, entry.api_version)
        resp = decode_response(entry.api_key, entry.api_version, memoryview(frame)[offset:])
        if entry.api_key == ApiKey.CREATE_PARTITIONS:
            for t in resp.results:
                if t.error_code == 0:
                    self.topics.forget(t.name)  # the new count is learned at the next lookup
        elif entry.api_key == ApiKey.CREATE_TOPICS:
            for t in resp.topics:
                if t.error_code == 0 and getattr(t, "num_partitions", -1) > 0:
                    self.topics.put(t.name, t.num_partitions, getattr(t, "topic_id", None))
        else:
            for t in resp.responses:
                if t.error_code == 0 and t.name:
                    self.topics.forget(t.name)
        return frame

    # -- rewriting --------------------------------------------------------------------------

    @staticmethod
    def _keep_only(key: int, version: int, req, admitted: list[_Topic]) -> None:
        items = [t.item for t in admitted]
        if key == ApiKey.DELETE_TOPICS and version < 6:
            req.topic_names = items
        else:
            req.topics = items

    def _merge(self, entry, frame, topics: list[_Topic], throttle: int):
        offset = response_body_offset(frame, entry.api_key, entry.api_version)
        resp = decode_response(entry.api_key, entry.api_version, memoryview(frame)[offset:])
        merged = self._response(entry.api_key, entry.api_version, topics, resp, throttle)
        return bytes(frame[:offset]) + encode_body(merged)

    def _response(self, key: int, version: int, topics: list[_Topic], upstream, throttle: int):
        """The response in the request's topic order: the broker's result for admitted topics,
        THROTTLING_QUOTA_EXCEEDED for the others."""
        cls = SPECS[key].response[version]
        results_attr = {ApiKey.CREATE_TOPICS: "topics", ApiKey.CREATE_PARTITIONS: "results",
                        ApiKey.DELETE_TOPICS: "responses"}[key]
        by_name, by_id = {}, {}
        for r in getattr(upstream, results_attr, None) or ():
            if r.name:
                by_name[r.name] = r
            if getattr(r, "topic_id", None) is not None:
                by_id[r.topic_id] = r
        results = []
        for t in topics:
            found = by_name.get(t.name) if t.name else None
            if found is None and t.topic_id is not None:
                found = by_id.get(t.topic_id)
            results.append(found if found is not None else self._rejected(key, version, t))
        broker_throttle = upstream.throttle_time_ms if upstream is not None else 0
        resp = cls(throttle_time_ms=max(broker_throttle, throttle))
        setattr(resp, results_attr, results)
        return resp

    @staticmethod
    def _rejected(key: int, version: int, t: _Topic):
        cls = SPECS[key].response[version]
        if key == ApiKey.CREATE_TOPICS:
            return cls.CreatableTopicResult(
                name=t.name, error_code=errors.THROTTLING_QUOTA_EXCEEDED, error_message=THROTTLED_MESSAGE,
                num_partitions=-1, replication_factor=-1, configs=None,
            )
        if key == ApiKey.CREATE_PARTITIONS:
            return cls.CreatePartitionsTopicResult(
                name=t.name, error_code=errors.THROTTLING_QUOTA_EXCEEDED, error_message=THROTTLED_MESSAGE
            )
        result = cls.DeletableTopicResult(
            name=t.name, error_code=errors.THROTTLING_QUOTA_EXCEEDED, error_message=THROTTLED_MESSAGE
        )
        if t.topic_id is not None:
            result.topic_id = t.topic_id
        return result
