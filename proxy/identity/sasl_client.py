"""SASL for the proxy's own connections to the brokers (metadata refresh, topic lookups).

Guarantees: :func:`authenticate` returns only once the broker accepted the credentials (for
SCRAM, also once the broker proved it knows them: its server signature is verified); anything
else, a broker error, a mechanism the broker does not enable, a malformed or dishonest server
message, raises :class:`SaslAuthenticationError` (a ConnectionError, so callers that handle
lost connections handle it too); a refusal the broker answered is its subclass
:class:`SaslRefused`, carrying the broker's words. No message, repr or exception text ever contains the password
or the token. The mechanism code (PLAIN, SCRAM-SHA-256/512, OAUTHBEARER) does no I/O; the
exchange goes through the caller's ``round_trip``, so it works over any transport.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import hashlib
import hmac
import re
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kafka.errors import for_code
from kafka.protocol.sasl import SaslAuthenticateRequest, SaslHandshakeRequest

from config import ConfigError
from config.model import UpstreamSaslConfig
from protocol.apis import ApiKey
from proxy.identity.secrets import read_secret

# An async callable sending a kafka-python request object and returning its decoded response.
RoundTrip = Callable[[Any], Awaitable[Any]]

# hashlib names of the mechanisms' hashes (RFC 7677, and Kafka's SCRAM-SHA-512 by the same recipe).
_HASHES = {"SCRAM-SHA-256": "sha256", "SCRAM-SHA-512": "sha512"}
# Kafka's ScramMechanism.minIterations (the same for both hashes).
SCRAM_MIN_ITERATIONS = 4096
# Ours, not Kafka's (its client has no ceiling): a hostile broker's i=2147483647 would otherwise
# keep a thread busy for hours; Kafka itself stores at most 16384 (ScramMechanism.maxIterations).
SCRAM_MAX_ITERATIONS = 1_000_000
# The newest versions kafka-python has schemas for; Kafka's clients use SaslHandshake v1, after
# which every token travels in a SaslAuthenticate request (KIP-152).
_HANDSHAKE_VERSION = 1
_AUTHENTICATE_MAX_VERSION = 2

# RFC 5802 §7 server-first-message, parsed as Kafka's ScramMessages.ServerFirstMessage does:
# an optional reserved "m=" attribute, nonce, salt, iterations, then extensions it ignores.
_SERVER_FIRST = re.compile(
    r"(?:m=[^,]+,)?r=(?P<nonce>[\x21-\x2b\x2d-\x7e]+),s=(?P<salt>[A-Za-z0-9+/]+={0,2}),"
    r"i=(?P<iterations>[0-9]{1,10})(?:,.*)?",
    re.DOTALL,
)
# RFC 5802 §7 server-final-message, as Kafka's ScramMessages.ServerFinalMessage.
_SERVER_FINAL = re.compile(r"e=(?P<error>[^,]+)|v=(?P<signature>[A-Za-z0-9+/]+={0,2})(?:,.*)?", re.DOTALL)


class SaslAuthenticationError(ConnectionError):
    """The broker refused the proxy's credentials, or the exchange could not be completed."""


class SaslRefused(SaslAuthenticationError):
    """The broker answered the exchange with a refusal (an error code, an error challenge, a
    SCRAM ``e=``); ``broker_message`` is what it said (never a secret: the broker's own words)."""

    def __init__(self, message: str, broker_message: str) -> None:
        super().__init__(message)
        self.broker_message = broker_message


@dataclass(frozen=True)
class SaslCredentials:
    """A mechanism with its secret (the password, or the OAUTHBEARER token), read for one
    connection. The secret is left out of repr() so that logging the object leaks nothing."""

    mechanism: str
    username: str | None
    secret: str = field(repr=False)


def credentials(cfg: UpstreamSaslConfig, path: str = "upstream.sasl") -> SaslCredentials:
    """The credentials ``cfg`` names, the secret read now (a rotated password or a refreshed
    token is picked up by the next connection); ConfigError naming the YAML path otherwise."""
    if cfg.mechanism == "OAUTHBEARER":
        secret = read_secret(path, "token_file", cfg.token_file, "token_env", cfg.token_env)
        if secret is None:
            raise ConfigError(f"{path}.token_file", "OAUTHBEARER needs token_file or token_env")
        return SaslCredentials(cfg.mechanism, None, secret)
    if cfg.mechanism != "PLAIN" and cfg.mechanism not in _HASHES:
        raise ConfigError(f"{path}.mechanism", f"unsupported SASL mechanism {cfg.mechanism!r}")
    if not cfg.username:
        raise ConfigError(f"{path}.username", f"{cfg.mechanism} needs a username")
    secret = read_secret(path, "password_file", cfg.password_file, "password_env", cfg.password_env)
    if secret is None:
        raise ConfigError(f"{path}.password_file", f"{cfg.mechanism} needs password_file or password_env")
    return SaslCredentials(cfg.mechanism, cfg.username, secret)


