"""Address rewriting: every broker address a client can see becomes a proxy address."""

from __future__ import annotations

import time
from collections.abc import Callable

from protocol import rewrite
from protocol.apis import ApiKey
from protocol.frames import Buffer
from protocol.headers import response_body_offset
from protocol.messages import decode_response, encode_body
from protocol.scan import FetchHead, ResponseScan, scan_fetch_response, scan_produce_response
from protocol.share_scan import scan_share_acknowledge, scan_share_fetch
from proxy.dataplane.filters.api import FilterContext, FilterSpec, Frame
from proxy.dataplane.inflight import InFlight

# First versions carrying NodeEndpoints: KIP-951's (tagged), KIP-932's (a field from v0).
_NODE_ENDPOINTS_SINCE: dict[int, int] = {ApiKey.PRODUCE: 10, ApiKey.FETCH: 16, ApiKey.SHARE_FETCH: 0,
                                         ApiKey.SHARE_ACKNOWLEDGE: 0}
_SCANNERS: dict[int, Callable[[Buffer, int], ResponseScan]] = {
    ApiKey.PRODUCE: scan_produce_response, ApiKey.FETCH: scan_fetch_response,
    ApiKey.SHARE_FETCH: lambda body, version: scan_share_fetch(body, version).scan,
    ApiKey.SHARE_ACKNOWLEDGE: scan_share_acknowledge,
}


class EndpointRewriteFilter:
    """Rewrites Metadata, FindCoordinator, DescribeCluster, and the NodeEndpoints of Produce,
    Fetch, ShareFetch and ShareAcknowledge."""

    # Produce / Fetch carry no endpoints before _NODE_ENDPOINTS_SINCE.
    spec = FilterSpec(response_keys=frozenset(rewrite.ENDPOINT_REWRITERS), response_since=_NODE_ENDPOINTS_SINCE,
                      stream=True)
    # Whether Fetch responses may stream (proxy.dataplane.routes.StreamRoute); off for good once a broker
    # sent NodeEndpoints where KIP-951 says it would not.
    streams = True

    def on_stream_head(self, ctx: FilterContext, entry: InFlight, head: FetchHead) -> bool:
        return self.streams  # the endpoints are in the tail, seen before it is sent

    def on_stream_tail(self, ctx: FilterContext, entry: InFlight, node_endpoints: int) -> bool:
        if node_endpoints:
            # KIP-951: a broker sends NodeEndpoints only with a partition that moved, and the
            # head showed none. This response cannot be rewritten (its size went first); the
            # next ones are assembled, so their endpoints are rewritten.
            self.streams = False
            return False
        return True

    def on_response(self, ctx: FilterContext, entry: InFlight, frame: Frame) -> Frame:
        key, version = entry.api_key, entry.api_version
        since = _NODE_ENDPOINTS_SINCE.get(key)
        if since is not None and version < since:
            return frame
        offset = response_body_offset(frame, key, version)
        if since is not None:
            # Hot path: walk the body without copying records (once: the leader filter may have
            # walked this very frame already); decode only to rewrite endpoints.
            scan = entry.scan or _SCANNERS[key](memoryview(frame)[offset:], version)
            if not scan.node_endpoints:
                return frame
        resp = decode_response(key, version, memoryview(frame)[offset:])
        if key == ApiKey.METADATA:
            ctx.topics.observe_metadata(resp)
            # Before the rewrite: the leader cache keeps the brokers' own view.
            ctx.leaders.observe_metadata(resp.topics, time.monotonic())
        rewrite.ENDPOINT_REWRITERS[key](resp, ctx.cluster.advertise)
        return bytes(frame[:offset]) + encode_body(resp)
