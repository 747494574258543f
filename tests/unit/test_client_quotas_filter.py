"""ClientQuotasFilter through a real ClientConnection (the broker played by the test, see Pair):
DescribeClientQuotas and AlterClientQuotas answered by the proxy at every version kafka-python
knows, never forwarded; authorization by principal; the changes in force before the answer and
audited; failures after validation change nothing; off, both APIs are forwarded untouched."""

from __future__ import annotations

import asyncio
import logging

import pytest
from kafka.protocol.admin import (
    AlterClientQuotasRequest,
    AlterClientQuotasResponse,
    DescribeClientQuotasRequest,
    DescribeClientQuotasResponse,
)

from config import parse_config
from protocol.apis import SPECS
from protocol.frames import FrameReader
from proxy.app.server import ProxyServer
from proxy.control.quota_store import StoreUnavailable
from proxy.dataplane.filters import client_quotas
from proxy.dataplane.filters.client_quotas import ALTER_CLIENT_QUOTAS, DESCRIBE_CLIENT_QUOTAS, describe_change
from quotas.client_quota_admin import CLIENT_ID, USER, QuotaChange, QuotaEntity
from quotas.limiters import RecordRateLimiter
from tests.support.off_loop import record_off_loop

from .test_connection_paths import BASE, Pair, api_versions, request

VERSIONS = range(SPECS[ALTER_CLIENT_QUOTAS].max_version + 1)
CLUSTER_AUTHORIZATION_FAILED = 31
INVALID_REQUEST = 42
POLICY_VIOLATION = 44
UNKNOWN_SERVER_ERROR = -1
REQUEST_TIMED_OUT = 7
FILE_QUOTAS = [{"user": "alice", "producer_byte_rate": 1000}, {"client_id": "<default>", "request_rate": 50}]


def admin_pair(principals=("ANONYMOUS",), describe="admins", enabled=True, **sections) -> Pair:
    raw = {**BASE, "quotas": FILE_QUOTAS, **sections,
           "quota_admin": {"enabled": enabled, "principals": list(principals), "describe": describe,
                           "store": "memory"}}
    return Pair(server=ProxyServer(parse_config(raw)))


def describe_request(version, components, correlation_id=1, strict=False) -> bytes:
    R = DescribeClientQuotasRequest[version]
    comps = [R.ComponentData(entity_type=t, match_type=m, match=s) for t, m, s in components]
    return request(R(components=comps, strict=strict), correlation_id, "admin")


def alter_request(version, entries, correlation_id=1, validate_only=False) -> bytes:
    R = AlterClientQuotasRequest[version]
    E = R.EntryData
    data = [E(entity=[E.EntityData(entity_type=t, entity_name=n) for t, n in entity],
              ops=[E.OpData(key=k, value=v, remove=r) for k, v, r in ops]) for entity, ops in entries]
    return request(R(entries=data, validate_only=validate_only), correlation_id, "admin")


def responses(pair: Pair, cls, version: int) -> list:
    out = []
    for frame in FrameReader(1 << 30).feed(pair.client.bytes()):
        resp = cls.decode(bytes(frame), version=version, header=True)
        assert bytes(resp.encode(header=True)) == bytes(frame)  # exactly kafka-python's bytes
        out.append(resp)
    return out


def described(resp) -> dict:
    assert resp.error_code == 0, resp
    return {tuple((e.entity_type, e.entity_name) for e in x.entity): {v.key: v.value for v in x.values}
            for x in resp.entries}


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.mark.parametrize("version", VERSIONS)
def test_describe_shows_the_file_with_the_overlay_on_top(version):
    async def go():
        pair = admin_pair()
        pair.server.quota_store.apply([QuotaChange(QuotaEntity.of({USER: "bob"}), "request_rate", None, 3.0)])
        pair.conn.data_received(describe_request(version, [], 7))
        [resp] = responses(pair, DescribeClientQuotasResponse, version)
        assert resp.header.correlation_id == 7 and resp.throttle_time_ms == 0
        assert described(resp) == {(("user", "alice"),): {"producer_byte_rate": 1000.0},
                                   (("client-id", None),): {"request_rate": 50.0},
                                   (("user", "bob"),): {"request_rate": 3.0}}
        assert pair.requests_seen_by_broker() == []
        assert pair.server.stats.local_responses[DESCRIBE_CLIENT_QUOTAS] == 1

    asyncio.run(go())


