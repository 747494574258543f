"""How the proxy reaches the brokers: TLS when ``upstream.tls`` is set and, for the connections
the proxy opens by itself (metadata refresh, topic and configuration lookups), SASL when
``upstream.sasl`` is set.

Guarantees:
- client connections and the proxy's own connections use the same TLS context: the brokers'
  certificates verified against ``upstream.tls.ca`` (the system's trust store without one) and,
  unless ``verify_hostname`` is false, required to name the host connected to (the bootstrap
  server's, or the host the broker advertises);
- an own connection is handed out only once its ApiVersions round trip is done and, with
  ``upstream.sasl``, once it is authenticated; client connections never use these credentials
  (their own SASL exchange passes through, and the brokers see the client's identity);
- a failed TLS handshake or a refused authentication raises a ConnectionError (as an unreachable
  broker does: every caller already retries those), is counted in
  ``kqp_upstream_authentication_failures_total{kind,reason}`` and logged at most once a minute
  per kind, naming the mechanism and the user or principal; secrets are read at each connection
  (a rotated password or token is picked up) and never logged;
- how the proxy authenticates to the brokers and what it trusts is logged at INFO by
  :meth:`BrokerDialer.announce_identity`, and again whenever new credentials or reloaded
  certificates change it (proxy.identity.upstream_identity), never once per connection.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from struct import Struct
from typing import Any

from kafka.protocol.metadata import ApiVersionsRequest

from config import ConfigError
from config.model import UpstreamConfig, UpstreamSaslConfig
from protocol.headers import response_body_offset
from protocol.messages import decode_response
from proxy.cluster.offload import decode_response_off_loop, is_big, off_loop
from proxy.identity.sasl_client import SaslAuthenticationError, SaslCredentials, SaslRefused, authenticate, credentials
from proxy.identity.tls import client_tls
from proxy.identity.upstream_identity import IdentityLog, sasl_principal
from proxy.observability.logs import LogLimiter
from proxy.observability.stats import ProxyStats

log = logging.getLogger(__name__)

_INT32 = Struct(">i")
_CLIENT_ID = "kafka-quota-proxy"


def _framed(request: Any) -> bytes:
    return bytes(request.encode(header=True, framed=True))


class OwnConnection:
    """One connection the proxy opened by itself, ready for requests (see BrokerDialer.open)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._correlation_id = 0
        self.api_versions: dict[int, tuple[int, int]] = {}  # api key -> (min, max) the broker offers

    async def round_trip(self, request: Any, big: bool = False) -> Any:
        """Sends a kafka-python request and returns the broker's decoded response. ``big``: the
        request names thousands of topics, and is encoded off the event loop."""
        body = await self.round_trip_body(request, big)
        if is_big(body):  # the partitions of thousands of topics: decoded off the loop
            return await decode_response_off_loop(request.API_KEY, request.API_VERSION, body)
        return decode_response(request.API_KEY, request.API_VERSION, body)

    async def round_trip_body(self, request: Any, big: bool = False) -> memoryview:
        """Sends a kafka-python request and returns the body of the broker's response, not
        decoded (for a response too big to decode on the event loop: protocol.metadata_scan).
        ``big``: as for :meth:`round_trip`."""
        self._correlation_id += 1
        request.with_header(correlation_id=self._correlation_id, client_id=_CLIENT_ID)
        frame = await off_loop(_framed, request) if big else _framed(request)
        self._writer.write(frame)
        await self._writer.drain()
        (size,) = _INT32.unpack(await self._reader.readexactly(4))
        frame = await self._reader.readexactly(size)
        if _INT32.unpack_from(frame)[0] != self._correlation_id:
            raise ConnectionError("the broker answered another request than the one sent")
        key, version = request.API_KEY, request.API_VERSION
        return memoryview(frame)[response_body_offset(frame, key, version):]

    def close(self) -> None:
        self._writer.close()

    async def __aenter__(self) -> OwnConnection:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class BrokerDialer:
    """Opens connections to brokers as ``upstream`` says (see the module docstring)."""

    def __init__(self, upstream: UpstreamConfig, stats: ProxyStats) -> None:
        # ConfigError (naming the YAML path) for a file that is missing or broken.
        self.tls: ssl.SSLContext | None = client_tls(upstream.tls) if upstream.tls is not None else None
        self.sasl = upstream.sasl
        # A secret that cannot be read stops a start, as a bad file does.
        creds = credentials(self.sasl) if self.sasl is not None else None
        self.identity = IdentityLog(upstream, creds)
        self._stats = stats
        self._logs: dict[str, LogLimiter] = {}

    def announce_identity(self) -> str:
        """Logs at INFO, and returns, how the proxy authenticates to the brokers and what it
        trusts (proxy.identity.upstream_identity); later calls log only a changed identity."""
        return self.identity.announce()

    def set_tls(self, tls: ssl.SSLContext) -> None:
        """Connections opened from now on use ``tls`` (certificates reloaded); the identity line
        is logged again if the upstream certificate or CA it describes changed."""
        self.tls = tls
        self.identity.tls_reloaded()

    def server_hostname(self, host: str) -> str | None:
        """What the TLS handshake to ``host`` checks the certificate against (None: no TLS)."""
        return host if self.tls is not None else None

    async def open(self, address: tuple[str, int], timeout_s: float) -> OwnConnection:
        """A connection to ``address`` with its ApiVersions known and, with ``upstream.sasl``,
        authenticated; the whole within ``timeout_s``."""
        host, port = address
        async with asyncio.timeout(timeout_s):
            try:
                reader, writer = await asyncio.open_connection(host, port, ssl=self.tls,
                                                               server_hostname=self.server_hostname(host))
            except ssl.SSLError as exc:
                raise self.failed("tls", address, exc) from exc
            conn = OwnConnection(reader, writer)
            try:
                try:
                    versions = await conn.round_trip(ApiVersionsRequest[0]())
                except ssl.SSLError as exc:
                    # TLS 1.3: a broker refusing the proxy's certificate says so on the first read.
                    raise self.failed("tls", address, exc) from exc
                conn.api_versions = {e.api_key: (e.min_version, e.max_version) for e in versions.api_keys}
                if self.sasl is not None:
                    await self._authenticate(conn, address, self.sasl)
            except BaseException:
                conn.close()
                raise
        return conn

    async def _authenticate(self, conn: OwnConnection, address: tuple[str, int], sasl: UpstreamSaslConfig) -> None:
        try:
            creds = credentials(sasl)
        except ConfigError as exc:
            raise self.failed("sasl", address, exc) from exc
        self.identity.credentials_read(creds)  # logs only a change, not each connection
        try:
            await authenticate(conn.round_trip, conn.api_versions, creds)
        except SaslAuthenticationError as exc:
            raise self.failed("sasl", address, exc, creds) from exc

    def log_failure(self, kind: str, level: int, msg: str, *args: object) -> None:
        """Logs a failure of the proxy's own broker connections at most once a minute per
        ``kind`` (a broker down or refusing the proxy would otherwise log at every retry, and
        clients can trigger lookups)."""
        limiter = self._logs.get(kind)
        if limiter is None:
            limiter = self._logs[kind] = LogLimiter(log, lines=1, interval_s=60.0)
        limiter.log(level, msg, *args)

    def failed(self, kind: str, address: tuple[str, int], exc: Exception,
               creds: SaslCredentials | None = None) -> ConnectionError:
        """Counts and logs (once a minute per kind) a TLS handshake or a SASL authentication the
        broker at ``address`` refused, a SASL one naming the mechanism and who (from ``creds``,
        the credentials tried); returns the error for the caller to raise."""
        reason = _reason(kind, exc)
        self._stats.upstream_auth_failures[(kind, reason)] += 1
        host, port = address
        if kind == "tls":
            self.log_failure(kind, logging.ERROR, "TLS handshake with broker %s:%d failed (%s): %s; retried with "
                             "back-off", host, port, reason, exc)
            return ConnectionError(f"TLS handshake with {host}:{port} failed: {exc}")
        text = _sasl_failure(self.sasl, address, exc, creds)
        self.log_failure(kind, logging.ERROR, "%s; retried with back-off", text)
        return ConnectionError(text)


