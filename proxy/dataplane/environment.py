"""What a client connection is given by whoever serves it: the parts it works with, and nothing
of the server that built them.

Guarantees: the environment is frozen, so a connection's parts are those in force when it was
accepted (a reload changes what the parts hold, never which parts a connection has); the one
thing swapped while connections live, the listener's TLS after a certificate reload, is read
through ``listener_tls`` at each accept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from config.model import UpstreamConfig
from proxy.cluster.brokers import Cluster
from proxy.cluster.leaders import LeaderCache
from proxy.cluster.topics import TopicCache
from proxy.dataplane.filters.chain import FilterChain
from proxy.dataplane.guard import ConnectionGuard, Swept
from proxy.dataplane.reads import ReadBuffer
from proxy.identity.tls import ServerTls
from proxy.observability.stats import ProxyStats
from proxy.observability.usage_log import UsageLog


class Served(Swept, Protocol):
    """What the server asks of an open client connection, besides the guard's sweep."""

    def close(self) -> None: ...

    def drain(self) -> None: ...

    def chain_changed(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ConnectionEnv:
    """The parts every client connection of one proxy shares (see the module docstring)."""

    chain: FilterChain
    stats: ProxyStats
    guard: ConnectionGuard
    cluster: Cluster
    topics: TopicCache
    leaders: LeaderCache
    usage: UsageLog | None  # None when the usage log is off
    upstream: UpstreamConfig  # how brokers are reached (connect timeout and attempts)
    max_frame_bytes: int  # listen.max_frame_bytes: the largest request frame read from a client
    connections: set[Served]  # the served connections: each adds itself, and leaves when closed
    listener_tls: Callable[[], ServerTls | None]  # the listener's TLS in force, None for plaintext
    reads: ReadBuffer = field(default_factory=ReadBuffer)  # what its connections read into (one event loop's)