@pytest.mark.parametrize("version", VERSIONS)
def test_alter_is_in_force_and_audited_before_the_answer(version, caplog):
    async def go():
        caplog.set_level(logging.INFO, logger="proxy.audit")
        pair = admin_pair()
        pair.conn.data_received(alter_request(version, [
            ([("user", "alice")], [("producer_byte_rate", 2048.0, False)]),
            ([("user", "bob"), ("client-id", None)], [("consumer_byte_rate", 10.0, False)]),
            ([("client-id", None)], [("request_rate", 0.0, True)]),
        ], 9))
        await settle()
        [resp] = responses(pair, AlterClientQuotasResponse, version)
        assert resp.header.correlation_id == 9
        assert [(e.error_code, e.error_message) for e in resp.entries] == [(0, None)] * 3
        assert [[(d.entity_type, d.entity_name) for d in e.entity] for e in resp.entries] == [
            [("user", "alice")], [("client-id", None), ("user", "bob")], [("client-id", None)]]  # Kafka's order
        server = pair.server
        assert server.quotas.resolve("alice", "x", "producer_byte_rate").quota == 2048.0
        assert server.quotas.resolve("bob", "x", "consumer_byte_rate").quota == 10.0
        assert server.quotas.resolve("carol", "x", "request_rate") is None  # the file's, removed
        assert server.config.quotas[1].values == {"request_rate": 50.0}  # the file is not rewritten
        assert pair.requests_seen_by_broker() == []
        client = pair.conn.ctx.label
        assert [r.getMessage() for r in caplog.records if r.name == "proxy.audit"] == [
            f"quota change by principal=ANONYMOUS client={client}: user=alice producer_byte_rate 1000 -> 2048",
            f"quota change by principal=ANONYMOUS client={client}: user=bob client-id=<default> "
            "consumer_byte_rate (none) -> 10",
            f"quota change by principal=ANONYMOUS client={client}: client-id=<default> request_rate 50 -> (none)",
        ]

    asyncio.run(go())


@pytest.mark.parametrize("version", VERSIONS)
def test_an_unauthorized_principal_is_refused_everything(version):
    async def go():
        pair = admin_pair(principals=["User:alice"])
        pair.conn.data_received(describe_request(version, [], 1))
        pair.conn.data_received(alter_request(version, [
            ([("user", "alice")], [("producer_byte_rate", 1.0, False)]),
            ([("user", "bob")], [("bogus", 1.0, False)]),
        ], 2))
        await settle()
        frames = list(FrameReader(1 << 30).feed(pair.client.bytes()))
        d = DescribeClientQuotasResponse.decode(bytes(frames[0]), version=version, header=True)
        assert (d.error_code, d.error_message, d.entries) == (CLUSTER_AUTHORIZATION_FAILED, None, None)
        a = AlterClientQuotasResponse.decode(bytes(frames[1]), version=version, header=True)
        assert [(e.error_code, e.error_message) for e in a.entries] == [
            (CLUSTER_AUTHORIZATION_FAILED, "Cluster authorization failed.")] * 2
        assert pair.server.rules_in_force == pair.server.config.quotas and not len(pair.server.quota_store)
        assert pair.requests_seen_by_broker() == []

    asyncio.run(go())


def test_describe_anyone_answers_every_principal_but_alter_stays_refused():
    async def go():
        pair = admin_pair(principals=["alice"], describe="anyone")
        pair.conn.data_received(describe_request(1, [("user", 0, "alice")], 1))
        [resp] = responses(pair, DescribeClientQuotasResponse, 1)
        assert described(resp) == {(("user", "alice"),): {"producer_byte_rate": 1000.0}}

    asyncio.run(go())


