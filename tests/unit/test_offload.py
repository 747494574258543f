"""proxy.cluster.offload: a body over OFFLOAD_BYTES is decoded in the decode thread, the filter
that needs it waits (Defer / Hold) and then decides exactly as it would have on the loop."""

from __future__ import annotations

import asyncio
import threading
import uuid
from types import SimpleNamespace

import pytest
from kafka.protocol.admin import CreateTopicsResponse, DeleteTopicsRequest, DeleteTopicsResponse
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
from tests.support.off_loop import record_off_loop
from tests.support.wire import request_bytes


def _find_coordinator_frame(groups: int) -> bytes:
    R = FindCoordinatorResponse
    coordinators = [make(R.Coordinator, 4, key=f"group-{i}", node_id=1 + i % 3, host=f"b{1 + i % 3}.internal",
                         port=9092, error_code=0, error_message=None) for i in range(groups)]
    return encode_response_header(5, True) + encode_body(make(R, 4, throttle_time_ms=0, coordinators=coordinators))


def _rewrite(frame: bytes, advertised: list | None = None):
    def advertise(n: int, h: str, p: int) -> tuple[str, int]:
        if advertised is not None:
            advertised.append((n, h, p))
        return "proxy.example", 20000 + n

    ctx = filter_context(cluster=SimpleNamespace(brokers={}, advertise=advertise))
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
    import proxy.dataplane.filters.endpoints as module
    worked = record_off_loop(monkeypatch, module)
    advertised: list = []
    held = _rewrite(frame, advertised)
    assert isinstance(held, Hold)

    async def resolve():
        return await held.frame, threading.get_ident()

    out, loop_thread = asyncio.run(resolve())
    assert decoded_in and loop_thread not in decoded_in
    # 5,000 coordinators on three brokers: three addresses advertised on the loop, the entries
    # rewritten in the decode thread.
    assert sorted(advertised) == [(n, f"b{n}.internal", 9092) for n in (1, 2, 3)]
    assert worked == ["_addresses", "_rewritten"]
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

    code = ("import gc; from proxy.app.heap import freeze_start_up_heap; before = gc.get_freeze_count(); "
            "freeze_start_up_heap(); print(before, gc.get_freeze_count() > 1000)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0", "True"]


def test_a_big_request_refused_whole_is_read_and_answered_in_the_decode_thread_as_on_the_loop(monkeypatch):
    """A principal in debt sends DeleteTopics v6 of 5,000 topics (strict, KIP-599): the proxy
    answers every topic THROTTLING_QUOTA_EXCEEDED itself. Read and answered in the decode thread,
    the answer is the very bytes the loop makes."""
    import proxy.dataplane.filters.controller_mutation as module
    from protocol.headers import response_body_offset
    from protocol.messages import decode_response
    from quotas import QuotaRule
    from tests.support.filter_context import unreachable_cluster

    names = [f"topic-{i}" for i in range(5_000)]
    frame = _delete_topics_frame(names)
    header = parse_request_header(frame)
    cache = TopicCache()
    for n in names:
        cache.put(n, 3)
    worked = record_off_loop(monkeypatch, module)
    monkeypatch.setattr(module, "now_ms", lambda: 1_000_000)  # the same throttle both times

    async def decide() -> tuple[object, SimpleNamespace]:
        manager = QuotaManager([QuotaRule("alice", None, {"controller_mutation_rate": 1.0})])
        manager.charge("alice", header.client_id or "", "controller_mutation_rate", 100, module.now_ms())  # in debt
        f = ControllerMutationFilter(manager, cache, fallback_num_partitions=1, timeout_s=1.0)
        entry = SimpleNamespace(mutations=0, notes={}, throttle_ms=0, rejected=False)
        entry.throttle = lambda ms: None
        decision = f.on_request(filter_context(principal="alice", cluster=unreachable_cluster()), header, frame, entry)
        while isinstance(decision, Defer):  # decoded, then the lookup before refusing (fails here)
            decision = await decision.decision
        return decision, entry

    off, entry = asyncio.run(decide())
    assert worked == ["_read", "_topics", "_looked_up", "whole_answer"]
    monkeypatch.setattr(offload, "OFFLOAD_BYTES", 1 << 30)
    monkeypatch.setattr(module, "BIG_TOPICS", 1 << 30)
    worked.clear()
    on_loop, _ = asyncio.run(decide())
    assert worked == [] and type(off) is type(on_loop) is module.Answer
    assert off.frame == on_loop.frame and off.throttle_ms == on_loop.throttle_ms > 0 and entry.rejected
    resp = decode_response(ApiKey.DELETE_TOPICS, 6, memoryview(off.frame)[response_body_offset(off.frame, 20, 6):])
    assert [r.name for r in resp.responses] == names and {r.error_code for r in resp.responses} == {89}


