"""Pure rewrites of decoded responses: broker endpoints and ApiVersions ranges (Metadata's
brokers are rewritten in place of the broker's bytes: protocol.metadata_scan).

``Advertise`` maps a broker (node id, upstream host, upstream port) to the address the
proxy serves that node on; every rewrite here goes through it, so no broker address survives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from kafka.protocol.api_message import ApiMessage
from kafka.protocol.metadata import ApiVersionsResponse

from . import errors
from .apis import ApiKey

Advertise = Callable[[int, str, int], tuple[str, int]]


def rewrite_find_coordinator(resp: ApiMessage, advertise: Advertise) -> None:
    # v4+ (KIP-699) batches coordinators; earlier versions carry a single one at top level.
    coordinators = resp.coordinators if resp.version >= 4 else [resp]
    for c in coordinators:
        if c.node_id >= 0 and c.host:
            c.host, c.port = advertise(c.node_id, c.host, c.port)


def rewrite_describe_cluster(resp: ApiMessage, advertise: Advertise) -> None:
    for broker in resp.brokers:
        broker.host, broker.port = advertise(broker.broker_id, broker.host, broker.port)


def rewrite_node_endpoints(resp: ApiMessage, advertise: Advertise) -> None:
    """Produce v10+ / Fetch v16+ ``NodeEndpoints`` (KIP-951), ShareFetch / ShareAcknowledge's."""
    for ep in resp.node_endpoints or ():
        ep.host, ep.port = advertise(ep.node_id, ep.host, ep.port)


# Metadata is rewritten without decoding: protocol.metadata_scan.
ENDPOINT_REWRITERS: dict[int, Callable[[ApiMessage, Advertise], None]] = {
    ApiKey.FIND_COORDINATOR: rewrite_find_coordinator,
    ApiKey.DESCRIBE_CLUSTER: rewrite_describe_cluster,
    ApiKey.PRODUCE: rewrite_node_endpoints,
    ApiKey.FETCH: rewrite_node_endpoints,
    ApiKey.SHARE_FETCH: rewrite_node_endpoints,  # KIP-932: an ordinary field there, from v0
    ApiKey.SHARE_ACKNOWLEDGE: rewrite_node_endpoints,
}


def cap_api_versions(resp: ApiMessage, caps: Mapping[int, int | None],
                     families: Iterable[frozenset[int]] = ()) -> None:
    """Lowers each listed API's max version to its cap; a cap of None removes the API.

    An API whose broker minimum is above the cap is removed: the proxy cannot speak it. Then
    each family (protocol.apis.API_FAMILIES) not listed whole is removed whole.
    """
    kept = []
    for entry in resp.api_keys:
        if entry.api_key in caps:
            cap = caps[entry.api_key]
            if cap is None or entry.min_version > cap:
                continue
            entry.max_version = min(entry.max_version, cap)
        kept.append(entry)
    listed = {entry.api_key for entry in kept}
    partial = set().union(*(family for family in families if family & listed and not family <= listed))
    resp.api_keys = [entry for entry in kept if entry.api_key not in partial] if partial else kept


def offer_api_versions(resp: ApiMessage, offered: Mapping[int, tuple[int, int]]) -> None:
    """Lists each API of ``offered`` with its (min, max) range, replacing the broker's range or
    adding the API the broker lacks: for APIs the proxy answers itself. Kept sorted by API key,
    as Kafka lists them (ApiVersionsResponse.collectApis)."""
    if not offered:
        return
    entry_cls = type(resp).ApiVersion
    kept = [e for e in resp.api_keys if e.api_key not in offered]
    kept.extend(entry_cls(api_key=key, min_version=lo, max_version=hi) for key, (lo, hi) in offered.items())
    resp.api_keys = sorted(kept, key=lambda e: e.api_key)


def unsupported_api_versions_response(max_version: int) -> ApiMessage:
    """What a broker answers to an ApiVersions request newer than it knows.

    Follows Kafka's ApiVersionsRequest.getErrorResponse: a v0 body with UNSUPPORTED_VERSION
    listing only ApiVersions' own range, so the client can retry with a version both speak.
    """
    entry = ApiVersionsResponse[0].ApiVersion(
        api_key=ApiKey.API_VERSIONS, min_version=0, max_version=max_version
    )
    return ApiVersionsResponse[0](error_code=errors.UNSUPPORTED_VERSION, api_keys=[entry])
