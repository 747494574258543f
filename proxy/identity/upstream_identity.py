"""Who the proxy is to the brokers: one line naming how it authenticates upstream and what it trusts.

Guarantees:
- :func:`describe_upstream_identity` names the SASL mechanism and user (for OAUTHBEARER the
  token's ``sub`` claim when the token is a JWT that has one), the client certificate's subject,
  issuer and expiry for mTLS, or "no authentication"; whether the connection is TLS and whether
  hostnames are verified; and what the brokers' certificates are verified against (the
  ``upstream.tls.ca`` path and its CA subjects, or the system trust store). It never contains a
  password, a token or a key: it is built from the configuration, the SASL user name, a JWT's
  ``sub`` claim and certificates, never from a secret's text;
- :class:`IdentityLog` logs that line at INFO the first time it is asked and again only when the
  line changes (new credentials yielding another user or principal, a reloaded client certificate
  with another subject or expiry, another CA): never once per connection. A secret re-read with
  the same identity is said once per change of the secret (a password at INFO, an OAUTHBEARER
  token, which is refreshed routinely, at DEBUG).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import ssl
from typing import Any

from config.model import UpstreamConfig, UpstreamSaslConfig, UpstreamTlsConfig
from proxy.identity.distinguished_name import distinguished_name
from proxy.identity.principal import SaslError, _jwt_claim
from proxy.identity.sasl_client import SaslCredentials

log = logging.getLogger(__name__)

# CA subjects named in the line; a system-sized bundle would otherwise make it hundreds long.
_MAX_CA_SUBJECTS = 3


def sasl_principal(mechanism: str, username: str | None, token: str | None = None) -> str:
    """Who the SASL credentials authenticate as, e.g. ``as user kqp``, ``as principal svc (the
    token's sub claim)``; never the token itself."""
    if mechanism != "OAUTHBEARER":
        return f"as user {_shown(username or '')}"
    if token is None:
        return "with a token not read yet"
    try:
        # Kafka's default sasl.oauthbearer.sub.claim.name; the same reading the proxy gives
        # a client's token (proxy.identity.principal), so both name a principal the same way.
        return f"as principal {_shown(_jwt_claim(token, 'sub'))} (the token's sub claim)"
    except SaslError:
        return "with a token that is not a JWT with a sub claim (the broker decides the principal)"


def describe_sasl(cfg: UpstreamSaslConfig, creds: SaslCredentials | None = None) -> str:
    """``SASL/<mechanism> <principal>`` for ``cfg`` (OAUTHBEARER's principal from ``creds``)."""
    token = creds.secret if creds is not None and creds.mechanism == "OAUTHBEARER" else None
    return f"SASL/{cfg.mechanism} {sasl_principal(cfg.mechanism, cfg.username, token)}"


def describe_tls(cfg: UpstreamTlsConfig | None) -> tuple[str | None, str]:
    """(the client certificate's description or None without one, the transport and trust
    description), read from the PEM files ``cfg`` names. A file that cannot be read is said so
    in the description, never raised: the TLS context loading the same files reports that."""
    if cfg is None:
        return None, "plaintext (no TLS)"
    client = None
    if cfg.certificate is not None:
        client = f"client certificate {_describe_leaf(cfg.certificate)}"
    hostnames = "with hostname verification" if cfg.verify_hostname else \
        "WITHOUT hostname verification (verify_hostname: false)"
    if cfg.ca is None:
        trust = "the system trust store"
    else:
        trust = f"upstream.tls.ca {_shown(cfg.ca)} ({_describe_cas(cfg.ca)})"
    return client, f"TLS {hostnames}, brokers' certificates verified against {trust}"


def describe_upstream_identity(config: UpstreamConfig, creds: SaslCredentials | None = None,
                               tls: tuple[str | None, str] | None = None) -> str:
    """The identity line for ``config`` (see the module docstring). ``creds`` are the SASL
    credentials last read (OAUTHBEARER's principal comes from its token); ``tls`` is
    :func:`describe_tls`'s answer when the caller has it (read from the files otherwise)."""
    client, transport = tls if tls is not None else describe_tls(config.tls)
    auth = []
    if config.sasl is not None:
        # Client connections carry their clients' own SASL exchange; these credentials are the proxy's.
        auth.append(f"{describe_sasl(config.sasl, creds)} on the proxy's own connections")
    if client is not None:
        auth.append(f"{client} on every connection")
    return f"{'; '.join(auth) or 'no authentication (neither upstream.sasl nor a client certificate)'}; {transport}"


def _shown(text: str) -> str:
    """``text`` as is when printable, else quoted with escapes: a name with a newline in it
    would otherwise write what looks like another log line."""
    return text if text.isprintable() else ascii(text)


def _read_certificate(path: str) -> dict[str, Any]:
    """The first certificate in the PEM file ``path`` as ``getpeercert()`` gives one. The
    standard library's only reader of a certificate file is private; ``cryptography`` is not a
    dependency of the proxy. Raises ValueError when it cannot be read."""
    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
    if decode is None:
        raise ValueError("this Python cannot decode certificate files")
    try:
        decoded: dict[str, Any] = decode(path)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"cannot read it: {exc}") from exc
    return decoded


