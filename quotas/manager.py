"""QuotaManager: (user, client id, kind, amount, now) → admit / reject with a throttle in ms.

Pure and single-threaded: time is an argument, nothing reads a clock or starts a timer; the
caller (``proxy/``) calls :meth:`QuotaManager.expire` now and then.

Kinds:

* ``producer_byte_rate``, ``consumer_byte_rate``, ``request_rate`` — a windowed rate per entity
  (``quota_window_num`` × ``quota_window_size_s``), recorded then checked.
* ``controller_mutation_rate`` — a KIP-599 token bucket per entity
  (``controller_quota_window_num`` × ``controller_quota_window_size_s``): :meth:`try_admit` for
  strict requests (error 89), :meth:`check_and_record` for permissive (old) versions.
* ``producer_record_rate``, ``consumer_record_rate``, ``producer_batch_rate`` (KIP-731) — windowed
  rates like the byte quotas, charged by the built-in rate limiters (``quotas.limiters``).
* ``producer_ids_rate`` — resolved user-level only (:meth:`resolve`); its engine is
  ``quotas.producer_ids.ProducerIdQuotaManager``.
"""

from __future__ import annotations

from collections.abc import Iterable

from quotas.common import (
    ADMIT,
    MAX_THROTTLE_MS,
    RATE_KINDS,
    REQUEST_RATE,
    TOKEN_BUCKET_KINDS,
    USER_LEVEL_ONLY_KINDS,
    Decision,
    ShadowDecision,
    round_ms,
)
from quotas.entities import (
    DEFAULT_IDLE_MS,
    DEFAULT_MAX_ENTITIES,
    EntityResolver,
    EntityTable,
    QuotaRule,
    ResolvedQuota,
    resolver_of,
)
from quotas.entity_state import BucketState, EntityState, EntityStats, KindCounters, RateState
from quotas.fleet import worth_reporting
from quotas.rate import WindowedRate
from quotas.token_bucket import TokenBucket

_MISS = object()  # not in the resolution cache (None there means: no rule applies)
_SHARE_WEIGHT = 0.1  # of one sync interval in the moving average of an instance's share


