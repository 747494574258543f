"""Shadow mode, filter by filter: the same sequence of requests and responses through a filter
with its quota enforced and in shadow mode. In shadow every decision is computed the same way
(the engines count it apart) and nothing is applied: no throttle, answer, mute or rewrite; what
enforcing gave is what shadow mode notes on the request for the usage log."""

from __future__ import annotations

import pytest

from config.engines import quota_manager_for
from config.loader import parse_config
from protocol.apis import SPECS, ApiKey
from protocol.headers import parse_request_header, response_body_offset
from protocol.messages import decode_response
from proxy.cluster.topics import TopicCache
from proxy.dataplane.filters.api import Answer, Forward
from proxy.dataplane.filters.controller_mutation import ControllerMutationFilter
from proxy.dataplane.filters.limiters import RateLimiterFilter
from proxy.dataplane.filters.producer_ids import ProducerIdQuotaFilter
from proxy.dataplane.filters.quotas import RateQuotaFilter
from proxy.dataplane.inflight import InFlight
from quotas import QuotaManager, QuotaRule
from quotas.common import ShadowDecision
from quotas.entities import EntityResolver
from quotas.limiters import BatchRateLimiter, LimiterContext, RecordRateLimiter
from quotas.producer_ids import ProducerIdQuotaManager, ProducerIdSettings
from tests.support.filter_context import decided, filter_context, unreachable_cluster
from tests.unit.test_records import batch, fetch_frame, produce_frame


class Clock:
    def __init__(self) -> None:
        self.ms = 5_000_000

    def __call__(self) -> int:
        return self.ms


def _request(frame: bytes):
    header = parse_request_header(frame)
    return header, InFlight(header.correlation_id, header.api_key, header.api_version, 0.0)


def _applied(decision, entry) -> tuple[int, bool]:
    """(throttle applied, refused) of a request filter's decision, as the connection applies it."""
    if decision is None:
        return entry.throttle_ms, entry.rejected
    assert isinstance(decision, (Forward, Answer)), decision
    return max(entry.throttle_ms, decision.throttle_ms), entry.rejected or isinstance(decision, Answer)


def _outcomes(run, shadow: bool):
    """Runs ``run(shadow)`` → [(decision, entry)], and returns [(throttle, refused)] per request:
    applied ones when enforced, noted ones in shadow (where nothing may be applied)."""
    out = []
    for decision, entry, ctx in run(shadow):
        if shadow:
            assert decision is None or (isinstance(decision, Forward) and decision.throttle_ms == 0
                                        and decision.frame is None), decision
            assert (entry.throttle_ms, entry.rejected) == (0, False)
            assert ctx.actions == []  # no mute, nothing asked of the connection
            out.append((entry.shadow_throttle_ms, entry.shadow_rejected))
        else:
            assert (entry.shadow_throttle_ms, entry.shadow_rejected) == (0, False)
            out.append(_applied(decision, entry))
    return out


def _same(run, at_least_throttled: int = 1, at_least_refused: int = 0):
    enforced, shadowed = _outcomes(run, False), _outcomes(run, True)
    assert shadowed == enforced
    assert sum(1 for t, _ in enforced if t) >= at_least_throttled  # the sequence does bite
    assert sum(1 for _, r in enforced if r) >= at_least_refused
    return enforced


# -- the rules carry their mode -----------------------------------------------------------------


def test_the_mode_is_the_matched_rules():
    resolver = EntityResolver([
        QuotaRule("alice", None, {"producer_byte_rate": 10}, shadow=True),
        QuotaRule("<default>", None, {"producer_byte_rate": 20}),
        QuotaRule(None, "connect-*", {"producer_byte_rate": 30}, shadow=True),
        QuotaRule(None, "<default>", {"request_rate": 5}, shadow=True),
    ])
    assert resolver.resolve("producer_byte_rate", "alice", "x").shadow
    assert not resolver.resolve("producer_byte_rate", "bob", "x").shadow
    assert resolver.resolve("request_rate", "bob", "connect-a").shadow
    anonymous = EntityResolver([QuotaRule(None, "connect-*", {"producer_byte_rate": 30}, shadow=True)])
    assert anonymous.resolve("producer_byte_rate", "bob", "connect-a").shadow


def test_global_mode_and_entry_mode_in_the_configuration():
    base = {"upstream": {"bootstrap_servers": ["127.0.0.1:1"]}}
    config = parse_config({**base, "mode": "shadow", "quotas": [
        {"user": "alice", "producer_byte_rate": 10},
        {"user": "bob", "producer_byte_rate": 10, "mode": "enforce"}]})
    assert [(r.user, r.shadow) for r in config.quotas] == [("alice", True), ("bob", False)]
    config = parse_config({**base, "quotas": [{"user": "alice", "producer_byte_rate": 10, "mode": "shadow"}]})
    assert config.mode == "enforce" and config.quotas[0].shadow
    from config import ConfigError
    with pytest.raises(ConfigError, match=r"^mode: must be enforce or shadow, got 'dry-run'"):
        parse_config({**base, "mode": "dry-run"})
    with pytest.raises(ConfigError, match=r"^quotas\[0\]\.mode: must be enforce or shadow, got True"):
        parse_config({**base, "quotas": [{"user": "a", "producer_byte_rate": 1, "mode": True}]})