def test_a_big_answer_is_learned_a_slice_at_a_time_with_the_loop_running_between():
    from kafka.protocol.admin import DeleteTopicsResponse

    names = [f"topic-{i}" for i in range(3_500)]
    R = DeleteTopicsResponse[6]
    body = encode_body(R(throttle_time_ms=0, responses=[
        R.DeletableTopicResult(name=n, topic_id=uuid.UUID(int=i + 1), error_code=0, error_message=None)
        for i, n in enumerate(names)]))
    frame = encode_response_header(7, True) + body
    assert offload.is_big(body)
    cache = TopicCache()
    for n in names:
        cache.put(n, 3)
    f = ControllerMutationFilter(QuotaManager(), cache, fallback_num_partitions=1, timeout_s=1.0)
    entry = SimpleNamespace(api_key=int(ApiKey.DELETE_TOPICS), api_version=6, notes={})
    known: list[int] = []

    async def go() -> object:
        async def other() -> None:  # another client's work: it runs between the slices
            while True:
                known.append(len(cache.partitions))
                await asyncio.sleep(0)

        task = asyncio.create_task(other())
        held = f.on_response(filter_context(principal="alice"), entry, frame)
        assert isinstance(held, Hold)
        out = await held.frame
        task.cancel()
        return out

    assert asyncio.run(go()) == frame
    assert all(cache.count(n) is None for n in names)  # deleted: forgotten
    slices = sorted({k for k in known if 0 < k < len(names)}, reverse=True)
    assert slices == [2_500, 1_500, 500]  # 1,000 topics a slice


