"""protocol.metadata_scan and proxy.cluster.metadata_learner: a Metadata response rewritten
without decoding is byte for byte what decoding, rewriting and encoding it again gave; what the
proxy learns from it is what it learned from the decoded response; the walk goes a slice at a
time and refuses a body that does not match its schema."""

from __future__ import annotations

import asyncio
import random
import string
import struct
import tracemalloc
import uuid
from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka.protocol.metadata import MetadataResponse

from protocol.messages import decode_response, encode_body
from protocol.metadata_scan import (
    MAX_VERSION,
    TopicWalk,
    read_metadata_head,
    rewrite_metadata_body,
    walk_all,
)
from protocol.scan import ScanError
from proxy.cluster.leaders import LeaderCache, PartitionLeader
from proxy.cluster.metadata_learner import MetadataLearner
from proxy.cluster.topics import TopicCache
from proxy.observability.stats import ProxyStats
from tests.support.kafka_messages import make

VERSIONS = range(MAX_VERSION + 1)
# Kafka's legal topic name characters (Topic.LEGAL_CHARS), names up to 249 of them.
LEGAL = string.ascii_letters + string.digits + "._-"
R = MetadataResponse
T = R.MetadataResponseTopic
P = T.MetadataResponsePartition


def advertise(node_id: int, host: str, port: int) -> tuple[str, int]:
    return "proxy.example", 30000 + node_id


def old_path(body: bytes, version: int) -> bytes:
    """What the proxy did before: decode whole, rewrite the brokers, encode whole."""
    resp = decode_response(3, version, body)
    for b in resp.brokers:
        b.host, b.port = advertise(b.node_id, b.host, b.port)
    return encode_body(resp)


def old_learned(body: bytes, version: int) -> tuple[dict, dict, dict]:
    """What the proxy learned before from the decoded response: partition counts, ids, and the
    leader (with its epoch) of every partition that had one, of every topic without error."""
    counts, ids, leaders = {}, {}, {}
    for t in decode_response(3, version, body).topics:
        if t.error_code != 0 or not t.name:
            continue
        counts[t.name] = len(t.partitions)
        topic_id = getattr(t, "topic_id", None)
        if topic_id is not None and topic_id.int:
            ids[topic_id] = t.name
        for p in t.partitions:
            if p.leader_id >= 0:
                leaders[(t.name, p.partition_index)] = PartitionLeader(p.leader_id, getattr(p, "leader_epoch", -1))
    return counts, ids, leaders


def learned(topics: TopicCache, cache: LeaderCache, body: bytes, version: int) -> tuple[dict, dict, dict]:
    """The same, read back from the caches the new path filled."""
    old_counts, old_ids, old_leaders = old_learned(body, version)
    counts = {name: topics.count(name) for name in old_counts}
    ids = {i: topics.name_of(i) for i in old_ids}
    assert ids == {i: cache.name_of(i) for i in old_ids}
    leaders = {key: cache.leader(*key) for key in old_leaders}
    assert len(topics.partitions) == len(old_counts)
    return counts, ids, leaders


def cluster(version: int, topics: list[tuple[int, str | None, int, list[tuple]]], brokers: int = 3,
            cluster_id: str | None = "cluster-1") -> bytes:
    """A MetadataResponse body: ``topics`` as (error, name, id int, partitions), each partition
    (error, index, leader, epoch, replicas, isr, offline)."""
    resp = make(
        R, version, throttle_time_ms=7, cluster_id=cluster_id, controller_id=1, error_code=0,
        authorized_operations=None,
        brokers=[make(R.MetadataResponseBroker, version, node_id=n, host=f"broker-{n}.internal", port=9092 + n,
                      rack=None if n % 2 else f"rack-{n}") for n in range(brokers)],
        topics=[make(T, version, error_code=err, name=name, topic_id=uuid.UUID(int=tid), is_internal=name == "__x",
                     authorized_operations={3, 4} if tid % 2 else None,
                     partitions=[make(P, version, error_code=pe, partition_index=i, leader_id=leader,
                                      leader_epoch=epoch, replica_nodes=replicas, isr_nodes=isr,
                                      offline_replicas=offline)
                                 for pe, i, leader, epoch, replicas, isr, offline in parts])
                for err, name, tid, parts in topics],
    )
    return encode_body(resp)


