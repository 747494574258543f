"""TopicPrefixPolicyFilter through a real ClientConnection: a CreateTopics of reserved names only
is answered by the proxy (POLICY_VIOLATION, nothing reaches the broker); one without is
forwarded byte for byte; a mixed one reaches the broker with the admitted topics only and its
response lists every topic in request order. The broker is played by the test (see Pair)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from kafka.protocol.admin import CreateTopicsRequest, CreateTopicsResponse

from config import parse_config
from protocol.apis import SPECS, ApiKey
from protocol.errors import THROTTLING_QUOTA_EXCEEDED
from protocol.frames import FrameReader
from protocol.headers import parse_request_header
from proxy.app.server import ProxyServer
from proxy.dataplane.filters.api import FilterSpec, Forward
from proxy.dataplane.filters.chain import UNFILTERED, FilterChain
from proxy.dataplane.filters.controller_mutation import ControllerMutationFilter
from proxy.dataplane.filters.quotas import now_ms
from proxy.dataplane.filters.topic_policy import TopicPrefixPolicyFilter
from quotas import CONTROLLER_MUTATION_RATE
from quotas.entities import ANONYMOUS

from .test_connection_paths import BASE, Pair, raw_request, request

VERSIONS = range(SPECS[ApiKey.CREATE_TOPICS].max_version + 1)
POLICY_VIOLATION = 44
INVALID_REQUEST = 42


def policy_pair(*before) -> Pair:
    """A connection whose only request filters are ``before`` then the policy on "tmp-"."""
    server = ProxyServer(parse_config(BASE))
    server.chain = FilterChain([*before, TopicPrefixPolicyFilter(["tmp-"])], [])
    return Pair(server=server)


def create_topics(version: int, names: list[str], correlation_id: int, validate_only: bool = False) -> bytes:
    R = CreateTopicsRequest[version]
    T = R.CreatableTopic
    topics = [T(name=name, num_partitions=3, replication_factor=1, assignments=[],
                configs=[T.CreatableTopicConfig(name="retention.ms", value="60000")]) for name in names]
    return request(R(topics=topics, timeout_ms=5000, validate_only=validate_only), correlation_id, "app")


def broker_answer(version: int, correlation_id: int, names: list[str], throttle_ms: int = 0) -> tuple[bytes, list]:
    """The broker's framed answer creating ``names``, and its results."""
    R = CreateTopicsResponse[version]
    results = [R.CreatableTopicResult(
        name=name, topic_id=uuid.UUID(int=i + 1), error_code=0, error_message=None, num_partitions=3,
        replication_factor=1, configs=[R.CreatableTopicResult.CreatableTopicConfigs(
            name="retention.ms", value="60000", read_only=False, config_source=1, is_sensitive=False)],
    ) for i, name in enumerate(names)]
    resp = R(throttle_time_ms=throttle_ms, topics=results)
    resp.with_header(correlation_id=correlation_id)
    return bytes(resp.encode(header=True, framed=True)), results


def client_responses(pair: Pair, version: int) -> list:
    """Every response the client got, decoded by kafka-python with its header; each must be
    exactly what kafka-python encodes again (no byte more or less)."""
    out = []
    for frame in FrameReader(1 << 30).feed(pair.client.bytes()):
        resp = CreateTopicsResponse.decode(bytes(frame), version=version, header=True)
        assert bytes(resp.encode(header=True)) == bytes(frame)
        out.append(resp)
    return out


def topics_seen_by_broker(pair: Pair, version: int) -> list[list]:
    seen = []
    for frame in pair.requests_seen_by_broker():
        header = parse_request_header(frame)
        seen.append(CreateTopicsRequest[version].decode(frame[header.body_offset :], version=version).topics)
    return seen


# validate_only (v1+) is judged the same way: Kafka runs its policy on validation too.
@pytest.mark.parametrize("version,validate_only", [(v, False) for v in VERSIONS] + [(v, True) for v in VERSIONS[1:]])
def test_a_reserved_name_is_answered_by_the_proxy_and_never_reaches_the_broker(version, validate_only):
    async def go():
        pair = policy_pair()
        pair.conn.data_received(create_topics(version, ["tmp-x"], 7, validate_only))
        assert pair.requests_seen_by_broker() == []
        (resp,) = client_responses(pair, version)
        assert resp.header.correlation_id == 7
        assert resp.header.version == (1 if version >= 5 else 0)  # ResponseHeader v1 for flexible versions
        (topic,) = resp.topics
        assert (topic.name, topic.error_code) == ("tmp-x", POLICY_VIOLATION)
        if version >= 1:
            assert topic.error_message == "Topic name 'tmp-x' starts with the reserved prefix 'tmp-'"
        if version >= 2:
            assert resp.throttle_time_ms == 0
        if version >= 5:
            assert (topic.num_partitions, topic.replication_factor, topic.configs) == (-1, -1, [])
        if version >= 7:
            assert topic.topic_id is None  # kafka-python reads the zero uuid as None
        assert pair.server.stats.local_responses[ApiKey.CREATE_TOPICS] == 1
        assert not pair.client.closed and not pair.conn.queue.pending

    asyncio.run(go())


