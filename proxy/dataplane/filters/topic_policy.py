"""A topic-name policy on CreateTopics: names starting with a reserved prefix are refused.

:class:`TopicPrefixPolicyFilter` answers clients as a broker with a CreateTopicPolicy (KIP-108)
that refuses those names would, without one configured on the broker. It is also the example
filter of docs/writing-a-filter.md, loaded through ``filters:`` by :func:`topic_prefix_policy`.

Guarantees:
- a topic whose name starts with a reserved prefix never reaches the broker in a CreateTopics
  request, at any version, ``validate_only`` or not (Kafka runs its policy on validation too);
- the client gets one result per topic name, in request order: POLICY_VIOLATION (44) with a
  message naming the prefix for a reserved name, the broker's own result for every other;
- a request without a reserved name is forwarded untouched (its very bytes); one with nothing
  but reserved names is answered by the proxy and never reaches the broker; a mixed one reaches
  the broker with the other topics only, and the refused ones are merged back into its response;
- a reserved name given more than once is answered INVALID_REQUEST "Duplicate topic name.", as
  Kafka answers a duplicate before any policy runs; other duplicates are the broker's to answer;
- a version the proxy cannot read (above kafka-python's) closes the connection (ProtocolError):
  nothing passes unchecked.

Where it differs from a broker policy: the proxy judges the name alone, before the broker's
checks, so a reserved name the broker would refuse for another reason (not authorized, not a
valid name, already there) is answered POLICY_VIOLATION all the same.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from protocol.apis import SPECS, ApiKey
from protocol.errors import INVALID_REQUEST, POLICY_VIOLATION
from protocol.headers import (
    RequestHeader,
    encode_response_header,
    response_body_offset,
    response_header_is_flexible,
)
from protocol.messages import decode_request, decode_response, encode_body
from proxy.cluster.offload import decode_request_off_loop, is_big
from proxy.dataplane.filters.api import Answer, Defer, FilterContext, FilterSpec, Forward, Frame
from proxy.dataplane.inflight import InFlight
from proxy.observability.logs import LogLimiter

log = logging.getLogger(__name__)
_refusals = LogLimiter(log)  # a client can send refused requests at will

DUPLICATE_MESSAGE = "Duplicate topic name."  # ControllerApis.createTopics
_ZERO_UUID = uuid.UUID(int=0)
_CREATE_TOPICS = ApiKey.CREATE_TOPICS


class TopicPrefixPolicyFilter:
    """Refuses to create topics whose names start with one of ``prefixes`` (see the module
    docstring). Keeps no state: one instance serves every connection."""

    spec = FilterSpec(request_keys=frozenset({ApiKey.CREATE_TOPICS}))

    def __init__(self, prefixes: Iterable[str]) -> None:
        self.prefixes = tuple(prefixes)
        if not self.prefixes or not all(isinstance(p, str) and p for p in self.prefixes):
            # An empty prefix would reserve every name: surely a configuration mistake.
            raise ValueError(f"prefixes must be non-empty strings, got {self.prefixes!r}")

    def reserved_prefix(self, name: str) -> str | None:
        """The first reserved prefix ``name`` starts with, or None."""
        for prefix in self.prefixes:
            if name.startswith(prefix):
                return prefix
        return None

    def on_request(self, ctx: FilterContext, header: RequestHeader, frame: Frame,
                   entry: InFlight) -> Answer | Forward | Defer | None:
        body = memoryview(frame)[header.body_offset :]
        if is_big(body):  # thousands of topics: decoded off the loop (proxy.cluster.offload)
            return Defer(self._decoded_off_loop(ctx, header, frame, body))
        return self._on_decoded(ctx, header, frame, decode_request(_CREATE_TOPICS, header.api_version, body))

    async def _decoded_off_loop(self, ctx: FilterContext, header: RequestHeader, frame: Frame,
                                body: memoryview) -> Answer | Forward | None:
        return self._on_decoded(ctx, header, frame, await decode_request_off_loop(_CREATE_TOPICS, header.api_version,
                                                                                  body))

    def _on_decoded(self, ctx: FilterContext, header: RequestHeader, frame: Frame, req: Any) -> Answer | Forward | None:
        version = header.api_version
        counts = Counter(t.name for t in req.topics)  # each name once, in request order
        refused: dict[str, tuple[int, str]] = {}  # name -> (error code, message)
        for name, n in counts.items():
            prefix = self.reserved_prefix(name)
            if prefix is None:
                continue
            # ControllerApis.createTopics answers a duplicated name before the policy runs;
            # ReplicationControlManager.maybeCheckCreateTopicPolicy answers POLICY_VIOLATION.
            refused[name] = ((INVALID_REQUEST, DUPLICATE_MESSAGE) if n > 1 else
                             (POLICY_VIOLATION, f"Topic name '{name}' starts with the reserved prefix '{prefix}'"))
        if not refused:
            return None
        _refusals.log(logging.INFO, "refused to create %d of %d topics for %s (principal=%s, client_id=%s): %s",
                      len(refused), len(counts), ctx.label, ctx.session.principal, header.client_id,
                      ", ".join(list(refused)[:5]))
        order = list(counts)
        if len(refused) == len(counts):
            cls = SPECS[_CREATE_TOPICS].response[version]
            # The connection writes the throttle of every quota into the answer (KIP-219).
            resp = cls(throttle_time_ms=0,
                       topics=[_refused_result(cls, name, *refused[name]) for name in order])
            head = encode_response_header(header.correlation_id, response_header_is_flexible(_CREATE_TOPICS, version))
            return Answer(head + encode_body(resp))
        req.topics = [t for t in req.topics if t.name not in refused]
        return Forward(bytes(frame[: header.body_offset]) + encode_body(req),
                       on_response=lambda response: _merge(version, response, order, refused))


def topic_prefix_policy(config: Mapping[str, Any]) -> TopicPrefixPolicyFilter:
    """The filter's factory, as ``filters:`` names it
    (``proxy.dataplane.filters.topic_policy:topic_prefix_policy``): ``config`` is
    ``{prefixes: [a list of reserved prefixes]}``. Raises ValueError for anything else."""
    unknown = sorted(str(key) for key in config if key != "prefixes")
    if unknown:
        raise ValueError(f"unknown key {', '.join(unknown)} (allowed: prefixes)")
    prefixes = config.get("prefixes")
    if not isinstance(prefixes, list):
        raise ValueError(f"prefixes must be a list of reserved topic name prefixes, got {prefixes!r}")
    return TopicPrefixPolicyFilter(prefixes)


def _merge(version: int, frame: Frame, order: list[str], refused: dict[str, tuple[int, str]]) -> bytes:
    """The broker's response with the refused topics put back: one result per name, in request
    order (a result for a name the request did not have is kept, at the end)."""
    offset = response_body_offset(frame, _CREATE_TOPICS, version)
    resp = decode_response(_CREATE_TOPICS, version, memoryview(frame)[offset:])
    cls = SPECS[_CREATE_TOPICS].response[version]
    from_broker: dict[str, list[Any]] = {}
    for result in resp.topics:
        from_broker.setdefault(result.name, []).append(result)
    topics: list[Any] = []
    for name in order:
        if name in refused:
            topics.append(_refused_result(cls, name, *refused[name]))
        else:
            topics.extend(from_broker.pop(name, ()))
    for rest in from_broker.values():
        topics.extend(rest)
    resp.topics = topics
    return bytes(frame[:offset]) + encode_body(resp)


def _refused_result(cls: Any, name: str, error_code: int, message: str) -> Any:
    # ReplicationControlManager.createTopics: a failed topic has its name, error code and
    # message; the rest keeps Kafka's defaults (-1, -1, no configs, zero topic id). Fields a
    # version lacks (the message before v1, the others before v5 / v7) are not encoded.
    return cls.CreatableTopicResult(name=name, error_code=error_code, error_message=message, num_partitions=-1,
                                    replication_factor=-1, configs=[], topic_id=_ZERO_UUID)
