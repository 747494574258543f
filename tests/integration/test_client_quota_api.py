"""DescribeClientQuotas and AlterClientQuotas through the proxy, in front of a real Tansu (which
supports neither: it closes the connection on them).

With ``quota_admin`` on, the proxy offers both APIs in ApiVersions and answers them itself, at
v0 and v1, on a raw connection sending kafka-python's requests: the file's quotas merged with
what was altered, every match type, strict, validate_only, bad keys, an unauthorized principal.
An Alter of ``producer_byte_rate`` for the connection's own principal (ANONYMOUS) holds back a
kafka-python producer at once, and is audited. With it off, both requests reach Tansu.
"""

from __future__ import annotations

import logging
import socket
import struct
import time

import pytest
from kafka import KafkaProducer
from kafka.protocol.admin import (
    AlterClientQuotasRequest,
    AlterClientQuotasResponse,
    DescribeClientQuotasRequest,
    DescribeClientQuotasResponse,
)

from tests.support.inproc import InProcessProxy
from tests.support.rate_runs import fresh_topic
from tests.support.wire import api_versions, read_frame, request_bytes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

VERSIONS = (0, 1)
EXACT, DEFAULT, SPECIFIED = 0, 1, 2
CLUSTER_AUTHORIZATION_FAILED = 31
INVALID_REQUEST = 42
FILE_QUOTAS = [
    {"user": "alice", "producer_byte_rate": 1048576},
    {"user": "alice", "client_id": "app", "consumer_byte_rate": 2097152},
    {"user": "<default>", "request_rate": 500},
    {"client_id": "<default>", "request_rate": 1000},
]
ALICE = (("user", "alice"),)
ALICE_APP = (("client-id", "app"), ("user", "alice"))
DEFAULT_USER = (("user", None),)
DEFAULT_CLIENT = (("client-id", None),)


def admin_proxy(tansu, principals=("User:ANONYMOUS",), enabled=True) -> InProcessProxy:
    return InProcessProxy([tansu.bootstrap], quotas=FILE_QUOTAS, quota_windows={
        "quota_window_num": 2, "quota_window_size_seconds": 1,  # throttles within a second
    }, quota_admin={"enabled": enabled, "principals": list(principals)})


class AdminConnection:
    """One raw client connection (principal ANONYMOUS) sending the two requests."""

    def __init__(self, address) -> None:
        self.sock = socket.create_connection(address, timeout=10)
        self.correlation_id = 0

    def round_trip(self, req, response_cls, version: int):
        self.correlation_id += 1
        self.sock.sendall(request_bytes(req, self.correlation_id, "quota-admin"))
        frame = read_frame(self.sock)
        assert frame is not None, "the connection was closed"
        assert struct.unpack(">i", frame[:4])[0] == self.correlation_id
        return response_cls.decode(frame, version=version, header=True)

    def describe(self, version: int, components=(), strict=False):
        R = DescribeClientQuotasRequest[version]
        comps = [R.ComponentData(entity_type=t, match_type=m, match=s) for t, m, s in components]
        return self.round_trip(R(components=comps, strict=strict), DescribeClientQuotasResponse, version)

    def quotas(self, version: int, components=(), strict=False) -> dict:
        """{entity as ((type, name), ...) in the response's order: {key: value}}."""
        resp = self.describe(version, components, strict)
        assert (resp.error_code, resp.error_message) == (0, None)
        return {tuple((e.entity_type, e.entity_name) for e in x.entity): {v.key: v.value for v in x.values}
                for x in resp.entries}

    def alter(self, version: int, entries, validate_only=False) -> list[tuple[tuple, int, str | None]]:
        """[(entity, error_code, error_message)] per entity answered."""
        R = AlterClientQuotasRequest[version]
        E = R.EntryData
        data = [E(entity=[E.EntityData(entity_type=t, entity_name=n) for t, n in entity],
                  ops=[E.OpData(key=k, value=v, remove=r) for k, v, r in ops]) for entity, ops in entries]
        resp = self.round_trip(R(entries=data, validate_only=validate_only), AlterClientQuotasResponse, version)
        assert resp.throttle_time_ms == 0
        return [(tuple((d.entity_type, d.entity_name) for d in e.entity), e.error_code, e.error_message)
                for e in resp.entries]

    def close(self) -> None:
        self.sock.close()


def set_(key, value):
    return (key, float(value), False)


def remove(key):
    return (key, 0.0, True)


