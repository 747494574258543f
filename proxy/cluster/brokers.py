"""What the proxy knows of the cluster behind it: brokers, and the listener serving each.

Guarantees: every address handed to a client goes through :meth:`Cluster.advertise`, which
records the broker's upstream address and makes sure a listener for that node is open before
the address is given out.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

from config.loader import split_host_port
from config.model import Config
from proxy.cluster.dialer import BrokerDialer
from proxy.observability.stats import ProxyStats

log = logging.getLogger(__name__)


class Cluster:
    def __init__(self, config: Config, stats: ProxyStats, serve: Callable[[int, socket.socket], None],
                 shared_ports: Callable[[int, int], int | None] | None = None):
        self._config = config
        self._stats = stats
        self._serve = serve  # starts accepting on a bound socket for a node
        # Workers: (node id, wanted port) -> the port the host serves that node on (None: none),
        # bound by every worker with SO_REUSEPORT (proxy.control.worker_hub).
        self._shared_ports = shared_ports
        self.bootstrap = [split_host_port(s) for s in config.upstream.bootstrap_servers]
        # How brokers are reached (TLS, the proxy's own SASL); ConfigError for a bad file.
        self.dialer = BrokerDialer(config.upstream, stats)
        self._next_bootstrap = 0
        self.brokers: dict[int, tuple[str, int]] = {}  # node id -> upstream (host, port)
        self.node_ports: dict[int, int] = {}  # node id -> proxy port serving it

    def advertise(self, node_id: int, host: str, port: int) -> tuple[str, int]:
        """Records broker ``node_id`` at ``host:port``; returns the proxy address that serves it."""
        if self.brokers.get(node_id) != (host, port):
            if node_id in self.brokers:
                log.info("broker %d moved from %s:%d to %s:%d", node_id, *self.brokers[node_id], host, port)
            self.brokers[node_id] = (host, port)
        proxy_port = self.node_ports.get(node_id)
        if proxy_port is None:
            proxy_port = self._open_listener(node_id)
        return self._config.listen.advertised_host, proxy_port

    def upstream_address(self, node_id: int | None, attempt: int) -> tuple[str, int]:
        """Where a client connection on ``node_id``'s port (None: bootstrap) goes upstream."""
        if node_id is not None and node_id in self.brokers:
            return self.brokers[node_id]
        address = self.bootstrap[self._next_bootstrap % len(self.bootstrap)]
        self._next_bootstrap += 1
        return address

    def port_for(self, node_id: int) -> int:
        listen = self._config.listen
        if node_id in listen.node_ports:
            return listen.node_ports[node_id]
        if listen.broker_port_base == 0:
            return 0
        return listen.broker_port_base + node_id

    def _open_listener(self, node_id: int) -> int:
        # Bound synchronously so the port is real before any client is told about it.
        listen = self._config.listen
        wanted = self.port_for(node_id)
        if not 0 <= wanted <= 65535:
            log.error("node %d maps to port %d, outside 0-65535: not served", node_id, wanted)
            return wanted
        if self._shared_ports is not None:
            shared = self._shared_ports(node_id, wanted)
            if shared is None:
                return wanted  # not served (the worker link logged why)
            wanted = shared
        family = socket.AF_INET6 if ":" in listen.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self._shared_ports is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((listen.host, wanted))
            sock.listen(1024)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            log.error("cannot listen for broker %d on %s:%d: %s", node_id, listen.host, wanted, exc)
            return wanted
        port: int = sock.getsockname()[1]  # (host, port) for AF_INET, (host, port, flow, scope) for AF_INET6
        self.node_ports[node_id] = port
        self._stats.broker_listeners += 1
        log.info("serving broker %d (%s:%d) on %s:%d", node_id, *self.brokers[node_id], listen.host, port)
        self._serve(node_id, sock)
        return port

