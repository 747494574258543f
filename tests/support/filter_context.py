"""A real FilterContext for unit tests of a filter alone: what a connection would hand it, with
the actions recorded instead of carried out."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from proxy.dataplane.filters.api import FilterContext
from proxy.identity.principal import Session
from proxy.observability.stats import ProxyStats


class Recorder:
    """Stands for the connection: lists the mutes, uplifts and raw SASL starts asked for."""

    def __init__(self) -> None:
        self.actions: list[tuple[str, object]] = []

    def mute(self, throttle_ms: int) -> None:
        self.actions.append(("mute", throttle_ms))

    def uplift_changed(self, uplift) -> None:
        self.actions.append(("uplift", uplift))

    def start_raw_sasl(self, mechanism) -> None:
        self.actions.append(("raw_sasl", mechanism))


class RecordingContext(FilterContext):
    __slots__ = ("actions",)


def filter_context(principal: str | None = None, client_id: str | None = "c", cluster=None, topics=None,
                   leaders=None, node_id: int | None = None) -> RecordingContext:
    """``ctx.actions`` lists the mutes, uplifts and raw SASL starts the filter asked for."""
    session = Session()
    if principal is not None:
        session.authenticate(principal)
    session.client_id = client_id
    recorder = Recorder()
    ctx = RecordingContext(session, node_id, cluster or SimpleNamespace(brokers={}), topics, leaders, ProxyStats(),
                           recorder)
    ctx.label = "test"
    ctx.actions = recorder.actions
    return ctx


class _NoDialer:
    """A BrokerDialer with no broker behind it: every own connection is refused."""

    @staticmethod
    async def open(address, timeout_s):
        raise ConnectionRefusedError("no broker in this test")

    @staticmethod
    def log_failure(*args) -> None:
        pass


def unreachable_cluster(brokers: dict | None = None) -> SimpleNamespace:
    """The cluster view of a proxy whose brokers cannot be reached: a filter's own lookups fail."""
    return SimpleNamespace(brokers=brokers or {}, upstream_address=lambda node_id, attempt: ("127.0.0.1", 1),
                           dialer=_NoDialer())


def decided(decision):
    """A Defer's decision, awaited (its lookups fail against an unreachable cluster); any other as is."""
    from proxy.dataplane.filters.api import Defer

    while isinstance(decision, Defer):
        decision = asyncio.run(decision.decision)
    return decision
