"""Certificate rotation without a restart: the files ``listen.tls`` and ``upstream.tls`` name are
read again when they change on disk (polled) or on SIGHUP.

Guarantees:
- client connections accepted, and broker connections opened, after a reload that succeeded use
  the new certificates; connections already open keep theirs;
- files are read only once every one of them has kept its signature (device, inode, mtime,
  size) for the debounce, so a certificate and its key replaced one after the other are read as
  a pair once both are written;
- a reload that fails (a file missing or not PEM, a key that is not the certificate's) is logged
  at ERROR naming the file and its YAML path, counted in
  ``kqp_certificate_reloads_total{outcome="failure"}``, and the certificates in force stay; the
  same files are not read again until they change again (or SIGHUP asks);
- a reload that changes the upstream client certificate or CA logs the proxy's new upstream
  identity once (proxy.identity.upstream_identity); one that changes neither does not.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from config import ConfigError
from config.model import Config
from proxy.cluster.brokers import Cluster
from proxy.control.file_signature import Signature, signature
from proxy.identity.tls import ServerTls, client_tls, server_tls
from proxy.observability.stats import ProxyStats


class TlsOwner(Protocol):
    """What a certificate reload reads, and the listener TLS it swaps (ProxyServer is one)."""

    tls: ServerTls | None

    @property
    def config(self) -> Config: ...

    @property
    def stats(self) -> ProxyStats: ...

    @property
    def cluster(self) -> Cluster: ...

log = logging.getLogger(__name__)


def tls_files(server: TlsOwner) -> list[str]:
    """Every file the TLS settings in force read."""
    files = []
    for cfg in (server.config.listen.tls, server.config.upstream.tls):
        if cfg is not None:
            names = ("certificate", "key", "ca", "key_password_file")
            files += [path for path in (getattr(cfg, name) for name in names) if path]
    return files


class CertificateReloader:
    """Watches the TLS files of ``server`` (see the module docstring)."""

    POLL_S = 1.0

    def __init__(self, server: TlsOwner, debounce_s: float) -> None:
        self.server = server
        self.debounce_s = debounce_s
        self.files = tls_files(server)
        self._seen = self._signatures()  # the signatures last acted on
        self._settling: tuple[tuple[Signature | None, ...], float] | None = None

    def _signatures(self) -> tuple[Signature | None, ...]:
        return tuple(signature(path) for path in self.files)

    @property
    def poll_interval_s(self) -> float:
        return self.POLL_S if self._settling is None else max(self.debounce_s / 4, 0.05)

    def poll_at(self, now_s: float) -> bool:
        """One look at the files at monotonic ``now_s``; True when new certificates were taken."""
        current = self._signatures()
        if current == self._seen:
            self._settling = None
            return False
        if self._settling is None or self._settling[0] != current:
            self._settling = (current, now_s)  # a new change, or one still being written
        if now_s - self._settling[1] < self.debounce_s:
            return False
        self._settling = None
        changed = [path for path, before, after in zip(self.files, self._seen, current) if before != after]
        self._seen = current
        return self.reload(f"{', '.join(changed) or 'a TLS file'} changed")

    def reload_now(self) -> bool:
        """SIGHUP: reads every TLS file at once."""
        self._settling = None
        self._seen = self._signatures()
        return self.reload("SIGHUP")

    def reload(self, why: str) -> bool:
        """Builds new TLS contexts from the files; takes them only when all of them load."""
        listen, upstream = self.server.config.listen.tls, self.server.config.upstream.tls
        try:
            new_server = server_tls(listen) if listen is not None else None
            new_client = client_tls(upstream) if upstream is not None else None
        except ConfigError as exc:
            self.server.stats.certificate_reloads["failure"] += 1
            log.error("certificate reload (%s) failed, the certificates in force stay: %s", why, exc)
            return False
        if new_server is not None:
            self.server.tls = new_server
        self.server.stats.certificate_reloads["success"] += 1
        log.info("certificates reloaded (%s): new connections use them, open ones keep theirs", why)
        if new_client is not None:
            # After the line above (no await between: no connection sees one context without the
            # other), so that a changed upstream identity is logged after what changed it.
            self.server.cluster.dialer.set_tls(new_client)
        return True


async def watch_certificates(reloader: CertificateReloader, clock: Callable[[], float] = time.monotonic) -> None:
    """Polls the TLS files for ever: every second, faster while a change settles."""
    while True:
        await asyncio.sleep(reloader.poll_interval_s)
        try:
            reloader.poll_at(clock())
        except Exception:  # one failed look must not end the watching for the proxy's lifetime
            log.exception("certificate reload failed; still watching the files")