def plain_initial_response(username: str, password: str) -> bytes:
    """RFC 4616 message: an empty authorization id, then NUL user NUL password (Kafka's
    PlainSaslClient, from the JDK's PLAIN client)."""
    return b"\x00" + username.encode() + b"\x00" + password.encode()


def oauthbearer_initial_response(token: str) -> bytes:
    """RFC 7628 §3.1 client initial response, as Kafka's OAuthBearerClientInitialResponse
    (KIP-255) writes it without an authorization id or extensions."""
    # gs2 header "n,," (no channel binding, no authzid), then %x01-separated key=value pairs.
    return b"n,,\x01auth=Bearer " + token.encode() + b"\x01\x01"


def scram_sasl_name(username: str) -> str:
    """RFC 5802 §5.1 saslname: '=' and ',' escaped (Kafka's ScramFormatter.saslName)."""
    # '=' first, or the '=' of "=2C" would be escaped again.
    return username.replace("=", "=3D").replace(",", "=2C")


@functools.lru_cache(maxsize=4)
def _salted_password(hash_name: str, password: str, salt: bytes, iterations: int) -> bytes:
    """RFC 5802's Hi(): kept for the same password, salt and count (RFC 5802 §5.1 lets a client
    cache it), so lookups that clients' requests start do not each cost thousands of HMACs."""
    return hashlib.pbkdf2_hmac(hash_name, password.encode(), salt, iterations)


class ScramClient:
    """The client side of one SCRAM-SHA-256 / SCRAM-SHA-512 exchange (RFC 5802, RFC 7677), as
    Kafka's ScramSaslClient: no channel binding, no SASLprep (the password's UTF-8 bytes, as
    Kafka's ScramFormatter.normalize). Call :meth:`client_first`, :meth:`client_final` with
    the server-first message, then :meth:`verify_server_final` with the server-final one."""

    def __init__(self, mechanism: str, username: str, password: str, nonce: str | None = None) -> None:
        if mechanism not in _HASHES:
            raise ValueError(f"not a SCRAM mechanism: {mechanism!r}")
        self.mechanism = mechanism
        self._hash = _HASHES[mechanism]
        self._password = password
        # Kafka's ScramFormatter.secureRandomString: printable, no ','; injectable for tests.
        self._nonce = nonce if nonce is not None else secrets.token_urlsafe(24)
        self._client_first_bare = f"n={scram_sasl_name(username)},r={self._nonce}"
        self._server_signature: bytes | None = None

    def __repr__(self) -> str:
        return f"ScramClient({self.mechanism})"

    def client_first(self) -> bytes:
        # gs2 header "n,,": the client does not support channel binding, no authzid (RFC 5802 §7).
        return f"n,,{self._client_first_bare}".encode()

    def client_final(self, server_first: bytes) -> bytes:
        """The client-final message (with its proof) answering ``server_first``."""
        text = self._text(server_first, "server-first")
        m = _SERVER_FIRST.fullmatch(text)
        if m is None:
            raise SaslAuthenticationError(f"{self.mechanism}: malformed server-first message")
        nonce, iterations = m["nonce"], int(m["iterations"])
        # ScramSaslClient: the server extends the client's nonce, or this is a replay.
        if not nonce.startswith(self._nonce):
            raise SaslAuthenticationError(f"{self.mechanism}: invalid server nonce: does not start with client nonce")
        if iterations < SCRAM_MIN_ITERATIONS:
            raise SaslAuthenticationError(
                f"{self.mechanism}: requested iterations {iterations} is less than the minimum {SCRAM_MIN_ITERATIONS}"
            )
        if iterations > SCRAM_MAX_ITERATIONS:
            raise SaslAuthenticationError(
                f"{self.mechanism}: requested iterations {iterations} is more than the maximum {SCRAM_MAX_ITERATIONS}"
            )
        try:
            salt = base64.b64decode(m["salt"], validate=True)
        except binascii.Error:
            raise SaslAuthenticationError(f"{self.mechanism}: malformed salt in server-first message") from None
        name = self._hash
        salted = _salted_password(name, self._password, salt, iterations)
        # "biws" is base64("n,,"): the gs2 header again, channel binding data being empty.
        without_proof = f"c=biws,r={nonce}"
        auth_message = f"{self._client_first_bare},{text},{without_proof}".encode()
        client_key = hmac.digest(salted, b"Client Key", name)
        stored_key = hashlib.new(name, client_key).digest()
        client_signature = hmac.digest(stored_key, auth_message, name)
        proof = bytes(a ^ b for a, b in zip(client_key, client_signature))
        self._server_signature = hmac.digest(hmac.digest(salted, b"Server Key", name), auth_message, name)
        return f"{without_proof},p={base64.b64encode(proof).decode()}".encode()

    def verify_server_final(self, server_final: bytes) -> None:
        """Returns when ``server_final`` carries the signature only a server knowing the
        password's salted form can compute; SaslAuthenticationError otherwise."""
        if self._server_signature is None:
            raise SaslAuthenticationError(f"{self.mechanism}: server-final message before client-final")
        m = _SERVER_FINAL.fullmatch(self._text(server_final, "server-final"))
        if m is None:
            raise SaslAuthenticationError(f"{self.mechanism}: malformed server-final message")
        if m["error"] is not None:
            raise SaslRefused(f"{self.mechanism} authentication failed with error: {m['error']}",
                              f"server-final error {m['error']}")
        try:
            signature = base64.b64decode(m["signature"], validate=True)
        except binascii.Error:
            raise SaslAuthenticationError(f"{self.mechanism}: malformed server-final message") from None
        if not hmac.compare_digest(signature, self._server_signature):
            raise SaslAuthenticationError(f"{self.mechanism}: invalid server signature in server-final message")

    def _text(self, message: bytes, what: str) -> str:
        try:
            return message.decode()
        except UnicodeDecodeError:
            raise SaslAuthenticationError(f"{self.mechanism}: {what} message is not UTF-8") from None


