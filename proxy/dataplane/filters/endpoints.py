"""Address rewriting: every broker address a client can see becomes a proxy address."""

from __future__ import annotations

from typing import Any

from protocol import rewrite
from protocol.apis import ApiKey
from protocol.headers import response_body_offset
from protocol.messages import decode_response, encode_body
from protocol.metadata_scan import rewrite_metadata_body
from protocol.scan import FetchHead
from proxy.cluster.metadata_learner import MetadataLearner
from proxy.cluster.offload import decode_response_off_loop, is_big, off_loop
from proxy.dataplane.filters.api import FilterContext, FilterSpec, Frame, Hold
from proxy.dataplane.filters.records import response_scan
from proxy.dataplane.inflight import InFlight

# First versions carrying NodeEndpoints: KIP-951's (tagged), KIP-932's (a field from v0).
_NODE_ENDPOINTS_SINCE: dict[int, int] = {ApiKey.PRODUCE: 10, ApiKey.FETCH: 16, ApiKey.SHARE_FETCH: 0,
                                         ApiKey.SHARE_ACKNOWLEDGE: 0}


class EndpointRewriteFilter:
    """Rewrites Metadata, FindCoordinator, DescribeCluster, and the NodeEndpoints of Produce,
    Fetch, ShareFetch and ShareAcknowledge.

    A Metadata response is not decoded: its broker list is rewritten in place of the broker's
    and every other byte goes on as the broker sent it (protocol.metadata_scan); its topics are
    learned by ``learner``, a slice at a time (proxy.cluster.metadata_learner)."""

    # Produce / Fetch carry no endpoints before _NODE_ENDPOINTS_SINCE.
    spec = FilterSpec(response_keys=frozenset({ApiKey.METADATA, *rewrite.ENDPOINT_REWRITERS}),
                      response_since=_NODE_ENDPOINTS_SINCE,
                      chunk=True, stream=True)
    # Whether Fetch responses may stream (proxy.dataplane.routes.StreamRoute); off for good once a broker
    # sent NodeEndpoints where KIP-951 says it would not.
    streams = True

    def __init__(self, learner: MetadataLearner | None = None) -> None:
        self.learner = learner if learner is not None else MetadataLearner()

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

    def on_response_chunk(self, ctx: FilterContext, entry: InFlight, chunk: bytes) -> Frame | None:
        # A Produce (or share) response without NodeEndpoints, on the chunk it came in whole:
        # nothing to rewrite. Every other response is rewritten by on_response.
        key, version = entry.api_key, entry.api_version
        since = _NODE_ENDPOINTS_SINCE.get(key)
        if since is None:
            return None
        if version < since:
            return chunk
        return None if response_scan(entry, memoryview(chunk)[4:]).node_endpoints else chunk

    def on_response(self, ctx: FilterContext, entry: InFlight, frame: Frame) -> Frame | Hold:
        key, version = entry.api_key, entry.api_version
        since = _NODE_ENDPOINTS_SINCE.get(key)
        if since is not None and version < since:
            return frame
        offset = response_body_offset(frame, key, version)
        if key == ApiKey.METADATA:
            body = memoryview(frame)[offset:]
            if not isinstance(body.obj, bytes):
                body = memoryview(bytes(body))  # learned later: must not change meanwhile
            # The cache keeps the brokers' own view: the body is the broker's, untouched.
            rewritten, head = rewrite_metadata_body(body, version, ctx.cluster.advertise, memoryview(frame)[:offset])
            self.learner.learn(ctx.topics, ctx.leaders, body, version, head.topics_at)
            return rewritten
        if since is not None:
            # Hot path: walk the body without copying records (once: the leader filter may have
            # walked this very frame already); decode only to rewrite endpoints.
            if not response_scan(entry, frame, offset).node_endpoints:
                return frame
        body = memoryview(frame)[offset:]
        if is_big(body):  # a FindCoordinator of many groups, a Fetch of many partitions
            return Hold(self._rewritten_off_loop(ctx, key, version, frame, offset))
        resp = decode_response(key, version, body)
        rewrite.ENDPOINT_REWRITERS[key](resp, ctx.cluster.advertise)
        return bytes(frame[:offset]) + encode_body(resp)

    @staticmethod
    async def _rewritten_off_loop(ctx: FilterContext, key: int, version: int, frame: Frame, offset: int) -> bytes:
        resp = await decode_response_off_loop(key, version, memoryview(frame)[offset:])
        # Each distinct address is advertised on the loop (it may open a listener), the entries
        # (a coordinator per group) rewritten and encoded in the decode thread.
        wanted = await off_loop(_addresses, key, resp)
        advertised = {address: ctx.cluster.advertise(*address) for address in wanted}
        return bytes(frame[:offset]) + await off_loop(_rewritten, key, resp, advertised)


def _addresses(key: int, resp: Any) -> set[tuple[int, str, int]]:
    """The (node id, host, port) a response's rewrite advertises, each once."""
    seen: set[tuple[int, str, int]] = set()

    def note(node_id: int, host: str, port: int) -> tuple[str, int]:
        seen.add((node_id, host, port))
        return host, port

    rewrite.ENDPOINT_REWRITERS[key](resp, note)
    return seen


def _rewritten(key: int, resp: Any, advertised: dict[tuple[int, str, int], tuple[str, int]]) -> bytes:
    rewrite.ENDPOINT_REWRITERS[key](resp, lambda node_id, host, port: advertised[(node_id, host, port)])
    return encode_body(resp)