def test_api_versions_offers_both_apis_though_tansu_has_neither(tansu):
    with admin_proxy(tansu) as p:
        offered = {e.api_key: (e.min_version, e.max_version) for e in api_versions(p.address).api_keys}
    assert offered[48] == (0, 1) and offered[49] == (0, 1)
    assert 48 not in {e.api_key for e in api_versions((tansu.host, tansu.port)).api_keys}


@pytest.mark.parametrize("version", VERSIONS)
def test_add_change_remove_and_describe_the_merged_view(tansu, version, caplog):
    caplog.set_level(logging.INFO, logger="proxy.audit")
    with admin_proxy(tansu) as p:
        c = AdminConnection(p.address)
        assert c.quotas(version) == {ALICE: {"producer_byte_rate": 1048576.0},
                                     ALICE_APP: {"consumer_byte_rate": 2097152.0},
                                     DEFAULT_USER: {"request_rate": 500.0}, DEFAULT_CLIENT: {"request_rate": 1000.0}}
        answered = c.alter(version, [
            ([("user", "alice")], [set_("producer_byte_rate", 2097152), set_("request_rate", 20)]),  # change, add
            ([("user", "bob"), ("client-id", None)], [set_("consumer_byte_rate", 4096)]),  # a new entity
            ([("user", None)], [remove("request_rate")]),  # the file's, removed: the entity is gone
            ([("client-id", None)], [remove("producer_byte_rate")]),  # not set: a successful no-op
        ])
        assert answered == [(ALICE, 0, None), ((("client-id", None), ("user", "bob")), 0, None),
                            (DEFAULT_USER, 0, None), (DEFAULT_CLIENT, 0, None)]
        assert c.quotas(version) == {ALICE: {"producer_byte_rate": 2097152.0, "request_rate": 20.0},
                                     ALICE_APP: {"consumer_byte_rate": 2097152.0},
                                     DEFAULT_CLIENT: {"request_rate": 1000.0},
                                     (("client-id", None), ("user", "bob")): {"consumer_byte_rate": 4096.0}}
        # Removing what the Admin API set brings nothing of the file back: the removal is the overlay's.
        assert c.alter(version, [([("user", "alice")], [remove("request_rate"), remove("producer_byte_rate")])]) == [
            (ALICE, 0, None)]
        assert ALICE not in c.quotas(version)
        assert p.metric("kqp_local_responses_total", api="DescribeClientQuotas") == 3
        assert p.metric("kqp_local_responses_total", api="AlterClientQuotas") == 2
        c.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "proxy.audit"]
    changes = [line.split(": ", 1)[1] for line in lines]
    assert all(line.startswith("quota change by principal=ANONYMOUS client=127.0.0.1:") for line in lines)
    assert changes == [
        "user=alice producer_byte_rate 1048576 -> 2097152",
        "user=alice request_rate (none) -> 20",
        "user=bob client-id=<default> consumer_byte_rate (none) -> 4096",
        "user=<default> request_rate 500 -> (none)",
        "user=alice request_rate 20 -> (none)",
        "user=alice producer_byte_rate 2097152 -> (none)",
    ]


@pytest.mark.parametrize("version", VERSIONS)
def test_describe_match_types_and_strict(tansu, version):
    with admin_proxy(tansu) as p:
        c = AdminConnection(p.address)
        assert set(c.quotas(version, [("user", EXACT, "alice")])) == {ALICE, ALICE_APP}
        assert set(c.quotas(version, [("user", EXACT, "alice")], strict=True)) == {ALICE}
        assert set(c.quotas(version, [("user", DEFAULT, None)])) == {DEFAULT_USER}
        assert set(c.quotas(version, [("client-id", SPECIFIED, None)])) == {ALICE_APP, DEFAULT_CLIENT}
        assert set(c.quotas(version, [("client-id", SPECIFIED, None)], strict=True)) == {DEFAULT_CLIENT}
        assert set(c.quotas(version, [("user", EXACT, "alice"), ("client-id", EXACT, "app")])) == {ALICE_APP}
        assert c.quotas(version, [("user", EXACT, "nobody")]) == {}
        bad = c.describe(version, [("user", EXACT, None)])
        assert (bad.error_code, bad.entries) == (INVALID_REQUEST, None)
        assert bad.error_message == "Request specified MATCH_TYPE_EXACT, but set match string to null."
        c.close()


