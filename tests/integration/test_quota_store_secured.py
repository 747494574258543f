"""The quota store's own connections use the upstream settings: SASL against a broker that
refuses anything else before authentication, and TLS to a broker that speaks only TLS.

Brokers: Tansu behind :class:`tests.support.sasl_front.SaslFront` with
``require_authentication`` (as a Kafka SASL listener, it closes a connection whose first
request after ApiVersions is not SASL), and Tansu behind stunnel (``tls_tansu``). Two proxy
instances share the store in each: an Alter through A is described by B, which read it from the
topic through the same secured connections.
"""

from __future__ import annotations

import pytest

from tests.integration.test_client_quota_api import AdminConnection, set_
from tests.support.inproc import InProcessProxy
from tests.support.polling import wait_for
from tests.support.sasl_front import tansu_behind_sasl_front

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ALICE = (("user", "alice"),)
REQUEST_TIMED_OUT = 7
USERS = {"kqp": "kqp-secret"}


def instance(bootstrap: str, **upstream) -> InProcessProxy:
    return InProcessProxy([bootstrap], upstream=upstream,
                          quota_admin={"enabled": True, "principals": ["ANONYMOUS"]}).start()


def described_by_both(a: InProcessProxy, b: InProcessProxy, value: float) -> None:
    ca, cb = AdminConnection(a.address), AdminConnection(b.address)
    try:
        assert ca.alter(1, [(ALICE, [set_("request_rate", value)])]) == [(ALICE, 0, None)]
        wait_for(lambda: cb.quotas(1).get(ALICE) == {"request_rate": value}, what="B to describe A's change")
    finally:
        ca.close()
        cb.close()


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-512"])
def test_the_store_authenticates_with_the_upstream_sasl_settings(tmp_path, mechanism):
    secret = tmp_path / "kqp.password"
    secret.write_text(USERS["kqp"] + "\n")
    sasl = {"mechanism": mechanism, "username": "kqp", "password_file": str(secret)}
    with tansu_behind_sasl_front(USERS, require_authentication=True) as behind:
        a, b = instance(behind.bootstrap, sasl=sasl), instance(behind.bootstrap, sasl=sasl)
        try:
            assert a.server.ready()[0] and b.server.ready()[0], (a.server.ready(), b.server.ready())
            described_by_both(a, b, 250)
        finally:
            a.stop()
            b.stop()
        relayed = [c for c in behind.front.connections if c.relayed]
        # The proxies' own connections: refresh, topic creation, both followers, A's producer.
        assert len(relayed) >= 4
        assert {(c.user, c.mechanism) for c in relayed} == {("kqp", mechanism)}
        assert [c.refused_api for c in behind.front.connections if c.refused_api is not None] == []


def test_without_upstream_sasl_the_store_is_refused_and_says_so():
    """The control: the front really refuses unauthenticated connections."""
    with tansu_behind_sasl_front(USERS, require_authentication=True) as behind:
        a = instance(behind.bootstrap)
        try:
            ready, detail = a.server.ready()
            assert not ready and "quota store __kqp_client_quotas: not read yet" in detail, detail
            c = AdminConnection(a.address)
            answered = c.alter(1, [(ALICE, [set_("request_rate", 250)])])
            assert [(e, code) for e, code, _ in answered] == [(ALICE, REQUEST_TIMED_OUT)]
            c.close()
        finally:
            a.stop()
        assert any(c.refused_api is not None for c in behind.front.connections)


def test_the_store_speaks_tls_to_the_brokers(tls_tansu, pki):
    tls = {"ca": pki.ca_file}
    a, b = instance(tls_tansu.bootstrap, tls=tls), instance(tls_tansu.bootstrap, tls=tls)
    try:
        assert a.server.ready()[0] and b.server.ready()[0], (a.server.ready(), b.server.ready())
        described_by_both(a, b, 125)
        assert a.metric("kqp_quota_store_errors_total", op="write") == 0
        assert b.metric("kqp_quota_store_errors_total", op="read") == 0
    finally:
        a.stop()
        b.stop()
    # A new instance without TLS cannot read the TLS-only broker: not ready, the file's quotas.
    c = instance(tls_tansu.bootstrap)
    try:
        assert not c.server.ready()[0]
    finally:
        c.stop()
