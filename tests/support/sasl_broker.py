"""A scripted broker that authenticates with SASL PLAIN, SCRAM-SHA-256/512 or OAUTHBEARER.

Tansu 0.6's ``--authentication`` cannot be used here (its own ``tansu user create`` is refused
with "early eof"), so SASL passthrough is tested against this script, which implements the
server side of each mechanism for real so that real client libraries complete the exchange.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import struct

from kafka.protocol.metadata import ApiVersionsResponse, MetadataResponse
from kafka.protocol.sasl import SaslAuthenticateResponse, SaslHandshakeResponse

from protocol.headers import encode_response_header, parse_request_header, response_header_is_flexible
from protocol.messages import decode_request, encode_body

SASL_AUTHENTICATION_FAILED = 58
UNSUPPORTED_SASL_MECHANISM = 33
ITERATIONS = 4096
_HASHES = {"SCRAM-SHA-256": hashlib.sha256, "SCRAM-SHA-512": hashlib.sha512}


class SaslScript:
    """One connection's server side. ``users`` maps user name to password."""

    def __init__(self, users: dict[str, str], node_id: int, port: int) -> None:
        self.users = users
        self.node_id = node_id
        self.port = port
        self.mechanism: str | None = None
        self._scram: dict = {}

    def __call__(self, frame: bytes) -> bytes | None:
        header = parse_request_header(frame)
        body = memoryview(frame)[header.body_offset :]
        if header.api_key == 18:
            resp = self._api_versions(header.api_version)
        elif header.api_key == 17:
            req = decode_request(17, header.api_version, body)
            ok = req.mechanism in ("PLAIN", "OAUTHBEARER", *_HASHES)
            self.mechanism = req.mechanism if ok else None
            resp = SaslHandshakeResponse[header.api_version](
                error_code=0 if ok else UNSUPPORTED_SASL_MECHANISM,
                mechanisms=["PLAIN", "OAUTHBEARER", *_HASHES],
            )
        elif header.api_key == 36:
            req = decode_request(36, header.api_version, body)
            error, token = self._authenticate(bytes(req.auth_bytes))
            resp = SaslAuthenticateResponse[header.api_version](
                error_code=error,
                error_message=None if error == 0 else "Authentication failed",
                auth_bytes=token,
                session_lifetime_ms=0,
            )
        elif header.api_key == 3:
            broker = MetadataResponse[header.api_version].MetadataResponseBroker(
                node_id=self.node_id, host="127.0.0.1", port=self.port, rack=None
            )
            resp = MetadataResponse[header.api_version](
                throttle_time_ms=0, brokers=[broker], cluster_id="sasl-test",
                controller_id=self.node_id, topics=[],
            )
        else:
            return None
        flexible = response_header_is_flexible(header.api_key, header.api_version)
        payload = encode_response_header(header.correlation_id, flexible) + encode_body(resp)
        return struct.pack(">i", len(payload)) + payload

    @staticmethod
    def _api_versions(version: int):
        entry = ApiVersionsResponse[version].ApiVersion
        keys = [entry(api_key=k, min_version=0, max_version=v) for k, v in ((18, 3), (17, 1), (36, 2), (3, 8))]
        return ApiVersionsResponse[version](error_code=0, api_keys=keys, throttle_time_ms=0)

    def _authenticate(self, token: bytes) -> tuple[int, bytes]:
        mech = self.mechanism
        if mech == "PLAIN":
            _authz, user, password = token.split(b"\x00")
            ok = self.users.get(user.decode()) == password.decode()
            return (0 if ok else SASL_AUTHENTICATION_FAILED), b""
        if mech == "OAUTHBEARER":
            return (0 if b"auth=Bearer " in token else SASL_AUTHENTICATION_FAILED), b""
        if mech in _HASHES:
            return self._scram_step(token)
        return SASL_AUTHENTICATION_FAILED, b""

    def _scram_step(self, token: bytes) -> tuple[int, bytes]:
        h = _HASHES[self.mechanism]
        text = token.decode()
        if not self._scram:
            bare = text.split(",", 2)[2]
            attrs = dict(a.split("=", 1) for a in bare.split(","))
            user = attrs["n"]
            if user not in self.users:
                return SASL_AUTHENTICATION_FAILED, b""
            salt = os.urandom(16)
            nonce = attrs["r"] + base64.b64encode(os.urandom(12)).decode()
            server_first = f"r={nonce},s={base64.b64encode(salt).decode()},i={ITERATIONS}"
            salted = hashlib.pbkdf2_hmac(h().name, self.users[user].encode(), salt, ITERATIONS)
            self._scram = {"bare": bare, "server_first": server_first, "salted": salted}
            return 0, server_first.encode()
        without_proof, _, proof = text.rpartition(",p=")
        s = self._scram
        auth_message = f"{s['bare']},{s['server_first']},{without_proof}".encode()
        client_key = hmac.new(s["salted"], b"Client Key", h).digest()
        stored_key = h(client_key).digest()
        signature = hmac.new(stored_key, auth_message, h).digest()
        expected = bytes(a ^ b for a, b in zip(client_key, signature))
        if base64.b64decode(proof) != expected:
            return SASL_AUTHENTICATION_FAILED, b""
        server_key = hmac.new(s["salted"], b"Server Key", h).digest()
        server_signature = hmac.new(server_key, auth_message, h).digest()
        return 0, b"v=" + base64.b64encode(server_signature)
