"""The leader cache (KIP-951): the highest leader epoch wins, a stale view never rolls it back;
the ApiVersions uplift: Produce v10 / Fetch v16 offered only over v9 / v15 brokers."""

from __future__ import annotations

import uuid
from array import array
from types import SimpleNamespace

import pytest
from kafka.protocol.metadata import ApiVersionsResponse

from config import ConfigError, parse_config
from protocol.headers import parse_request_header, response_body_offset
from protocol.messages import decode_response, encode_body
from proxy.cluster.leaders import LeaderCache, PartitionLeader
from proxy.dataplane.filters.api_versions import ApiVersionsFilter
from proxy.dataplane.filters.leaders import UpliftFilter, uplifted_caps
from tests.support.filter_context import filter_context
from tests.unit.test_records import batch, produce_frame


def quads(leaders):
    """A topic's partitions as protocol.metadata_scan reads them: (error, index, leader, epoch)."""
    return array("i", [n for i, (leader, epoch) in enumerate(leaders) for n in (0, i, leader, epoch)])


def test_the_highest_epoch_wins_and_a_stale_view_is_ignored():
    cache = LeaderCache()
    tid = uuid.uuid4()
    assert cache.observe_topic("orders", tid.bytes, quads([(1, 4), (2, 7)]), 1.0) == 2
    assert cache.leader("orders", 0) == PartitionLeader(1, 4)
    assert cache.name_of(tid) == "orders"
    assert cache.observe("orders", 0, 3, 5, 2.0)  # a hint: moved to 3 at epoch 5
    # A Metadata response from a broker that has not heard yet: epoch 4 names leader 1.
    assert cache.observe_topic("orders", None, quads([(1, 4), (2, 7)]), 3.0) == 0
    assert cache.leader("orders", 0) == PartitionLeader(3, 5)
    assert cache.stale_ignored == 1
    assert cache.age_s(4.0) == 2.0  # last changed at 2.0: the stale view changed nothing


def test_an_epoch_names_one_leader_and_unknown_epochs_rank_lowest():
    cache = LeaderCache()
    assert cache.observe("t", 0, 1, 3, 0.0)
    assert not cache.observe("t", 0, 2, 3, 0.0)  # same epoch, another leader: keep the first
    assert cache.leader("t", 0).leader == 1
    assert cache.observe("u", 0, 1, -1, 0.0)  # Metadata < v7: no epoch
    assert cache.observe("u", 0, 2, -1, 0.0)  # still unknown: the newer view replaces it
    assert cache.observe("u", 0, 3, 0, 0.0)
    stale = cache.stale_ignored
    assert not cache.observe("u", 0, 1, -1, 0.0)
    assert cache.stale_ignored == stale  # no epoch is not an old epoch: nothing counted


def test_leaderless_partitions_teach_nothing():
    cache = LeaderCache()
    assert cache.observe_topic("electing", None, quads([(-1, 2), (3, 1)]), 0.0) == 1
    assert cache.leader("electing", 0) is None
    assert cache.observe_topic("electing", None, quads([(2, 3), (-1, 1)]), 1.0) == 1  # elected; 1 lost its leader
    assert cache.leader("electing", 0) == PartitionLeader(2, 3)
    assert cache.leader("electing", 1) == PartitionLeader(3, 1)  # a leaderless view says nothing
    assert cache.observe_topic("electing", None, quads([(2, 3), (3, 1)]), 2.0) == 0
    assert cache.age_s(3.0) == 2.0


def test_partitions_out_of_order_or_added_are_found():
    cache = LeaderCache()
    cache.observe_topic("t", None, array("i", [0, 1, 5, 1, 0, 0, 4, 1]), 0.0)  # index 1 before index 0
    assert (cache.leader("t", 0), cache.leader("t", 1)) == (PartitionLeader(4, 1), PartitionLeader(5, 1))
    assert cache.observe("t", 7, 6, 0, 1.0) and cache.leader("t", 7) == PartitionLeader(6, 0)
    assert cache.leader("t", 2) is None and cache.leader("u", 0) is None
    assert len(cache) == 3


