"""KIP-936 producer-id quota: how many producer ids a user may introduce per window.

Per user with a ``producer_ids_rate`` (a user or ``<default>``, never a client id):

* a :class:`~quotas.bloom.LayeredBloomFilter` remembers the ids seen in the last window;
* :class:`WindowTokens`, a bucket of ``producer_ids_rate`` tokens (one window's worth) refilled
  at that many tokens per window; an id not seen in the window costs one token, and a request
  is admitted only when a whole token is there for each of its new ids. Ids already seen cost
  nothing. A token comes back one window after it was spent: a bucket refilled at a steady
  rate would let ``2 × quota − 1`` new ids through in one window (a full bucket, then the
  refill), while this one never lets a user introduce more than the quota in any window.

Pure: time is an argument. The proxy calls :meth:`ProducerIdQuotaManager.cleanup` every
``producer_id_quota_cache_cleanup_interval_ms``; it drops expired layers, and users left with
no live layer.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from quotas.bloom import MAX_LAYER_IDS, BloomShape, LayeredBloomFilter, LayerPolicy, shape_for
from quotas.common import ADMIT, MAX_THROTTLE_MS, PRODUCER_IDS_RATE, Decision, ShadowDecision
from quotas.entities import EntityResolver, QuotaRule, ResolvedQuota, resolver_of
from quotas.rate import WindowedRate

# A layer sized for fewer ids is mostly overhead, and with a small quota the ids of long-lived
# producers (re-added every layer) would close it early again and again.
MIN_LAYER_IDS = 64


@dataclass(frozen=True, slots=True)
class ProducerIdSettings:
    """KIP-936's broker settings (``producer.id.quota.*``), with its defaults."""

    window_size_s: float = 3600.0
    window_num: int = 11  # samples of the ProducerIds rate metric
    layer_count: int = 4
    false_positive_rate: float = 0.001
    cleanup_interval_ms: int = 10

    def __post_init__(self) -> None:
        if not self.window_size_s > 0:
            raise ValueError(f"window size must be positive, got {self.window_size_s!r}")
        if self.window_num < 1 or self.layer_count < 1:
            raise ValueError("window_num and layer_count must be at least 1")
        if not 0 < self.false_positive_rate < 1:
            raise ValueError(f"false-positive rate must be in (0, 1), got {self.false_positive_rate!r}")

    @property
    def window_ms(self) -> int:
        return max(1, round(self.window_size_s * 1000))

    def layer_shape(self, quota: float) -> BloomShape:
        """A layer expects a layer's share of the quota (at least MIN_LAYER_IDS, at most
        MAX_LAYER_IDS: a huge quota must not allocate a huge filter up front; layers grow and
        multiply with the ids actually seen); the false-positive rate is split over the layers
        so that the whole filter, checked layer by layer, meets the configured rate."""
        expected = min(max(MIN_LAYER_IDS, math.ceil(quota / self.layer_count)), MAX_LAYER_IDS)
        per_layer = 1.0 - (1.0 - self.false_positive_rate) ** (1.0 / self.layer_count)
        return shape_for(expected, per_layer)

    def policy(self, quota: float) -> LayerPolicy:
        return LayerPolicy(self.window_ms, self.layer_count, self.layer_shape(quota))


# Spends are kept per slot of window / _SLOTS: a token is returned at the end of its slot plus
# a window (at most one slot late, never early), and a user's state is at most _SLOTS entries.
_SLOTS = 256


MAX_REMOTE_USERS = 100_000  # users another fleet member may make this instance track


