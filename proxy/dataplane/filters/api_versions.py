"""ApiVersions: answer versions the proxy does not know, cap what clients may use, and refuse
the APIs it hides."""

from __future__ import annotations

from struct import Struct
from typing import Any

from protocol import rewrite
from protocol.apis import API_FAMILIES, SPECS, ApiKey, api_name
from protocol.headers import RequestHeader, encode_response_header
from protocol.messages import decode_response, encode_body
from proxy.dataplane.filters.api import Answer, Close, FilterContext, FilterSpec, Frame
from proxy.dataplane.filters.leaders import uplifted_caps
from proxy.dataplane.inflight import InFlight

_INT32 = Struct(">i")
# A rewrite made of a broker's ApiVersions body: (broker body, body to send, uplift, the size
# prefix of the frame to send).
_Rewrite = tuple[bytes, bytes, dict[int, int], bytes]

# APIs whose responses the proxy decodes: clients must not use a version it cannot parse.
_DECODED = (
    ApiKey.API_VERSIONS,
    ApiKey.METADATA,
    ApiKey.FIND_COORDINATOR,
    ApiKey.DESCRIBE_CLUSTER,
    ApiKey.PRODUCE,
    ApiKey.FETCH,
    ApiKey.SASL_HANDSHAKE,
    ApiKey.SASL_AUTHENTICATE,
    ApiKey.SHARE_FETCH,  # KIP-932, protocol.share_messages
    ApiKey.SHARE_ACKNOWLEDGE,
)


def default_caps() -> dict[int, int | None]:
    caps: dict[int, int | None] = {key: SPECS[key].max_version for key in _DECODED}
    # DescribeQuorum v2 lists controller endpoints, which the proxy does not serve.
    caps[ApiKey.DESCRIBE_QUORUM] = 1
    return caps


def hidden_apis(caps: dict[int, int | None], families: tuple[frozenset[int], ...] = API_FAMILIES) -> frozenset[int]:
    """The APIs never offered to clients: those capped to None, with their families."""
    hidden = {key for key, cap in caps.items() if cap is None}
    for family in families:
        if family & hidden:
            hidden |= family
    return frozenset(hidden)