def test_validate_only_and_bad_entries_change_nothing():
    async def go():
        pair = admin_pair()
        pair.conn.data_received(alter_request(1, [([("user", "alice")], [("producer_byte_rate", 5.0, False)])], 1,
                                              validate_only=True))
        pair.conn.data_received(alter_request(1, [([("user", "bob")], [("bogus_rate", 5.0, False)])], 2))
        await settle()
        first, second = responses(pair, AlterClientQuotasResponse, 1)
        assert [e.error_code for e in first.entries] == [0]
        assert [(e.error_code, e.error_message) for e in second.entries] == [
            (INVALID_REQUEST, "Invalid configuration key bogus_rate")]
        assert pair.server.quotas.resolve("alice", "x", "producer_byte_rate").quota == 1000.0
        assert not len(pair.server.quota_store)

    asyncio.run(go())


def test_a_record_rate_no_limiter_enforces_is_refused():
    async def go():
        pair = admin_pair(rate_limiters=["quotas.limiters:BatchRateLimiter"])
        pair.conn.data_received(alter_request(1, [([("user", "bob")], [("producer_record_rate", 5.0, False)]),
                                                  ([("user", "bob")], [("producer_batch_rate", 5.0, False)])], 1))
        await settle()
        [resp] = responses(pair, AlterClientQuotasResponse, 1)
        assert resp.entries[0].error_code == INVALID_REQUEST  # a duplicate entity: both refused
        pair.conn.data_received(alter_request(1, [([("user", "bob")], [("producer_record_rate", 5.0, False)])], 2))
        await settle()
        _, resp = responses(pair, AlterClientQuotasResponse, 1)
        assert resp.entries[0].error_code == INVALID_REQUEST
        assert "no configured rate limiter enforces it" in resp.entries[0].error_message

    asyncio.run(go())


class RefusingLimiter(RecordRateLimiter):
    def configure(self, context):
        if any(r.user == "refused" for r in context.rules):
            raise ValueError("no quota for 'refused'")
        super().configure(context)


def test_a_limiter_refusing_the_new_quotas_changes_nothing():
    async def go():
        pair = admin_pair(rate_limiters=[f"{__name__}:RefusingLimiter"])
        pair.conn.data_received(alter_request(1, [
            ([("user", "refused")], [("request_rate", 5.0, False)]),
            ([("user", "bob")], [("nope", 5.0, False)]),
        ], 1))
        await settle()
        [resp] = responses(pair, AlterClientQuotasResponse, 1)
        assert resp.entries[0].error_code == POLICY_VIOLATION
        assert "no quota for 'refused'" in resp.entries[0].error_message
        assert resp.entries[1].error_code == INVALID_REQUEST  # its own error
        assert pair.server.quotas.resolve("refused", "x", "request_rate").quota == 50.0  # the file's default
        assert not len(pair.server.quota_store)

    asyncio.run(go())


def test_a_store_out_of_reach_answers_request_timed_out_with_its_reason():
    async def go():
        pair = admin_pair()

        async def unavailable(changes):
            raise StoreUnavailable("the quota topic could not be written (broker down); retry later")

        pair.server.quota_store.commit = unavailable
        pair.conn.data_received(alter_request(1, [([("user", "alice")], [("producer_byte_rate", 5.0, False)]),
                                                  ([("user", "bob")], [("bad_key", 5.0, False)])], 1))
        await settle()
        [resp] = responses(pair, AlterClientQuotasResponse, 1)
        assert [(e.error_code, e.error_message) for e in resp.entries] == [
            (REQUEST_TIMED_OUT, "the quota topic could not be written (broker down); retry later"),
            (INVALID_REQUEST, resp.entries[1].error_message)]
        assert pair.server.quotas.resolve("alice", "x", "producer_byte_rate").quota == 1000.0
        assert not len(pair.server.quota_store)

    asyncio.run(go())


def test_a_store_that_fails_leaves_the_quotas_before_in_force():
    async def go():
        pair = admin_pair()

        async def failing(changes):
            raise OSError("the quota topic is not there")

        pair.server.quota_store.commit = failing
        pair.conn.data_received(alter_request(1, [([("user", "alice")], [("producer_byte_rate", 5.0, False)])], 1))
        await settle()
        [resp] = responses(pair, AlterClientQuotasResponse, 1)
        assert [(e.error_code, e.error_message) for e in resp.entries] == [(UNKNOWN_SERVER_ERROR, None)]
        assert pair.server.quotas.resolve("alice", "x", "producer_byte_rate").quota == 1000.0
        assert not pair.client.closed

    asyncio.run(go())