def test_the_engine_decides_the_same_and_counts_apart():
    def run(shadow):
        m = QuotaManager([QuotaRule("alice", None, {"producer_byte_rate": 100, "controller_mutation_rate": 0.2},
                                    shadow=shadow)], quota_window_num=2)
        decisions = [m.check_and_record("alice", "c", "producer_byte_rate", 150, 1000 + i) for i in range(3)]
        decisions += [m.try_admit("alice", "c", "controller_mutation_rate", 2, 2000 + i) for i in range(3)]
        return m, decisions

    enforced, shadowed = run(False), run(True)
    assert [tuple(d) for d in shadowed[1]] == [tuple(d) for d in enforced[1]]
    assert all(d.shadow == (not d.admitted or d.throttle_ms > 0) for d in shadowed[1])
    assert all(isinstance(d, ShadowDecision) for d in shadowed[1] if d.throttle_ms)
    counters = {c.kind: c for c in enforced[0].kind_counters()}
    shadow_counters = {c.kind: c for c in shadowed[0].kind_counters()}
    for kind in ("producer_byte_rate", "controller_mutation_rate"):
        e, s = counters[kind], shadow_counters[kind]
        assert (s.shadow_throttled, s.shadow_rejected, s.throttled, s.rejected) == (e.throttled, e.rejected, 0, 0)
        assert (e.shadow_throttled, e.shadow_rejected) == (0, 0)
    assert counters["producer_byte_rate"].throttled == 3 and counters["controller_mutation_rate"].rejected == 1


# -- each filter, enforced and in shadow --------------------------------------------------------


@pytest.mark.parametrize("kind", ["producer_byte_rate", "request_rate"])
def test_request_rate_and_producer_byte_rate(kind):
    frames = [produce_frame(9, {"t": {0: batch(n)}}) for n in (5, 40, 3, 60, 1, 1, 1, 80)]
    bound = {"producer_byte_rate": 400, "request_rate": 2}[kind]

    def run(shadow):
        clock = Clock()
        manager = QuotaManager([QuotaRule("alice", None, {kind: bound}, shadow=shadow)], quota_window_num=3)
        f = RateQuotaFilter(manager, 2.0, clock)
        ctx = filter_context("alice")
        for i, frame in enumerate(frames):
            clock.ms += 150 * (i % 3)
            header, entry = _request(frame)
            yield f.on_request(ctx, header, frame, entry), entry, ctx

    _same(run, at_least_throttled=3)


def test_consumer_byte_rate_delivers_what_it_would_have_emptied_and_caps_nothing():
    fetched = [fetch_frame(12, batch(n)) for n in (10, 30, 5, 50, 2, 2)]

    def run(shadow):
        clock = Clock()
        manager = QuotaManager([QuotaRule("alice", None, {"consumer_byte_rate": 500}, shadow=shadow)],
                               quota_window_num=3)
        f = RateQuotaFilter(manager, 2.0, clock)
        ctx = filter_context("alice")
        for i, frame in enumerate(fetched):
            clock.ms += 200 * i
            entry = InFlight(i, ApiKey.FETCH, 12, 0.0)
            decision = f.on_response(ctx, entry, frame)
            if shadow:
                assert decision is frame  # delivered as the broker sent it
                yield None, entry, ctx
            else:
                if isinstance(decision, Forward):
                    offset = response_body_offset(decision.frame, ApiKey.FETCH, 12)
                    body = decode_response(ApiKey.FETCH, 12, memoryview(decision.frame)[offset:])
                    assert all(not p.records for t in body.responses for p in t.partitions)  # emptied
                    yield decision, entry, ctx
                else:
                    yield None, entry, ctx

    _same(run, at_least_throttled=2)
    # The Fetch request's MaxBytes is lowered to what the quota admits when enforced, never in shadow.
    req = SPECS[ApiKey.FETCH].request[12]
    fetch = req(replica_id=-1, max_wait_ms=500, min_bytes=1, max_bytes=50_000_000, isolation_level=0,
                session_id=0, session_epoch=-1, topics=[], forgotten_topics_data=[], rack_id="")
    fetch.with_header(correlation_id=3, client_id="c")
    frame = bytes(fetch.encode(header=True))
    for shadow, capped in ((False, True), (True, False)):
        manager = QuotaManager([QuotaRule("alice", None, {"consumer_byte_rate": 500}, shadow=shadow)])
        header, entry = _request(frame)
        decision = RateQuotaFilter(manager, 10.0, Clock()).on_request(filter_context("alice"), header, frame, entry)
        assert (decision is not None and decision.frame is not None) == capped