def generated(version: int, partitions: int, seed: int = 1) -> bytes:
    """A cluster of about ``partitions`` partitions: topics of 1 to 60 partitions named with
    every legal character, ids, leaders and epochs, replica lists of every length a varint
    still takes in one byte and some that take two."""
    rng = random.Random(seed)
    topics = []
    left = partitions
    n = 0
    while left > 0:
        count = min(left, rng.choice((1, 3, 5, 12, 60)))
        left -= count
        name = "".join(rng.choice(LEGAL) for _ in range(rng.choice((1, 8, 40, 249)))) + f"-{n}"
        replicas = list(range(rng.choice((1, 3, 130))))
        parts = [(0 if i % 17 else 5, i, -1 if i % 17 == 0 else rng.randrange(3), rng.randrange(1 << 20),
                  replicas, replicas[:2], replicas[2:3]) for i in range(count)]
        topics.append((0 if n % 11 else 3, name[:249], rng.getrandbits(128) if n % 7 else 0, parts))
        n += 1
    return cluster(version, topics)


def learn(body: bytes, version: int, slice_partitions: int = 1 << 30) -> tuple[TopicCache, LeaderCache]:
    topics, cache = TopicCache(), LeaderCache()

    async def run():
        learner = MetadataLearner(slice_partitions=slice_partitions)
        head = read_metadata_head(body, version)
        await learner.learn_all(topics, cache, body, version, head.topics_at)

    asyncio.run(run())
    return topics, cache


@pytest.mark.parametrize("version", VERSIONS)
def test_a_generated_cluster_is_rewritten_as_decoding_did_and_learned_the_same(version):
    partitions = 20_000 if version in (1, 8, 12, 13) else 2_000
    body = generated(version, partitions)
    rewritten, head = rewrite_metadata_body(body, version, advertise)
    assert rewritten == old_path(body, version)
    assert b".internal" not in rewritten[: head.topics_at + 200]
    assert [b.host for b in head.brokers] == [f"broker-{n}.internal" for n in range(3)]  # the broker's view
    topics, cache = learn(body, version, slice_partitions=997)
    assert learned(topics, cache, body, version) == old_learned(body, version)


partition = st.tuples(st.sampled_from((0, 5, 9)), st.integers(-1, 4), st.integers(-1, 1 << 31 - 1),
                      st.lists(st.integers(0, 1 << 31 - 1), max_size=140), st.lists(st.integers(0, 9), max_size=3),
                      st.lists(st.integers(0, 9), max_size=2))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(version=st.sampled_from(VERSIONS),
       topics=st.lists(st.tuples(st.sampled_from((0, 0, 3)), st.text(LEGAL, min_size=1, max_size=249),
                                 st.integers(0, (1 << 128) - 1), st.lists(partition, max_size=8)), max_size=8,
                       unique_by=lambda t: t[1]),  # a topic is listed once
       brokers=st.integers(0, 4), cluster_id=st.none() | st.text(max_size=5), slice_partitions=st.integers(1, 5))
def test_random_clusters_are_rewritten_and_learned_as_decoding_did(version, topics, brokers, cluster_id,
                                                                   slice_partitions):
    listed = [(err, name, tid, [(pe, i, leader, epoch, replicas, isr, offline)
                                for i, (pe, leader, epoch, replicas, isr, offline) in enumerate(parts)])
              for err, name, tid, parts in topics]
    body = cluster(version, listed, brokers, cluster_id if version >= 2 else "c")
    assert rewrite_metadata_body(body, version, advertise)[0] == old_path(body, version)
    topics_cache, cache = learn(body, version, slice_partitions)
    assert learned(topics_cache, cache, body, version) == old_learned(body, version)