@pytest.mark.parametrize("version", VERSIONS)
def test_validate_only_changes_nothing_and_bad_keys_fail_their_entry(tansu, version):
    with admin_proxy(tansu) as p:
        c = AdminConnection(p.address)
        before = c.quotas(version)
        assert c.alter(version, [([("user", "alice")], [set_("producer_byte_rate", 1)])], validate_only=True) == [
            (ALICE, 0, None)]
        assert c.alter(version, [([("user", "alice")], [set_("producer_byte_rate", 1)]),
                                 ([("user", "bob")], [set_("producer_byte_rat", 1)])], validate_only=True) == [
            (ALICE, 0, None), ((("user", "bob"),), INVALID_REQUEST, "Invalid configuration key producer_byte_rat")]
        assert c.quotas(version) == before
        # Not validating: the good entry is applied, the bad one fails on its own.
        answered = c.alter(version, [([("user", "carol")], [set_("request_rate", 5)]),
                                     ([("user", "dave")], [set_("request_rate", 5), set_("bogus", 1)]),
                                     ([("user", "erin")], [set_("producer_byte_rate", 1.5)])])
        assert answered == [((("user", "carol"),), 0, None),
                            ((("user", "dave"),), INVALID_REQUEST, "Invalid configuration key bogus"),
                            ((("user", "erin"),), INVALID_REQUEST, "producer_byte_rate cannot be a fractional value.")]
        after = c.quotas(version)
        assert after == {**before, (("user", "carol"),): {"request_rate": 5.0}}
        c.close()


@pytest.mark.parametrize("version", VERSIONS)
def test_an_unauthorized_principal_gets_cluster_authorization_failed_everywhere(tansu, version):
    with admin_proxy(tansu, principals=["alice"]) as p:
        c = AdminConnection(p.address)
        resp = c.describe(version)
        assert (resp.error_code, resp.error_message, resp.entries) == (CLUSTER_AUTHORIZATION_FAILED, None, None)
        answered = c.alter(version, [([("user", "ANONYMOUS")], [set_("producer_byte_rate", 1)]),
                                     ([("user", "bob")], [set_("bogus", 1)])])
        assert [(code, message) for _, code, message in answered] == [
            (CLUSTER_AUTHORIZATION_FAILED, "Cluster authorization failed.")] * 2
        assert p.run(lambda: p.server.rules_in_force) == p.server.config.quotas
        c.close()


def test_an_altered_producer_byte_rate_holds_back_a_producer_at_once(tansu, caplog):
    caplog.set_level(logging.INFO, logger="proxy.audit")
    quota = 20 * 1024  # bytes/s
    topic = fresh_topic(tansu, "altered-quota")
    with admin_proxy(tansu) as p:
        c = AdminConnection(p.address)
        assert c.alter(1, [([("user", "ANONYMOUS")], [set_("producer_byte_rate", quota)])]) == [
            ((("user", "ANONYMOUS"),), 0, None)]
        producer = KafkaProducer(bootstrap_servers=p.bootstrap, client_id="held-back", acks=1, linger_ms=5,
                                 batch_size=4096, request_timeout_ms=20_000)
        try:
            start = time.monotonic()
            for i in range(100):  # ~100 KiB at 20 KiB/s: a few seconds
                producer.send(topic, b"x" * 1024, key=b"%d" % i)
            producer.flush(60)
            elapsed_s = time.monotonic() - start
        finally:
            producer.close()
        assert p.metric("kqp_quota_bound", kind="producer_byte_rate", user="ANONYMOUS") == quota
        assert p.metric("kqp_quota_throttled_total", kind="producer_byte_rate") > 0
        # 100 KiB over a 1 s window of 20 KiB/s: at least ~4 s once the first window is spent.
        assert elapsed_s > 2.5, f"100 KiB took {elapsed_s:.1f} s at a quota of 20 KiB/s"
        c.close()
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records if r.name == "proxy.audit"] == [
        "user=ANONYMOUS producer_byte_rate (none) -> 20480"]


def test_off_both_requests_reach_the_broker(tansu):
    with admin_proxy(tansu, enabled=False) as p:
        assert 48 not in {e.api_key for e in api_versions(p.address).api_keys}
        for req in (DescribeClientQuotasRequest[0](components=[], strict=False),
                    AlterClientQuotasRequest[1](entries=[], validate_only=True)):
            with socket.create_connection(p.address, timeout=10) as s:
                s.sendall(request_bytes(req, 1))
                read_frame(s)  # Tansu 0.6.0 closes the connection: whatever it answers goes back
        assert p.metric("kqp_requests_total", api="DescribeClientQuotas") == 1
        assert p.metric("kqp_requests_total", api="AlterClientQuotas") == 1
        assert p.metric("kqp_local_responses_total", api="DescribeClientQuotas") == 0
        assert p.metric("kqp_local_responses_total", api="AlterClientQuotas") == 0