@pytest.mark.parametrize("kind", ["producer_record_rate", "producer_batch_rate", "consumer_record_rate"])
def test_record_and_batch_rates(kind):
    def run(shadow):
        clock = Clock()
        bound = 6 if kind == "producer_batch_rate" else 20
        manager = QuotaManager([QuotaRule("alice", None, {kind: bound}, shadow=shadow)], quota_window_num=2)
        limiters = [RecordRateLimiter(), BatchRateLimiter()]
        for lim in limiters:
            lim.configure(LimiterContext(manager.rules, 2, 1, manager))
        f = RateLimiterFilter(limiters, clock)
        ctx = filter_context("alice")
        for i in range(8):
            clock.ms += 120
            if kind == "consumer_record_rate":
                entry = InFlight(i, ApiKey.FETCH, 12, 0.0)
                frame = fetch_frame(12, batch(3 + 4 * (i % 3)) + batch(2))
                decision = f.on_response(ctx, entry, frame)
                assert decision is frame or decision.frame is frame  # records are delivered either way
                yield (None if decision is frame else decision), entry, ctx
            else:
                frame = produce_frame(9, {"t": {0: batch(3 + 4 * (i % 3)), 1: batch(2)}, "u": {0: batch(1)}})
                header, entry = _request(frame)
                yield f.on_request(ctx, header, frame, entry), entry, ctx

    _same(run, at_least_throttled=3)


def test_producer_ids_rate():
    def frame(pid):
        return produce_frame(9, {"orders": {0: batch(2, pid=pid, epoch=0, seq=0)}})

    def run(shadow):
        clock = Clock()
        manager = ProducerIdQuotaManager([QuotaRule("alice", None, {"producer_ids_rate": 2}, shadow=shadow)],
                                         ProducerIdSettings(window_size_s=10.0))
        f = ProducerIdQuotaFilter(manager, "reject", clock)
        ctx = filter_context("alice")
        for pid in (1, 2, 1, 3, 4, 2, 5):  # 3, 4 and 5 come over the quota
            clock.ms += 10
            fr = frame(pid)
            header, entry = _request(fr)
            yield f.on_request(ctx, header, fr, entry), entry, ctx
        assert (manager.rejected_total, manager.shadow_rejected_total) == ((0, 3) if shadow else (3, 0))

    outcomes = _same(run, at_least_throttled=3, at_least_refused=3)
    assert [r for _, r in outcomes] == [False, False, False, True, True, False, True]


class _Topics(TopicCache):
    """No topic exists yet: each CreateTopics entry is one Kafka would create."""

    def count(self, name=None, topic_id=None):
        return None


@pytest.mark.parametrize("version", [5, 6])  # permissive (throttled) and strict (refused, KIP-599)
def test_controller_mutation_rate(version, monkeypatch):
    import proxy.dataplane.filters.controller_mutation as module

    clock = Clock()
    monkeypatch.setattr(module, "now_ms", clock)
    create = SPECS[ApiKey.CREATE_TOPICS].request[version]
    topic = create.CreatableTopic

    def frame(names):
        req = create(topics=[topic(name=n, num_partitions=2, replication_factor=1, assignments=[], configs=[])
                             for n in names], timeout_ms=1000, validate_only=False)
        req.with_header(correlation_id=9, client_id="app")
        return bytes(req.encode(header=True))

    def run(shadow):
        raw = {"upstream": {"bootstrap_servers": ["127.0.0.1:1"]},
               "quotas": [{"client_id": "app", "controller_mutation_rate": 0.1,
                           "mode": "shadow" if shadow else "enforce"}]}
        f = ControllerMutationFilter(quota_manager_for(parse_config(raw)), _Topics(), 1, 1.0)
        ctx = filter_context("alice", client_id="app", cluster=unreachable_cluster())
        for names in (["a"], ["b", "c"], ["d"]):  # a burst of 1.1: a goes into debt, the rest wait 9 s+
            clock.ms += 100
            fr = frame(names)
            header, entry = _request(fr)
            decision = decided(f.on_request(ctx, header, fr, entry))  # before refusing, a lookup (failing here)
            if not shadow and isinstance(decision, Forward) and decision.frame is not None:
                decision = Forward(None, decision.throttle_ms)  # the topics it cut out: counted as refused
                entry.rejected = True
            yield decision, entry, ctx

    outcomes = _same(run, at_least_throttled=2, at_least_refused=0 if version < 6 else 2)
    # Permissive: every request in debt is throttled; strict: the first is admitted into debt
    # unthrottled (StrictControllerMutationQuota), then topics are refused.
    assert [r for _, r in outcomes] == ([False] * 3 if version < 6 else [False, True, True])
    assert (outcomes[0][0] > 0) == (version < 6)


def test_the_readme_shadow_example_is_a_valid_configuration():
    import re
    from pathlib import Path

    import yaml

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme.split("### Shadow mode", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    config = parse_config({"upstream": {"bootstrap_servers": ["127.0.0.1:1"]}, **yaml.safe_load(block)})
    assert config.mode == "enforce"
    assert [(r.client_id or r.user, r.shadow) for r in config.quotas] == [("<default>", True), ("connect-*", False)]