def test_alters_from_two_connections_apply_one_after_the_other(caplog):
    async def go():
        caplog.set_level(logging.INFO, logger="proxy.audit")
        first = admin_pair()
        second = Pair(server=first.server)
        for pair, value in ((first, 1.0), (second, 2.0)):
            pair.conn.data_received(alter_request(1, [([("user", "dave")], [("request_rate", value, False)])], 1))
        await settle()
        assert first.server.quotas.resolve("dave", "x", "request_rate").quota == 2.0
        assert [r.getMessage().split(": ", 1)[1] for r in caplog.records if r.name == "proxy.audit"] == [
            "user=dave request_rate (none) -> 1", "user=dave request_rate 1 -> 2"]

    asyncio.run(go())


@pytest.mark.parametrize("version", VERSIONS)
def test_off_both_apis_reach_the_broker_untouched(version):
    async def go():
        pair = admin_pair(enabled=False)
        sent = [describe_request(version, [], 1), alter_request(version, [([("user", "a")], [])], 2)]
        for frame in sent:
            pair.conn.data_received(frame)
        assert pair.requests_seen_by_broker() == [f[4:] for f in sent]
        assert pair.server.stats.local_responses == {}

    asyncio.run(go())


def test_api_versions_offers_both_apis_only_when_on():
    from kafka.protocol.metadata import ApiVersionsResponse

    def offered(enabled: bool) -> dict:
        async def go():
            pair = admin_pair(enabled=enabled)
            pair.conn.data_received(api_versions(3, 1, "admin"))
            R = ApiVersionsResponse[3]
            broker = R(error_code=0, api_keys=[R.ApiVersion(api_key=18, min_version=0, max_version=3),
                                               R.ApiVersion(api_key=49, min_version=0, max_version=0)],
                       throttle_time_ms=0)
            broker.with_header(correlation_id=1)
            pair.up.data_received(bytes(broker.encode(header=True, framed=True)))
            [frame] = FrameReader(1 << 30).feed(pair.client.bytes())
            resp = ApiVersionsResponse.decode(bytes(frame[4:]), version=3)
            return {e.api_key: (e.min_version, e.max_version) for e in resp.api_keys}

        return asyncio.run(go())

    assert offered(True) == {18: (0, 3), 48: (0, 1), 49: (0, 1)}  # sorted by key, kafka-python's range
    assert offered(False) == {18: (0, 3), 49: (0, 0)}  # the broker's own


def test_describe_change_names_entity_key_and_values():
    entity = QuotaEntity.of({CLIENT_ID: "app\nx", USER: None})
    assert describe_change(QuotaChange(entity, "request_rate", 2.5, None)) == (
        "user=<default> client-id=app\\nx request_rate 2.5 -> (none)")  # one line, whatever the name


def test_an_alter_whose_client_goes_away_is_carried_out_whole(caplog):
    async def go():
        caplog.set_level(logging.INFO, logger="proxy.audit")
        pair = admin_pair()
        store = pair.server.quota_store
        written = asyncio.Event()

        async def slow_commit(changes):  # as a store that waits for its write to be acknowledged
            await written.wait()
            store.apply(changes)

        store.commit = slow_commit
        pair.conn.data_received(alter_request(1, [([("user", "frank")], [("request_rate", 7.0, False)])], 1))
        await settle()  # the Alter is in force, its write under way
        pair.conn.close()  # cancels the deferred decision
        written.set()
        await settle()
        assert pair.server.quotas.resolve("frank", "x", "request_rate").quota == 7.0
        assert len(pair.server.quota_store) == 1
        assert [r.getMessage().split(": ", 1)[1] for r in caplog.records if r.name == "proxy.audit"] == [
            "user=frank request_rate (none) -> 7"]

    asyncio.run(go())