def _describe_leaf(path: str) -> str:
    try:
        cert = _read_certificate(path)
        subject, issuer = _shown(distinguished_name(cert["subject"])), _shown(distinguished_name(cert["issuer"]))
    except (ValueError, KeyError) as exc:
        return f"in {_shown(path)} (subject not readable: {_shown(str(exc))})"
    # OpenSSL pads the day with a space ("Jan  1 ..."): one space reads better in a log line.
    until = " ".join(str(cert.get("notAfter", "?")).split())
    return f"{subject} (issuer {issuer}, valid until {until})"


def _describe_cas(path: str) -> str:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_verify_locations(cafile=path)
        cas: list[dict[str, Any]] = list(ctx.get_ca_certs())
        if not cas:
            # A pinned broker certificate that is no CA: get_ca_certs() leaves it out.
            cas = [_read_certificate(path)]
        subjects = [_shown(distinguished_name(ca["subject"])) for ca in cas]
    except (ssl.SSLError, OSError, ValueError, KeyError) as exc:
        return f"subject not readable: {_shown(str(exc))}"
    more = len(subjects) - _MAX_CA_SUBJECTS
    # " | ": a DN has commas and the line's parts are separated by "; ".
    named = " | ".join(subjects[:_MAX_CA_SUBJECTS]) + (f" | {more} more" if more > 0 else "")
    return f"CA {named}" if len(subjects) == 1 else f"{len(subjects)} CAs: {named}"


class IdentityLog:
    """Logs the identity line for ``config`` when it changes (see the module docstring)."""

    def __init__(self, config: UpstreamConfig, creds: SaslCredentials | None = None,
                 logger: logging.Logger = log) -> None:
        self._config = config
        self._creds = creds
        self._log = logger
        self._tls: tuple[str | None, str] | None = None  # describe_tls's answer, read once per reload
        self._line: str | None = None  # the line last logged
        # Secrets compared by a keyed digest, so no copy of one outlives its connection, and the
        # digest (random key per process) tells nothing about the secret even if it leaked.
        self._key = secrets.token_bytes(16)
        self._secret_digest = self._digest(creds)

    def announce(self, why: str | None = None) -> str:
        """Logs the identity line unless it is the line last logged; returns it."""
        if self._tls is None:
            self._tls = describe_tls(self._config.tls)
        line = describe_upstream_identity(self._config, self._creds, self._tls)
        if line != self._line:
            if self._line is None:
                self._log.info("upstream identity: %s", line)
            else:
                self._log.info("upstream identity changed (%s): %s", why or "reloaded", line)
            self._line = line
        return line

    def tls_reloaded(self) -> None:
        """The upstream TLS files were read again: logs the line if their identity changed."""
        self._tls = None
        self.announce("upstream TLS files reloaded")

    def credentials_read(self, creds: SaslCredentials) -> None:
        """``creds`` were read for a connection: logs the line if they name another principal,
        a shorter line if only the secret changed, nothing if neither did (one hash per call)."""
        digest = self._digest(creds)
        if digest == self._secret_digest:
            return
        self._creds, self._secret_digest = creds, digest
        before = self._line
        line = self.announce("SASL credentials re-read")
        if line != before:
            return
        if self._config.sasl is None:
            return  # credentials are read only with upstream.sasl
        who = describe_sasl(self._config.sasl, creds)
        if creds.mechanism == "OAUTHBEARER":
            # Tokens are short-lived and refreshed routinely: an INFO line per refresh is noise.
            self._log.debug("upstream SASL credentials changed (token re-read), still %s", who)
        else:
            self._log.info("upstream SASL credentials changed (password re-read), still %s", who)

    def _digest(self, creds: SaslCredentials | None) -> bytes | None:
        if creds is None:
            return None
        return hashlib.blake2b(creds.secret.encode(), key=self._key, digest_size=16).digest()