@pytest.mark.parametrize("version", VERSIONS)
def test_a_request_without_a_reserved_name_passes_unchanged_both_ways(version):
    async def go():
        pair = policy_pair()
        sent = create_topics(version, ["orders", "tmp"], 3)  # "tmp" does not start with "tmp-"
        pair.conn.data_received(sent)
        assert pair.requests_seen_by_broker() == [sent[4:]]
        answer, _ = broker_answer(version, 3, ["orders", "tmp"])
        pair.up.data_received(answer)
        assert pair.client.bytes() == answer
        assert not pair.client.closed and not pair.conn.queue.pending

    asyncio.run(go())


@pytest.mark.parametrize("version", VERSIONS)
def test_a_mixed_request_reaches_the_broker_without_the_reserved_names_and_gets_them_back(version):
    async def go():
        pair = policy_pair()
        sent = create_topics(version, ["tmp-a", "orders", "tmp-b"], 5, validate_only=version >= 1)
        pair.conn.data_received(sent)
        (forwarded,) = pair.requests_seen_by_broker()
        header = parse_request_header(forwarded)
        assert forwarded[: header.body_offset] == sent[4 : 4 + header.body_offset]  # the client's header
        original = CreateTopicsRequest[version].decode(sent[4 + header.body_offset :], version=version)
        rewritten = CreateTopicsRequest[version].decode(forwarded[header.body_offset :], version=version)
        assert rewritten.topics == [original.topics[1]]  # "orders", every field as the client sent it
        assert rewritten.timeout_ms == original.timeout_ms
        if version >= 1:
            assert rewritten.validate_only is True
        answer, (_orders,) = broker_answer(version, 5, ["orders"], throttle_ms=12)
        pair.up.data_received(answer)
        (resp,) = client_responses(pair, version)
        assert resp.header.correlation_id == 5
        assert [t.name for t in resp.topics] == ["tmp-a", "orders", "tmp-b"]
        assert [t.error_code for t in resp.topics] == [POLICY_VIOLATION, 0, POLICY_VIOLATION]
        broker_result = CreateTopicsResponse.decode(answer[4:], version=version, header=True).topics[0]
        assert resp.topics[1] == broker_result  # the broker's result for "orders", as it sent it
        if version >= 1:
            assert resp.topics[2].error_message == "Topic name 'tmp-b' starts with the reserved prefix 'tmp-'"
        if version >= 2:
            assert resp.throttle_time_ms == 12  # the broker's throttle is kept
        if version >= 5:
            assert resp.topics[1].num_partitions == 3 and resp.topics[0].num_partitions == -1
        assert not pair.client.closed and not pair.conn.queue.pending

    asyncio.run(go())


def test_a_duplicated_reserved_name_is_answered_as_kafka_answers_a_duplicate():
    async def go():
        version = 7
        pair = policy_pair()
        pair.conn.data_received(create_topics(version, ["tmp-a", "orders", "tmp-a"], 2))
        assert [[t.name for t in topics] for topics in topics_seen_by_broker(pair, version)] == [["orders"]]
        pair.up.data_received(broker_answer(version, 2, ["orders"])[0])
        (resp,) = client_responses(pair, version)
        assert [(t.name, t.error_code, t.error_message) for t in resp.topics] == [
            ("tmp-a", INVALID_REQUEST, "Duplicate topic name."), ("orders", 0, None)]

    asyncio.run(go())


def test_an_earlier_filters_throttle_is_in_the_proxys_answer_and_mutes():
    class Throttling:  # as a request_rate quota over its bound would decide
        spec = FilterSpec(request_keys=None)

        def on_request(self, ctx, header, frame, entry):
            return Forward(throttle_ms=250)

    async def go():
        pair = policy_pair(Throttling())
        pair.conn.data_received(create_topics(4, ["tmp-x"], 9))
        assert pair.requests_seen_by_broker() == []
        (resp,) = client_responses(pair, 4)
        assert resp.throttle_time_ms == 250 and resp.topics[0].error_code == POLICY_VIOLATION
        assert pair.client.paused  # KIP-219: answered at once, then muted
        pair.conn._teardown()

    asyncio.run(go())


