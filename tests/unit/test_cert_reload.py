"""The certificate reloader (``proxy.control.cert_reload.CertificateReloader``) on real PEM files, with
time passed in: a real ProxyServer (not started) with listen.tls and upstream.tls (mTLS to the
brokers) whose files live in a directory the test replaces them in.

What a context presents is read with an in-memory handshake (``ssl.MemoryBIO``): the server
context's certificate as a client sees it, the upstream context's client certificate as a broker
requiring one sees it.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from pathlib import Path

import pytest
import trustme

from config import parse_config
from proxy.app.server import ProxyServer
from proxy.control.cert_reload import CertificateReloader, tls_files, watch_certificates
from tests.support.certs import TestPki, chain_pem, leaf_der, replace_file
from tests.support.memory_tls import handshake_in_memory

DEBOUNCE_S = 0.5


class Files:
    """listen.tls's and upstream.tls's files."""

    def __init__(self, directory: Path, pki: TestPki) -> None:
        self.pki = pki
        self.first: trustme.LeafCert | None = None  # the pairs in force at start
        self.first_client: trustme.LeafCert | None = None
        self.cert, self.key = directory / "listen.crt", directory / "listen.key"
        self.client_cert, self.client_key = directory / "upstream.crt", directory / "upstream.key"
        self.ca = directory / "upstream-ca.pem"
        self.ca.write_bytes(Path(pki.ca_file).read_bytes())

    def server_pair(self, common_name: str) -> trustme.LeafCert:
        leaf = self.pki.ca.issue_cert("127.0.0.1", common_name=common_name)
        replace_file(self.cert, chain_pem(leaf))
        replace_file(self.key, leaf.private_key_pem.bytes())
        return leaf

    def client_pair(self, common_name: str) -> trustme.LeafCert:
        leaf = self.pki.ca.issue_cert(f"{common_name}.clients.test", common_name=common_name)
        replace_file(self.client_cert, chain_pem(leaf))
        replace_file(self.client_key, leaf.private_key_pem.bytes())
        return leaf


@pytest.fixture
def files(tmp_path, pki):
    live = tmp_path / "live"
    live.mkdir()
    f = Files(live, pki)
    f.first = f.server_pair("gen-1")
    f.first_client = f.client_pair("kqp-1")
    return f


@pytest.fixture
def server(files):
    return ProxyServer(parse_config({
        "upstream": {"bootstrap_servers": ["127.0.0.1:9"],
                     "tls": {"ca": str(files.ca), "certificate": str(files.client_cert), "key": str(files.client_key)}},
        "listen": {"tls": {"certificate": str(files.cert), "key": str(files.key)}},
        "metrics": {"enabled": False},
    }))


@pytest.fixture
def reloader(server):
    return CertificateReloader(server, DEBOUNCE_S)


def presented_by_listener(server: ProxyServer, pki: TestPki) -> bytes:
    """The certificate a client connecting now gets (DER)."""
    client, _ = handshake_in_memory(pki.client_context(), server.tls.context, "127.0.0.1")
    return client.getpeercert(binary_form=True)


def presented_to_brokers(server: ProxyServer, pki: TestPki) -> bytes:
    """The client certificate a broker connection opened now presents (DER)."""
    broker = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    broker.load_cert_chain(pki.server.cert, pki.server.key)
    broker.verify_mode = ssl.CERT_REQUIRED
    broker.load_verify_locations(cafile=pki.ca_file)
    _, side = handshake_in_memory(server.cluster.dialer.tls, broker, "127.0.0.1")
    return side.getpeercert(binary_form=True)


def _counts(server: ProxyServer) -> dict[str, int]:
    return dict(server.stats.certificate_reloads)


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.ERROR and r.name == "proxy.control.cert_reload"]


def test_every_tls_file_is_watched(reloader, files):
    assert sorted(reloader.files) == sorted(map(str, (files.cert, files.key, files.ca, files.client_cert,
                                                      files.client_key)))
    assert tls_files(reloader.server) == reloader.files


def test_nothing_changes_and_nothing_is_read(reloader, server, pki, files):
    before = (server.tls, server.cluster.dialer.tls)
    assert reloader.poll_interval_s == CertificateReloader.POLL_S
    for now in (0.0, 1.0, 100.0):
        assert not reloader.poll_at(now)
    assert (server.tls, server.cluster.dialer.tls) == before
    assert _counts(server) == {}
    assert presented_by_listener(server, pki) == leaf_der(files.first)
    assert presented_to_brokers(server, pki) == leaf_der(files.first_client)


def test_no_reload_until_the_files_are_stable_for_the_debounce(reloader, server, pki, files):
    old = server.tls
    second = files.server_pair("gen-2")
    assert not reloader.poll_at(100.0)  # the change is seen: it settles from now
    assert reloader.poll_interval_s == pytest.approx(DEBOUNCE_S / 4)  # polled faster meanwhile
    assert not reloader.poll_at(100.0 + DEBOUNCE_S - 0.01)
    assert server.tls is old and _counts(server) == {}
    assert presented_by_listener(server, pki) == leaf_der(files.first)

    assert reloader.poll_at(100.0 + DEBOUNCE_S)
    assert server.tls is not old
    assert presented_by_listener(server, pki) == leaf_der(second)
    assert _counts(server) == {"success": 1}
    assert reloader.poll_interval_s == CertificateReloader.POLL_S
    # Taken once: later polls see nothing new.
    for now in (101.0, 102.0, 200.0):
        assert not reloader.poll_at(now)
    assert _counts(server) == {"success": 1}


def test_a_certificate_and_its_key_replaced_at_different_times_are_read_together(reloader, server, pki, files,
                                                                                caplog):
    second = files.pki.ca.issue_cert("127.0.0.1", common_name="gen-2")
    replace_file(files.cert, chain_pem(second))  # the new certificate with the old key: no pair yet
    assert not reloader.poll_at(10.0)
    assert not reloader.poll_at(10.3)
    replace_file(files.key, second.private_key_pem.bytes())  # the key follows within the debounce
    assert not reloader.poll_at(10.45)
    # The certificate has been stable for longer than the debounce, the key has not: not yet.
    assert not reloader.poll_at(10.6)
    assert _counts(server) == {}
    assert reloader.poll_at(10.45 + DEBOUNCE_S)
    assert _counts(server) == {"success": 1}
    assert presented_by_listener(server, pki) == leaf_der(second)
    assert _errors(caplog) == []


def test_a_failed_reload_keeps_the_contexts_in_force_and_names_the_file(reloader, server, pki, files, caplog):
    old_listener, old_dialer = server.tls, server.cluster.dialer.tls
    replace_file(files.cert, b"-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    assert not reloader.poll_at(0.0)
    with caplog.at_level(logging.ERROR, logger="proxy.control.cert_reload"):
        assert not reloader.poll_at(DEBOUNCE_S)
    assert server.tls is old_listener and server.cluster.dialer.tls is old_dialer
    assert _counts(server) == {"failure": 1}
    [message] = _errors(caplog)
    assert "the certificates in force stay" in message
    assert "listen.tls.certificate" in message and str(files.cert) in message, message
    assert presented_by_listener(server, pki) == leaf_der(files.first)


def test_a_key_that_is_not_the_certificates_is_refused(reloader, server, pki, files, caplog):
    old = server.tls
    stray = files.pki.ca.issue_cert("127.0.0.1", common_name="stray")
    replace_file(files.key, stray.private_key_pem.bytes())
    assert not reloader.poll_at(0.0)
    with caplog.at_level(logging.ERROR, logger="proxy.control.cert_reload"):
        assert not reloader.poll_at(DEBOUNCE_S)
    assert server.tls is old and _counts(server) == {"failure": 1}
    [message] = _errors(caplog)
    assert str(files.key) in message and str(files.cert) in message, message


def test_the_same_broken_files_are_not_read_again_until_they_change(reloader, server, pki, files, caplog):
    replace_file(files.cert, b"garbage\n")
    reloader.poll_at(0.0)
    with caplog.at_level(logging.ERROR, logger="proxy.control.cert_reload"):
        assert not reloader.poll_at(DEBOUNCE_S)
        for now in (1.0, 2.0, 5.0, 100.0):
            assert not reloader.poll_at(now)
    assert _counts(server) == {"failure": 1}
    assert len(_errors(caplog)) == 1
    assert reloader.poll_interval_s == CertificateReloader.POLL_S  # nothing settling

    # SIGHUP asks: the files are read again, and still fail.
    assert not reloader.reload_now()
    assert _counts(server) == {"failure": 2}

    # A fix is a change: taken after the debounce.
    third = files.server_pair("gen-3")
    assert not reloader.poll_at(200.0)
    assert reloader.poll_at(200.0 + DEBOUNCE_S)
    assert _counts(server) == {"failure": 2, "success": 1}
    assert presented_by_listener(server, pki) == leaf_der(third)


def test_a_missing_file_fails_and_its_return_is_taken(reloader, server, pki, files, caplog):
    old = server.tls
    key = files.key.read_bytes()
    files.key.unlink()
    reloader.poll_at(0.0)
    with caplog.at_level(logging.ERROR, logger="proxy.control.cert_reload"):
        assert not reloader.poll_at(DEBOUNCE_S)
    assert server.tls is old and _counts(server) == {"failure": 1}
    [message] = _errors(caplog)
    assert "listen.tls.key" in message and str(files.key) in message, message

    replace_file(files.key, key)
    assert not reloader.poll_at(10.0)
    assert reloader.poll_at(10.0 + DEBOUNCE_S)
    assert _counts(server) == {"failure": 1, "success": 1}
    assert server.tls is not old
    assert presented_by_listener(server, pki) == leaf_der(files.first)


def test_the_upstream_files_are_reloaded_too_and_all_or_nothing(reloader, server, pki, files, caplog):
    old_dialer = server.cluster.dialer.tls
    # A new client certificate for the brokers.
    second_client = files.client_pair("kqp-2")
    reloader.poll_at(0.0)
    assert reloader.poll_at(DEBOUNCE_S)
    assert server.cluster.dialer.tls is not old_dialer
    assert presented_to_brokers(server, pki) == leaf_der(second_client)
    assert presented_by_listener(server, pki) == leaf_der(files.first)

    # A broken upstream CA bundle, with a new listener certificate at the same time: neither is
    # taken (the listener's files alone would load).
    listener, dialer = server.tls, server.cluster.dialer.tls
    files.server_pair("gen-2")
    replace_file(files.ca, b"not a CA bundle\n")
    reloader.poll_at(10.0)
    with caplog.at_level(logging.ERROR, logger="proxy.control.cert_reload"):
        assert not reloader.poll_at(10.0 + DEBOUNCE_S)
    assert server.tls is listener and server.cluster.dialer.tls is dialer
    [message] = _errors(caplog)
    assert "upstream.tls.ca" in message and str(files.ca) in message, message
    assert presented_by_listener(server, pki) == leaf_der(files.first)
    assert presented_to_brokers(server, pki) == leaf_der(second_client)
    assert _counts(server) == {"success": 1, "failure": 1}


def test_reload_now_reads_at_once_and_settles_the_pending_change(reloader, server, pki, files):
    second = files.server_pair("gen-2")
    assert not reloader.poll_at(0.0)  # settling
    assert reloader.reload_now()
    assert presented_by_listener(server, pki) == leaf_der(second)
    assert _counts(server) == {"success": 1}
    # The change SIGHUP took is not taken a second time once its debounce has passed.
    for now in (DEBOUNCE_S, 1.0, 10.0):
        assert not reloader.poll_at(now)
    assert _counts(server) == {"success": 1}
    assert reloader.poll_interval_s == CertificateReloader.POLL_S


def test_the_watch_goes_on_after_a_poll_that_raised(reloader, monkeypatch, caplog):
    calls = []

    def poll_at(now_s: float) -> bool:
        calls.append(now_s)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return False

    monkeypatch.setattr(CertificateReloader, "POLL_S", 0.001)
    monkeypatch.setattr(reloader, "poll_at", poll_at)
    ticks = iter(range(1000))

    async def run() -> None:
        task = asyncio.get_running_loop().create_task(watch_certificates(reloader, clock=lambda: float(next(ticks))))
        while len(calls) < 3:
            await asyncio.sleep(0.001)
        task.cancel()

    with caplog.at_level(logging.ERROR, logger="proxy.control.cert_reload"):
        asyncio.run(asyncio.wait_for(run(), 5))
    assert calls[:3] == [0.0, 1.0, 2.0]
    assert any("still watching" in m for m in _errors(caplog))


def _identity_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "proxy.identity.upstream_identity"]


def test_a_new_upstream_client_certificate_logs_the_new_identity_once(reloader, server, files, caplog):
    caplog.set_level(logging.INFO)
    server.cluster.dialer.announce_identity()  # as ProxyServer.start does
    [first] = _identity_lines(caplog)
    assert first.startswith("upstream identity: client certificate CN=kqp-1,"), first

    # The listener's certificate alone: the upstream identity did not change, nothing said.
    files.server_pair("gen-2")
    reloader.poll_at(0.0)
    assert reloader.poll_at(DEBOUNCE_S)
    assert reloader.reload_now()  # nor when SIGHUP reads the same upstream files again
    assert len(_identity_lines(caplog)) == 1

    files.client_pair("kqp-2")
    reloader.poll_at(10.0)
    assert reloader.poll_at(10.0 + DEBOUNCE_S)
    for now in (11.0, 12.0, 100.0):
        assert not reloader.poll_at(now)
    lines = _identity_lines(caplog)
    assert len(lines) == 2, lines
    assert lines[1].startswith("upstream identity changed (upstream TLS files reloaded): client certificate "
                               "CN=kqp-2,"), lines[1]
    assert f"upstream.tls.ca {files.ca} (CA " in lines[1], lines[1]
    # Said after the reload it comes from.
    messages = [r.getMessage() for r in caplog.records]
    reloaded = [i for i, m in enumerate(messages) if m.startswith("certificates reloaded")]
    assert messages.index(lines[1]) == reloaded[-1] + 1, messages
