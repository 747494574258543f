"""The answers the controller-mutation filter makes itself (proxy.dataplane.filters.controller_mutation).

Guarantees: an answer lists the request's topics in the request's order, a duplicate once (as
Kafka's ControllerApis answers it, INVALID_REQUEST); a topic the proxy decided is answered its
refusal (THROTTLING_QUOTA_EXCEEDED, or Kafka's own refusal while in debt), a topic it forwarded
the broker's result. Pure functions of their arguments: the decode thread may run them.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, Protocol

from protocol import errors
from protocol.apis import SPECS, ApiKey
from protocol.headers import RequestHeader, encode_response_header, response_body_offset
from protocol.messages import decode_response, encode_body
from proxy.dataplane.filters.mutation_checks import Refusal
from proxy.dataplane.inflight import Frame, InFlight

THROTTLED_MESSAGE = "The throttling quota has been exceeded."  # Kafka's Errors default message
# The name of each response's array of per-topic results.
RESULTS: dict[int, str] = {ApiKey.CREATE_TOPICS: "topics", ApiKey.CREATE_PARTITIONS: "results",
                           ApiKey.DELETE_TOPICS: "responses"}


class Answerable(Protocol):
    """What an answer reads of one of the request's topics."""

    @property
    def name(self) -> str | None: ...

    @property
    def topic_id(self) -> uuid.UUID | None: ...

    @property
    def answer(self) -> Refusal | None: ...  # None: forwarded, the broker answers it


def whole_answer(header: RequestHeader, topics: Sequence[Answerable], throttle: int) -> bytes:
    """The proxy's answer to a request none of whose topics is forwarded."""
    body = encode_body(response(header.api_key, header.api_version, topics, None, throttle))
    return encode_response_header(header.correlation_id, SPECS[header.api_key].is_flexible(header.api_version)) + body


def merged(entry: InFlight, frame: Frame, topics: Sequence[Answerable], throttle: int) -> bytes:
    """The broker's answer to the topics forwarded, with the proxy's answers to the others."""
    offset = response_body_offset(frame, entry.api_key, entry.api_version)
    resp = decode_response(entry.api_key, entry.api_version, memoryview(frame)[offset:])
    return bytes(frame[:offset]) + encode_body(response(entry.api_key, entry.api_version, topics, resp, throttle))


def response(key: int, version: int, topics: Sequence[Answerable], upstream: Any, throttle: int) -> Any:
    """The response in the request's topic order: the broker's result for forwarded topics,
    the proxy's answer for the others."""
    cls = SPECS[key].response[version]
    results_attr = RESULTS[key]
    by_name: dict[str, Any] = {}
    by_id: dict[uuid.UUID, Any] = {}
    for r in getattr(upstream, results_attr, None) or ():
        if r.name:
            by_name[r.name] = r
        if getattr(r, "topic_id", None) is not None:
            by_id[r.topic_id] = r
    results: list[Any] = []
    seen: set[str | uuid.UUID | None] = set()
    for t in topics:
        if (t.name or t.topic_id) in seen:
            continue  # ControllerApis answers a duplicate once (INVALID_REQUEST)
        seen.add(t.name or t.topic_id)
        found = None
        if t.answer is None:
            found = by_name.get(t.name) if t.name else None
            if found is None and t.topic_id is not None:
                found = by_id.get(t.topic_id)
        results.append(found if found is not None else _answered(key, version, t))
    broker_throttle = upstream.throttle_time_ms if upstream is not None else 0
    resp = cls(throttle_time_ms=max(broker_throttle, throttle))
    setattr(resp, results_attr, results)
    return resp


def _answered(key: int, version: int, t: Answerable) -> Any:
    code, message = t.answer or (errors.THROTTLING_QUOTA_EXCEEDED, THROTTLED_MESSAGE)
    cls = SPECS[key].response[version]
    if key == ApiKey.CREATE_TOPICS:
        return cls.CreatableTopicResult(
            name=t.name, error_code=code, error_message=message,
            num_partitions=-1, replication_factor=-1, configs=None,
        )
    if key == ApiKey.CREATE_PARTITIONS:
        return cls.CreatePartitionsTopicResult(name=t.name, error_code=code, error_message=message)
    result = cls.DeletableTopicResult(name=t.name, error_code=code, error_message=message)
    if t.topic_id is not None:
        result.topic_id = t.topic_id
    return result