@pytest.mark.parametrize("version", [9, 12])
def test_tagged_fields_the_proxy_does_not_know_are_kept_and_skipped(version):
    """Flexible versions: a broker may add tagged fields anywhere; they go on as they came
    (decoding and encoding again dropped them) and the walk steps over them."""
    body = bytearray(cluster(version, [(0, "t", 5, [(0, 0, 1, 2, [1], [1], [])])], brokers=1))
    head = read_metadata_head(bytes(body), version)
    # The broker's tagged fields: one tag (7) of 3 bytes.
    assert body[head.brokers_end - 1] == 0
    body[head.brokers_end - 1 : head.brokers_end] = b"\x01\x07\x03abc"
    # From the end: the top level's tags, its ErrorCode (v13+), ClusterAuthorizedOperations
    # (v8-v10), the topic's tags, its TopicAuthorizedOperations, then the partition's tags.
    top = len(body) - 1 - (2 if version >= 13 else 0) - (4 if 8 <= version <= 10 else 0)
    partition_tags = top - 1 - 4 - 1
    assert body[partition_tags] == 0
    body[partition_tags : partition_tags + 1] = b"\x01\x07\x03xyz"
    rewritten, _ = rewrite_metadata_body(bytes(body), version, advertise)
    assert b"\x01\x07\x03abc" in rewritten and b"\x01\x07\x03xyz" in rewritten
    _, topics = walk_all(bytes(body), version)
    assert [(t.name, list(t.partitions)) for t in topics] == [("t", [0, 0, 1, 2])]


def test_the_walk_goes_a_slice_at_a_time_and_a_slice_can_end_inside_a_topic():
    body = cluster(12, [(0, f"t{n}", n + 1, [(0, i, 1, 3, [1], [1], []) for i in range(n * 3)]) for n in range(6)])
    head = read_metadata_head(body, 12)
    walk = TopicWalk(body, 12, head.topics_at)
    reads, seen = 0, []
    while not walk.done:
        before = walk.partitions_read
        seen += walk.step(4)
        assert walk.partitions_read - before <= 4
        reads += 1
    assert [t.name for t in seen] == [f"t{n}" for n in range(6)]
    assert [t.partition_count for t in seen] == [0, 3, 6, 9, 12, 15]
    assert reads >= 45 // 4


@pytest.mark.parametrize("version", [1, 8, 12])
def test_a_body_cut_short_or_lying_about_a_length_is_refused(version):
    body = generated(version, 50)
    rng = random.Random(version)
    head = read_metadata_head(body, version)
    for cut in [*rng.sample(range(head.topics_at + 1, len(body)), 40), len(body) - 1]:
        with pytest.raises(ScanError):
            walk_all(body[:cut], version)
    with pytest.raises(ScanError):
        walk_all(body + b"\x00", version)  # a byte after the message
    for cut in range(head.brokers_at, head.topics_at):
        with pytest.raises(ScanError):
            read_metadata_head(body[:cut], version)
    with pytest.raises(ScanError):
        read_metadata_head(body, MAX_VERSION + 1)
    if version < 9:  # the first topic's partition count (an int32 before v9), made huge
        first = walk_all(body, version)[1][0]
        at = (head.topics_at + 4 + 2 + 2 + len(first.name.encode()) + (16 if version >= 10 else 0)
              + (1 if version >= 1 else 0))
        assert struct.unpack_from(">i", body, at)[0] == first.partition_count
        lying = bytearray(body)
        struct.pack_into(">i", lying, at, 1 << 30)
        with pytest.raises(ScanError):
            walk_all(bytes(lying), version)


def test_a_malformed_body_is_counted_and_learned_from_no_further():
    stats = ProxyStats()
    body = generated(12, 40)
    topics, cache = TopicCache(), LeaderCache()

    async def run():
        learner = MetadataLearner(stats, slice_partitions=10)
        head = read_metadata_head(body, 12)
        changed = await learner.learn_all(topics, cache, body[:-3], 12, head.topics_at)
        assert (changed, learner.malformed) == (0, 1)
        learner.learn(topics, cache, body, 12, head.topics_at)
        await learner.learn_all(topics, cache, body, 12, head.topics_at)

    asyncio.run(run())
    assert stats.metadata_learned == {"malformed": 1, "responses": 2}


