"""proxy.cluster.offload: a body over OFFLOAD_BYTES is decoded in the decode thread, the filter
that needs it waits (Defer / Hold) and then decides exactly as it would have on the loop."""

from __future__ import annotations

import asyncio
import threading
import uuid
from types import SimpleNamespace

import pytest
from kafka.protocol.admin import CreateTopicsResponse, DeleteTopicsRequest
from kafka.protocol.metadata import FindCoordinatorResponse

import protocol.messages as messages
from protocol.apis import ApiKey
from protocol.headers import encode_response_header, parse_request_header
from protocol.messages import encode_body
from proxy.cluster import offload
from proxy.cluster.topics import TopicCache
from proxy.dataplane.filters.api import Defer, Hold
from proxy.dataplane.filters.controller_mutation import ControllerMutationFilter
from proxy.dataplane.filters.endpoints import EndpointRewriteFilter
from quotas import QuotaManager
from tests.support.filter_context import filter_context
from tests.support.kafka_messages import make
from tests.support.wire import request_bytes


def _find_coordinator_frame(groups: int) -> bytes:
    R = FindCoordinatorResponse
    coordinators = [make(R.Coordinator, 4, key=f"group-{i}", node_id=1 + i % 3, host=f"b{1 + i % 3}.internal",
                         port=9092, error_code=0, error_message=None) for i in range(groups)]
    return encode_response_header(5, True) + encode_body(make(R, 4, throttle_time_ms=0, coordinators=coordinators))


def _rewrite(frame: bytes):
    ctx = filter_context(cluster=SimpleNamespace(brokers={}, advertise=lambda n, h, p: ("proxy.example", 20000 + n)))
    entry = SimpleNamespace(api_key=ApiKey.FIND_COORDINATOR, api_version=4, scan=None)
    return EndpointRewriteFilter().on_response(ctx, entry, frame)


def test_a_big_response_is_rewritten_off_the_loop_into_the_same_bytes(monkeypatch):
    frame = _find_coordinator_frame(5_000)
    assert offload.is_big(memoryview(frame)[5:])
    decoded_in: set[int] = set()
    decode = messages.decode_response

    def recording(*args):
        decoded_in.add(threading.get_ident())
        return decode(*args)

    monkeypatch.setattr(offload, "decode_response", recording)
    held = _rewrite(frame)
    assert isinstance(held, Hold)

    async def resolve():
        return await held.frame, threading.get_ident()

    out, loop_thread = asyncio.run(resolve())
    assert decoded_in and loop_thread not in decoded_in
    monkeypatch.setattr(offload, "OFFLOAD_BYTES", 1 << 30)  # the same frame, on the loop
    on_loop = _rewrite(frame)
    assert isinstance(on_loop, bytes) and out == on_loop and b".internal" not in out


def _delete_topics_frame(names: list[str]) -> bytes:
    T = DeleteTopicsRequest[6].DeleteTopicState
    request = DeleteTopicsRequest[6](topics=[T(name=n, topic_id=uuid.UUID(int=0)) for n in names], timeout_ms=1000)
    return request_bytes(request, 9)[4:]


@pytest.mark.parametrize("topics", [20_000])
def test_a_big_request_is_decided_after_decoding_off_the_loop_as_on_it(monkeypatch, topics):
    names = [f"topic-{i}" for i in range(topics)]
    frame = _delete_topics_frame(names)
    header = parse_request_header(frame)
    assert offload.is_big(memoryview(frame)[header.body_offset :])
    cache = TopicCache()
    for n in names:
        cache.put(n, 3)
    manager = QuotaManager()

    def decide():
        f = ControllerMutationFilter(manager, cache, fallback_num_partitions=1, timeout_s=1.0, count_all=True)
        entry = SimpleNamespace(mutations=0, notes={}, throttle_ms=0)
        entry.throttle = lambda ms: None
        return f.on_request(filter_context(principal="alice"), header, frame, entry), entry

    async def off_the_loop():
        decision, entry = decide()
        assert isinstance(decision, Defer)
        return await decision.decision, entry

    decided, entry = asyncio.run(off_the_loop())
    monkeypatch.setattr(offload, "OFFLOAD_BYTES", 1 << 30)
    on_loop, on_loop_entry = decide()
    assert type(decided) is type(on_loop) and entry.mutations == on_loop_entry.mutations == 3 * topics


def test_the_tagged_field_budget_is_each_threads_own():
    """A decode in the decode thread and one on the loop at the same time each count only what
    they copy: what one thread spends is not taken from the other's budget."""
    messages._tagged_copies.budget_bytes = 123.0
    seen: list[float] = []

    def other() -> None:
        seen.append(messages._tagged_copies.budget_bytes)  # a thread starts uncounted
        messages._tagged_copies.budget_bytes = -1.0

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == [float("inf")] and messages._tagged_copies.budget_bytes == 123.0
    messages._tagged_copies.budget_bytes = float("inf")


def test_a_decode_outside_the_proxys_own_is_not_counted():
    """kafka-python's own clients (the demo's, in the proxy's process) decode with the same
    generated decoders: a response with tagged fields decodes in any thread, before and after
    a decode of the proxy's."""
    body = bytes.fromhex("00000000" "02" "0764656d6f2d78" + "a2" * 16 + "0000" "00" "00000003" "0001" "01"
                         "01" "00" "02" "0000" "00")  # CreateTopics v7: one topic, a tagged field
    decoded: list[object] = []

    def client() -> None:
        decoded.append(CreateTopicsResponse[7].decode(body).topics[0].num_partitions)

    for _ in range(2):
        t = threading.Thread(target=client)
        t.start()
        t.join()
        messages.decode_response(ApiKey.CREATE_TOPICS, 7, body)  # the proxy's own, counted
    client()
    assert decoded == [3, 3, 3]


def test_work_in_the_decode_thread_runs_with_the_cyclic_collector_off_and_leaves_it_as_it_was():
    import gc

    async def go() -> list[bool]:
        during = await offload.off_loop(gc.isenabled)
        after = gc.isenabled()
        gc.disable()  # off for the whole process (an embedding application's choice): left off
        try:
            during_off = await offload.off_loop(gc.isenabled)
            return [during, after, during_off, gc.isenabled()]
        finally:
            gc.enable()

    assert gc.isenabled()
    assert asyncio.run(go()) == [False, True, False, False]


def test_start_up_heap_is_frozen_out_of_full_collections():
    import subprocess
    import sys

    code = ("import gc; from proxy.cluster.offload import freeze_start_up_heap; before = gc.get_freeze_count(); "
            "freeze_start_up_heap(); print(before, gc.get_freeze_count() > 1000)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0", "True"]
