"""ProducerIdQuotaManager (KIP-936) over a fake clock: the per-user budget of new producer ids,
which users it applies to, rule reloads, cleanup, and stats."""

from __future__ import annotations

import copy

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from quotas.common import ADMIT, MAX_THROTTLE_MS
from quotas.entities import DEFAULT, QuotaRule
from quotas.producer_ids import ProducerIdQuotaManager, ProducerIdSettings

KIND = "producer_ids_rate"


def rule(user: str, quota: float, client_id: str | None = None) -> QuotaRule:
    return QuotaRule(user, client_id, {KIND: quota})


def manager(*rules: QuotaRule, window_ms: int = 1000, **kw) -> ProducerIdQuotaManager:
    return ProducerIdQuotaManager(rules, ProducerIdSettings(window_size_s=window_ms / 1000, **kw))


def fork(m: ProducerIdQuotaManager) -> ProducerIdQuotaManager:
    """An independent copy, to try a request without touching ``m`` (the rules are shared:
    they are immutable)."""
    return copy.deepcopy(m, {id(m._resolver): m._resolver})


def tokens(m: ProducerIdQuotaManager, user: str, now_ms: int) -> float:
    return next(s.tokens for s in m.user_stats(now_ms) if s.user == user)


# --- the budget ---------------------------------------------------------------------------------


def test_quota_new_ids_then_rejected_seen_ids_free():
    m = manager(rule("alice", 3))
    assert m.admit("alice", [10, 11], 0) == ADMIT
    assert m.admit("alice", [12], 5) == ADMIT
    rejected = m.admit("alice", [13], 6)
    assert not rejected.admitted
    # The first tokens were spent at 0: back one window later, rounded up to the end of their
    # window/256 slot.
    assert 1000 - 6 <= rejected.throttle_ms <= 1000 + 1000 // 256 - 6
    for t in (6, 500, 999):
        assert m.admit("alice", [10, 11, 12], t) == ADMIT  # seen: never charged
    assert m.new_ids_total == 3 and m.rejected_total == 1


def test_empty_request_is_admitted_without_state():
    m = manager(rule("alice", 1))
    assert m.admit("alice", [], 0) is ADMIT
    assert m.tracked_users == 0


def test_request_with_more_new_ids_than_the_quota_is_never_admissible():
    m = manager(rule("alice", 2), window_ms=10_000)
    d = m.admit("alice", [1, 2, 3], 0)
    assert d == (False, 10_000)  # told to wait a window, and told again after it
    assert m.admit("alice", [1, 2, 3], 10_000) == (False, 10_000)
    assert m.admit("alice", [1, 2, 3], 10**9) == (False, 10_000)
    assert m.admit("alice", [1, 2], 10**9) == ADMIT


def test_throttle_is_capped_at_int32_for_huge_windows():
    m = manager(rule("alice", 1), window_ms=30 * 86_400_000)  # 30 days
    assert m.admit("alice", [1], 0) == ADMIT
    assert m.admit("alice", [2], 0) == (False, MAX_THROTTLE_MS)
    assert m.admit("alice", [2, 3], 0) == (False, MAX_THROTTLE_MS)


def test_rejection_charges_nothing_and_remembers_nothing():
    m = manager(rule("alice", 2))
    m.admit("alice", [1], 0)
    before = tokens(m, "alice", 100)
    assert not m.admit("alice", [2, 3], 100).admitted
    assert tokens(m, "alice", 100) == before == 1
    assert m.new_ids_total == 1
    # Both still new: one of them alone fits in the one token left, and is charged.
    assert m.admit("alice", [3], 100) == ADMIT
    assert m.new_ids_total == 2
    assert not m.admit("alice", [2], 100).admitted


request = st.tuples(
    st.one_of(st.floats(0, 0.05), st.floats(0, 1.5)),  # time since the previous request, in windows
    st.one_of(st.integers(0, 2), st.integers(0, 7)),  # new ids (sometimes more than the quota)
    st.integers(0, 3),  # ids seen before (still within their window, when there are any)
)