class ApiVersionsFilter:
    """Answers an ApiVersions version the proxy does not know, caps each API at what the
    proxy carries (a family of APIs whole or not at all), learns the connection's KIP-951
    uplift from the broker's answer, and closes a connection that sends an API it hides."""

    def __init__(self, caps: dict[int, int | None] | None = None, uplift: bool = False,
                 offered: dict[int, tuple[int, int]] | None = None) -> None:
        self.caps = default_caps() if caps is None else caps
        # {api key: (min, max)}: APIs the proxy answers itself, listed whatever the broker says.
        self.offered = offered or {}
        self.max_version = SPECS[ApiKey.API_VERSIONS].max_version
        self.hidden = hidden_apis(self.caps) - self.offered.keys()
        keys = frozenset({ApiKey.API_VERSIONS})
        self.spec = FilterSpec(
            request_keys=keys | self.hidden, response_keys=keys, chunk=True,
            request_since={ApiKey.API_VERSIONS: self.max_version + 1},  # only unknown versions are answered
        )
        self.uplift = uplift  # KIP-951: offer Produce v10 / Fetch v16 over v9 / v15 brokers
        # A broker answers ApiVersions with the same body every time: each body is rewritten
        # once (with the versions this connection's requests must go up as, see UpliftFilter).
        # Keyed by version and body length, so a response is matched by comparing its bytes in
        # place: (broker body, rewritten body, uplift, the rewritten frame's size prefix).
        self._rewritten: dict[tuple[int, int], list[_Rewrite]] = {}
        self._rewrites = 0
        # The rewrite the last chunk matched, tried first (one broker and one client library
        # ask the same way every time): (version, chunk length, that rewrite).
        self._last: tuple[int, int, _Rewrite] | None = None

    def on_request(self, ctx: FilterContext, header: RequestHeader, frame: Frame,
                   entry: InFlight) -> Answer | Close | None:
        if header.api_key in self.hidden:
            # Kafka's SocketServer (Processor.parseRequestHeader) closes a connection that sends
            # an API not enabled on its listener; the broker behind would answer it unrewritten.
            return Close(f"{api_name(header.api_key)} (api key {header.api_key}) v{header.api_version} is not "
                         "offered through the proxy")
        if header.api_version > self.max_version:
            # Kafka answers an unknown ApiVersions version itself with v0 + UNSUPPORTED_VERSION
            # (ApiVersionsRequest.getErrorResponse), so the client retries at a known version.
            body = encode_body(rewrite.unsupported_api_versions_response(self.max_version))
            return Answer(encode_response_header(header.correlation_id, False) + body)
        return None

    def on_response(self, ctx: FilterContext, entry: InFlight, frame: Frame) -> bytes:
        # The ApiVersions response header is always v0 (KIP-511): the body starts at byte 4.
        data = bytes(frame)
        done = self._find(entry.api_version, data, 4) or self._rewrite(entry, data[4:])
        ctx.set_uplift(done[2])
        return data if done[1] is done[0] else data[:4] + done[1]

    def on_response_chunk(self, ctx: FilterContext, entry: InFlight, chunk: bytes) -> bytes | None:
        # Every response after a connection's first: a rewrite already made, without a copy.
        # This runs before the response is written, so the common case is kept short.
        last = self._last
        if (last is not None and last[0] == entry.api_version and last[1] == len(chunk)
                and chunk[8:] == last[2][0]):  # a slice and ==: startswith parses its arguments
            done = last[2]
        else:
            found = self._find(entry.api_version, chunk, 8)
            if found is None:
                return None
            done = found
            self._last = (entry.api_version, len(chunk), done)
        if ctx.uplift is not done[2]:
            ctx.set_uplift(done[2])
        if done[1] is done[0]:
            return chunk  # nothing to change: the broker's very bytes
        return b"".join((done[3], chunk[4:8], done[1]))

    def _find(self, version: int, data: bytes, offset: int) -> _Rewrite | None:
        """The rewrite already made of the broker body at ``data[offset:]`` (compared in place)."""
        for done in self._rewritten.get((version, len(data) - offset), ()):
            if data.startswith(done[0], offset):
                return done
        return None

    def _rewrite(self, entry: InFlight, broker_body: bytes) -> _Rewrite:
        """(broker body, body to send, uplift, the size prefix of the frame to send). The body
        to send *is* the broker body when the rewrite gives the same bytes."""
        resp = decode_response(entry.api_key, entry.api_version, broker_body)
        body, uplift = (broker_body, {}) if resp.error_code != 0 else self._capped(resp)
        if body == broker_body:
            body = broker_body  # on_response_chunk then sends the broker's chunk itself
        done = (broker_body, body, uplift, _INT32.pack(len(body) + 4))
        if self._rewrites < 64:  # a handful of brokers x versions
            self._rewritten.setdefault((entry.api_version, len(broker_body)), []).append(done)
            self._rewrites += 1
        return done

    def _capped(self, resp: Any) -> tuple[bytes, dict[int, int]]:
        broker_max = {e.api_key: e.max_version for e in resp.api_keys}
        rewrite.cap_api_versions(resp, self.caps, API_FAMILIES)
        rewrite.offer_api_versions(resp, self.offered)
        uplift = uplifted_caps(broker_max, self.uplift)
        for e in resp.api_keys:
            if e.api_key in uplift and e.max_version == uplift[e.api_key]:
                e.max_version += 1
        # Re-encoded even when no version changes: tagged fields at their defaults are left
        # out, as Kafka's own writers do (librdkafka 2.0 misreads Tansu's, which has them).
        return encode_body(resp), uplift
