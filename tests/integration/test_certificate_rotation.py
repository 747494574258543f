"""Certificate rotation without a restart (proxy.control.cert_reload), on the proxy as a real process with
``listen.tls`` files in a directory the test owns and a short ``reload.debounce_ms``:

- replaced files (a new certificate and key, each put in place by a rename) are taken within a
  few seconds: new TLS connections get the new certificate, a connection opened before keeps its
  own and still works; counted in ``kqp_certificate_reloads_total{outcome="success"}``;
- a broken replacement (not PEM, a key that is not the certificate's) is logged at ERROR naming
  the file, counted as a failure, and the certificate in force stays; a fix is then taken;
- SIGHUP reloads at once, whatever the debounce;
- a rotated upstream client certificate (mTLS to a broker that requires one) is taken and the
  proxy's new upstream identity, its CN, is logged once.

The certificate a connection got is compared as DER (``getpeercert(binary_form=True)``).
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import time
from pathlib import Path

import pytest
import trustme

from tests.support.certs import TestPki, chain_pem, leaf_der, replace_file
from tests.support.polling import wait_for
from tests.support.tls_broker import TlsTansu
from tests.support.wire import api_versions_round_trip

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

RELOADS = "kqp_certificate_reloads_total"


class LiveFiles:
    """The certificate and key paths listen.tls names; replaced the way a tool would."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir()
        self.cert = directory / "tls.crt"
        self.key = directory / "tls.key"

    def install(self, leaf: trustme.LeafCert) -> bytes:
        """Puts ``leaf``'s chain and key in place (each by a rename); returns its DER."""
        replace_file(self.cert, chain_pem(leaf))
        replace_file(self.key, leaf.private_key_pem.bytes())
        return leaf_der(leaf)


def _issue(pki: TestPki, common_name: str) -> trustme.LeafCert:
    return pki.ca.issue_cert("127.0.0.1", "localhost", common_name=common_name)


def _start(proxy, tansu, live: LiveFiles, debounce_ms: int):
    return proxy([tansu.bootstrap], extra_config={
        "listen": {"tls": {"certificate": str(live.cert), "key": str(live.key)}},
        "reload": {"debounce_ms": debounce_ms},
    })


def _connect(p, pki: TestPki) -> ssl.SSLSocket:
    raw = socket.create_connection(p.address, timeout=5)
    return pki.client_context().wrap_socket(raw, server_hostname="127.0.0.1")


def _presented(p, pki: TestPki) -> bytes:
    """The certificate a new TLS connection gets (DER); the connection answers ApiVersions."""
    with _connect(p, pki) as s:
        assert api_versions_round_trip(s) == 7
        return s.getpeercert(binary_form=True)




def _reloads(p) -> dict[str, float]:
    return {outcome: p.metric_sum(RELOADS, outcome=outcome) for outcome in ("success", "failure")}


def _error_lines(p) -> list[str]:
    return [line for line in p.log_text().splitlines() if "level=ERROR" in line]


def test_replaced_files_are_taken_by_new_connections_and_open_ones_keep_theirs(tansu, proxy, pki, tmp_path):
    live = LiveFiles(tmp_path / "live")
    first = live.install(_issue(pki, "proxy-gen-1"))
    p = _start(proxy, tansu, live, debounce_ms=100)
    held = _connect(p, pki)
    try:
        assert held.getpeercert(binary_form=True) == first
        assert api_versions_round_trip(held, 1) == 1
        assert _reloads(p) == {"success": 0, "failure": 0}

        second = live.install(_issue(pki, "proxy-gen-2"))
        assert second != first
        started = time.monotonic()
        wait_for(lambda: _presented(p, pki) == second, 15, "new connections to get the new certificate")
        # The poll runs every second, then the debounce (100 ms): about 1 s on a quiet machine.
        print(f"\nnew certificate presented {time.monotonic() - started:.2f} s after the files were replaced")

        # The connection opened before the change still works, on the certificate it got.
        assert api_versions_round_trip(held, 2) == 2
        assert held.getpeercert(binary_form=True) == first
    finally:
        held.close()
    assert _reloads(p) == {"success": 1, "failure": 0}  # the pair, read once both were in place
    assert "certificates reloaded" in p.log_text()
    assert _error_lines(p) == []
    assert p.metric_sum("kqp_tls_handshake_failures_total") == 0