def test_a_reload_while_the_store_writes_keeps_the_alter_on_top_of_the_new_file():
    async def go():
        pair = admin_pair()
        server, store = pair.server, pair.server.quota_store
        written = asyncio.Event()

        async def slow_commit(changes):
            await written.wait()
            store.apply(changes)

        store.commit = slow_commit
        pair.conn.data_received(alter_request(1, [([("user", "alice")], [("producer_byte_rate", 4096.0, False)])], 1))
        await settle()
        server.reload(parse_config({**BASE, "quotas": [{"user": "alice", "producer_byte_rate": 10, "request_rate": 3}],
                                    "quota_admin": {"enabled": True, "principals": ["ANONYMOUS"], "store": "memory"}}))
        written.set()
        await settle()
        assert server.quotas.resolve("alice", "x", "producer_byte_rate").quota == 4096.0
        assert server.quotas.resolve("alice", "x", "request_rate").quota == 3.0
        [resp] = responses(pair, AlterClientQuotasResponse, 1)
        assert resp.entries[0].error_code == 0

    asyncio.run(go())


async def answered(pair: Pair, timeout_s: float = 30.0) -> None:
    """Waits for the proxy's answer (a big request is worked in the decode thread)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not pair.client.writes:
        assert loop.time() < deadline, "no answer"
        await asyncio.sleep(0.005)


def test_a_big_alter_and_describe_are_worked_off_the_loop_and_answered_as_small_ones(monkeypatch):
    n = client_quotas.BIG_ENTRIES + 44
    worked = record_off_loop(monkeypatch, client_quotas)

    async def go():
        pair = admin_pair()
        users = [f"user-{i}" for i in range(n)]
        pair.conn.data_received(alter_request(1, [([("user", u)], [("consumer_byte_rate", float(i + 1), False)])
                                                   for i, u in enumerate(users)], 1))
        await answered(pair)
        [resp] = responses(pair, AlterClientQuotasResponse, 1)
        pair.client.writes.clear()
        assert [e.error_code for e in resp.entries] == [0] * n
        assert [e.entity[0].entity_name for e in resp.entries] == users
        assert pair.server.quotas.resolve(users[-1], "x", "consumer_byte_rate").quota == float(n)
        assert worked == ["_alter_with_rules", "_alter_response"]
        # Every entity: the file's two and the n just set, selected and encoded in the thread.
        pair.conn.data_received(describe_request(1, [], 2))
        await answered(pair)
        [resp] = responses(pair, DescribeClientQuotasResponse, 1)
        pair.client.writes.clear()
        shown = described(resp)
        assert len(shown) == n + 2 and shown[(("user", users[7]),)] == {"consumer_byte_rate": 8.0}
        assert worked[2:] == ["_describe_answer"]
        # With a component: one entity answered, but every entity held is walked: in the thread too.
        pair.conn.data_received(describe_request(1, [("user", 0, users[7])], 3))
        await answered(pair)
        [resp] = responses(pair, DescribeClientQuotasResponse, 1)
        assert described(resp) == {(("user", users[7]),): {"consumer_byte_rate": 8.0}}
        assert worked[3:] == ["_describe_answer"]

    asyncio.run(go())


def test_rules_put_in_force_while_a_big_alter_is_validated_are_not_lost(monkeypatch):
    real = client_quotas.off_loop

    async def meanwhile(fn, *args):
        if fn.__name__ == "_alter_with_rules":
            # Another instance's change arrives while the decode thread validates.
            server.quota_store.apply([QuotaChange(QuotaEntity.of({USER: "zoe"}), "request_rate", None, 9.0)])
            server.quota_store_changed()
        return await real(fn, *args)

    monkeypatch.setattr(client_quotas, "off_loop", meanwhile)

    async def go():
        nonlocal server
        pair = admin_pair()
        server = pair.server
        n = client_quotas.BIG_ENTRIES + 1
        pair.conn.data_received(alter_request(1, [([("user", f"u{i}")], [("request_rate", 1.0, False)])
                                                   for i in range(n)], 1))
        await answered(pair)
        assert server.quotas.resolve("u0", "x", "request_rate").quota == 1.0
        assert server.quotas.resolve("zoe", "x", "request_rate").quota == 9.0  # still in force

    server: ProxyServer
    asyncio.run(go())