async def authenticate(round_trip: RoundTrip, api_versions: dict[int, tuple[int, int]], creds: SaslCredentials) -> None:
    """Authenticates the connection ``round_trip`` talks over, whose broker offered
    ``api_versions`` (api key to (min, max)): SaslHandshake v1, then the mechanism's tokens in
    SaslAuthenticate requests. Returns once the broker accepted; SaslAuthenticationError if not."""
    mechanism = creds.mechanism
    if ApiKey.SASL_HANDSHAKE not in api_versions:
        raise SaslAuthenticationError(f"broker does not offer SASL (no SaslHandshake in its ApiVersions): {mechanism}")
    lo, hi = api_versions[ApiKey.SASL_HANDSHAKE]
    if min(hi, _HANDSHAKE_VERSION) < max(lo, 1):
        # v0 means the tokens follow as raw frames (KIP-43), which only pre-1.0 brokers require.
        raise SaslAuthenticationError(f"broker offers SaslHandshake v{lo}-v{hi}; the proxy needs v1")
    if ApiKey.SASL_AUTHENTICATE not in api_versions:
        raise SaslAuthenticationError("broker offers SaslHandshake but not SaslAuthenticate")
    lo, hi = api_versions[ApiKey.SASL_AUTHENTICATE]
    version = min(hi, _AUTHENTICATE_MAX_VERSION)
    if version < lo:
        raise SaslAuthenticationError(f"broker offers SaslAuthenticate v{lo}-v{hi}; the proxy knows v0-v2")

    handshake = await round_trip(SaslHandshakeRequest[_HANDSHAKE_VERSION](mechanism=mechanism))
    offered = list(handshake.mechanisms or ())
    if handshake.error_code != 0 or mechanism not in offered:
        # Kafka's SaslClientAuthenticator words it so for UNSUPPORTED_SASL_MECHANISM.
        error = f" ({_error_name(handshake.error_code)})" if handshake.error_code else ""
        enabled = f"enabled mechanisms are {', '.join(offered) or 'none'}"
        raise SaslRefused(f"SASL mechanism {mechanism} not enabled in the broker{error}; {enabled}",
                          f"mechanism not enabled{error}; {enabled}")

    async def step(token: bytes) -> bytes:
        resp = await round_trip(SaslAuthenticateRequest[version](auth_bytes=token))
        if resp.error_code != 0:
            said = _error_name(resp.error_code) + (f": {resp.error_message}" if resp.error_message else "")
            raise SaslRefused(f"{mechanism} authentication failed: {said}", said)
        # session_lifetime_ms (v1+, KIP-368) is ignored: the proxy's connections are short-lived.
        return bytes(resp.auth_bytes or b"")

    if mechanism == "PLAIN":
        await step(plain_initial_response(creds.username or "", creds.secret))
    elif mechanism == "OAUTHBEARER":
        challenge = await step(oauthbearer_initial_response(creds.secret))
        if challenge:
            # RFC 7628 §3.2.2, Kafka's OAuthBearerSaslServer: a rejected token gets an error JSON
            # as a challenge, which the client answers with %x01 for the server to fail the exchange.
            detail = challenge.decode(errors="replace")
            try:
                await step(b"\x01")
            except SaslRefused as exc:
                raise SaslRefused(f"{exc} ({detail})", f"{exc.broker_message} ({detail})") from None
            raise SaslRefused(f"OAUTHBEARER token rejected: {detail}", f"token rejected: {detail}")
    elif mechanism in _HASHES:
        scram = ScramClient(mechanism, creds.username or "", creds.secret)
        server_first = await step(scram.client_first())
        # PBKDF2 off the event loop: 4096 iterations take milliseconds, a broker may ask for more.
        client_final = await asyncio.to_thread(scram.client_final, server_first)
        scram.verify_server_final(await step(client_final))
    else:
        raise SaslAuthenticationError(f"unsupported SASL mechanism {mechanism!r}")


def _error_name(code: int) -> str:
    """Kafka's name for an error code, e.g. SASL_AUTHENTICATION_FAILED (58)."""
    name: str = for_code(code).message
    return f"{name} ({code})"
