"""TLS termination on the client listeners, and the context for TLS to the brokers.

Guarantees:
- the server context is built from the configured PEM files with TLS 1.2 at least and Python's
  secure default ciphers; a file that is missing, unreadable, not PEM, or a key that does not
  match its certificate is a ConfigError naming the YAML path (check-config and a start alike);
- a handshake that fails or stalls past ``handshake_timeout_ms`` closes that one connection,
  counted in ``kqp_tls_handshake_failures_total{reason}`` and logged rate-limited; nothing else
  is affected;
- a verified client certificate gives the connection its principal by Kafka's
  ``ssl.principal.mapping.rules`` (``SslPrincipalMapper``); a SASL exchange that succeeds later
  overrides it, as Kafka's principal builder prefers SASL.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from dataclasses import dataclass
from typing import Any

from config import ConfigError
from config.model import ListenTlsConfig, UpstreamTlsConfig
from proxy.identity.distinguished_name import distinguished_name
from proxy.identity.secrets import read_secret
from proxy.identity.ssl_principal import PrincipalMappingError, SslPrincipalMapper

_CLIENT_AUTH = {"none": ssl.CERT_NONE, "requested": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}
# OpenSSL's X509_V_ERR codes for the reasons a client certificate is refused.
_EXPIRED, _NOT_YET_VALID = 10, 9
_UNKNOWN_ISSUER = frozenset({2, 18, 19, 20, 21})


@dataclass(frozen=True)
class ServerTls:
    """What a TLS listener needs per connection: the context and the principal mapping."""

    context: ssl.SSLContext
    handshake_timeout_s: float
    mapper: SslPrincipalMapper


def server_tls(cfg: ListenTlsConfig, path: str = "listen.tls") -> ServerTls:
    """Loads the files of ``cfg``. Raises ConfigError naming the YAML path of what is wrong."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, cfg.certificate, cfg.key, _key_password(cfg, path), path)
    ctx.verify_mode = _CLIENT_AUTH[cfg.client_auth]
    if cfg.ca is not None:
        _load_ca(ctx, cfg.ca, f"{path}.ca")
    try:
        mapper = SslPrincipalMapper.from_rules(cfg.principal_mapping_rules)
    except PrincipalMappingError as exc:
        raise ConfigError(f"{path}.principal_mapping_rules", str(exc)) from exc
    return ServerTls(ctx, cfg.handshake_timeout_ms / 1000, mapper)


def client_tls(cfg: UpstreamTlsConfig, path: str = "upstream.tls") -> ssl.SSLContext:
    """The context for TLS to the brokers: TLS 1.2 at least, the brokers' certificates verified
    against ``cfg.ca`` (the system's trust store without one) and, unless ``verify_hostname`` is
    false, required to name the host connected to (Kafka's default
    ssl.endpoint.identification.algorithm=https); a client certificate when one is configured.
    Raises ConfigError naming the YAML path of what is wrong."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = cfg.verify_hostname
    ctx.verify_mode = ssl.CERT_REQUIRED  # Kafka has no setting that skips the trust check
    if cfg.ca is not None:
        _load_ca(ctx, cfg.ca, f"{path}.ca")
    else:
        ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
    if cfg.certificate is not None and cfg.key is not None:
        _load_chain(ctx, cfg.certificate, cfg.key, _key_password(cfg, path), path)
    return ctx


def _load_chain(ctx: ssl.SSLContext, certificate: str, key: str, password: str | None, path: str) -> None:
    for name, file in (("certificate", certificate), ("key", key)):
        if not os.path.isfile(file):
            raise ConfigError(f"{path}.{name}", f"no such file: {file}")
    try:
        ctx.load_cert_chain(certificate, key, password)
    except ssl.SSLError as exc:
        # OpenSSL says which: a key that is not the certificate's, or a file that is not PEM.
        raise ConfigError(f"{path}.certificate", f"cannot load {certificate} with key {key}: "
                                                 f"{exc.reason or exc}") from exc
    except OSError as exc:
        raise ConfigError(f"{path}.certificate", f"cannot read {certificate} / {key}: {exc}") from exc


def _load_ca(ctx: ssl.SSLContext, ca: str, path: str) -> None:
    if not os.path.isfile(ca):
        raise ConfigError(path, f"no such file: {ca}")
    try:
        ctx.load_verify_locations(cafile=ca)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(path, f"cannot load the CA bundle {ca}: {exc}") from exc


def _key_password(cfg: ListenTlsConfig | UpstreamTlsConfig, path: str) -> str | None:
    return read_secret(path, "key_password_file", cfg.key_password_file, "key_password_env", cfg.key_password_env)


def handshake_failure_reason(exc: BaseException) -> str:
    """A short label for why a client's handshake failed (the counter's ``reason``)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        if exc.verify_code in (_EXPIRED, _NOT_YET_VALID):
            return "certificate_expired"
        if exc.verify_code in _UNKNOWN_ISSUER:
            return "unknown_ca"
        return "certificate_refused"
    if isinstance(exc, ssl.SSLError):
        reason = (exc.reason or "").upper()
        if reason in ("WRONG_VERSION_NUMBER", "HTTP_REQUEST", "HTTPS_PROXY_REQUEST", "RECORD_LAYER_FAILURE",
                      "UNEXPECTED_RECORD", "PACKET_LENGTH_TOO_LONG", "UNKNOWN_PROTOCOL"):
            return "not_tls"  # plaintext (a Kafka request, say) on a TLS port
        if "CERTIFICATE" in reason:
            return "no_certificate" if "RETURN" in reason or "NO_CERTIFICATE" in reason else "certificate_refused"
        if "VERSION" in reason or "PROTOCOL" in reason or "CIPHER" in reason:
            return "protocol_version"
        return "tls_error"
    if isinstance(exc, TimeoutError) or (isinstance(exc, ConnectionAbortedError) and "longer" in str(exc)):
        return "timeout"
    if isinstance(exc, (ConnectionError, EOFError)):
        return "closed"
    return "tls_error"


