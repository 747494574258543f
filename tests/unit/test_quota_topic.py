"""The quota topic's record format (proxy.control.quota_topic) and how the store applies records
(proxy.control.quota_topic_store, fed records without a broker)."""

from __future__ import annotations

import asyncio
import json

import pytest
from kafka.record import MemoryRecordsBuilder

from proxy.control import quota_topic
from proxy.control.quota_topic_store import APPLY_SLICE_RECORDS, TopicStore
from quotas.client_quota_admin import CLIENT_ID, USER, QuotaEntity
from quotas.entities import QuotaRule

ALICE = QuotaEntity.of({USER: "alice"})
ALICE_DEFAULT_CLIENT = QuotaEntity.of({USER: "alice", CLIENT_ID: None})
DEFAULT_USER = QuotaEntity.of({USER: None})


@pytest.mark.parametrize("entity", [ALICE, ALICE_DEFAULT_CLIENT, DEFAULT_USER, QuotaEntity.of({CLIENT_ID: "é app"})])
@pytest.mark.parametrize("values", [{"producer_byte_rate": 1048576.0},
                                    {"request_rate": 2.5, "consumer_byte_rate": None},
                                    {"request_rate": None}])
def test_round_trip(entity, values):
    key, value = quota_topic.encode(entity, values)
    assert quota_topic.decode(key, value) == (entity, values)


def test_the_format_is_the_documented_one():
    key, value = quota_topic.encode(ALICE_DEFAULT_CLIENT, {"producer_byte_rate": 1048576, "request_rate": None})
    assert key == b'{"client-id":null,"user":"alice"}'
    assert json.loads(value) == {"v": 1, "entity": {"user": "alice", "client-id": None},
                                 "quotas": {"producer_byte_rate": 1048576.0}, "removed": ["request_rate"]}
    # The key does not depend on the order the entity was given in.
    assert quota_topic.entity_key(QuotaEntity((("user", "alice"), ("client-id", None)))) == key


def test_an_empty_overlay_is_a_tombstone():
    key, value = quota_topic.encode(ALICE, {})
    assert value is None
    assert quota_topic.decode(key, None) == (ALICE, None)


KEY = quota_topic.entity_key(ALICE)


def value(**fields) -> bytes:
    return json.dumps({"v": 1, "entity": {"user": "alice"}, "quotas": {}, **fields}).encode()


@pytest.mark.parametrize("key, raw, reason", [
    (None, value(), "no_key"),
    (b"not json", value(), "not_json"),
    (KEY, b"\xff\xfe", "not_json"),
    (KEY, b"[1, 2]", "not_json"),
    (KEY, value(v=2), "unknown_version"),
    (KEY, json.dumps({"entity": {"user": "alice"}}).encode(), "unknown_version"),
    (KEY, value(entity={"user": "bob"}), "bad_entity"),
    (b'{"ip":"1.2.3.4"}', value(entity={"ip": "1.2.3.4"}), "bad_entity"),
    (b'{"user":"<default>"}', value(entity={"user": "<default>"}), "bad_entity"),
    (KEY, value(quotas={"request_rate": -1}), "bad_values"),
    (KEY, value(quotas={"request_rate": "fast"}), "bad_values"),
    (KEY, value(quotas={"request_rate": True}), "bad_values"),
    (KEY, b'{"v":1,"entity":{"user":"alice"},"quotas":{"request_rate":NaN}}', "bad_values"),
    (KEY, value(quotas={"request_rate": 1}, removed=["request_rate"]), "bad_values"),
    (KEY, value(removed="request_rate"), "bad_values"),
])
def test_bad_records_are_refused_with_a_reason(key, raw, reason):
    with pytest.raises(quota_topic.BadRecord) as caught:
        quota_topic.decode(key, raw)
    assert caught.value.reason == reason


# -- the store applying records (no broker: records handed to it) -------------------------------


class FakeCluster:
    class dialer:
        @staticmethod
        def log_failure(*args) -> None:
            pass


def batch(records, offset: int = 0) -> bytes:
    builder = MemoryRecordsBuilder(2, 0, 1 << 20, offset=offset)
    for key, raw in records:
        builder.append(timestamp=0, key=key, value=raw, headers=[])
    builder.close()
    return bytes(builder.buffer())


def apply_records(store: TopicStore, data: bytes) -> None:
    asyncio.run(store._apply_records(data))


def test_a_big_batch_read_back_is_applied_in_slices_with_the_loop_running_between():
    store = TopicStore("t", FakeCluster(), 1.0, lambda: None)  # type: ignore[arg-type]
    n = 3 * APPLY_SLICE_RECORDS + 7
    data = batch([quota_topic.encode(QuotaEntity.of({"user": f"u{i}"}), {"request_rate": float(i)}) for i in range(n)])
    turns: list[int] = []

    async def go() -> None:
        async def other() -> None:  # another task of the loop: it runs between the slices
            while True:
                turns.append(store.next_offset)
                await asyncio.sleep(0)

        task = asyncio.create_task(other())
        await asyncio.sleep(0)
        await store._apply_records(data)
        task.cancel()

    asyncio.run(go())
    applied_between = sorted({t for t in turns if 0 < t < n})
    assert applied_between == [APPLY_SLICE_RECORDS, 2 * APPLY_SLICE_RECORDS, 3 * APPLY_SLICE_RECORDS]
    assert store.next_offset == n and len(store) == n
    assert store.overlay[QuotaEntity.of({"user": f"u{n - 1}"})] == {"request_rate": float(n - 1)}


def test_the_store_applies_records_ignores_bad_ones_and_counts_them():
    changes = []
    store = TopicStore("t", FakeCluster(), 1.0, lambda: changes.append(1))  # type: ignore[arg-type]
    base = (QuotaRule("alice", None, {"request_rate": 100}),)
    apply_records(store, batch([
        quota_topic.encode(ALICE, {"producer_byte_rate": 10.0, "request_rate": None}),
        (KEY, value(v=99)),  # a later format: ignored, counted
        (b"junk", b"junk"),
        quota_topic.encode(DEFAULT_USER, {"request_rate": 5.0}),
    ]))
    assert store.merged(base) == {ALICE: {"producer_byte_rate": 10.0}, DEFAULT_USER: {"request_rate": 5.0}}
    assert store.bad_records == {"unknown_version": 1, "not_json": 1}
    assert (store.next_offset, store.last_applied_offset, len(changes)) == (4, 3, 1)
    # A tombstone gives the entity back to the file; records below next_offset are skipped.
    apply_records(store, batch([quota_topic.encode(DEFAULT_USER, {"request_rate": 9.0}),
                                quota_topic.encode(ALICE, {})], offset=3))
    assert store.merged(base) == {ALICE: {"request_rate": 100}, DEFAULT_USER: {"request_rate": 5.0}}
    assert store.next_offset == 5 and len(store) == 1


def test_a_record_older_than_the_one_applied_for_its_entity_is_skipped():
    store = TopicStore("t", FakeCluster(), 1.0, lambda: None)  # type: ignore[arg-type]
    store._set(ALICE, {"request_rate": 2.0}, 7)  # this instance's write, acknowledged at offset 7
    apply_records(store, batch([quota_topic.encode(ALICE, {"request_rate": 1.0})], offset=5))
    assert store.overlay[ALICE] == {"request_rate": 2.0}
    apply_records(store, batch([quota_topic.encode(ALICE, {"request_rate": 3.0})], offset=8))
    assert store.overlay[ALICE] == {"request_rate": 3.0}
