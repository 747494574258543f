"""A SASL front for Tansu: authenticates clients itself, then relays them to the broker.

Tansu 0.6's own SASL cannot be used (``tansu user create`` is refused with "early eof"), yet
the proxy learns a principal only by forwarding a client's SaslHandshake / SaslAuthenticate
upstream and seeing the broker answer success. The front stands where that broker answer is
made: on each accepted connection it opens a connection to Tansu and reads whole request
frames until the first request that is not about SASL.

- ApiVersions (18) goes to Tansu; its answer comes back re-encoded (kafka-python's
  ``ApiVersionsResponse`` of the request's version) with SaslHandshake v0-1 and
  SaslAuthenticate v0-2 added if Tansu left them out.
- SaslHandshake (17) and SaslAuthenticate (36) are answered here, against ``users``
  ({name: password}), for PLAIN and SCRAM-SHA-256/512 (SCRAM's server side is
  :class:`tests.support.sasl_broker.SaslScript`'s), and for OAUTHBEARER when ``tokens``
  ({bearer token: principal}) are given (RFC 7628's initial response; an unknown token
  fails). After SaslHandshake v0 the tokens arrive as raw frames, as Kafka does it. A failed
  exchange is answered SASL_AUTHENTICATION_FAILED (58) with a message, and the connection is
  then closed, as a broker closes it.
- Any other request, and everything after it in both directions, is relayed byte for byte.
  Authentication is optional: a connection that never authenticates is relayed too, unless
  ``require_authentication``: then, as on a Kafka SASL listener (``SaslServerAuthenticator``:
  "Unexpected Kafka request of type ... during SASL handshake"), such a request closes the
  connection, recorded as ``refused_api``.

Tansu must advertise the front's port, so that clients reach every broker through it:

    front = SaslFront({"alice": "alice-secret"}).start()
    broker = TansuBroker(advertised_port=front.port).start()
    front.target = (broker.host, broker.port)

or ``with tansu_behind_sasl_front(users) as stack: ...`` (``stack.bootstrap``, ``.front``,
``.broker``). Every accepted connection is recorded (:attr:`SaslFront.connections`) with the
user it authenticated as, or None.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

from kafka.protocol.metadata import ApiVersionsResponse
from kafka.protocol.sasl import SaslAuthenticateResponse, SaslHandshakeResponse

from protocol.apis import ApiKey
from protocol.headers import (
    HeaderError,
    encode_response_header,
    parse_request_header,
    response_body_offset,
    response_header_is_flexible,
)
from protocol.messages import DecodeError, decode_request, decode_response, encode_body
from tests.support.sasl_broker import SaslScript
from tests.support.tansu import TansuBroker
from tests.support.threaded_server import ThreadedServer, pipe

SASL_AUTHENTICATION_FAILED = 58
UNSUPPORTED_SASL_MECHANISM = 33
ILLEGAL_SASL_STATE = 34
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
KNOWN_MECHANISMS = (*MECHANISMS, "OAUTHBEARER")
# What the front adds to Tansu's ApiVersions answer when Tansu leaves it out: (min, max).
SASL_API_VERSIONS = {ApiKey.SASL_HANDSHAKE: (0, 1), ApiKey.SASL_AUTHENTICATE: (0, 2)}

_INT32 = struct.Struct(">i")
_BEFORE_AUTHENTICATION = (ApiKey.API_VERSIONS, ApiKey.SASL_HANDSHAKE, ApiKey.SASL_AUTHENTICATE)


@dataclass(frozen=True)
class FrontConnection:
    """One accepted connection, as of when it was read."""

    peer: tuple[str, int]
    mechanism: str | None = None  # the mechanism of the last successful SaslHandshake
    user: str | None = None  # set once an exchange succeeded; None: never authenticated
    rejected_user: str | None = None  # the user name of an exchange that failed
    relayed: bool = False  # a non-SASL request arrived and the connection went to byte relay
    refused_api: int | None = None  # require_authentication: the request that closed it unauthenticated


class SaslError(Exception):
    """A SASL exchange that failed: ``message`` goes to the client."""

    def __init__(self, message: str, user: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.user = user


class SaslExchange:
    """The server side of one SASL exchange for ``mechanism``.

    :meth:`step` takes a client token and returns the server's token; :attr:`user` is set when
    the exchange has succeeded. Raises :class:`SaslError` when it fails.
    """

    def __init__(self, users: dict[str, str], mechanism: str, tokens: dict[str, str] | None = None) -> None:
        self.users = users
        self.tokens = tokens or {}
        self.mechanism = mechanism
        self.user: str | None = None
        self._claimed: str | None = None
        self._scram: SaslScript | None = None
        if mechanism.startswith("SCRAM-"):
            self._scram = SaslScript(users, node_id=0, port=0)
            self._scram.mechanism = mechanism

    @property
    def done(self) -> bool:
        return self.user is not None

    def step(self, token: bytes) -> bytes:
        if self.done:
            raise SaslError("Authentication failed: the SASL exchange is already complete")
        if self.mechanism == "PLAIN":
            return self._plain(token)
        if self.mechanism == "OAUTHBEARER":
            return self._oauthbearer(token)
        return self._scram_step(token)

    def _oauthbearer(self, token: bytes) -> bytes:
        # RFC 7628: gs2-header, then \x01-separated key=value pairs with auth=Bearer <token>.
        bearer = next((kv[12:] for kv in token.split(b"\x01") if kv.startswith(b"auth=Bearer ")), None)
        user = self.tokens.get(bearer.decode("ascii", "replace")) if bearer is not None else None
        if user is None:
            raise SaslError("Authentication failed: invalid OAUTHBEARER token")
        self.user = user
        return b""

    def _plain(self, token: bytes) -> bytes:
        # RFC 4616: [authzid] NUL authcid NUL passwd.
        parts = token.split(b"\x00")
        if len(parts) != 3 or not parts[1]:
            raise SaslError("Authentication failed: invalid SASL/PLAIN response")
        try:
            user, password = parts[1].decode(), parts[2].decode()
        except UnicodeDecodeError:
            raise SaslError("Authentication failed: invalid SASL/PLAIN response") from None
        if self.users.get(user) != password:
            raise SaslError("Authentication failed: Invalid username or password", user)
        self.user = user
        return b""

    def _scram_step(self, token: bytes) -> bytes:
        assert self._scram is not None
        failed = (f"Authentication failed during authentication due to invalid credentials "
                  f"with SASL mechanism {self.mechanism}")
        if self._claimed is None:
            self._claimed = _scram_user(token)
        try:
            error, reply = self._scram._authenticate(token)
        except (ValueError, KeyError, IndexError, UnicodeDecodeError):
            raise SaslError(f"Authentication failed: invalid {self.mechanism} message", self._claimed) from None
        if error:
            raise SaslError(failed, self._claimed)
        if reply.startswith(b"v="):  # server-final-message: the proof checked out
            self.user = self._claimed
        return reply


def _scram_user(token: bytes) -> str | None:
    """The user name of a SCRAM client-first-message (``n,,n=<user>,r=<nonce>``)."""
    try:
        bare = token.decode().split(",", 2)[2]
    except (UnicodeDecodeError, IndexError):
        return None
    for attr in bare.split(","):
        if attr.startswith("n="):
            return attr[2:].replace("=2C", ",").replace("=3D", "=")
    return None


def with_sasl_apis(body: bytes, version: int) -> bytes:
    """An ApiVersions response body (of ``version``) listing SaslHandshake and SaslAuthenticate.

    A body carrying an error is returned as it is (Kafka encodes those as v0 whatever the
    version); otherwise the decoded response gets the missing SASL APIs and is re-encoded with
    kafka-python's ``ApiVersionsResponse[version]``.
    """
    resp = decode_response(ApiKey.API_VERSIONS, version, body)
    if resp.error_code != 0:
        return body
    present = {entry.api_key for entry in resp.api_keys}
    entry_class = ApiVersionsResponse[version].ApiVersion
    keys = list(resp.api_keys)
    for api_key, (low, high) in SASL_API_VERSIONS.items():
        if api_key not in present:
            keys.append(entry_class(api_key=int(api_key), min_version=low, max_version=high))
    resp.api_keys = keys
    return encode_body(resp)


class _Closed(Exception):
    """The connection is over (a peer closed it, or a failed exchange ends it)."""


class SaslFront(ThreadedServer):
    """The SASL front on its own thread and event loop (see the module docstring)."""

    thread_name = "sasl-front"

    def __init__(self, users: dict[str, str], host: str = "127.0.0.1",
                 target: tuple[str, int] | None = None, mechanisms: tuple[str, ...] = MECHANISMS,
                 max_frame_bytes: int = 100 * 1024 * 1024, require_authentication: bool = False,
                 tokens: dict[str, str] | None = None) -> None:
        unknown = set(mechanisms) - set(KNOWN_MECHANISMS)
        if unknown:
            raise ValueError(f"unsupported mechanisms {sorted(unknown)}; the front knows {KNOWN_MECHANISMS}")
        super().__init__(host, target)
        self.users = dict(users)
        self.mechanisms = tuple(mechanisms)
        self.max_frame_bytes = max_frame_bytes
        self.require_authentication = require_authentication
        self.tokens = dict(tokens or {})
        self._connections: list[FrontConnection] = []

    # -- what tests read ------------------------------------------------------------------

    @property
    def connections(self) -> list[FrontConnection]:
        """Every accepted connection so far, in accept order."""
        with self._lock:
            return list(self._connections)

    @property
    def authenticated_users(self) -> list[str]:
        """The user of each connection that authenticated, in accept order (with repeats)."""
        return [c.user for c in self.connections if c.user is not None]

    @property
    def rejected_users(self) -> list[str]:
        """The user name each failed exchange claimed (when it named one), in accept order."""
        return [c.rejected_user for c in self.connections if c.rejected_user is not None]

    def wait_for(self, predicate, timeout_s: float = 10.0) -> list[FrontConnection]:
        """Polls :attr:`connections` until ``predicate(connections)`` holds; AssertionError if not."""
        deadline = time.monotonic() + timeout_s
        while True:
            connections = self.connections
            if predicate(connections):
                return connections
            if time.monotonic() > deadline:
                raise AssertionError(f"front connections never matched: {connections}")
            time.sleep(0.02)

    # -- one connection ---------------------------------------------------------------------

    def _update(self, index: int, **changes) -> None:
        with self._lock:
            self._connections[index] = replace(self._connections[index], **changes)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_writer = None
        try:
            with self._lock:
                index = len(self._connections)
                self._connections.append(FrontConnection(peer=writer.get_extra_info("peername")[:2]))
            upstream = await self._connect_target()
            if upstream is None:
                return
            up_reader, up_writer = upstream
            try:
                first = await self._sasl_phase(index, reader, writer, up_reader, up_writer)
            except (_Closed, DecodeError):  # DecodeError: a SASL request that is not one
                return
            self._update(index, relayed=True)
            up_writer.write(first)
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        except (ConnectionError, OSError):
            pass
        finally:
            if up_writer is not None:
                up_writer.close()
            writer.close()

    async def _sasl_phase(self, index, reader, writer, up_reader, up_writer) -> bytes:
        """Answers ApiVersions and SASL until another request arrives; returns that frame
        (with its size prefix) for the relay. Raises _Closed when the connection is over."""
        exchange: SaslExchange | None = None
        raw_tokens = False  # after SaslHandshake v0: the next frames are bare SASL tokens
        while True:
            frame = await self._read_frame(reader)
            if raw_tokens:
                assert exchange is not None
                try:
                    reply = exchange.step(frame)
                except SaslError as exc:
                    # SaslHandshake v0 has no way to carry an error: the broker just closes.
                    self._update(index, rejected_user=exc.user)
                    raise _Closed from None
                await _send(writer, reply)
                if exchange.done:
                    self._update(index, user=exchange.user)
                    raw_tokens = False
                continue
            try:
                header = parse_request_header(frame)
            except HeaderError:
                return _INT32.pack(len(frame)) + frame
            if self.require_authentication and header.api_key not in _BEFORE_AUTHENTICATION and (
                    exchange is None or not exchange.done):
                self._update(index, refused_api=header.api_key)
                raise _Closed
            if header.api_key == ApiKey.API_VERSIONS:
                await self._api_versions(header, frame, writer, up_reader, up_writer)
            elif header.api_key == ApiKey.SASL_HANDSHAKE:
                req = decode_request(header.api_key, header.api_version, memoryview(frame)[header.body_offset :])
                ok = req.mechanism in self.mechanisms and exchange is None
                if ok:
                    exchange = SaslExchange(self.users, req.mechanism, self.tokens)
                    self._update(index, mechanism=req.mechanism)
                error = 0 if ok else (UNSUPPORTED_SASL_MECHANISM if exchange is None else ILLEGAL_SASL_STATE)
                resp = SaslHandshakeResponse[header.api_version](error_code=error, mechanisms=list(self.mechanisms))
                await _send(writer, _response(header, resp))
                if not ok:
                    raise _Closed
                raw_tokens = header.api_version == 0
            elif header.api_key == ApiKey.SASL_AUTHENTICATE:
                req = decode_request(header.api_key, header.api_version, memoryview(frame)[header.body_offset :])
                error, message, reply = 0, None, b""
                if exchange is None:
                    error, message = ILLEGAL_SASL_STATE, "SaslAuthenticate before a successful SaslHandshake"
                else:
                    try:
                        reply = exchange.step(bytes(req.auth_bytes))
                    except SaslError as exc:
                        error, message = SASL_AUTHENTICATION_FAILED, exc.message
                        self._update(index, rejected_user=exc.user)
                resp = SaslAuthenticateResponse[header.api_version](
                    error_code=error, error_message=message, auth_bytes=reply, session_lifetime_ms=0,
                )
                await _send(writer, _response(header, resp))
                if error:
                    raise _Closed
                if exchange.done:
                    self._update(index, user=exchange.user)
            else:
                return _INT32.pack(len(frame)) + frame

    async def _api_versions(self, header, frame: bytes, writer, up_reader, up_writer) -> None:
        await _send(up_writer, frame)
        answer = await self._read_frame(up_reader)
        offset = response_body_offset(answer, ApiKey.API_VERSIONS, header.api_version)
        try:
            body = with_sasl_apis(answer[offset:], header.api_version)
        except DecodeError:
            body = answer[offset:]  # a version kafka-python cannot decode: pass it on as it is
        await _send(writer, answer[:offset] + body)

    async def _read_frame(self, reader: asyncio.StreamReader) -> bytes:
        try:
            (size,) = _INT32.unpack(await reader.readexactly(4))
            if size < 0 or size > self.max_frame_bytes:
                raise _Closed
            return await reader.readexactly(size)
        except asyncio.IncompleteReadError:
            raise _Closed from None


def _response(header, resp) -> bytes:
    flexible = response_header_is_flexible(header.api_key, header.api_version)
    return encode_response_header(header.correlation_id, flexible) + encode_body(resp)


async def _send(writer: asyncio.StreamWriter, payload: bytes) -> None:
    writer.write(_INT32.pack(len(payload)) + payload)
    await writer.drain()




# -- Tansu behind the front ------------------------------------------------------------------


@dataclass
class TansuBehindSaslFront:
    """Tansu listening on ``broker.port`` but advertising ``front.port``."""

    broker: TansuBroker
    front: SaslFront

    @property
    def bootstrap(self) -> str:
        """The address to give clients or the proxy: the front's."""
        return self.front.bootstrap


@contextlib.contextmanager
def tansu_behind_sasl_front(users: dict[str, str], **front_kwargs) -> Iterator[TansuBehindSaslFront]:
    """A started front and a Tansu that advertises it; both stopped on exit."""
    front = SaslFront(users, **front_kwargs).start()
    try:
        with TansuBroker(advertised_port=front.port) as broker:
            front.target = (broker.host, broker.port)
            yield TansuBehindSaslFront(broker=broker, front=front)
    finally:
        front.stop()