def test_waiting_responses_are_bounded_and_learned_in_order():
    """Responses queue behind the one being read; past the byte bound the oldest waiting one is
    dropped (never the one being read); the rest are learned in the order given, so the last
    response's partition counts are what the cache holds."""
    versions = [cluster(12, [(0, "grows", 1, [(0, i, 1, n, [1], [1], []) for i in range(n + 1)])]
                        + [(0, f"filler{j}", 0, [(0, 0, 1, 1, [1], [1], [])]) for j in range(30)])
                for n in range(6)]
    stats = ProxyStats()
    topics, cache = TopicCache(), LeaderCache()

    async def run():
        learner = MetadataLearner(stats, slice_partitions=5, max_pending_bytes=3 * len(versions[-1]))
        for body in versions:
            learner.learn(topics, cache, body, 12, read_metadata_head(body, 12).topics_at)
        assert learner.pending <= 4
        while learner.pending:
            await asyncio.sleep(0)

    asyncio.run(run())
    assert topics.count("grows") == 6 and cache.leader("grows", 5) == PartitionLeader(1, 5)
    assert stats.metadata_learned["dropped"] >= 1
    assert stats.metadata_learned["responses"] + stats.metadata_learned["dropped"] == 6


def test_a_slice_is_the_most_one_turn_of_the_loop_reads():
    """Another task of the event loop runs between every two slices of a big response."""
    body = generated(12, 20_000)
    head = read_metadata_head(body, 12)
    topics, cache = TopicCache(), LeaderCache()
    most = 0

    async def run():
        nonlocal most
        learner = MetadataLearner(slice_partitions=500)
        learner.learn(topics, cache, body, 12, head.topics_at)
        while learner.pending:
            before = _partitions(cache)
            await asyncio.sleep(0)
            most = max(most, _partitions(cache) - before)

    asyncio.run(run())
    assert 0 < most <= 500 + 60  # a slice, and the rest of the topic it ended in (at most 60 here)
    assert _partitions(cache) == sum(topics.partitions.values())


def _partitions(cache: LeaderCache) -> int:
    return len(cache)


def test_the_leader_cache_costs_about_16_bytes_a_partition_and_stays_bounded():
    """A million partitions is the bound; memory is measured at 200,000 (in 40,000 topics of
    five) with everything the cache holds for them: the arrays, names, ids, dict entries."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        # The arrays, names and ids as the walk makes them: new objects, kept by the cache.
        quads = [array("i", [x for i in range(5) for x in (0, i, 1, 7)]) for _ in range(40_000)]
        names = [f"team-{n:06d}.events" for n in range(40_000)]
        ids = [uuid.UUID(int=n + 1).bytes for n in range(40_000)]
        cache = LeaderCache()
        for name, topic_id, q in zip(names, ids, quads, strict=True):
            cache.observe_topic(name, topic_id, q, 0.0)
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    print(f"{used / 40_000:.0f} bytes a topic of five partitions")
    assert len(cache) == 200_000
    per_topic = used / 40_000
    # 5 partitions of 16 bytes, an array's head, a dict entry in each map: about 250 bytes.
    assert per_topic < 400, f"{per_topic:.0f} bytes a topic of five partitions"
    bounded = LeaderCache(max_partitions=1_000)
    for name, topic_id, q in zip(names[:1000], ids, quads, strict=False):
        bounded.observe_topic(name, topic_id, q, 0.0)
        assert len(bounded) <= 1_000
    assert bounded.leader(names[999], 4) == PartitionLeader(1, 7)


def test_the_same_topics_again_are_not_walked_again_unless_the_caches_forgot_something(monkeypatch):
    import proxy.cluster.metadata_learner as module

    body = generated(12, 3_000)
    stats = ProxyStats()
    topics, cache = TopicCache(), LeaderCache()
    walks = []

    class Counting(TopicWalk):
        def __init__(self, *args):
            walks.append(1)
            super().__init__(*args)

    monkeypatch.setattr(module, "TopicWalk", Counting)
    learner = MetadataLearner(stats)

    def learn(body):
        async def run():
            await learner.learn_all(topics, cache, body, 12, read_metadata_head(body, 12).topics_at)
        asyncio.run(run())

    learn(body)
    learn(bytes(body))  # the same bytes: not walked
    assert (len(walks), stats.metadata_learned["unchanged"]) == (1, 1)
    name = next(iter(topics.partitions))
    topics.forget(name)  # a DeleteTopics went through: the next response is read again
    learn(body)
    assert len(walks) == 2 and topics.count(name) is not None
    learn(generated(12, 3_000, seed=2))  # other topics: read
    assert len(walks) == 3