def certificate_principal(tls: ServerTls, peercert: dict[str, Any] | None) -> str | None:
    """The principal a verified client certificate maps to (None: no certificate). Raises
    PrincipalMappingError when no rule applies (Kafka then fails the authentication)."""
    if not peercert or "subject" not in peercert:
        return None
    return tls.mapper.principal_name(distinguished_name(peercert["subject"]))


class EarlyBytes(asyncio.Protocol):
    """Holds what a client sent before the TLS layer took its transport (uvloop may read a
    ClientHello before the connection's first callback returns, even with reading paused)."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.lost = False  # the client went away before the connection took over

    def data_received(self, data: bytes) -> None:
        self.data += data

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True

    def hand_over(self, raw: asyncio.Transport) -> None:
        """Feeds the bytes kept to the TLS protocol now in charge of ``raw``."""
        if not self.data:
            return
        tls_protocol: Any = raw.get_protocol()
        data, self.data = bytes(self.data), bytearray()
        if tls_protocol is None or raw.is_closing():
            return  # the client went away meanwhile: its handshake fails on its own
        # Duck-typed: uvloop's TLS protocol is buffered but no asyncio.BufferedProtocol subclass.
        if hasattr(tls_protocol, "buffer_updated"):  # asyncio's and uvloop's TLS protocols
            while data:
                buffer = tls_protocol.get_buffer(len(data))
                n = min(len(buffer), len(data))
                buffer[:n] = data[:n]
                tls_protocol.buffer_updated(n)
                data = data[n:]
        else:
            tls_protocol.data_received(data)


@dataclass(frozen=True)
class HandshakeFailure:
    """Why a client's handshake failed: ``reason`` a label of kqp_tls_handshake_failures_total."""

    reason: str
    detail: str


async def handshake(raw: asyncio.Transport, early: EarlyBytes,
                    tls: ServerTls) -> tuple[asyncio.Transport, str | None, EarlyBytes] | HandshakeFailure:
    """Runs the server side of a client's handshake on ``raw``; ``early`` has been ``raw``'s
    protocol since it was accepted (set in the same callback). Returns the TLS transport, the
    certificate's principal and what the client sent right after its handshake (the caller sets
    its own protocol on the transport, then hands it that data; the principal is None without a
    certificate), or why it failed: then ``raw`` is closed (the caller counts and logs it)."""
    loop = asyncio.get_running_loop()
    try:
        # The TLS layer hands application data on as soon as the handshake is done, before this
        # coroutine resumes: it is kept until the connection is ready for it.
        after = EarlyBytes()
        started = asyncio.ensure_future(loop.start_tls(raw, after, tls.context, server_side=True,
                                                       ssl_handshake_timeout=tls.handshake_timeout_s))
        # start_tls installs its TLS protocol, then schedules its connection_made: the bytes
        # kept go to it after that (callbacks run in the order they were scheduled).
        loop.call_soon(loop.call_soon, early.hand_over, raw)
        transport = await started
        if transport is None:
            raise ConnectionResetError("closed during the handshake")
    except asyncio.CancelledError:
        raw.abort()
        raise
    except Exception as exc:  # whatever a client's bytes or silence make of it: this connection only
        reason, detail = handshake_failure_reason(exc), f"{type(exc).__name__}: {exc}"
    else:
        try:
            return transport, certificate_principal(tls, transport.get_extra_info("peercert")), after
        except ValueError as exc:  # PrincipalMappingError, or a subject no DN can be made of
            reason, detail = "principal", str(exc)  # Kafka's principal builder fails the authentication
            transport.abort()
    raw.abort()
    return HandshakeFailure(reason, detail)
