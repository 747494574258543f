"""KIP-951 in the proxy: leader hints on failed Produce / Fetch partitions, and version uplift.

* :class:`LeaderHintFilter` (responses): a Produce v10+ / Fetch v16+ partition that failed with
  NOT_LEADER_OR_FOLLOWER or FENCED_LEADER_EPOCH either carries the broker's ``CurrentLeader``
  (learned into the cache; its ``NodeEndpoints`` are rewritten to proxy addresses by the
  endpoint filter that runs next), or, from a broker before Kafka 3.7, carries nothing: then an
  expedited metadata refresh is asked for and, when the cache knows a leader other than the
  broker that just refused, ``CurrentLeader`` and ``NodeEndpoints`` are filled in from it; if it
  does not yet, the response waits (up to ``hint_wait_ms``) for that refresh, so even the first
  failure after a move can name the new leader. The response keeps its place in order.
* :class:`UpliftFilter` (requests): a client may speak Produce v10 / Fetch v16 to a broker that
  stops at Produce v9 / Fetch v15. The request bodies are identical, so the request goes up
  with the lower version number; the response body of the lower version is a valid body of the
  higher one (the new fields are tagged), so it comes back as it is.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from protocol import errors
from protocol.apis import SPECS, ApiKey, api_name
from protocol.headers import RequestHeader, response_body_offset
from protocol.messages import decode_response, encode_body
from protocol.scan import FetchHead
from proxy.cluster.leaders import ExpeditedRefresher, LeaderCache
from proxy.dataplane.filters.api import FilterContext, FilterSpec, Forward, Frame, Hold
from proxy.dataplane.filters.records import response_scan
from proxy.dataplane.inflight import InFlight

# First versions whose responses carry KIP-951's CurrentLeader + NodeEndpoints (KIP-932's
# share responses carry them from v0).
HINTS_SINCE: dict[int, int] = {ApiKey.PRODUCE: 10, ApiKey.FETCH: 16, ApiKey.SHARE_FETCH: 0,
                               ApiKey.SHARE_ACKNOWLEDGE: 0}
# Uplift is exact only from the version just below: the request bodies are the same.
UPLIFT_FROM: dict[int, int] = {ApiKey.PRODUCE: 9, ApiKey.FETCH: 15}
_SHARE = (ApiKey.SHARE_FETCH, ApiKey.SHARE_ACKNOWLEDGE)
# The topic classes of each response, whose PartitionData holds CurrentLeader.
_TOPIC_CLASS: dict[int, str] = {ApiKey.SHARE_FETCH: "ShareFetchableTopicResponse", ApiKey.SHARE_ACKNOWLEDGE:
                "ShareAcknowledgeTopicResponse", ApiKey.FETCH: "FetchableTopicResponse"}
_MOVED = frozenset({errors.NOT_LEADER_OR_FOLLOWER, errors.FENCED_LEADER_EPOCH})
# A failed partition without a hint: (topic name or None, topic id, index, the decoded partition).
_Missing = tuple[str | None, uuid.UUID | None, int, Any]


class LeaderHintFilter:
    spec = FilterSpec(response_keys=frozenset(HINTS_SINCE), response_since=HINTS_SINCE, chunk=True, stream=True)

    def __init__(self, cache: LeaderCache, refresher: ExpeditedRefresher | None, fill: bool = True,
                 wait_s: float = 0.0) -> None:
        self.cache = cache
        self.refresher = refresher
        self.fill = fill
        self.wait_s = wait_s  # how long a response without a hint may wait for the refresh

    def on_response(self, ctx: FilterContext, entry: InFlight, frame: Frame) -> Frame | Hold:
        key, version = entry.api_key, entry.api_version
        if version < HINTS_SINCE[key]:
            return frame
        offset = response_body_offset(frame, key, version)
        # A ShareFetch response's walk, made in slices before (FetchCountFilter), or made now.
        scan = response_scan(entry, frame, offset)
        if _MOVED.isdisjoint(scan.error_codes):
            entry.scan = scan  # the endpoint filter reads the same frame next
            return frame  # the hot path: no partition moved
        resp = decode_response(key, version, memoryview(frame)[offset:])
        hintless = self._learn(ctx, key, version, resp)
        missing = self._fill_all(ctx, key, version, resp, hintless)
        filled = len(missing) < len(hintless)
        refreshed = self._refresh(missing)
        if refreshed is not None and self.fill and self.wait_s > 0 and ctx.node_id is not None:
            head = bytes(frame[:offset])
            return Hold(self._after_refresh(ctx, key, version, resp, head, bytes(frame), missing, filled, refreshed))
        ctx.stats.leader_hints["none"] += len(missing)
        return bytes(frame[:offset]) + encode_body(resp) if filled else frame

    def on_response_chunk(self, ctx: FilterContext, entry: InFlight, chunk: bytes) -> Frame | None:
        # The hot path of on_response (nothing moved: nothing to learn or fill) on the chunk a
        # whole response came in; anything else is left to on_response.
        key, version = entry.api_key, entry.api_version
        if version < HINTS_SINCE[key]:
            return chunk
        scan = response_scan(entry, memoryview(chunk)[4:])
        if _MOVED.isdisjoint(scan.error_codes):
            entry.scan = scan  # the endpoint filter reads the same response next
            return chunk
        return None

    def on_stream_head(self, ctx: FilterContext, entry: InFlight, head: FetchHead) -> bool:
        # KIP-951: brokers set CurrentLeader and NodeEndpoints only for partitions that failed
        # with NOT_LEADER_OR_FOLLOWER or FENCED_LEADER_EPOCH; without one there is nothing to
        # learn or fill, so the response may stream (see proxy.dataplane.routes.StreamRoute).
        return _MOVED.isdisjoint(head.error_codes)

    def on_stream_tail(self, ctx: FilterContext, entry: InFlight, node_endpoints: int) -> bool:
        return True  # nothing moved (the head said so): nothing to learn or fill

    def _refresh(self, missing: list[_Missing]) -> asyncio.Future[None] | None:
        """Asks for the metadata of the topics of ``missing`` (by id when known only by id);
        the future of that refresh, or None when there is nothing to ask for."""
        topics = {name for name, _, _, _ in missing if name is not None}
        ids = {topic_id for name, topic_id, _, _ in missing if name is None and topic_id is not None}
        if not (topics or ids) or self.refresher is None:
            return None
        return self.refresher.request(topics, ids)

    async def _after_refresh(self, ctx: FilterContext, key: int, version: int, resp: Any, head: bytes,
                             original: bytes, missing: list[_Missing], filled_before: bool,
                             refreshed: asyncio.Future[None]) -> bytes:
        """The response once the cache can name the leaders: tried again after every refresh
        round that ends (the one already running may bring them); a round of its own that
        still left it without a leader (a broker that has not heard yet) is followed by
        another, from the next broker, until ``wait_s`` has passed."""
        refresher = self.refresher
        assert refresher is not None  # refreshed is one of its refreshes
        deadline = time.monotonic() + self.wait_s
        filled = filled_before
        while missing:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            any_round = refresher.round_end()
            await asyncio.wait({refreshed, any_round}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            still = self._fill_all(ctx, key, version, resp, missing)
            filled = filled or len(still) < len(missing)
            missing = still
            if missing and refreshed.done():
                again = self._refresh(missing)
                if again is None:
                    break
                refreshed = again
        ctx.stats.leader_hints["none"] += len(missing)
        return head + encode_body(resp) if filled else original

    def _learn(self, ctx: FilterContext, key: int, version: int, resp: Any) -> list[_Missing]:
        """Learns the broker's hints; returns (topic name or None, topic id, index, partition)
        of the partitions without one."""
        cache, stats, now_s = self.cache, ctx.stats, time.monotonic()
        missing: list[_Missing] = []
        for topic in resp.responses:
            # Produce and Fetch name their topics before v13; share responses never do.
            name = topic.name if version < 13 and key not in _SHARE else cache.name_of(topic.topic_id)
            partitions = topic.partition_responses if key == ApiKey.PRODUCE else topic.partitions
            for p in partitions:
                if p.error_code not in _MOVED:
                    continue
                index = p.index if key == ApiKey.PRODUCE else p.partition_index
                hint = p.current_leader
                if hint is not None and hint.leader_id >= 0 and hint.leader_epoch >= 0:
                    stats.leader_hints["broker"] += 1
                    if name is not None:
                        cache.observe(name, index, hint.leader_id, hint.leader_epoch, now_s)
                else:
                    missing.append((name, getattr(topic, "topic_id", None), index, p))
        return missing

    def _fill_all(self, ctx: FilterContext, key: int, version: int, resp: Any,
                  missing: list[_Missing]) -> list[_Missing]:
        """Fills what the cache can; returns the partitions still without a hint."""
        return [m for m in missing if not self._fill(ctx, key, version, resp, m)]

    def _fill(self, ctx: FilterContext, key: int, version: int, resp: Any, missing: _Missing) -> bool:
        """Fills one partition's hint from the cache if the proxy is sure of it."""
        name, topic_id, index, p = missing
        if name is None:  # known by id only: the refresh may have taught the cache its name
            name = self.cache.name_of(topic_id)
        known = self.cache.leader(name, index) if (self.fill and name is not None) else None
        # Only a leader other than the broker that refused, at a known epoch, with an address:
        # never a hint the proxy is not sure of (an empty one is always fine). A client applies
        # it only if its epoch is newer than the one it has (KIP-951).
        if (known is None or known.epoch < 0 or ctx.node_id is None or known.leader == ctx.node_id
                or known.leader not in ctx.cluster.brokers):
            return False
        cls = SPECS[key].response[version]
        partition_cls = (cls.TopicProduceResponse.PartitionProduceResponse if key == ApiKey.PRODUCE
                         else getattr(cls, _TOPIC_CLASS[key]).PartitionData)
        p.current_leader = partition_cls.LeaderIdAndEpoch(leader_id=known.leader, leader_epoch=known.epoch)
        if all(ep.node_id != known.leader for ep in resp.node_endpoints or ()):
            host, port = ctx.cluster.brokers[known.leader]
            resp.node_endpoints = [*(resp.node_endpoints or ()),
                                   cls.NodeEndpoint(node_id=known.leader, host=host, port=port, rack=None)]
        ctx.stats.leader_hints["proxy"] += 1
        return True