def test_the_cache_is_bounded():
    cache = LeaderCache(max_partitions=100)
    for i in range(250):
        cache.observe(f"t{i}", 0, 1, 0, 0.0)
        cache.learn_id(uuid.UUID(int=i + 1), f"t{i}")
    assert len(cache) <= 100
    assert cache.leader("t249", 0) is not None
    assert cache.name_of(uuid.UUID(int=250)) == "t249" and cache.name_of(uuid.UUID(int=1)) is None
    cache.observe_topic("big", None, quads([(1, 0)] * 80), 0.0)  # a topic of 80 partitions makes room for itself
    assert len(cache) <= 100 and cache.leader("big", 79) == PartitionLeader(1, 0)


@pytest.mark.parametrize("broker_max,expected", [
    ({0: 9, 1: 15}, {0: 9, 1: 15}),
    ({0: 11, 1: 17}, {}),  # already KIP-951
    ({0: 8, 1: 12}, {}),  # not exact: the request bodies differ below v9 / v15
    ({0: 9, 1: 17}, {0: 9}),
])
def test_uplift_only_from_the_version_just_below(broker_max, expected):
    assert uplifted_caps(broker_max, True) == expected
    assert uplifted_caps(broker_max, False) == {}


def api_versions_frame(version: int, maxima: dict[int, int]) -> bytes:
    cls = ApiVersionsResponse[version]
    keys = [cls.ApiVersion(api_key=k, min_version=0, max_version=v) for k, v in maxima.items()]
    resp = cls(error_code=0, api_keys=keys, throttle_time_ms=0)
    resp.with_header(correlation_id=1)
    return bytes(resp.encode(header=True))


@pytest.mark.parametrize("uplift", [True, False])
def test_api_versions_offers_one_version_more_and_requests_go_down(uplift):
    f = ApiVersionsFilter(uplift=uplift)
    conn = filter_context()
    frame = api_versions_frame(3, {0: 9, 1: 15, 3: 12})
    entry = SimpleNamespace(api_key=18, api_version=3)
    out = f.on_response(conn, entry, frame)
    resp = decode_response(18, 3, memoryview(out)[response_body_offset(out, 18, 3):])
    maxima = {e.api_key: e.max_version for e in resp.api_keys}
    assert maxima[0] == (10 if uplift else 9) and maxima[1] == (16 if uplift else 15)
    assert conn.uplift == ({0: 9, 1: 15} if uplift else {})
    assert conn.actions == [("uplift", conn.uplift)]  # the connection is told

    request = produce_frame(10, {"t": {0: batch(2)}})
    header = parse_request_header(request)
    decision = UpliftFilter().on_request(conn, header, request, None)
    if not uplift:
        assert decision is None
        return
    sent = decision.frame
    assert parse_request_header(sent).api_version == 9
    assert sent[:2] == request[:2] and sent[4:] == request[4:]  # only the version changed
    assert conn.stats.uplifted_requests["Produce"] == 1
    assert UpliftFilter().on_request(conn, parse_request_header(sent), sent, None) is None  # v9 stays v9


def test_leader_discovery_config():
    base = {"upstream": {"bootstrap_servers": ["k:9092"]}}
    ld = parse_config(base).leader_discovery
    assert (ld.fill_hints, ld.uplift, ld.expedited_refresh_min_interval_ms, ld.hint_wait_ms) == (True, True, 50, 100)
    ld = parse_config({**base, "leader_discovery": {"fill_hints": False, "uplift": False}}).leader_discovery
    assert (ld.fill_hints, ld.uplift) == (False, False)
    for key, value in (("fill_hints", "yes"), ("uplift", 1), ("expedited_refresh_min_interval_ms", -1),
                       ("wait", 1)):
        with pytest.raises(ConfigError) as info:
            parse_config({**base, "leader_discovery": {key: value}})
        assert info.value.path == f"leader_discovery.{key}"


def test_encode_body_round_trip_sanity():
    # The uplift relies on a v9 ProduceResponse body decoding unchanged as v10.
    from kafka.protocol.producer import ProduceResponse

    from tests.support.kafka_messages import make

    R = ProduceResponse
    P = R.TopicProduceResponse.PartitionProduceResponse
    v9 = make(R, 9, responses=[make(R.TopicProduceResponse, 9, name="t", partition_responses=[
        make(P, 9, index=0, error_code=0, base_offset=5, log_append_time_ms=-1, log_start_offset=0,
             record_errors=[], error_message=None)])], throttle_time_ms=0)
    body = encode_body(v9)
    as_v10 = decode_response(0, 10, body)
    assert as_v10.responses[0].partition_responses[0].base_offset == 5
    assert encode_body(as_v10) == body
