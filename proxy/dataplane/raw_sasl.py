"""Raw SASL tokens: after a SaslHandshake v0 succeeds, the client's next frames are bare SASL
tokens (no request header, no correlation id) and so are the broker's answers.

Guarantees: exactly the number of token frames the mechanism's exchange has (PLAIN one,
SCRAM-SHA-* two) is forwarded as tokens, in order with the requests around them; the principal
claimed in the client's first token is believed only once the broker answered the whole
exchange (a broker that rejects closes the connection: SaslHandshake v0 has no error field for
the tokens); an unsupported mechanism closes the connection.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from struct import Struct

from protocol.apis import ApiKey
from proxy.dataplane.filters.api import FilterContext
from proxy.dataplane.inflight import Frame, InFlight
from proxy.dataplane.response_queue import ResponseQueue
from proxy.identity.principal import SaslError, principal_from_client_token, scram_exchange_complete

log = logging.getLogger(__name__)

_INT32 = Struct(">i")
_ROUND_TRIPS = {"PLAIN": 1, "SCRAM-SHA-256": 2, "SCRAM-SHA-512": 2}


class RawSasl:
    """The raw SASL exchange of one client connection. ``frames_due``: token frames still to
    come from the client (0: its frames are requests)."""

    __slots__ = ("frames_due", "_ctx", "_queue", "_log")

    def __init__(self, ctx: FilterContext, queue: ResponseQueue, log_limited: Callable[..., None]) -> None:
        self.frames_due = 0
        self._ctx = ctx
        self._queue = queue
        self._log = log_limited  # ConnectionGuard.log: a client can send unreadable tokens at will

    def start(self, mechanism: str | None) -> bool:
        """SaslHandshake v0 succeeded for ``mechanism``: False if its exchange is not supported."""
        rounds = _ROUND_TRIPS.get(mechanism or "")
        if rounds is None:
            return False
        self.frames_due = rounds
        return True

    def forward(self, frame: Frame, out: list[Frame]) -> None:
        """Queues the client's token ``frame`` for the broker and an answer owed for it."""
        session = self._ctx.session
        if session.claimed_principal is None:
            try:
                session.claimed_principal = principal_from_client_token(session.sasl_mechanism or "", bytes(frame))
            except (SaslError, UnicodeDecodeError) as exc:
                self._log("sasl_token", logging.WARNING, "cannot read principal from raw SASL token on %s: %s",
                          self._ctx.label, exc, logger=log)
        entry = InFlight(-1, ApiKey.SASL_AUTHENTICATE, -1, time.monotonic())
        entry.raw = True
        self._queue.expect_from_broker(entry)
        self.frames_due -= 1
        out.append(_INT32.pack(len(frame)))
        out.append(frame)

    def on_response(self, frame: Frame) -> None:
        """The broker answered a token: after the last one, the claimed principal is believed."""
        session = self._ctx.session
        if any(e.raw for e in self._queue.awaiting) or self.frames_due:
            return
        mechanism = session.sasl_mechanism or ""
        if mechanism.startswith("SCRAM-") and not scram_exchange_complete(bytes(frame)):
            return
        if session.claimed_principal is not None:
            session.authenticate(session.claimed_principal)
            log.info("authenticated %s as %s via %s (SaslHandshake v0)", self._ctx.label, session.principal,
                     mechanism)
