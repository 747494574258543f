"""proxy.control.quota_store: the Admin API's overlay on top of the file's quotas, and a reload keeping it."""

from __future__ import annotations

import asyncio

from config import parse_config
from proxy.app.server import ProxyServer
from proxy.control.quota_store import REMOVED, OverlayStore, merge
from quotas.client_quota_admin import CLIENT_ID, USER, QuotaChange, QuotaEntity
from quotas.entities import QuotaRule

from .test_connection_paths import BASE

ALICE = QuotaEntity.of({USER: "alice"})
BOB = QuotaEntity.of({USER: "bob"})
CONNECT = QuotaEntity.of({CLIENT_ID: "connect-*"})
BASE_RULES = (
    QuotaRule("alice", None, {"producer_byte_rate": 1000.0, "request_rate": 5.0}),
    QuotaRule(None, "connect-*", {"consumer_byte_rate": 300.0}),
)


def test_the_overlay_overrides_per_key_and_a_removal_masks_the_base():
    store = OverlayStore()
    store.apply([QuotaChange(ALICE, "producer_byte_rate", 1000.0, 2000.0),
                 QuotaChange(ALICE, "request_rate", 5.0, None),
                 QuotaChange(BOB, "consumer_byte_rate", None, 7.0)])
    assert store.overlay == {ALICE: {"producer_byte_rate": 2000.0, "request_rate": REMOVED},
                             BOB: {"consumer_byte_rate": 7.0}}
    assert len(store) == 3
    assert store.merged(BASE_RULES) == {ALICE: {"producer_byte_rate": 2000.0}, CONNECT: {"consumer_byte_rate": 300.0},
                                        BOB: {"consumer_byte_rate": 7.0}}
    # Base entities first, in the file's order (it ranks globs of equal rank), then the new ones.
    assert list(store.merged(BASE_RULES)) == [ALICE, CONNECT, BOB]


def test_keys_the_overlay_does_not_name_follow_the_base():
    store = OverlayStore()
    store.apply([QuotaChange(ALICE, "request_rate", 5.0, None)])
    new_base = (QuotaRule("alice", None, {"producer_byte_rate": 9.0, "request_rate": 50.0}),)
    assert store.merged(new_base) == {ALICE: {"producer_byte_rate": 9.0}}  # the removal still masks


def test_an_entity_left_without_a_value_is_gone_and_the_overlay_remembers_the_removal():
    store = OverlayStore()
    store.apply([QuotaChange(CONNECT, "consumer_byte_rate", 300.0, None)])
    assert store.merged(BASE_RULES) == {ALICE: dict(BASE_RULES[0].values)}
    assert merge(BASE_RULES, {}) == {ALICE: dict(BASE_RULES[0].values), CONNECT: {"consumer_byte_rate": 300.0}}


def test_commit_of_the_memory_store_applies_at_once():
    store = OverlayStore()
    asyncio.run(store.commit([QuotaChange(BOB, "request_rate", None, 3.0)]))
    assert store.merged(()) == {BOB: {"request_rate": 3.0}}
    assert store.overlay[BOB]["request_rate"] == 3.0


def _server(quotas: list[dict]) -> ProxyServer:
    return ProxyServer(parse_config({**BASE, "quotas": quotas}))


def test_apply_quota_rules_puts_rules_in_force_and_a_reload_keeps_the_overlay_on_the_new_base():
    server = _server([{"user": "alice", "producer_byte_rate": 1000, "request_rate": 5}])
    assert server.quota_rules_over(server.config.quotas) is server.config.quotas  # nothing set: the file's
    server.quota_store.apply([QuotaChange(ALICE, "producer_byte_rate", 1000.0, 2000.0)])
    server.apply_quota_rules(server.quota_rules_over(server.config.quotas))
    assert server.quotas.resolve("alice", "app", "producer_byte_rate").quota == 2000.0
    assert server.config.quotas[0].values["producer_byte_rate"] == 1000.0  # the file's, untouched

    server.reload(parse_config({**BASE, "quotas": [
        {"user": "alice", "producer_byte_rate": 10, "request_rate": 50},
        {"user": "bob", "request_rate": 1},
    ]}))
    assert server.quotas.resolve("alice", "app", "producer_byte_rate").quota == 2000.0  # the overlay's
    assert server.quotas.resolve("alice", "app", "request_rate").quota == 50.0  # the new file's
    assert server.quotas.resolve("bob", "app", "request_rate").quota == 1.0
    assert [r.user for r in server.rules_in_force] == ["alice", "bob"]


def test_a_reload_logs_what_changes_in_force(caplog):
    server = _server([{"user": "alice", "producer_byte_rate": 1000}])
    server.quota_store.apply([QuotaChange(ALICE, "producer_byte_rate", 1000.0, 2000.0)])
    server.apply_quota_rules(server.quota_rules_over(server.config.quotas))
    caplog.set_level("INFO", logger="proxy.app.server")
    server.reload(parse_config({**BASE, "quotas": [{"user": "alice", "producer_byte_rate": 10}]}))
    lines = [r.getMessage() for r in caplog.records if r.name == "proxy.app.server"]
    assert not any(line.startswith("reload user=alice") for line in lines), lines  # 2000 stays in force
    assert "reload: 1 quota values set or removed through the Admin API stay over the file's" in lines
    assert "reloaded: 1 quota entry in force (0 added, 0 removed, 0 changed), 2 rate limiters" in lines


def test_a_removal_is_kept_only_while_it_masks_a_key_of_the_file():
    file_keys = {ALICE: {"producer_byte_rate", "request_rate"}}
    store = OverlayStore(lambda entity: file_keys.get(entity, set()))
    store.apply([QuotaChange(ALICE, "request_rate", 5.0, None),  # the file's: masked
                 QuotaChange(ALICE, "consumer_byte_rate", 10.0, None),  # the API's own: forgotten
                 QuotaChange(BOB, "consumer_byte_rate", None, 7.0)])
    assert store.overlay == {ALICE: {"request_rate": REMOVED}, BOB: {"consumer_byte_rate": 7.0}}
    store.apply([QuotaChange(BOB, "consumer_byte_rate", 7.0, None)])  # its last key: the entity is forgotten
    assert BOB not in store.overlay and len(store) == 1
    # A key the file gives later is in force (nothing of the API's removal was kept).
    later = (QuotaRule("alice", None, {"consumer_byte_rate": 20.0, "request_rate": 50.0}),
             QuotaRule("bob", None, {"consumer_byte_rate": 30.0}))
    assert store.merged(later) == {ALICE: {"consumer_byte_rate": 20.0}, BOB: {"consumer_byte_rate": 30.0}}