_FAULTS_OF_BIG_BLOCKS = """
import resource, sys
if sys.argv[1] == "tuned":
    from proxy.app.heap import tune_malloc
    tune_malloc()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(20):  # frames of a few MB joined and dropped, as a Fetch response the filters see whole
    blocks = [b"\\x01" * ((5 << 20) + i) for _ in range(3)]
    del blocks
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="glibc's mallopt")
def test_big_blocks_come_from_the_heap_once_tuned_not_faulted_in_from_the_kernel_each_time():
    import subprocess
    import sys

    def faults(how: str) -> int:
        run = subprocess.run([sys.executable, "-c", _FAULTS_OF_BIG_BLOCKS, how], capture_output=True, text=True,
                             check=True)
        return int(run.stdout)

    pages = 3 * (5 << 20) // 4096  # what the first round faults in, once
    assert faults("tuned") < 2 * pages < 4 * pages < faults("default")  # default: 8-14 times, as measured


def test_a_big_strict_decision_is_made_a_slice_at_a_time_and_forwards_what_the_loop_would(monkeypatch):
    """DeleteTopics v6 of 2,500 topics of one partition from a principal whose
    controller_mutation_rate lets about 1,100 through (KIP-599, strict): the first are charged
    and forwarded, the rest refused THROTTLING_QUOTA_EXCEEDED. Decided 1,000 topics at a time
    (another task of the loop sees the tokens fall in between) and the request re-encoded without
    the refused topics in the decode thread: the very frame the loop's own path forwards."""
    import proxy.dataplane.filters.controller_mutation as module
    from quotas import QuotaRule
    from tests.support.filter_context import unreachable_cluster

    names = [f"topic-{i}" for i in range(2_500)]
    frame = _delete_topics_frame(names)
    header = parse_request_header(frame)
    monkeypatch.setattr(module, "now_ms", lambda: 1_000_000)
    worked = record_off_loop(monkeypatch, module)

    async def decide() -> tuple[object, SimpleNamespace, set[float], bytes]:
        manager = QuotaManager([QuotaRule("alice", None, {"controller_mutation_rate": 100.0})])
        cache = TopicCache()  # each run its own: an answer makes the cache forget deleted topics
        for n in names:
            cache.put(n, 1)
        client_id = header.client_id or ""
        f = ControllerMutationFilter(manager, cache, fallback_num_partitions=1, timeout_s=1.0)
        entry = SimpleNamespace(mutations=0, notes={}, throttle_ms=0, rejected=False, api_key=ApiKey.DELETE_TOPICS,
                                api_version=6)
        entry.throttle = lambda ms: None
        seen: set[float] = set()

        async def other() -> None:  # another client's turn of the loop: what the tokens are now
            while True:
                seen.add(manager.tokens("alice", client_id, "controller_mutation_rate", 1_000_000) or 0.0)
                await asyncio.sleep(0)

        task = asyncio.create_task(other())
        ctx = filter_context(principal="alice", cluster=unreachable_cluster())
        decision = f.on_request(ctx, header, frame, entry)
        while isinstance(decision, Defer):
            decision = await decision.decision
        task.cancel()
        forwarded = DeleteTopicsRequest[6].decode(memoryview(decision.frame)[header.body_offset:]).topics
        R = DeleteTopicsResponse[6]
        response = encode_response_header(9, True) + encode_body(R(throttle_time_ms=0, responses=[
            R.DeletableTopicResult(name=t.name, topic_id=uuid.UUID(int=1), error_code=0, error_message=None)
            for t in forwarded]))
        answer = f.on_response(ctx, entry, response)
        if isinstance(answer, Hold):
            answer = await answer.frame
        if decision.on_response is not None:
            answer = decision.on_response(answer)
        return decision, entry, seen, bytes(answer)

    sliced, entry, seen, sliced_answer = asyncio.run(decide())
    assert "_kept_and_encoded" in worked and "_encoded_answer" in worked  # the answer merged off the loop too
    assert any(0 < tokens < 1_000 for tokens in seen)  # seen after 1,000 topics were charged, before the rest
    monkeypatch.setattr(offload, "OFFLOAD_BYTES", 1 << 30)
    monkeypatch.setattr(module, "BIG_TOPICS", 1 << 30)
    on_loop, on_loop_entry, _, on_loop_answer = asyncio.run(decide())
    assert type(sliced) is type(on_loop) is module.Forward
    assert sliced.frame == on_loop.frame and sliced.throttle_ms == on_loop.throttle_ms > 0
    # The client's answer: the broker's results for the topics forwarded, the proxy's for the rest.
    assert sliced_answer == on_loop_answer
    merged = DeleteTopicsResponse[6].decode(memoryview(sliced_answer)[5:])
    assert [r.name for r in merged.responses] == names
    assert {r.error_code for r in merged.responses} == {0, 89}  # THROTTLING_QUOTA_EXCEEDED
    assert entry.mutations == on_loop_entry.mutations and entry.rejected and on_loop_entry.rejected
    forwarded = [t.name for t in DeleteTopicsRequest[6].decode(memoryview(sliced.frame)[header.body_offset:]).topics]
    assert 1_000 < len(forwarded) < 1_200 and forwarded == names[: len(forwarded)]