class UpliftFilter:
    """Sends Produce v10 / Fetch v16 to a broker that only has v9 / v15 (see the module doc)."""

    # Only the versions above the broker's go up; a connection whose broker needs no uplift
    # skips it.
    spec = FilterSpec(request_keys=frozenset(UPLIFT_FROM), needs_uplift=True,
                      request_since={key: lower + 1 for key, lower in UPLIFT_FROM.items()})

    def on_request(self, ctx: FilterContext, header: RequestHeader, frame: Frame, entry: InFlight) -> Forward | None:
        lower = ctx.uplift.get(header.api_key) if ctx.uplift else None
        if lower is None or header.api_version <= lower:
            return None
        ctx.stats.uplifted_requests[api_name(header.api_key)] += 1
        # The version is bytes 2-3 of the request header; the response is parsed at the
        # client's version (entry.api_version), whose body the lower version's body already is.
        patched = bytearray(frame)  # the one copy: it is written to the broker as it is
        patched[2:4] = lower.to_bytes(2, "big")
        return Forward(patched)


def uplifted_caps(broker_max: dict[int, int], enabled: bool) -> dict[int, int]:
    """{api key: broker's max} for the APIs to advertise one version higher than the broker has."""
    if not enabled:
        return {}
    return {key: lower for key, lower in UPLIFT_FROM.items() if broker_max.get(key) == lower}