class QuotaManager:
    """Quota decisions for every kind, with per-entity state.

    ``idle_ms``: entity state unused this long is dropped by :meth:`expire` (Kafka: one hour).
    ``max_entities``: hard cap on live entity states (all kinds together).
    ``max_cached_resolutions``: bound on the (kind, user, client id) resolution cache.
    """

    def __init__(
        self,
        rules: Iterable[QuotaRule] | EntityResolver = (),
        *,
        quota_window_num: int = 11,
        quota_window_size_s: float = 1,
        controller_quota_window_num: int = 11,
        controller_quota_window_size_s: float = 1,
        idle_ms: int = DEFAULT_IDLE_MS,
        max_entities: int = DEFAULT_MAX_ENTITIES,
        max_cached_resolutions: int | None = None,
    ) -> None:
        self.quota_window_num = quota_window_num
        self.quota_window_size_ms = _window_ms(quota_window_size_s)
        self.controller_quota_window_num = controller_quota_window_num
        self.controller_quota_window_size_ms = _window_ms(controller_quota_window_size_s)
        if quota_window_num < 1 or controller_quota_window_num < 1:
            raise ValueError("window counts must be at least 1")
        # ClientRequestQuotaManager: request throttles are capped at one quota window.
        self.request_max_throttle_ms = self.quota_window_size_ms
        self._table = EntityTable(idle_ms, max_entities)
        self._cache: dict[tuple[str, str, str], EntityState | None] = {}
        self._cache_max = max_cached_resolutions or 4 * max_entities
        self._resolver = resolver_of(rules)
        self._throttled = dict.fromkeys(RATE_KINDS | TOKEN_BUCKET_KINDS, 0)
        self._rejected = dict.fromkeys(TOKEN_BUCKET_KINDS, 0)
        self._shadow_throttled = dict.fromkeys(RATE_KINDS | TOKEN_BUCKET_KINDS, 0)
        self._shadow_rejected = dict.fromkeys(TOKEN_BUCKET_KINDS, 0)
        self._share = 1  # the fleet's fallback divides every bound by the members last known
        self._members = 1  # fleet members sharing usage (1: no fleet, or alone in it)
        self._sync_interval_ms = 0
        self._reports_in_flight = 1
        self._next_sync_ms = 0
        self.withheld_total = 0  # entities' interval usage left out of the fleet's reports (take_local_usage)
        # The states charged, reported or told of since the fleet's last take_local_usage: what
        # the next one reads (None until the first: nothing is tracked outside a fleet).
        self._active: set[EntityState] | None = None

    # -- rules ------------------------------------------------------------------------------

    @property
    def rules(self) -> tuple[QuotaRule, ...]:
        return self._resolver.rules

    def replace_rules(self, rules: Iterable[QuotaRule] | EntityResolver) -> None:
        """New rules (SIGHUP reload). An entity that still has a quota keeps its state (rate
        samples, tokens) under the new bound, as Kafka updates a live sensor's MetricConfig;
        entities that no longer have one are dropped. Raises ValueError, keeping the old rules."""
        resolver = resolver_of(rules)
        self._resolver = resolver
        self._cache.clear()
        for key, state in self._table.items():
            kind, user, client_id = key
            resolved = resolver.resolve_entity(kind, user, client_id)
            if resolved is None or resolved.key != key:
                self._table.remove(key)
            else:
                state.set_quota(resolved, self._share)

    def resolve(self, user: str, client_id: str, kind: str) -> ResolvedQuota | None:
        """The rule that applies, or None. User-level only for ``producer_ids_rate``.

        Read on every request by the filters: once the entity has been charged, from the
        resolution cache (one dict lookup) instead of walking the rules and their globs."""
        state = self._cache.get((kind, user, client_id), _MISS)
        if state is _MISS:
            return self._resolver.resolve(kind, user or "", client_id or "")
        return state.resolved if isinstance(state, EntityState) else None

    # -- decisions --------------------------------------------------------------------------

    def check_and_record(self, user: str, client_id: str, kind: str, amount: float, now_ms: int,
                         paced: bool = True) -> Decision:
        """Records ``amount`` and answers with the throttle it earns.

        Rate kinds: Sensor.record(checkQuotas=true) — always admitted, throttled while the rate
        is above the bound. ``controller_mutation_rate``: the permissive mode of old request
        versions — always admitted, throttled while the bucket is in debt. A quota in shadow mode
        records and decides the same, and says so (``Decision.shadow``); it is counted apart.
        In a fleet, ``paced`` False leaves out the burst pacing (:meth:`_paced_ms`): for a caller
        that answers a throttled request empty and takes its amount back (a Fetch, KafkaApis),
        where a response larger than this member's part of the burst would be emptied again and
        again while the window never fills (a starved consumer).
        """
        state = self._cache.get((kind, user, client_id), _MISS)
        if state is _MISS:
            state = self._state_for(user, client_id, kind, now_ms)
        if state is None:
            return ADMIT
        assert isinstance(state, EntityState)
        if now_ms > state.last_used_ms:
            state.last_used_ms = now_ms
        if not state.pending and self._active is not None:  # _track, inlined: every request
            self._active.add(state)
        throttle_ms = state.record_and_throttle_at(amount, now_ms)
        if self._members > 1 and type(state) is RateState:
            throttle_ms = self._fleet_throttle_ms(state, throttle_ms, now_ms, paced)
        if throttle_ms:
            state.last_throttle_ms = throttle_ms
            state.last_throttle_at_ms = now_ms
            if state.resolved.shadow:
                self._shadow_throttled[kind] += 1
                return ShadowDecision(True, throttle_ms)
            self._throttled[kind] += 1
            return Decision(True, throttle_ms)
        return ADMIT

    def record(self, user: str, client_id: str, kind: str, amount: float, now_ms: int) -> Decision:
        """Permissive token-bucket mode (older CreateTopics / CreatePartitions / DeleteTopics):
        always admitted, throttled with −K/Q while in debt. The same as :meth:`check_and_record`."""
        if kind not in TOKEN_BUCKET_KINDS:
            raise ValueError(f"record is for token-bucket kinds, not {kind!r}")
        return self.check_and_record(user, client_id, kind, amount, now_ms)

    def try_admit(self, user: str, client_id: str, kind: str, amount: float, now_ms: int) -> Decision:
        """Strict token-bucket admission (CreateTopics v6+, CreatePartitions v3+, DeleteTopics v5+).

        Admitted (throttle 0) while tokens ≥ 0, even if this drives them negative; otherwise
        rejected with throttle −K/Q. Call once per topic, with that topic's partition count.
        """
        if kind not in TOKEN_BUCKET_KINDS:
            raise ValueError(f"try_admit is for token-bucket kinds, not {kind!r}")
        state = self._entity(user, client_id, kind, now_ms)
        if state is None:
            return ADMIT
        assert isinstance(state, BucketState)
        if now_ms > state.last_used_ms:
            state.last_used_ms = now_ms
        decision = state.bucket.try_admit_at(amount, now_ms)
        if decision.admitted:
            # Strict mode records the Rate only for what it admits (checkQuotas, then record).
            state.rate.record_at(amount, now_ms)
            self._track(state, state.pending)
            state.pending += amount
            return decision
        state.last_throttle_ms = decision.throttle_ms
        state.last_throttle_at_ms = now_ms
        if state.resolved.shadow:
            # What enforcing would do to the bucket is done (nothing taken for a refusal).
            self._shadow_rejected[kind] += 1
            return ShadowDecision(False, decision.throttle_ms)
        self._rejected[kind] += 1
        return decision

    def throttle_ms(self, user: str, client_id: str, kind: str, now_ms: int) -> int:
        """The throttle the entity's rate asks for now, recording nothing (rate kinds only):
        the smallest wait that brings the rate back to the bound (QuotaUtils.throttleTime)."""
        if kind not in RATE_KINDS:
            raise ValueError(f"throttle_ms is for rate kinds, not {kind!r}")
        state = self._entity(user, client_id, kind, now_ms)
        if state is None:
            return 0
        assert isinstance(state, RateState)
        return state.rate.throttle_ms_at(state.quota, now_ms, state.max_throttle_ms)

    def unrecord(self, user: str, client_id: str, kind: str, amount: float, now_ms: int) -> None:
        """Takes back ``amount`` recorded before: a throttled Fetch is answered empty and its
        bytes are un-recorded (ClientQuotaManager.unrecordQuotaSensor)."""
        state = self._entity(user, client_id, kind, now_ms)
        if state is None:
            return
        assert isinstance(state, EntityState)
        if now_ms > state.last_used_ms:
            state.last_used_ms = now_ms
        self._track(state, state.pending)
        state.unrecord_at(amount, now_ms)

    def charge(self, user: str, client_id: str, kind: str, amount: float, now_ms: int) -> None:
        """Records ``amount`` learned after the decision (a topic the broker created although the
        proxy expected it refused), deciding and counting nothing: the next request pays for it."""
        self.unrecord(user, client_id, kind, -amount, now_ms)

    def tokens(self, user: str, client_id: str, kind: str, now_ms: int) -> float | None:
        """The entity's tokens now (token-bucket kinds), charging nothing; None: no quota applies."""
        if kind not in TOKEN_BUCKET_KINDS:
            raise ValueError(f"tokens is for token-bucket kinds, not {kind!r}")
        state = self._entity(user, client_id, kind, now_ms)
        return None if state is None else state.tokens_at(now_ms)

    def _entity(self, user: str, client_id: str, kind: str, now_ms: int) -> EntityState | None:
        """The state this (user, client id) is charged to for ``kind``, or None (no rule).
        check_and_record, the per-request path, has these two lines inline."""
        state = self._cache.get((kind, user, client_id), _MISS)
        # Not _MISS, so a cached EntityState | None; mypy does not narrow an identity check against a sentinel.
        return self._state_for(user, client_id, kind, now_ms) if state is _MISS else state  # type: ignore[return-value]

    def _state_for(self, user: str, client_id: str, kind: str, now_ms: int) -> EntityState | None:
        """Cache miss: resolve the rule, find or create the entity's state, cache it."""
        if kind in USER_LEVEL_ONLY_KINDS or kind not in self._throttled:
            raise ValueError(f"no engine here for quota kind {kind!r}")
        resolved = self._resolver.resolve(kind, user or "", client_id or "")
        state = None
        if resolved is not None:
            state = self._table.get(resolved.key)
            if state is None:
                state = self._new_state(resolved, now_ms)
                if self._table.add(resolved.key, state, now_ms):
                    self._cache.clear()  # cached states may have been dropped
        if len(self._cache) >= self._cache_max:
            self._cache.clear()
        self._cache[(kind, user, client_id)] = state
        return state

    def _new_state(self, resolved: ResolvedQuota, now_ms: int) -> EntityState:
        state: EntityState
        if resolved.kind in TOKEN_BUCKET_KINDS:
            num, size_ms = self.controller_quota_window_num, self.controller_quota_window_size_ms
            bucket = TokenBucket(resolved.quota, num, size_ms, now_ms)
            state = BucketState(resolved, WindowedRate(num, size_ms), bucket, now_ms)
        else:
            max_throttle_ms = self.request_max_throttle_ms if resolved.kind == REQUEST_RATE else MAX_THROTTLE_MS
            rate = WindowedRate(self.quota_window_num, self.quota_window_size_ms)
            state = RateState(resolved, rate, now_ms, max_throttle_ms)
        if self._share != 1:
            state.set_quota(resolved, self._share)
        return state

    # -- the fleet (quotas.fleet): usage shared with other instances -------------------------

    def take_local_usage(self, now_ms: int = 0,
                         report_threshold: float = 0.0) -> list[tuple[tuple[str, str | None, str | None], float]]:
        """What this instance charged each entity since the last call ((kind, user, client id)
        labels, amount), for the fleet's next report; a net give-back (an un-recorded Fetch) is
        carried into the next interval rather than sent.

        With ``report_threshold`` (the fleet's), an entity is left out unless what it was charged
        is worth the others' reading (quotas.fleet.worth_reporting: that fraction of its bound
        over the interval, divided among the members) or the fleet shares it already (a member,
        this one or another, reported it within its quota window); then every amount is. What
        is left out is dropped (counted in ``withheld_total``), never sent later: the fleet's
        rate of an entity nobody reports is under that fraction of its bound."""
        self._next_sync_ms = now_ms + self._sync_interval_ms
        interval_ms, members = self._sync_interval_ms, self._members
        # Only the states touched since the last call: an interval costs what was charged in
        # it, not every entity known (the first call reads them all, then tracking starts).
        states = self._table.values() if self._active is None else self._active
        self._active = active = set()
        out = []
        for state in states:
            pending = state.pending
            told = 0.0  # what this report tells of the entity
            if pending > 0:
                state.pending = 0.0
                if (report_threshold and state.shared_until_ms <= now_ms
                        and not worth_reporting(pending, state.resolved.quota, interval_ms, members, report_threshold)):
                    self.withheld_total += 1
                else:
                    out.append((state.resolved.key, pending))
                    told = pending
                    if report_threshold:
                        state.mark_shared(now_ms)
            elif pending:
                active.add(state)  # a give-back, carried
                pending = 0.0
            # Still on its way to the others: this report, and the one before when the fleet's
            # owners pass usage on (one more interval; proxy.control.fleet_owners).
            state.reported = told + (state.reported_last if self._reports_in_flight > 1 else 0.0)
            state.reported_last = told
            if state.reported:
                active.add(state)  # its ``reported`` goes back to 0 at a later call
            total = pending + state.remote
            if total > 0:  # this interval's part, into a moving average (about ten intervals)
                state.local_share += _SHARE_WEIGHT * (pending / total - state.local_share)
            state.remote = 0.0
        return out

    def add_remote(self, kind: str, user: str | None, client_id: str | None, amount: float, now_ms: int) -> bool:
        """Another member's usage of the entity with these labels, into the same samples as this
        instance's own (rates) or debited from its bucket (KIP-599). False, and nothing kept,
        when no rule here gives that entity, or when its state would have to push out an entity
        of this instance's (remote usage never evicts)."""
        key = (kind, user, client_id)
        state = self._table.get(key)
        if state is None:
            if kind not in self._throttled:
                return False
            resolved = self._resolver.resolve_entity(kind, user, client_id)
            if resolved is None or resolved.key != key or len(self._table) >= self._table.max_entities:
                return False
            state = self._new_state(resolved, now_ms)
            self._table.add(key, state, now_ms)
        elif now_ms > state.last_used_ms:
            state.last_used_ms = now_ms
        self._track(state, state.remote)
        state.add_remote_at(amount, now_ms)
        return True

    def _track(self, state: EntityState, before: float) -> None:
        """``state`` is about to change what the fleet's next take reads (``before``: the pending
        or remote amount it had): it is read then, if the fleet is taking."""
        if not before and self._active is not None:
            self._active.add(state)

    def set_fleet(self, members: int, sync_interval_ms: int, reports_in_flight: int = 1) -> None:
        """``members`` instances (this one included) share usage every ``sync_interval_ms``:
        a windowed rate's burst is paced (:meth:`_paced_ms`), counting what the last
        ``reports_in_flight`` reports told as not read by the others yet."""
        self._members = max(1, int(members))
        self._sync_interval_ms = sync_interval_ms
        self._reports_in_flight = reports_in_flight

    def _fleet_throttle_ms(self, state: RateState, throttle_ms: int, now_ms: int, paced: bool) -> int:
        """Kafka's throttle on the fleet's rate, stretched by this instance's share of the
        principal's recent usage; then the burst pacing (:meth:`_paced_ms`).

        Kafka's formula gives the wait after which the rate is back at the bound if nothing more
        is recorded; each of N members' clients waiting that long would then send again at
        once, N requests where one fits. So a member carrying a part f of the fleet's usage
        throttles ``throttle / f`` (f at least 1 / members): a principal on one member (f = 1)
        gets Kafka's throttle, three even members three times it each, and together the rate
        Kafka's formula aims at."""
        if throttle_ms:
            share = max(state.local_share, 1 / self._members)
            throttle_ms = min(round_ms(throttle_ms / share), state.max_throttle_ms)
        if paced and throttle_ms < self._sync_interval_ms:
            throttle_ms = max(throttle_ms, self._paced_ms(state, now_ms))
        return throttle_ms

    def paced_ms(self, user: str, client_id: str, kind: str, amount: float, now_ms: int) -> int:
        """How long to hold a request of ``amount`` before charging it, so that it does not take
        this instance past its part of the fleet's burst (:meth:`_paced_ms`, the request counted
        before it is admitted); 0 outside a fleet, or when it fits. Charges nothing."""
        if self._members <= 1:
            return 0
        state = self._entity(user, client_id, kind, now_ms)
        if type(state) is not RateState:
            return 0
        return self._paced_ms(state, now_ms, amount)

    def _paced_ms(self, state: RateState, now_ms: int, amount: float = 0.0) -> int:
        """The fleet's burst pacing: what the others may not have read yet (this interval's usage
        and the reports' still on their way, and ``amount`` about to be admitted) is at most
        this instance's part (1 / members) of what the window still allows. Greedy clients on
        every member would otherwise each get what the window allows before the first reports
        are read: one burst per member at the start, and again each time a sample leaves the
        window. Over it, the wait until the next report.

        A principal this member carries (almost) alone is paced only while the window holds more
        than two intervals of quota per member (its start, before the others' reports could say
        it is alone): below that, Kafka's throttle holds its rate, and it keeps its whole quota."""
        rate = state.rate
        window_ms = rate.window_ms_at(now_ms)
        headroom = state.quota * window_ms / 1000 - rate.total_at(now_ms)
        members = self._members
        allowance = headroom / members
        if state.local_share > 1 - 0.5 / members and allowance <= state.quota * 2 * self._sync_interval_ms / 1000:
            return 0  # alone here and no burst left to share: Kafka's throttle holds the rate
        if state.pending + state.reported + amount <= allowance:
            return 0
        wait_ms = self._next_sync_ms - now_ms
        return wait_ms if wait_ms > 0 else 1

    def set_share(self, members: int) -> None:
        """Every bound divided by ``members`` (1: the whole bound): the fleet's ``share`` fallback."""
        members = max(1, int(members))
        if members == self._share:
            return
        self._share = members
        for _, state in self._table.items():
            state.set_quota(state.resolved, members)

    @property
    def share(self) -> int:
        return self._share

    # -- housekeeping and observation -------------------------------------------------------

    def expire(self, now_ms: int) -> int:
        """Drops entity state idle for longer than ``idle_ms``; returns how many went."""
        dropped = self._table.expire(now_ms)
        if dropped:
            self._cache.clear()
        return dropped

    @property
    def live_entities(self) -> int:
        return len(self._table)

    @property
    def expired_total(self) -> int:
        return self._table.expired_total

    @property
    def evicted_total(self) -> int:
        """Entities dropped before their idle time because ``max_entities`` was reached."""
        return self._table.evicted_total

    def kind_counters(self) -> list[KindCounters]:
        rejected, shadow_throttled, shadow_rejected = self._rejected, self._shadow_throttled, self._shadow_rejected
        return [KindCounters(k, n, rejected.get(k, 0), shadow_throttled[k], shadow_rejected.get(k, 0))
                for k, n in sorted(self._throttled.items())]

    def entity_stats(self, now_ms: int) -> list[EntityStats]:
        """Every live entity's rate (or tokens) and throttle, measured at ``now_ms``."""
        return [state.stats_at(now_ms) for _, state in self._table.items()]

    def entity_stats_for(self, user: str, client_id: str, kind: str, now_ms: int) -> EntityStats | None:
        """The stats of the entity this connection is charged to, if it has live state."""
        resolved = self._resolver.resolve(kind, user or "", client_id or "")
        if resolved is None:
            return None
        state = self._table.get(resolved.key)
        return None if state is None else state.stats_at(now_ms)


def _window_ms(window_size_s: float) -> int:
    window_ms = round(window_size_s * 1000)
    if window_ms < 1:
        raise ValueError(f"a quota window must be at least 1 ms, got {window_size_s!r} s")
    return window_ms