def _sasl_failure(sasl: UpstreamSaslConfig | None, address: tuple[str, int], exc: Exception,
                  creds: SaslCredentials | None) -> str:
    """What went wrong with a SASL authentication, e.g. "SASL/SCRAM-SHA-512 authentication as
    user kqp refused by broker b1:9093: SASL_AUTHENTICATION_FAILED (58): ..."; no secret."""
    mechanism = sasl.mechanism if sasl is not None else "?"
    username = sasl.username if sasl is not None else None
    broker = f"broker {address[0]}:{address[1]}"
    if creds is None:  # never read; the ConfigError names the YAML path and the file or variable
        user = f" of user {username}" if username else ""
        return f"SASL/{mechanism} credentials{user} for {broker} cannot be read (credentials_unreadable): {exc}"
    token = creds.secret if mechanism == "OAUTHBEARER" else None
    who = sasl_principal(mechanism, username, token)
    if isinstance(exc, SaslRefused):
        return f"SASL/{mechanism} authentication {who} refused by {broker}: {exc.broker_message}"
    return f"SASL/{mechanism} authentication {who} with {broker} failed: {exc}"


def _reason(kind: str, exc: Exception) -> str:
    if kind == "tls":
        if isinstance(exc, ssl.SSLCertVerificationError):
            # OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH and X509_V_ERR_IP_ADDRESS_MISMATCH.
            return "hostname_mismatch" if exc.verify_code in (62, 64) else "certificate_refused"
        if isinstance(exc, ssl.SSLError) and "CERTIFICATE_REQUIRED" in (exc.reason or ""):
            return "certificate_required"  # the broker wants the proxy's client certificate
        return "handshake"
    if isinstance(exc, ConfigError):
        return "credentials_unreadable"
    return "refused"