@given(
    quota=st.integers(1, 6),
    window_ms=st.integers(20, 5000),
    requests=st.lists(request, min_size=1, max_size=60),
)
@settings(max_examples=400, deadline=None)
def test_window_budget_retry_after_throttle_and_wait_ms(quota, window_ms, requests):
    """At most ``quota`` new ids in any window of length ``window_ms``; seen ids are free; a
    rejection charges and remembers nothing; ``throttle_ms`` is exactly the instant a retry of
    the same request gets in (when nothing else happened); ``wait_ms`` says what ``admit`` will
    answer."""
    user = "alice"
    m = manager(rule(user, quota), window_ms=window_ms)
    last_seen: dict[int, int] = {}  # ids the manager has seen, and when last
    admitted_new_at: list[int] = []
    t = 0
    next_id = 10**12  # far from anything else (realistic ids, but not small)
    for gap, n_new, n_old in requests:
        t += int(gap * window_ms)
        live = sorted((i for i, s in last_seen.items() if t < s + window_ms), key=last_seen.get)
        old = live[-n_old:] if n_old else []
        new = list(range(next_id, next_id + n_new))
        next_id += n_new
        ids = old + new
        if not ids:
            continue
        m.cleanup(t)  # as the proxy does: never forgets a user with tokens out or ids live
        tracked = m.tracked_users == 1
        expected_wait = m.wait_ms(user, ids, t) if tracked else None
        tokens_before = tokens(m, user, t) if tracked else None
        total_before = m.new_ids_total
        d = m.admit(user, ids, t)
        charged = m.new_ids_total - total_before
        if not new:
            assert d is ADMIT and charged == 0  # seen ids cost nothing, tokens or not
        if d.admitted:
            assert charged == len(new)
            admitted_new_at += [t] * charged
            for i in ids:
                last_seen[i] = t
            if expected_wait is not None:
                assert expected_wait == 0
            continue
        # Rejected.
        assert charged == 0 and d.throttle_ms > 0
        if tracked:
            assert tokens(m, user, t) == tokens_before
        for i in old:
            last_seen[i] = t  # refreshed whatever the answer
        if expected_wait is not None:
            assert expected_wait == d.throttle_ms
        fresh = list(range(next_id, next_id + len(new)))  # never sent
        assert m.wait_ms(user, new, t) == m.wait_ms(user, fresh, t)  # the rejected ids are still new
        event("rejected: " + ("over the quota" if len(new) > quota else
                              "retry within the window" if d.throttle_ms < window_ms else "long throttle"))
        if len(new) > quota:
            assert d.throttle_ms == window_ms
            assert not fork(m).admit(user, ids, t + d.throttle_ms).admitted
        elif d.throttle_ms < window_ms:
            # The seen ids are still seen at the retry (an id seen now is remembered a window).
            early, on_time = fork(m), fork(m)
            assert not early.admit(user, ids, t + d.throttle_ms - 1).admitted
            retry = on_time.admit(user, ids, t + d.throttle_ms)
            if not retry.admitted:
                # A request with seen ids is told to come back just inside the window, where
                # its tokens may still be up to a slot away: one short refusal, then admitted.
                assert old and d.throttle_ms == window_ms - 1
                assert retry.throttle_ms <= max(1, window_ms // 256) + 1
                assert on_time.admit(user, ids, t + d.throttle_ms + retry.throttle_ms).admitted
        else:
            # Only requests of new ids (the seen ones would be forgotten by then).
            on_time = fork(m)
            early = fork(m)
            assert not early.admit(user, new, t + d.throttle_ms - 1).admitted
            assert on_time.admit(user, new, t + d.throttle_ms).admitted
    event(f"admitted new ids: {min(len(admitted_new_at) // quota, 3)}+ quotas' worth")
    # The sliding window over admitted new ids.
    for k, start in enumerate(admitted_new_at):
        in_window = sum(1 for s in admitted_new_at[k:] if s < start + window_ms)
        assert in_window <= quota, (start, admitted_new_at)


def test_never_more_than_the_quota_in_one_window_even_from_a_full_bucket():
    """A full bucket then its refill would let 2 × quota − 1 ids in one window; tokens come back
    only a window after they were spent."""
    m = manager(rule("alice", 10), window_ms=10_000)
    assert all(m.admit("alice", [i], 0).admitted for i in range(10))
    assert not any(m.admit("alice", [100 + i], 9_999).admitted for i in range(10))
    assert m.admit("alice", [200], 10_000 + 10_000 // 256 + 1) == ADMIT


# --- who it applies to --------------------------------------------------------------------------


def test_no_rule_always_admitted_and_not_tracked():
    m = manager(rule("alice", 1))
    for t in range(5):
        assert m.admit("bob", list(range(t * 100, t * 100 + 100)), t) is ADMIT
    assert m.wait_ms("bob", list(range(1000)), 5) == 0
    assert m.tracked_users == 0 and m.new_ids_total == 0
    assert m.user_stats(5) == []
    empty = manager()
    assert not empty.active
    assert empty.admit("alice", [1, 2, 3], 0) is ADMIT and empty.tracked_users == 0


@pytest.mark.parametrize(
    "rules",
    [
        [rule("alice", 1, client_id="app")],  # user + client id: not a producer_ids_rate entity
        [QuotaRule(None, "app", {KIND: 1})],
        [QuotaRule(None, DEFAULT, {KIND: 1})],
        [QuotaRule(DEFAULT, DEFAULT, {KIND: 1})],
    ],
)
def test_client_level_rules_do_not_apply(rules):
    m = ProducerIdQuotaManager(rules, ProducerIdSettings(window_size_s=1))
    assert m.admit("alice", [1, 2, 3], 0) is ADMIT
    assert m.tracked_users == 0


def test_default_user_quota_is_per_user():
    m = manager(rule(DEFAULT, 2), rule("carol", 5))
    assert m.active
    assert m.admit("alice", [1, 2], 0) == ADMIT
    assert not m.admit("alice", [3], 0).admitted
    assert m.admit("bob", [1, 2], 0) == ADMIT  # its own bucket (the same ids: its own filter too)
    assert not m.admit("bob", [3], 0).admitted
    assert m.admit("carol", [1, 2, 3, 4, 5], 0) == ADMIT  # a user's own rule over the default
    assert m.admit(DEFAULT, [1, 2], 0) == ADMIT  # a principal named "<default>" is just a user
    assert m.tracked_users == 4
    stats = {s.user: s for s in m.user_stats(0)}
    assert {u: s.quota for u, s in stats.items()} == {"alice": 2, "bob": 2, "carol": 5, DEFAULT: 2}
    assert {u: s.tokens for u, s in stats.items()} == {"alice": 0, "bob": 0, "carol": 0, DEFAULT: 0}


# --- rule reloads -------------------------------------------------------------------------------


def test_replace_rules_keeps_state_of_users_that_keep_a_quota():
    m = manager(rule("alice", 3), rule(DEFAULT, 3))
    m.admit("alice", [1, 2], 0)
    m.admit("bob", [1, 2], 0)
    m.admit("dave", [1], 0)
    m.replace_rules([rule("alice", 3), rule("bob", 3)])  # dave has no quota any more
    assert m.tracked_users == 2
    assert {s.user for s in m.user_stats(10)} == {"alice", "bob"}
    assert m.admit("alice", [1, 2], 10) == ADMIT  # ids kept
    assert m.admit("bob", [1, 2, 3], 10) == ADMIT  # ids kept: only 3 is charged
    assert not m.admit("bob", [4], 10).admitted  # tokens kept
    assert m.admit("dave", list(range(100)), 10) is ADMIT  # no rule: not tracked
    assert m.tracked_users == 2
    m.replace_rules([rule(DEFAULT, 3)])
    assert m.admit("dave", [7, 8, 9], 20) == ADMIT  # back under a quota: a fresh state
    assert not m.admit("dave", [10], 20).admitted


def test_lower_quota_takes_effect_and_a_higher_one_too():
    m = manager(rule("alice", 10), window_ms=10_000)
    assert m.admit("alice", list(range(6)), 0) == ADMIT
    m.replace_rules([rule("alice", 4)])
    assert tokens(m, "alice", 1) == -2  # what was spent in the window stays spent
    assert not m.admit("alice", [100], 1).admitted
    assert m.admit("alice", list(range(6)), 1) == ADMIT  # seen ids still free
    assert m.user_stats(1)[0].quota == 4
    m.replace_rules([rule("alice", 8)])
    assert m.admit("alice", [100, 101], 2) == ADMIT
    assert not m.admit("alice", [102], 2).admitted
    # Old ids are still recognised. (Quotas this small share the minimum layer shape, so the
    # change needs no new layer; test_bloom covers a changed shape opening one.)
    assert all(m.admit("alice", [i], 3) is ADMIT for i in range(6))
    assert m.user_stats(3)[0].live_layers >= 1


def test_replace_rules_to_default_with_same_quota_keeps_everything():
    m = manager(rule("alice", 2))
    m.admit("alice", [1, 2], 0)
    m.replace_rules([rule(DEFAULT, 2)])
    assert m.resolve("alice").level == 6
    assert not m.admit("alice", [3], 0).admitted
    assert m.admit("alice", [1, 2], 0) == ADMIT


# --- cleanup ------------------------------------------------------------------------------------


def test_cleanup_removes_only_users_whose_layers_all_expired():
    w = 1000
    m = manager(rule(DEFAULT, 100), window_ms=w)
    m.admit("alice", [1], 0)
    m.admit("bob", [2], 400)
    m.admit("carol", [3], 0)
    removed_at: dict[str, int] = {}
    for now in range(0, 10 * w, 7):
        if now % 600 < 7:
            assert m.admit("carol", [3], now) is ADMIT  # long-lived: seen every 600 ms
        users_before = {s.user for s in m.user_stats(now)}
        m.cleanup(now)
        for u in users_before - {s.user for s in m.user_stats(now)}:
            removed_at[u] = now
    slot = w // 256
    assert set(removed_at) == {"alice", "bob"}
    # Not before its layer (last written at its sighting) is a window old, nor long after the
    # last token it spent has come back (a window after, rounded up to a slot).
    assert 0 + w <= removed_at["alice"] <= 0 + w + slot + 7
    assert 400 + w <= removed_at["bob"] <= 400 + w + slot + 7
    assert m.tracked_users == 1 and m.users_removed_total == 2


def test_cleanup_exact_instant_and_return_value():
    m = manager(rule("alice", 5), rule("bob", 5), window_ms=1000)
    m.admit("alice", [1], 0)
    m.admit("bob", [1], 500)
    assert m.cleanup(999) == 0
    removed = [m.cleanup(t) for t in range(1000, 1500)]
    assert sum(removed) == 1 and m.tracked_users == 1
    assert 1000 <= 1000 + removed.index(1) <= 1000 + 1000 // 256
    assert m.admit("alice", [1], 1500) == ADMIT  # forgotten: a new id again, a full budget
    assert tokens(m, "alice", 1500) == 4
    assert m.cleanup(10_000) == 2 and m.users_removed_total == 3 and m.tracked_users == 0


def test_cleanup_removes_a_user_whose_only_request_was_rejected():
    m = manager(rule("alice", 1), window_ms=1000)
    assert not m.admit("alice", [1, 2], 0).admitted
    assert m.cleanup(999) == 0
    assert m.cleanup(1000) == 1 and m.tracked_users == 0


def test_cleanup_of_a_user_dropped_then_back_keeps_the_new_state():
    m = manager(rule("alice", 5), window_ms=1000)
    m.admit("alice", [1], 0)
    m.replace_rules([])
    m.replace_rules([rule("alice", 5)])
    m.admit("alice", [2], 900)
    assert m.cleanup(1000) == 0  # the old schedule finds the new state alive
    assert m.admit("alice", [2], 1800) is ADMIT
    assert m.cleanup(2700) == 0 and m.tracked_users == 1


# --- stats --------------------------------------------------------------------------------------


def test_user_stats_fields_are_sane():
    m = manager(rule("alice", 4000), rule("bob", 2), window_ms=60_000)  # alice: layers of 1,000
    for i in range(600):
        m.admit("alice", [i], i * 10)
    m.admit("bob", [1, 2], 0)
    assert not m.admit("bob", [3], 1000).admitted
    stats = {s.user: s for s in m.user_stats(6000)}
    a, b = stats["alice"], stats["bob"]
    assert (a.quota, a.tokens, a.rejected, a.throttle_ms, a.last_throttle_ms) == (4000, 3400, 0, 0, 0)
    assert a.rate > 0
    assert a.live_layers == 1  # 600 ids within the first 15 s layer, which expects 1,000
    assert 0 < a.bits_set <= a.bits
    assert 0 < a.estimated_fpr < 0.001  # a layer 60 % full, at a quarter of 0.001 when full
    assert a.memory_bytes == (a.bits + 7) // 8
    assert (b.tokens, b.rejected) == (0, 1)
    assert 59_000 <= b.last_throttle_ms <= 59_000 + 60_000 // 256  # first token back at 60 s
    assert b.throttle_ms == b.last_throttle_ms - 5000  # 5 s of it gone
    assert {s.user: s.throttle_ms for s in m.user_stats(10**6)} == {"alice": 0, "bob": 0}
    for s in m.user_stats(10**6):  # all layers expired: nothing set, nothing estimated
        assert (s.live_layers, s.bits_set, s.bits, s.estimated_fpr, s.memory_bytes) == (0, 0, 0, 0.0, 0)
        assert s.tokens == s.quota


def test_user_stats_estimated_fpr_near_configured_at_the_configured_load():
    m = manager(rule("alice", 20_000), window_ms=3_600_000)
    for i in range(20_000):
        m.admit("alice", [i], i * 180)  # the configured load: the quota over one window
    s = m.user_stats(3_599_999)[0]
    # A few fresh ids pass as seen (false positives): admitted, and not charged.
    assert 0 <= s.tokens <= 0.002 * 20_000
    assert s.live_layers == 4
    assert 0.0005 < s.estimated_fpr < 0.002
    assert s.bits_set < s.bits


# --- known problems -----------------------------------------------------------------------------


def test_wait_ms_agrees_with_admit_for_a_user_not_tracked_yet():
    m = manager(rule("alice", 2), window_ms=10_000)
    ids = [1, 2, 3]  # more than the quota: admit will never admit it
    assert m.wait_ms("alice", ids, 0) == m.admit("alice", ids, 0).throttle_ms  # 0 != 10000


def test_retry_after_throttle_with_a_seen_id_that_expires_meanwhile():
    m = manager(rule("alice", 1), window_ms=10_000)
    assert m.admit("alice", [1], 0) == ADMIT
    d = m.admit("alice", [1, 2], 0)  # 1 seen, 2 new: one token, spent
    # The token is back at the end of its slot + a window, when id 1 would be a window old: the
    # request is told to come back just inside the window instead, while id 1 is still seen.
    assert d.throttle_ms == 9_999
    retry = m.admit("alice", [1, 2], d.throttle_ms)
    assert not retry.admitted and 0 < retry.throttle_ms <= 10_000 // 256 + 1
    assert m.admit("alice", [1, 2], d.throttle_ms + retry.throttle_ms).admitted


def test_long_lived_producers_within_the_quota_keep_a_bounded_number_of_layers():
    """KIP-936's example: 100 new producer ids per hour; here a user with 100 long-lived
    producers (all admitted at once, within the quota) each sending a request per 10 ms, for
    2 s. Nothing rotates by time (a layer lasts 15 minutes)."""
    s = ProducerIdSettings()  # 1 h window, 4 layers, 0.001
    m = ProducerIdQuotaManager([rule("alice", 100)], s)
    assert m.admit("alice", list(range(100)), 0) == ADMIT
    for t in range(10, 2000, 10):
        for pid in range(100):
            assert m.admit("alice", [pid], t) is ADMIT
    st_ = m.user_stats(2000)[0]
    assert st_.live_layers <= s.layer_count + 1  # 312 today, and growing with every request
    assert st_.estimated_fpr <= 2 * s.false_positive_rate