def test_a_version_the_proxy_cannot_read_closes_the_connection_rather_than_pass_unchecked():
    async def go():
        pair = policy_pair()
        v7 = create_topics(7, ["tmp-x"], 4)
        body = v7[4 + parse_request_header(v7[4:]).body_offset :]
        # A v8 header (flexible: empty tagged fields), a v7 body: nothing kafka-python can read as v8.
        pair.conn.data_received(raw_request(ApiKey.CREATE_TOPICS, 8, 4, b"app", b"\x00" + body))
        assert pair.requests_seen_by_broker() == [] and pair.client.writes == []
        assert pair.client.closed and pair.server.stats.frames_rejected["undecodable"] == 1

    asyncio.run(go())


def test_the_chain_takes_its_spec_create_topics_only_every_version_no_response_role():
    policy = TopicPrefixPolicyFilter(["tmp-", "_internal."])
    chain = FilterChain([policy], [])
    assert chain.request[ApiKey.CREATE_TOPICS] == (0, (policy,))
    assert chain.request[ApiKey.PRODUCE] == UNFILTERED and chain.request_all == UNFILTERED
    assert ApiKey.CREATE_TOPICS not in chain.response_route  # its response goes back as read
    assert policy.reserved_prefix("_internal.x") == "_internal." and policy.reserved_prefix("orders") is None


@pytest.mark.parametrize("prefixes", [[], [""], ["tmp-", ""]])
def test_no_prefix_or_an_empty_one_is_refused(prefixes):
    with pytest.raises(ValueError):
        TopicPrefixPolicyFilter(prefixes)


def policy_then_mutations() -> Pair:
    """The policy on "tmp-", then the real controller mutation quota at 0.1 partitions/s for
    client id "app" (strict on CreateTopics v6+): the first topic it sees goes into debt, the
    next ones are refused THROTTLING_QUOTA_EXCEEDED."""
    raw = {**BASE, "quotas": [{"client_id": "app", "controller_mutation_rate": 0.1}]}
    server = ProxyServer(parse_config(raw))
    mutations = ControllerMutationFilter(server.quotas, server.topics, 1, 1.0)
    server.chain = FilterChain([TopicPrefixPolicyFilter(["tmp-"]), mutations], [])
    return Pair(server=server)


def test_two_filters_that_each_cut_topics_out_give_every_topic_back_in_order():
    async def go():
        pair = policy_then_mutations()
        pair.conn.data_received(create_topics(6, ["tmp-a", "orders", "billing"], 5))
        # The policy forwards orders and billing; the quota admits orders (into debt) and, after
        # asking the broker about billing (127.0.0.1:1 refuses at once), forwards it alone. Each
        # merges its own refusals back: the quota's first, then the policy's.
        async with asyncio.timeout(10):
            while not pair.requests_seen_by_broker():
                await asyncio.sleep(0.01)
        assert [[t.name for t in topics] for topics in topics_seen_by_broker(pair, 6)] == [["orders"]]
        answer, _ = broker_answer(6, 5, ["orders"])
        pair.up.data_received(answer)
        (resp,) = client_responses(pair, 6)
        assert [(t.name, t.error_code) for t in resp.topics] == [
            ("tmp-a", POLICY_VIOLATION), ("orders", 0), ("billing", THROTTLING_QUOTA_EXCEEDED)]
        assert resp.throttle_time_ms > 0
        pair.conn._teardown()

    asyncio.run(go())


def test_an_answer_after_an_earlier_filters_cut_gets_that_filters_topics_back():
    async def go():
        pair = policy_then_mutations()
        pair.server.quotas.record(ANONYMOUS, "app", CONTROLLER_MUTATION_RATE, 100, now_ms())  # deep in debt
        pair.conn.data_received(create_topics(6, ["billing", "tmp-a"], 5))
        async with asyncio.timeout(10):  # after asking the broker about billing (127.0.0.1:1 refuses at once)
            while not pair.client.bytes():
                await asyncio.sleep(0.01)
        assert pair.requests_seen_by_broker() == []  # the quota answers for billing, the policy's cut is merged in
        (resp,) = client_responses(pair, 6)
        assert [(t.name, t.error_code) for t in resp.topics] == [
            ("billing", THROTTLING_QUOTA_EXCEEDED), ("tmp-a", POLICY_VIOLATION)]
        pair.conn._teardown()

    asyncio.run(go())
