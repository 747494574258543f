"""The producer-id filter (KIP-936) and the rate-limiter filter (KIP-731) on real frames, with a
fake clock and a stand-in connection (these filters read only its principal, label and stats)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.headers import parse_request_header, response_body_offset
from protocol.messages import decode_response
from proxy.dataplane.filters.api import Answer, Close, Defer, Forward
from proxy.dataplane.filters.limiters import RateLimiterFilter
from proxy.dataplane.filters.producer_ids import ProducerIdQuotaFilter
from proxy.dataplane.inflight import InFlight
from quotas import QuotaManager, QuotaRule
from quotas.limiters import LimiterContext, RateLimiter, RecordRateLimiter, Usage
from quotas.producer_ids import ProducerIdQuotaManager, ProducerIdSettings
from tests.support.filter_context import filter_context
from tests.unit.test_records import batch, fetch_frame, produce_frame


class Clock:
    def __init__(self) -> None:
        self.ms = 1_000_000

    def __call__(self) -> int:
        return self.ms


def conn(user: str = "alice"):
    return filter_context(user)


def request(frame: bytes):
    header = parse_request_header(frame)
    return header, InFlight(header.correlation_id, header.api_key, header.api_version, 0.0)


def pid_frame(pid: int, version: int = 9, acks: int = -1) -> bytes:
    return produce_frame(version, {"orders": {0: batch(2, pid=pid, epoch=0, seq=0),
                                              1: batch(1, pid=pid, epoch=0, seq=0)}},
                         acks=acks)


def pid_filter(quota: float, reaction: str = "reject", window_s: float = 10.0):
    clock = Clock()
    manager = ProducerIdQuotaManager([QuotaRule("alice", None, {"producer_ids_rate": quota})],
                                     ProducerIdSettings(window_size_s=window_s))
    return ProducerIdQuotaFilter(manager, reaction, clock), clock


@pytest.mark.parametrize("version", [3, 9, 11])
def test_a_new_producer_id_over_the_quota_is_rejected_on_every_partition(version):
    f, clock = pid_filter(2)
    c = conn()
    for pid in (1, 2, 1, 2):  # two new ids, then the same two again: all admitted
        header, entry = request(pid_frame(pid, version))
        assert f.on_request(c, header, pid_frame(pid, version), entry) is None
    frame = pid_frame(3, version)
    header, entry = request(frame)
    decision = f.on_request(c, header, frame, entry)
    assert isinstance(decision, Answer)
    # 2 new ids per 10 s window, both spent at the same instant: the first token is back one
    # window later (rounded up to the end of its 10 s / 256 slot).
    throttle = decision.throttle_ms  # the throttle is part of the decision, and in the answer
    assert 10_000 <= throttle <= 10_000 + 10_000 // 256
    body = memoryview(decision.frame)[response_body_offset(decision.frame, 0, version):]
    resp = decode_response(0, version, body)
    assert resp.throttle_time_ms == throttle
    assert [(t.name, [(p.index, p.error_code, p.base_offset) for p in t.partition_responses])
            for t in resp.responses] == [
        ("orders", [(0, 89, -1), (1, 89, -1)])]
    assert int.from_bytes(decision.frame[:4], "big") == header.correlation_id
    # Nothing was remembered: after the throttle the same id is admitted, as new.
    clock.ms += throttle - 1
    assert isinstance(f.on_request(c, header, frame, request(frame)[1]), Answer)
    clock.ms += 1
    assert f.on_request(c, header, frame, request(frame)[1]) is None
    assert f.manager.new_ids_total == 3


def test_other_users_and_ids_already_seen_are_not_charged():
    f, _ = pid_filter(1)
    assert f.on_request(conn(), *_args(pid_frame(1))) is None
    assert f.on_request(conn(), *_args(pid_frame(1))) is None
    assert f.on_request(conn("bob"), *_args(pid_frame(2))) is None  # no rule for bob
    assert isinstance(f.on_request(conn(), *_args(pid_frame(2))), Answer)


def _args(frame):
    header, entry = request(frame)
    return header, frame, entry


def test_acks_0_over_the_quota_closes_the_connection():
    f, _ = pid_filter(1)
    assert f.on_request(conn(), *_args(pid_frame(1, acks=0))) is None
    assert isinstance(f.on_request(conn(), *_args(pid_frame(2, acks=0))), Close)


def test_no_producer_id_and_no_rule_cost_nothing():
    f, _ = pid_filter(1)
    plain = produce_frame(9, {"t": {0: batch(3)}})
    for _ in range(3):
        assert f.on_request(conn(), *_args(plain)) is None
    assert f.manager.tracked_users == 0


def test_delay_holds_the_request_until_a_token_is_there():
    f, clock = pid_filter(1, "delay", window_s=0.2)
    assert f.on_request(conn(), *_args(pid_frame(1))) is None
    decision = f.on_request(conn(), *_args(pid_frame(2)))
    assert isinstance(decision, Defer)

    async def advance_and_wait():
        task = asyncio.ensure_future(decision.decision)
        await asyncio.sleep(0.05)
        assert not task.done()  # the fake clock has not moved: still no token
        clock.ms += 201  # a window (and a slot) after the first id was admitted
        return await asyncio.wait_for(task, 2)

    assert asyncio.run(advance_and_wait()) is None
    assert f.manager.new_ids_total == 2 and f.delayed_total == 1


def test_unreadable_records_are_forwarded_uncharged_and_counted():
    f, _ = pid_filter(1)
    # A batch one byte shorter than its length says: the record set no longer adds up.
    frame = produce_frame(9, {"t": {0: batch(1, pid=1, epoch=0, seq=0)[:-1]}})
    c = conn()
    header, entry = request(frame)
    assert f.on_request(c, header, frame, entry) is None
    assert c.stats.records_scan_failures["Produce"] == 1


class Fixed(RateLimiter):
    def __init__(self, ms: int) -> None:
        self.ms = ms
        self.seen: list[Usage] = []

    def accumulate(self, usage, now_ms):
        self.seen.append(usage)

    def throttle_ms(self, usage, now_ms):
        return self.ms


class Broken(RateLimiter):
    def accumulate(self, usage, now_ms):
        raise RuntimeError("plug-in bug")

    def throttle_ms(self, usage, now_ms):
        return 10_000


def test_the_longest_throttle_of_all_limiters_applies_once():
    a, b = Fixed(100), Fixed(300)
    f = RateLimiterFilter([a, b, Broken()], Clock())
    frame = pid_frame(7)
    header, entry = request(frame)
    entry.throttle(50)  # what the byte quotas asked for
    decision = f.on_request(conn(), header, frame, entry)
    assert decision == Forward(throttle_ms=300)  # the longest of the limiters'
    entry.throttle(decision.throttle_ms)  # as the connection applies a decision
    assert entry.throttle_ms == 300
    assert a.seen == [Usage("alice", "golden", 0, 9, len(frame), 2, 3)]
    assert f.failures == {"Broken": 1}


def test_record_rate_limiter_counts_produced_and_fetched_records():
    manager = QuotaManager([QuotaRule(None, "golden", {"producer_record_rate": 10, "consumer_record_rate": 4})],
                           quota_window_num=2)
    rules = manager.rules
    limiter = RecordRateLimiter()
    limiter.configure(LimiterContext(rules, 2, 1, manager))
    assert limiter.api_keys == frozenset({0}) and limiter.fetch_responses
    clock = Clock()
    f = RateLimiterFilter([limiter], clock)
    frame = produce_frame(9, {"t": {0: batch(30)}})
    header, entry = request(frame)
    # 30 records against 10/s over a 1 s window minimum: (30 − 10) / 10 × 1000 ms.
    assert f.on_request(conn(), header, frame, entry) == Forward(throttle_ms=2000)
    fetched = fetch_frame(12, batch(6) + batch(6))
    c = conn()
    c.session.client_id = "golden"
    fetch_entry = InFlight(5, 1, 12, 0.0)
    decision = f.on_response(c, fetch_entry, fetched)
    assert decision.frame is fetched  # delivered, not emptied
    assert decision.throttle_ms == 2000  # (12 − 4) / 4 × 1000 ms


def test_limiters_with_nothing_to_enforce_ask_for_nothing():
    limiter = RecordRateLimiter()
    manager = QuotaManager([QuotaRule(None, "x", {"producer_byte_rate": 10})])
    limiter.configure(LimiterContext(manager.rules, 11, 1, manager))
    assert limiter.api_keys == frozenset() and not limiter.fetch_responses
    f = RateLimiterFilter([limiter], Clock())
    frame = produce_frame(9, {"t": {0: batch(3)}})
    header, entry = request(frame)
    assert f.on_request(conn(), header, frame, entry) is None and entry.produce is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([(0, False), (1, True), (78, True), (0, True), (3, False)]),
                          st.integers(0, 50), st.integers(0, 400)), min_size=1, max_size=25),
       st.booleans())
def test_a_built_in_limiters_one_step_charge_answers_as_its_three_calls(usages, shadow):
    """The built-ins' charge (one lookup) gives what RateLimiter.charge's accumulate,
    throttle_ms and shadow_throttle_ms give, and leaves the same rates, enforced or in shadow
    mode, for every kind they charge and for usages they do not."""
    from quotas.limiters import BatchRateLimiter

    def fresh() -> tuple[QuotaManager, list[RateLimiter]]:
        manager = QuotaManager([QuotaRule("alice", None, {"producer_record_rate": 30, "producer_batch_rate": 3,
                                                          "consumer_record_rate": 20}, shadow=shadow)],
                               quota_window_num=2)
        limiters: list[RateLimiter] = [RecordRateLimiter(), BatchRateLimiter()]
        for lim in limiters:
            lim.configure(LimiterContext(manager.rules, 2, 1, manager))
        return manager, limiters

    (one_manager, one_step), (three_manager, three_calls) = fresh(), fresh()
    now = 0
    for (api_key, response), batches, dt in usages:
        now += dt
        usage = Usage("alice", "app", api_key, 9, 100, batches, batches * 7, response)
        for one, three in zip(one_step, three_calls, strict=True):
            assert one.charge(usage, now) == RateLimiter.charge(three, usage, now)
            assert one.throttle_ms(usage, now) == three.throttle_ms(usage, now)
    assert sorted(one_manager.entity_stats(now)) == sorted(three_manager.entity_stats(now))


def test_a_built_in_limiters_subclass_that_changes_a_call_is_charged_through_the_calls():
    """A subclass of a built-in that overrides throttle_ms (not charge) keeps its say: charge
    goes through accumulate, throttle_ms and shadow_throttle_ms for it, as the filter did."""

    class AlwaysFive(RecordRateLimiter):
        def throttle_ms(self, usage: Usage, now_ms: int) -> int:
            return 5

    manager = QuotaManager([QuotaRule("alice", None, {"producer_record_rate": 1e9})], quota_window_num=2)
    limiter = AlwaysFive()
    limiter.configure(LimiterContext(manager.rules, 2, 1, manager))
    assert limiter.charge(Usage("alice", "app", 0, 9, 100, 1, 10), 1000) == (5, 0)
    assert RecordRateLimiter._one_step and not AlwaysFive._one_step
