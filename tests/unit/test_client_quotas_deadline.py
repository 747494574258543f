"""ClientQuotasFilter's deadline (``quota_admin.write_deadline_ms``, from each Alter's arrival)
through a real ClientConnection, with stores played by the test: a write that outlasts it is
answered REQUEST_TIMED_OUT naming what the store is retrying; a later Alter is never held past
its own deadline, however long the one before takes; beyond ``max_waiting_alters`` an Alter is
answered at once; a store error that retrying would not change is UNKNOWN_SERVER_ERROR with its
cause. Nothing changes in any of these. Only bounds the deadline guarantees are timed."""

from __future__ import annotations

import asyncio
import logging

import pytest
from kafka.protocol.admin import AlterClientQuotasResponse

from config import ConfigError, parse_config
from proxy.app.server import ProxyServer
from proxy.control.quota_store import StoreUnavailable

from .test_client_quotas_filter import FILE_QUOTAS, alter_request, responses, settle
from .test_connection_paths import BASE, Pair

REQUEST_TIMED_OUT = 7
UNKNOWN_SERVER_ERROR = -1
INVALID_REQUEST = 42
TROUBLE = "writing t: InitProducerId answered CoordinatorLoadInProgress (14); 3 attempts failed"


def server(deadline_ms: int = 200) -> ProxyServer:
    return ProxyServer(parse_config({**BASE, "quotas": FILE_QUOTAS, "quota_admin": {
        "enabled": True, "principals": ["ANONYMOUS"], "store": "memory", "write_deadline_ms": deadline_ms}}))


def alter(pair: Pair, user: str, value: float, correlation_id: int = 1) -> None:
    pair.conn.data_received(alter_request(1, [([("user", user)], [("request_rate", value, False)])], correlation_id))


def answers(pair: Pair) -> list[tuple[int, str | None]]:
    return [(e.error_code, e.error_message) for r in responses(pair, AlterClientQuotasResponse, 1) for e in r.entries]


def audited(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "proxy.audit"]


def test_a_write_that_outlasts_the_deadline_is_answered_with_what_the_store_retries(caplog):
    async def go():
        caplog.set_level(logging.INFO, logger="proxy.audit")
        pair = Pair(server=server(200))
        store = pair.server.quota_store
        cancelled = asyncio.Event()

        async def retrying(changes):  # a store retrying a retriable error for ever
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise

        store.commit = retrying
        store.write_trouble = lambda: TROUBLE
        pair.conn.data_received(alter_request(1, [([("user", "alice")], [("request_rate", 5.0, False)]),
                                                  ([("user", "bob")], [("bad_key", 5.0, False)])], 1))
        await settle()
        assert answers(pair) == []  # in force, its write under way
        assert pair.server.quotas.resolve("alice", "x", "request_rate").quota == 5.0
        await asyncio.wait_for(cancelled.wait(), 5)
        await settle()
        [timed_out, invalid] = answers(pair)
        assert timed_out == (REQUEST_TIMED_OUT, f"not recorded within 0.2 s ({TROUBLE}); nothing changed, retry later")
        assert invalid[0] == INVALID_REQUEST
        assert pair.server.quotas.resolve("alice", "x", "request_rate").quota == 50.0  # the file's, back in force
        assert not len(store) and audited(caplog) == []

    asyncio.run(go())


def test_an_alter_is_never_held_past_its_own_deadline_by_the_one_before():
    async def go():
        first = Pair(server=server(200))
        second = Pair(server=first.server)
        store = first.server.quota_store
        release = asyncio.Event()

        async def overrunning(changes):  # a store that does not stop at its caller's deadline
            try:
                await release.wait()
            except asyncio.CancelledError:
                await release.wait()
                raise

        store.commit = overrunning
        store.write_trouble = lambda: TROUBLE
        alter(first, "alice", 5.0)
        await settle()
        alter(second, "bob", 6.0)
        await asyncio.sleep(0.5)  # both deadlines passed; the first Alter's write goes on
        assert answers(first) == []
        assert answers(second) == [(REQUEST_TIMED_OUT, "not recorded within 0.2 s: an earlier quota change is still "
                                                       f"being written ({TROUBLE}); nothing changed, retry later")]
        release.set()
        await settle()
        assert answers(first) == [(REQUEST_TIMED_OUT, f"not recorded within 0.2 s ({TROUBLE}); nothing changed, "
                                                      "retry later")]
        assert not len(store)

    asyncio.run(go())


def test_beyond_max_waiting_alters_an_alter_is_answered_at_once(caplog):
    async def go():
        caplog.set_level(logging.INFO, logger="proxy.audit")
        pairs = [Pair(server=server(60_000))]
        pairs += [Pair(server=pairs[0].server) for _ in range(2)]
        filter_ = pairs[0].server.client_quotas
        filter_.max_waiting_alters = 1
        store = pairs[0].server.quota_store
        written = asyncio.Event()
        apply = store.commit

        async def slow(changes):
            await written.wait()
            await apply(changes)

        store.commit = slow
        for pair, user in zip(pairs, ("alice", "bob", "carol")):
            alter(pair, user, 7.0)
            await settle()
        # alice's write is under way, bob waits for it, carol finds one waiting already.
        assert [answers(p) for p in pairs] == [[], [], [(
            REQUEST_TIMED_OUT, "1 quota changes are already waiting for the quota store (no answer from the store "
                               "yet); nothing changed, retry later")]]
        written.set()
        await settle()
        assert [answers(p) for p in pairs[:2]] == [[(0, None)], [(0, None)]]
        assert [m.split(": ", 1)[1] for m in audited(caplog)] == [
            "user=alice request_rate (none) -> 7", "user=bob request_rate (none) -> 7"]
        assert pairs[0].server.quotas.resolve("carol", "x", "request_rate").quota == 50.0

    asyncio.run(go())


def test_a_store_error_retrying_would_not_change_is_unknown_server_error_with_its_cause():
    async def go():
        pair = Pair(server=server())
        cause = ("the quota topic t could not be written (InitProducerId answered "
                 "TransactionalIdAuthorizationFailed (53)); nothing changed")

        async def refused(changes):
            raise StoreUnavailable(cause, retriable=False)

        pair.server.quota_store.commit = refused
        alter(pair, "alice", 5.0)
        await settle()
        assert answers(pair) == [(UNKNOWN_SERVER_ERROR, cause)]
        assert pair.server.quotas.resolve("alice", "x", "request_rate").quota == 50.0

    asyncio.run(go())


def test_the_deadline_is_25_s_by_default_and_validated():
    assert parse_config({**BASE, "quota_admin": {"enabled": True}}).quota_admin.write_deadline_ms == 25_000
    for bad in (99, 300_001, 2.5, True, "25s"):
        with pytest.raises(ConfigError, match=r"quota_admin\.write_deadline_ms.*\[100, 300000\]"):
            parse_config({**BASE, "quota_admin": {"write_deadline_ms": bad}})
