"""Principals from SASL exchanges seen in passing (PLAIN, SCRAM-SHA-*, OAUTHBEARER).

A candidate principal is read from the client's first SaslAuthenticate token; the connection
believes it only after the broker answers the exchange with success.
"""

from __future__ import annotations

import base64
import json

from quotas.entities import ANONYMOUS  # the pipeline shares it; defined in quotas


class Session:
    """Who is on the other end of a client connection: its principal (ANONYMOUS until a SASL
    exchange succeeds), the client id of its last request, and the SASL exchange under way."""

    __slots__ = ("principal", "client_id", "sasl_mechanism", "claimed_principal", "authenticated")

    def __init__(self) -> None:
        self.principal = ANONYMOUS
        self.client_id: str | None = None
        self.sasl_mechanism: str | None = None
        self.claimed_principal: str | None = None
        self.authenticated = False

    def authenticate(self, principal: str) -> None:
        self.principal = principal
        self.authenticated = True


class SaslError(ValueError):
    """A SASL token the proxy cannot read a principal from."""


def principal_from_client_token(mechanism: str, token: bytes) -> str | None:
    """The user name a client's first SASL token claims, or None if this token names nobody."""
    if mechanism == "PLAIN":
        # RFC 4616: [authzid] NUL authcid NUL passwd; Kafka's PlainSaslServer uses authcid.
        parts = token.split(b"\x00")
        if len(parts) != 3 or not parts[1]:
            raise SaslError("PLAIN token is not authzid\\0authcid\\0passwd")
        return parts[1].decode("utf-8")
    if mechanism.startswith("SCRAM-"):
        return _scram_user(token)
    if mechanism == "OAUTHBEARER":
        return _oauthbearer_sub(token)
    return None


def scram_exchange_complete(server_token: bytes) -> bool:
    """True for SCRAM's server-final-message (``v=...``), the end of a successful exchange."""
    return server_token.startswith(b"v=")


def _scram_user(token: bytes) -> str | None:
    # RFC 5802 client-first-message: gs2-header "n,," then "n=<user>,r=<nonce>".
    text = token.decode("utf-8", errors="strict")
    if not text.startswith(("n,", "y,", "p=")):
        return None  # client-final-message: names nobody
    bare = text.split(",", 2)[2] if text.count(",") >= 2 else ""
    for attr in bare.split(","):
        if attr.startswith("n="):
            return attr[2:].replace("=2C", ",").replace("=3D", "=")
    raise SaslError("SCRAM client-first-message has no n= attribute")


def _oauthbearer_sub(token: bytes) -> str:
    # RFC 7628: gs2-header, then \x01-separated key=value pairs including auth=Bearer <jwt>.
    for kv in token.split(b"\x01"):
        if kv.startswith(b"auth="):
            scheme, _, jwt = kv[5:].decode("ascii").partition(" ")
            if scheme.lower() != "bearer":
                raise SaslError("OAUTHBEARER auth is not a Bearer token")
            return _jwt_claim(jwt.strip(), "sub")
    raise SaslError("OAUTHBEARER token has no auth= key")


def _jwt_claim(jwt: str, claim: str) -> str:
    # Kafka's default sasl.oauthbearer.sub.claim.name is "sub".
    parts = jwt.split(".")
    if len(parts) < 2:
        raise SaslError("bearer token is not a JWT")
    payload = parts[1] + "=" * (-len(parts[1]) % 4)
    try:
        claims = json.loads(base64.urlsafe_b64decode(payload))
    except (ValueError, RecursionError) as exc:  # json recurses on nesting: a hostile token
        raise SaslError("JWT payload is not base64url JSON") from exc
    value = claims.get(claim) if isinstance(claims, dict) else None
    if not isinstance(value, str) or not value:
        raise SaslError(f"JWT has no {claim!r} claim")
    return value
