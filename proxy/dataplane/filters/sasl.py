"""Principal detection from SASL passthrough (SaslHandshake + SaslAuthenticate)."""

from __future__ import annotations

import logging

from protocol.apis import ApiKey
from protocol.headers import RequestHeader, response_body_offset
from protocol.messages import decode_request, decode_response
from proxy.dataplane.filters.api import FilterContext, FilterSpec, Frame
from proxy.dataplane.inflight import InFlight
from proxy.identity.principal import SaslError, principal_from_client_token, scram_exchange_complete
from proxy.observability.logs import LogLimiter

log = logging.getLogger(__name__)
_unreadable_token = LogLimiter(log)  # a client can send unreadable tokens at will


class SaslFilter:
    """Follows SASL passthrough. A body that cannot be decoded (a null auth_bytes included: the
    schema does not allow one, and Kafka's own reader refuses it) raises DecodeError; a token
    no principal can be read from claims none."""

    spec = FilterSpec(request_keys=frozenset({ApiKey.SASL_HANDSHAKE, ApiKey.SASL_AUTHENTICATE}),
                      response_keys=frozenset({ApiKey.SASL_HANDSHAKE, ApiKey.SASL_AUTHENTICATE}))

    def on_request(self, ctx: FilterContext, header: RequestHeader, frame: Frame, entry: InFlight) -> None:
        req = decode_request(header.api_key, header.api_version, memoryview(frame)[header.body_offset :])
        session = ctx.session
        if header.api_key == ApiKey.SASL_HANDSHAKE:
            session.sasl_mechanism = req.mechanism
            return None
        mechanism = session.sasl_mechanism or ""
        try:
            claimed = principal_from_client_token(mechanism, bytes(req.auth_bytes))
        except (SaslError, UnicodeDecodeError, RecursionError) as exc:
            # RecursionError: json's decoder on a JWT payload nested deeper than the stack.
            _unreadable_token.log(logging.WARNING, "cannot read principal from %s token on %s: %s",
                                  mechanism, ctx.label, exc)
            claimed = None
        if claimed is not None:
            session.claimed_principal = claimed
        return None

    def on_response(self, ctx: FilterContext, entry: InFlight, frame: Frame) -> Frame:
        offset = response_body_offset(frame, entry.api_key, entry.api_version)
        resp = decode_response(entry.api_key, entry.api_version, memoryview(frame)[offset:])
        session = ctx.session
        if entry.api_key == ApiKey.SASL_HANDSHAKE:
            if resp.error_code != 0:
                session.sasl_mechanism = None
            elif entry.api_version == 0:
                # SaslHandshake v0: the SASL tokens that follow are raw frames, not requests.
                ctx.start_raw_sasl(session.sasl_mechanism)
            return frame
        if resp.error_code != 0:
            session.claimed_principal = None
            return frame
        mechanism = session.sasl_mechanism or ""
        done = not mechanism.startswith("SCRAM-") or scram_exchange_complete(bytes(resp.auth_bytes))
        if done and session.claimed_principal is not None:
            session.authenticate(session.claimed_principal)
            log.info("authenticated %s as %s via %s", ctx.label, session.principal, mechanism)
        return frame
