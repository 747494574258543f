"""ApiVersions: answer versions the proxy does not know, cap what clients may use."""

from __future__ import annotations

from struct import Struct

from protocol import rewrite
from protocol.apis import SPECS, ApiKey
from protocol.headers import encode_response_header
from protocol.messages import decode_response, encode_body

from .base import Answer
from .leaders import uplifted_caps

_INT32 = Struct(">i")

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
)


def default_caps() -> dict[int, int | None]:
    caps: dict[int, int | None] = {key: SPECS[key].max_version for key in _DECODED}
    # Share-group responses carry NodeEndpoints the proxy cannot decode (kafka-python has no
    # schema for them), so they would leak broker addresses: hide them from clients.
    caps[ApiKey.SHARE_FETCH] = None
    caps[ApiKey.SHARE_ACKNOWLEDGE] = None
    # DescribeQuorum v2 lists controller endpoints, which the proxy does not serve.
    caps[ApiKey.DESCRIBE_QUORUM] = 1
    return caps


class ApiVersionsFilter:
    api_keys = frozenset({ApiKey.API_VERSIONS})

    def __init__(self, caps: dict[int, int | None] | None = None, uplift: bool = False) -> None:
        self.caps = default_caps() if caps is None else caps
        self.max_version = SPECS[ApiKey.API_VERSIONS].max_version
        self.request_since = {ApiKey.API_VERSIONS: self.max_version + 1}  # only unknown versions are answered
        self.uplift = uplift  # KIP-951: offer Produce v10 / Fetch v16 over v9 / v15 brokers
        # A broker answers ApiVersions with the same body every time: rewrite each body once
        # (with the versions this connection's requests must go up as, see UpliftFilter).
        self._rewritten: dict[tuple[int, bytes], tuple[bytes, dict[int, int]]] = {}

    def on_request(self, conn, header, frame, entry):
        if header.api_version > self.max_version:
            # Kafka answers an unknown ApiVersions version itself with v0 + UNSUPPORTED_VERSION
            # (ApiVersionsRequest.getErrorResponse), so the client retries at a known version.
            body = encode_body(rewrite.unsupported_api_versions_response(self.max_version))
            return Answer(encode_response_header(header.correlation_id, False) + body)
        return None

    def on_response(self, conn, entry, frame):
        # The ApiVersions response header is always v0 (KIP-511): the body starts at byte 4.
        key = (entry.api_version, bytes(frame[4:]))
        done = self._rewritten.get(key)
        if done is None:
            resp = decode_response(entry.api_key, entry.api_version, key[1])
            done = (key[1], {}) if resp.error_code != 0 else self._capped(resp)
            if len(self._rewritten) < 64:  # a handful of brokers x versions
                self._rewritten[key] = done
        body, conn.uplift = done
        return bytes(frame[:4]) + body

    def on_response_chunk(self, conn, entry, chunk):
        # Every response after a connection's first: the cached rewrite, without a decode.
        done = self._rewritten.get((entry.api_version, chunk[8:]))
        if done is None:
            return None
        body, conn.uplift = done
        return b"".join((_INT32.pack(len(body) + 4), chunk[4:8], body))

    def _capped(self, resp) -> tuple[bytes, dict[int, int]]:
        broker_max = {e.api_key: e.max_version for e in resp.api_keys}
        rewrite.cap_api_versions(resp, self.caps)
        uplift = uplifted_caps(broker_max, self.uplift)
        for e in resp.api_keys:
            if e.api_key in uplift and e.max_version == uplift[e.api_key]:
                e.max_version += 1
        return encode_body(resp), uplift