def test_a_broken_replacement_keeps_the_certificate_in_force_until_fixed(tansu, proxy, pki, tmp_path):
    live = LiveFiles(tmp_path / "live")
    first = live.install(_issue(pki, "proxy-gen-1"))
    p = _start(proxy, tansu, live, debounce_ms=100)
    assert _presented(p, pki) == first

    # Not PEM at all.
    replace_file(live.cert, b"-----BEGIN CERTIFICATE-----\ngarbage\n-----END CERTIFICATE-----\n")
    wait_for(lambda: _reloads(p)["failure"] == 1, 15, "the failed reload to be counted")
    errors = _error_lines(p)
    assert len(errors) == 1, errors
    assert "the certificates in force stay" in errors[0] and str(live.cert) in errors[0], errors
    assert "listen.tls.certificate" in errors[0], errors
    assert _presented(p, pki) == first

    # A valid certificate, but the key is another certificate's.
    second = _issue(pki, "proxy-gen-2")
    stray = _issue(pki, "stray")
    replace_file(live.cert, chain_pem(second))
    replace_file(live.key, stray.private_key_pem.bytes())
    wait_for(lambda: _reloads(p)["failure"] == 2, 15, "the mismatched key to be counted")
    errors = _error_lines(p)
    assert len(errors) == 2, errors
    assert "the certificates in force stay" in errors[1] and str(live.key) in errors[1], errors
    assert _presented(p, pki) == first
    assert _reloads(p)["success"] == 0

    # The fix: the key that goes with the certificate.
    replace_file(live.key, second.private_key_pem.bytes())
    wait_for(lambda: _presented(p, pki) == leaf_der(second), 15, "the fixed pair to be taken")
    assert _reloads(p) == {"success": 1, "failure": 2}
    assert p.process.poll() is None


def test_sighup_reloads_at_once_whatever_the_debounce(tansu, proxy, pki, tmp_path):
    live = LiveFiles(tmp_path / "live")
    first = live.install(_issue(pki, "proxy-gen-1"))
    p = _start(proxy, tansu, live, debounce_ms=60_000)
    second = live.install(_issue(pki, "proxy-gen-2"))
    # Past the next poll (every second) the change is seen but still settling for a minute.
    time.sleep(1.3)
    assert _presented(p, pki) == first
    assert _reloads(p) == {"success": 0, "failure": 0}

    os.kill(p.pid, signal.SIGHUP)
    # At once: well before the minute the debounce would hold it.
    wait_for(lambda: _presented(p, pki) == second, 15, "SIGHUP to take the new certificate")
    assert _reloads(p) == {"success": 1, "failure": 0}
    assert "certificates reloaded (SIGHUP)" in p.log_text()
    assert _error_lines(p) == []


def _identity_lines(p) -> list[str]:
    return [line for line in p.log_text().splitlines() if "upstream identity" in line]


def test_a_rotated_upstream_client_certificate_logs_the_new_identity_once(proxy, pki, tmp_path):
    live = LiveFiles(tmp_path / "upstream")
    live.install(pki.ca.issue_cert("kqp-gen-1.clients.test", common_name="kqp-gen-1"))
    with TlsTansu(pki.server, verify_client_ca=pki.ca_file, probe_client=pki.client("probe", "probe")) as broker:
        p = proxy([broker.bootstrap], extra_config={
            "upstream": {"connect_timeout_s": 3, "tls": {"ca": pki.ca_file, "certificate": str(live.cert),
                                                         "key": str(live.key)}},
            "reload": {"debounce_ms": 100},
        })
        [line] = _identity_lines(p)
        assert "level=INFO" in line and "upstream identity: client certificate CN=kqp-gen-1," in line, line
        assert f"upstream.tls.ca {pki.ca_file} (CA " in line, line

        live.install(pki.ca.issue_cert("kqp-gen-2.clients.test", common_name="kqp-gen-2"))
        wait_for(lambda: _reloads(p)["success"] == 1, 15, "the upstream certificate to be reloaded")
        # The broker takes the new certificate: a client is still served through the proxy.
        with socket.create_connection(p.address, timeout=5) as s:
            assert api_versions_round_trip(s, 3) == 3
        time.sleep(1.3)  # another poll of the files: nothing new to say
        lines = _identity_lines(p)
        assert len(lines) == 2, lines
        assert "upstream identity changed (upstream TLS files reloaded): client certificate CN=kqp-gen-2," in lines[1]
        assert "CN=kqp-gen-1," not in lines[1]
        assert _reloads(p) == {"success": 1, "failure": 0}
        assert _error_lines(p) == []