class WindowTokens:
    """``quota`` tokens per window; a token spent at ``t`` is back at ``t + window`` (rounded up
    to the end of its slot). Time going backwards counts as no time passing."""

    __slots__ = ("quota", "window_ms", "slot_ms", "used", "_spent", "_latest_ms")

    def __init__(self, quota: float, window_ms: int) -> None:
        self.quota = float(quota)
        self.window_ms = window_ms
        self.slot_ms = max(1, window_ms // _SLOTS)
        self.used = 0
        self._spent: deque[list[int]] = deque()  # [slot, tokens spent in it], oldest first
        self._latest_ms = 0

    def _advance(self, now_ms: int) -> int:
        if now_ms < self._latest_ms:
            now_ms = self._latest_ms
        self._latest_ms = now_ms
        spent, slot_ms, window_ms = self._spent, self.slot_ms, self.window_ms
        while spent and (spent[0][0] + 1) * slot_ms + window_ms <= now_ms:
            self.used -= spent.popleft()[1]
        return now_ms

    def tokens_at(self, now_ms: int) -> float:
        self._advance(now_ms)
        return self.quota - self.used

    def take(self, n: int, now_ms: int) -> None:
        now_ms = self._advance(now_ms)
        slot = now_ms // self.slot_ms
        spent = self._spent
        if spent and spent[-1][0] == slot:
            spent[-1][1] += n
        else:
            spent.append([slot, n])
        self.used += n

    def wait_ms(self, n: int, now_ms: int) -> int | None:
        """How long until ``n`` tokens are there (0: now; None: never, n is over the quota)."""
        now_ms = self._advance(now_ms)
        short = n - (self.quota - self.used)
        if short <= 0:
            return 0
        if n > self.quota:
            return None
        for slot, count in self._spent:
            short -= count
            if short <= 0:
                return (slot + 1) * self.slot_ms + self.window_ms - now_ms
        return None  # unreachable while used is the sum of the spends

    def next_return_ms(self) -> int | None:
        """When the oldest spent tokens come back (None: none are out)."""
        return (self._spent[0][0] + 1) * self.slot_ms + self.window_ms if self._spent else None


class ProducerIdStats(NamedTuple):
    """One tracked user's state for a scrape."""

    user: str
    quota: float  # new producer ids per window
    rate: float  # new producer ids per second, over window_num windows (KIP-936 "rate")
    tokens: float  # KIP-936 "tokens": new ids admissible now
    rejected: int  # requests rejected since the user's state was created
    throttle_ms: int  # what is left of the last rejection's throttle
    last_throttle_ms: int
    live_layers: int
    bits_set: int
    bits: int
    estimated_fpr: float
    memory_bytes: int


class _UserState:
    __slots__ = ("resolved", "filter", "tokens", "rate", "last_throttle_ms", "last_throttle_at_ms", "rejected",
                 "pending")

    def __init__(self, resolved: ResolvedQuota, settings: ProducerIdSettings, now_ms: int) -> None:
        self.resolved = resolved
        self.filter = LayeredBloomFilter(settings.policy(resolved.quota))
        self.tokens = WindowTokens(resolved.quota, settings.window_ms)
        self.rate = WindowedRate(settings.window_num, settings.window_ms)
        self.last_throttle_ms = 0
        self.last_throttle_at_ms = now_ms
        self.rejected = 0
        self.pending = 0  # new ids admitted here since the fleet was last told (quotas.fleet)

    def set_quota(self, resolved: ResolvedQuota, settings: ProducerIdSettings) -> None:
        if resolved.quota != self.resolved.quota:
            self.tokens.quota = resolved.quota  # what was spent in the window stays spent
            self.filter.policy = settings.policy(resolved.quota)
        self.resolved = resolved


class ProducerIdQuotaManager:
    """Admits or rejects the new producer ids of each Produce request, per user."""

    def __init__(self, rules: Iterable[QuotaRule] | EntityResolver = (),
                 settings: ProducerIdSettings | None = None) -> None:
        self.settings = settings or ProducerIdSettings()
        self._users: dict[str, _UserState] = {}
        self._due: list[tuple[int, str]] = []  # (when to look at the user's layers again, user)
        self.new_ids_total = 0  # ids admitted as new
        self.rejected_total = 0  # requests rejected
        self.shadow_rejected_total = 0  # requests a producer_ids_rate in shadow mode would have rejected
        self.users_removed_total = 0
        self.replace_rules(rules)

    @property
    def _max_wait_ms(self) -> int:
        # A refused request's ids already seen were refreshed when it was refused, so a retry
        # within a window still finds them seen; its tokens may come back up to a slot later.
        # Such a request is told to retry just inside the window (and may be refused again,
        # briefly) rather than after it, when its old ids would count as new again.
        return max(1, self.settings.window_ms - 1)

    def replace_rules(self, rules: Iterable[QuotaRule] | EntityResolver) -> None:
        """New rules: users that keep a quota keep their ids and tokens; the others are dropped."""
        self._resolver = resolver_of(rules)
        # Whether any producer_ids_rate rule exists (no rule: nothing to scan for); read per
        # Produce request, so kept as a plain attribute.
        self.active = PRODUCER_IDS_RATE in self._resolver.kinds()
        for user, state in list(self._users.items()):
            resolved = self._resolver.resolve_user_level(PRODUCER_IDS_RATE, user)
            if resolved is None:
                del self._users[user]
            else:
                state.set_quota(resolved, self.settings)

    def resolve(self, user: str) -> ResolvedQuota | None:
        return self._resolver.resolve_user_level(PRODUCER_IDS_RATE, user)

    def admit(self, user: str, producer_ids: Sequence[int], now_ms: int, *, rejecting: bool = True) -> Decision:
        """A Produce request from ``user`` carrying ``producer_ids``.

        Admitted: its new ids are now remembered and paid for. Rejected (``admitted`` False):
        nothing is remembered or charged, and ``throttle_ms`` is how long until the tokens for
        its new ids will be there (rounded up, so a retry after it finds them). ``rejecting``
        False: the caller holds the request instead, so the refusal is not counted as a rejection.
        A user's quota in shadow mode decides the same (``Decision.shadow``): a refusal remembers
        and charges nothing, as when enforced, and is counted in ``shadow_rejected_total``.
        """
        if not producer_ids:
            return ADMIT
        state = self._users.get(user)
        if state is None:
            state = self._new_user(user, now_ms)
            if state is None:
                return ADMIT
        bloom = state.filter
        # Ids seen in the window are refreshed into the newest layer whatever happens next, so
        # a long-lived producer is never new; unseen ones are remembered only if admitted.
        new = [pid for pid in producer_ids if not bloom.refresh(pid, now_ms)]
        if not new:
            return ADMIT
        need = len(new)
        wait_ms = state.tokens.wait_ms(need, now_ms)
        if wait_ms == 0:
            state.tokens.take(need, now_ms)
            state.rate.record_at(need, now_ms)
            state.pending += need
            for pid in new:
                bloom.track(pid, now_ms)
            self.new_ids_total += need
            return ADMIT
        # More new ids in one request than a whole window admits can never be admitted: the
        # client is told to wait a window, and will be told again.
        if wait_ms is None:
            throttle_ms = self.settings.window_ms
        elif need < len(producer_ids):
            throttle_ms = min(wait_ms, self._max_wait_ms)
        else:
            throttle_ms = wait_ms
        throttle_ms = min(throttle_ms, MAX_THROTTLE_MS)
        state.last_throttle_ms = throttle_ms
        state.last_throttle_at_ms = now_ms
        if state.resolved.shadow:
            self.shadow_rejected_total += 1
            return ShadowDecision(False, throttle_ms)
        if rejecting:
            state.rejected += 1
            self.rejected_total += 1
        return Decision(False, throttle_ms)

    def _new_user(self, user: str, now_ms: int) -> _UserState | None:
        resolved = self._resolver.resolve_user_level(PRODUCER_IDS_RATE, user)
        if resolved is None:
            return None
        state = _UserState(resolved, self.settings, now_ms)
        self._users[user] = state
        heapq.heappush(self._due, (now_ms + self.settings.window_ms, user))
        return state

    # -- the fleet (quotas.fleet) ----------------------------------------------------------

    def take_local_usage(self) -> list[tuple[tuple[str, str | None, str | None], float]]:
        """New ids admitted here per user since the last call, for the fleet's next report."""
        out: list[tuple[tuple[str, str | None, str | None], float]] = []
        for user, state in self._users.items():
            if state.pending:
                out.append(((PRODUCER_IDS_RATE, user, None), float(state.pending)))
                state.pending = 0
        return out

    def add_remote(self, user: str, amount: float, now_ms: int) -> bool:
        """New ids another member admitted for ``user``: they take this instance's tokens too, so
        the user's new ids per window are counted fleet-wide (each member's Bloom filter stays its
        own: an id seen on one member and new on another counts there). False, nothing kept,
        when no rule gives the user a producer-id quota here, or past MAX_REMOTE_USERS users."""
        state = self._users.get(user)
        if state is None:
            if len(self._users) >= MAX_REMOTE_USERS:
                return False
            state = self._new_user(user, now_ms)
            if state is None:
                return False
        n = round(amount)
        state.tokens.take(n, now_ms)
        state.rate.record_at(n, now_ms)
        return True

    def wait_ms(self, user: str, producer_ids: Sequence[int], now_ms: int) -> int:
        """How long until :meth:`admit` could admit these ids (0: now); charges nothing."""
        state = self._users.get(user)
        if state is None:
            resolved = self.resolve(user)
            if resolved is None or not producer_ids or len(producer_ids) <= resolved.quota:
                return 0
            return self.settings.window_ms
        need = sum(1 for pid in producer_ids if not state.filter.contains(pid, now_ms))
        wait_ms = state.tokens.wait_ms(need, now_ms)
        if wait_ms is None:
            return self.settings.window_ms
        return min(wait_ms, self._max_wait_ms) if need < len(producer_ids) else wait_ms

    def cleanup(self, now_ms: int) -> int:
        """Drops expired layers of users that are due; removes users with no live layer.
        Returns how many users were removed."""
        due = self._due
        removed = 0
        while due and due[0][0] <= now_ms:
            _, user = heapq.heappop(due)
            state = self._users.get(user)
            if state is None:
                continue
            state.filter.cleanup(now_ms)
            state.tokens.tokens_at(now_ms)
            # Forgotten only when nothing is left to remember: no live layer, no token out.
            following = [t for t in (state.filter.policy.next_cleanup_ms(state.filter.layers),
                                     state.tokens.next_return_ms()) if t is not None]
            if not following:
                del self._users[user]
                removed += 1
            else:
                heapq.heappush(due, (max(min(following), now_ms + 1), user))
        self.users_removed_total += removed
        return removed

    @property
    def tracked_users(self) -> int:
        return len(self._users)

    def user_stats(self, now_ms: int) -> list[ProducerIdStats]:
        out = []
        for user, s in self._users.items():
            bloom = s.filter
            bloom.cleanup(now_ms)
            elapsed = now_ms - s.last_throttle_at_ms
            left = s.last_throttle_ms - max(elapsed, 0)
            out.append(
                ProducerIdStats(
                    user,
                    s.resolved.quota,
                    s.rate.rate_at(now_ms),
                    s.tokens.tokens_at(now_ms),
                    s.rejected,
                    max(left, 0),
                    s.last_throttle_ms,
                    bloom.live_layers,
                    bloom.bits_set(),
                    sum(layer.filter.shape.bits for layer in bloom.layers),
                    bloom.estimated_fpr(),
                    bloom.memory_bytes,
                )
            )
        return out


class ProducerIdObserver:
    """Counts the producer ids each user brings that it was not seen with in the last window,
    quota or not (for the usage log): the same layered filters as the quota, grown from the
    smallest shape as ids arrive. At most ``max_users`` users are followed; the one seen
    longest ago makes room."""

    def __init__(self, settings: ProducerIdSettings | None = None, max_users: int = 100_000) -> None:
        self.settings = settings or ProducerIdSettings()
        self.max_users = max_users
        self._policy = self.settings.policy(0)
        self._users: dict[str, LayeredBloomFilter] = {}  # least recently seen first

    def new_ids(self, user: str, producer_ids: Sequence[int], now_ms: int) -> int:
        users = self._users
        bloom = users.pop(user, None)
        if bloom is None:
            bloom = LayeredBloomFilter(self._policy)
            if len(users) >= self.max_users:
                del users[next(iter(users))]
        users[user] = bloom
        return sum(1 for pid in producer_ids if not bloom.track(pid, now_ms))

    def cleanup(self, now_ms: int) -> int:
        """Forgets users with no id seen within the window; returns how many."""
        gone = []
        for user, bloom in self._users.items():
            bloom.cleanup(now_ms)
            if not bloom.layers:
                gone.append(user)
        for user in gone:
            del self._users[user]
        return len(gone)

    @property
    def tracked_users(self) -> int:
        return len(self._users)
