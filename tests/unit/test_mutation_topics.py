"""What a controller-mutation decision reads of a request's topics as a whole (Topics.sum_up),
worked out in one pass where the topics are made, is what the passes over every topic on the
event loop gave: the same topics to ask the broker for, the same totals, the same index, and
the same answer to "would a strict decision refuse a topic?" for any tokens."""

from __future__ import annotations

import uuid

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import errors
from proxy.dataplane.filters import mutation_checks as checks
from proxy.dataplane.filters.mutation_topics import Strike, Topic, Topics

REFUSALS = [None, checks.Refusal(checks.UNKNOWN_TOPIC_OR_PARTITION, "gone"),
            checks.Refusal(checks.TOPIC_ALREADY_EXISTS, "exists"), checks.Refusal(errors.INVALID_REQUEST, "twice")]

topic_st = st.builds(
    lambda name, by_id, mutations, refusal: Topic(None, None if by_id else name,
                                                  uuid.UUID(int=hash(name) % 2**64) if by_id else None,
                                                  mutations, refusal),
    st.sampled_from(["a", "b", "c", "d"]), st.booleans(), st.one_of(st.none(), st.integers(0, 5)),
    st.sampled_from(REFUSALS))


def _strict_refuses(tokens: float, topics: list[Topic]) -> bool:
    """The strict check as a pass over every topic (what ControllerMutationFilter did)."""
    for t in topics:
        if tokens < 0:
            return True
        if t.refusal is None:
            tokens -= t.mutations or 0
    return False


@settings(max_examples=400, deadline=None)
@given(topics=st.lists(topic_st, max_size=8), tokens=st.integers(-3, 20))
def test_sum_up_gives_what_the_passes_gave(topics, tokens):
    summed = Topics(topics).sum_up()
    unknown = [t for t in topics if t.mutations is None and t.refusal is None]
    asked = [t for t in topics if t.refusal is None or t.refusal.error_code in checks.CACHE_CODES]
    assert summed.unknown == bool(unknown)
    assert (summed.unknown_names, summed.unknown_ids) == (
        [t.name for t in unknown if t.name], [t.topic_id for t in unknown if not t.name and t.topic_id is not None])
    assert (summed.asked_names, summed.asked_ids) == (
        [t.name for t in asked if t.name], [t.topic_id for t in asked if not t.name and t.topic_id is not None])
    assert summed.mutations == sum(t.mutations or 0 for t in topics if t.refusal is None)
    would_refuse = bool(topics) and tokens - summed.but_last < 0
    assert would_refuse == _strict_refuses(tokens, topics)
    for t in topics:
        if t.name:
            assert summed.by_name[t.name] is next(u for u in topics if u.name == t.name)
        if t.topic_id is not None:
            assert summed.by_id[t.topic_id] is next(u for u in topics if u.topic_id == t.topic_id)


def test_a_strike_notes_a_throttled_answer_as_a_rejection_and_kafkas_own_refusal_not():
    strike = Strike(enforcing=True)
    strike.refuse(Topic(None, "a", None), checks.Refusal(checks.TOPIC_ALREADY_EXISTS, "exists"))
    assert not strike.rejected
    throttled = Topic(None, "b", None)
    strike.refuse(throttled, checks.Refusal(errors.THROTTLING_QUOTA_EXCEEDED, "quota"))
    assert strike.rejected and throttled.answer.error_code == errors.THROTTLING_QUOTA_EXCEEDED
