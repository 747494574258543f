"""Shared fixtures: a real Tansu broker, the same behind a counting relay, the proxy process;
certificates made for the test (``pki``) and Tansu behind stunnel speaking TLS (``tls_tansu``).

Every server listens on 127.0.0.1 on a port the OS picked, and the test that started it
stops it (all fixtures here are function-scoped; Tansu starts in well under a second).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from tests.support.certs import TestPki
from tests.support.proxy_process import ProxyProcess
from tests.support.relay import CountingRelay
from tests.support.tansu import TansuBroker
from tests.support.tls_broker import TlsTansu


@dataclass
class BrokerBehindRelay:
    """Tansu listening on ``broker.port`` but advertising ``relay.port``."""

    broker: TansuBroker
    relay: CountingRelay

    @property
    def bootstrap(self) -> str:
        """The address to give the proxy: the relay's, so every connection is counted."""
        return self.relay.bootstrap


@pytest.fixture
def tansu():
    with TansuBroker() as broker:
        yield broker


@pytest.fixture
def relay_tansu():
    relay = CountingRelay(candidate_pids=(os.getpid(),)).start()
    try:
        with TansuBroker(advertised_port=relay.port) as broker:
            relay.target = (broker.host, broker.port)
            yield BrokerBehindRelay(broker=broker, relay=relay)
    finally:
        relay.stop()


@pytest.fixture
def pki(tmp_path):
    """A test CA, a server certificate for 127.0.0.1 and client certificates on demand, as PEM
    files in ``tmp_path``."""
    return TestPki(tmp_path)


@pytest.fixture
def tls_tansu(pki):
    """Tansu behind stunnel: TLS on ``bootstrap`` with ``pki.server``'s certificate."""
    with TlsTansu(pki.server) as broker:
        yield broker


@pytest.fixture
def proxy():
    """Factory: ``proxy([bootstrap, ...], log_level=..., extra_config={...})`` -> a started
    :class:`ProxyProcess`, stopped when the test ends."""
    started: list[ProxyProcess] = []

    def start(upstream_bootstrap, **kwargs) -> ProxyProcess:
        if isinstance(upstream_bootstrap, str):
            upstream_bootstrap = [upstream_bootstrap]
        p = ProxyProcess(upstream_bootstrap, **kwargs)
        started.append(p)
        return p.start()

    yield start
    for p in reversed(started):
        p.close()
