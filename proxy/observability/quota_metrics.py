"""Per-entity quota metrics, built from the quota engines' state at scrape time, within a budget.

Series exist only while their entity does: an expired entity's series vanish with it. Labels
are the entity's user and client id as matched ("" when not part of the entity), as in
Kafka's quota metric tags.

Guarantees:

* At most ``max_entity_series`` entities get series of their own in each per-entity family:
  the most throttled first (throttle time left), then the most active (rate / quota). The
  others are summed into one series per quota kind labelled ``user="(other)"`` (and
  ``client_id="(other)"``); the false-positive rate of the Bloom filters takes the worst one
  instead of a sum. ``kqp_quota_folded_entities`` / ``kqp_producer_ids_folded_users`` say how
  many entities were summed.
* Per-entity work never has to run in one go: within a ``stats.Scrape`` (what ``/metrics``
  sets up, with the configured budget), collectors hand it over as a step generator that the
  endpoint runs in slices, giving the event loop back between them. Outside one (a plain
  ``generate_latest``), the same steps run to the end at once, with the collector's budget.
* A scrape keeps nothing per entity but the shown ones and one sum per kind: it allocates no
  object per entity that outlives a slice, so it does not feed the garbage collector's oldest
  generation (a full collection over 100,000 entities' state takes ~100 ms).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from contextlib import contextmanager
from itertools import chain
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.observability.stats import SAMPLES_PER_STEP, Steps, counter_by, current_scrape, in_slices
from quotas import QuotaManager
from quotas.producer_ids import ProducerIdQuotaManager


class DelayCounts(Protocol):
    """What the producer-id collector reads of the producer-id filter (ProducerIdQuotaFilter)."""

    @property
    def delayed_total(self) -> int: ...


class FailureCounts(Protocol):
    """What the collector reads of the rate-limiter filter (RateLimiterFilter)."""

    @property
    def failures(self) -> Mapping[str, int]: ...


OTHER = "(other)"
DEFAULT_MAX_ENTITY_SERIES = 1000  # config.model.MetricsConfig.max_entity_series
STEP_ENTITIES = 32  # entities measured between two chances to yield the event loop (~0.1 ms)

_LABELS = ["kind", "user", "client_id"]
_PRODUCER_IDS = "producer_ids_rate"  # the one kind of ProducerIdCollector's entities


def entity_budget(default: int) -> int:
    """Per-entity series allowed in each family: the current scrape's budget, or ``default``."""
    scrape = current_scrape()
    return default if scrape is None else scrape.max_entity_series


# -- choosing the entities shown ---------------------------------------------------------------

K = TypeVar("K")  # an entity's key: (kind, user, client id) for quotas, the user for producer ids
QuotaKey = tuple[str, str | None, str | None]
# An entity's measured values, one per field: numbers, or None where the entity has no such value
# (the tokens of a rate-only kind, the local rate with fleet off). Any, not ``float | None``: each
# family knows which of its fields can be None.
Values = tuple[Any, ...]
Measured = tuple[str, float, Values]  # (group, rank, values)


class Folded(NamedTuple, Generic[K]):
    shown: list[tuple[K, Values]]  # (key, values), most throttled / active first
    other: dict[str, list[Any]]  # group (kind) -> values summed over the entities folded (None: no value)
    counts: dict[str, int]  # group -> entities (shown or folded) seen


class KeySnapshot(Generic[K]):
    """A mapping's keys, copied at C speed into one list that is kept from scrape to scrape.

    Why one list kept: a new list of 100,000 references is traversed by the next young garbage
    collections (~4 ms each, on the event loop, twice before it is old); a list that lived
    through earlier collections is in the oldest generation, which young collections never
    look at. It is emptied after each use, so it holds no key between scrapes."""

    def __init__(self) -> None:
        self._keys: list[K] = []
        self._in_use = False

    @contextmanager
    def of(self, mapping: Iterable[K]) -> Iterator[list[K]]:
        if self._in_use:  # a plain generate_latest while a sliced scrape is under way
            yield list(mapping)
            return
        self._in_use = True
        try:
            self._keys.extend(mapping)
            yield self._keys
        finally:
            self._keys.clear()
            self._in_use = False


def activity(throttle_ms: int, rate: float, quota: float) -> float:
    """The ranking of an entity: the throttle time left, then rate / quota as a fraction below 1
    (one float, so ranking 100,000 entities allocates no tuple per entity)."""
    used = rate / quota if quota > 0 else (1e12 if rate > 0 else 0.0)
    used = used if used > 0 else 0.0
    return throttle_ms + min(used / (1.0 + used), 0.999999)


def fold_entities(
    keys: list[K], measure: Callable[[K, int], Measured | None], clock_ms: Callable[[], int], budget: int,
    maxed: frozenset[int] = frozenset(),
) -> Generator[None, None, Folded[K]]:
    """Measures every entity of ``keys`` and keeps the ``budget`` highest ranked; the others'
    values are summed per group (the fields in ``maxed`` take the largest instead; None never
    counts). Yields every STEP_ENTITIES entities; the clock is read again after each yield.

    ``measure(key, now_ms)`` -> ``(group, rank, values)``, or None for an entity gone since the
    keys were copied."""
    shown: list[tuple[tuple[float, int], K, str, Values]] = []  # a min-heap of ((rank, seq), key, group, values)
    other: dict[str, list[Any]] = {}
    counts: dict[str, int] = {}
    now_ms = clock_ms()
    for seq, key in enumerate(keys):
        if seq % STEP_ENTITIES == 0 and seq:
            yield
            now_ms = clock_ms()
        measured = measure(key, now_ms)
        if measured is None:
            continue
        group, rank, values = measured
        counts[group] = counts.get(group, 0) + 1
        item = ((rank, seq), key, group, values)
        if len(shown) < budget:
            heapq.heappush(shown, item)
            continue
        if budget and item[0] > shown[0][0]:
            item = heapq.heapreplace(shown, item)  # the lowest ranked goes to (other)
        _, _, group, values = item
        _fold(other.setdefault(group, [None] * len(values)), values, maxed)
    yield
    shown.sort(reverse=True)
    return Folded([(key, values) for _, key, _, values in shown], other, counts)


def _fold(sums: list[Any], values: Values, maxed: frozenset[int]) -> None:
    for f, v in enumerate(values):
        if v is None:
            continue
        s = sums[f]
        sums[f] = v if s is None else (max(s, v) if f in maxed else s + v)


# -- quota entities ---------------------------------------------------------------------------


class QuotaCollector(Collector):
    """Rate, bound, tokens and throttle per quota entity (within the series budget), and the
    throttle / rejection counters per kind."""

    def __init__(self, manager: QuotaManager, clock_ms: Callable[[], int],
                 max_entity_series: int = DEFAULT_MAX_ENTITY_SERIES, fleet: bool = False) -> None:
        self._manager = manager
        self._clock_ms = clock_ms
        self._max_entity_series = max_entity_series  # without a Scrape (which brings its own)
        self._fleet = fleet  # kqp_quota_rate is the fleet's: this instance's part beside it
        self._keys: KeySnapshot[QuotaKey] = KeySnapshot()

    def collect(self) -> Iterator[Metric]:
        m = self._manager
        throttled = CounterMetricFamily(
            "kqp_quota_throttled", "Requests admitted with a throttle, by quota kind (refused topics are in "
            "kqp_quota_rejected_total)", labels=["kind"])
        rejected = CounterMetricFamily(
            "kqp_quota_rejected", "Topics refused with THROTTLING_QUOTA_EXCEEDED (KIP-599 strict mode; their "
            "responses carry a throttle time too), by quota kind", labels=["kind"]
        )
        shadow_throttled = CounterMetricFamily(
            "kqp_quota_shadow_throttled", "Requests quotas in shadow mode would have throttled (counted as "
            "kqp_quota_throttled_total counts, nothing applied), by quota kind", labels=["kind"])
        shadow_rejected = CounterMetricFamily(
            "kqp_quota_shadow_rejected", "Topics quotas in shadow mode would have refused (counted as "
            "kqp_quota_rejected_total counts, nothing refused), by quota kind", labels=["kind"])
        for c in m.kind_counters():
            throttled.add_metric([c.kind], c.throttled)
            rejected.add_metric([c.kind], c.rejected)
            shadow_throttled.add_metric([c.kind], c.shadow_throttled)
            shadow_rejected.add_metric([c.kind], c.shadow_rejected)
        yield throttled
        yield rejected
        yield shadow_throttled
        yield shadow_rejected
        yield GaugeMetricFamily("kqp_quota_live_entities", "Quota entities holding state", value=m.live_entities)
        yield from in_slices(self._entity_steps(entity_budget(self._max_entity_series)))

    def _measure(self, key: QuotaKey, now_ms: int) -> Measured | None:
        state = self._manager._table.get(key)
        if state is None:
            return None
        throttle_ms = state.remaining_throttle_ms_at(now_ms)
        rate = state.rate.rate_at(now_ms)
        quota = state.quota
        local = state.local_rate_at(now_ms) if self._fleet else None
        return key[0], activity(throttle_ms, rate, quota), (rate, quota, state.tokens_at(now_ms), throttle_ms, local)

    def _entity_steps(self, budget: int) -> Steps:
        # quotas/ offers entity_stats() (every entity in one go: too long for the event loop at
        # 100,000 entities) and no cheaper public form: the keys are copied, each state looked up.
        with self._keys.of(self._manager._table._states) as keys:
            yield  # the copy (~1 ms at 100,000 entities) is a step of its own
            folded = yield from fold_entities(keys, self._measure, self._clock_ms, budget)
            yield  # and so is emptying it
        return (yield from _quota_families(folded))


def _quota_families(folded: Folded[QuotaKey]) -> Steps:
    rate = GaugeMetricFamily("kqp_quota_rate", "Observed rate per second over the quota window (with fleet on: "
                             "the fleet's, what the quota holds)", labels=_LABELS)
    local_rate = GaugeMetricFamily(
        "kqp_quota_local_rate", "This instance's part of kqp_quota_rate (exported with fleet on)", labels=_LABELS)
    bound = GaugeMetricFamily("kqp_quota_bound", "The quota in force (per second)", labels=_LABELS)
    tokens = GaugeMetricFamily(
        "kqp_quota_tokens", "Token-bucket tokens left (negative: debt), KIP-599", labels=_LABELS
    )
    throttle = GaugeMetricFamily(
        "kqp_quota_throttle_time_ms", "What is left of the entity's last throttle", labels=_LABELS
    )
    rows = chain(
        (([kind, user or "", client_id or ""], values) for (kind, user, client_id), values in folded.shown),
        (([kind, OTHER, OTHER], sums) for kind, sums in sorted(folded.other.items())),
    )
    for i, (labels, (r, q, t, ms, local)) in enumerate(rows):
        if i % (SAMPLES_PER_STEP // 5) == 0:
            yield
        rate.add_metric(labels, r)
        if local is not None:
            local_rate.add_metric(labels, local)
        bound.add_metric(labels, q)
        throttle.add_metric(labels, ms)
        if t is not None:
            tokens.add_metric(labels, t)
    folded_entities = GaugeMetricFamily(
        "kqp_quota_folded_entities", "Quota entities summed into the (other) series: over metrics.max_entity_series",
        labels=["kind"],
    )
    shown: dict[str, int] = {}
    for (kind, *_), _values in folded.shown:
        shown[kind] = shown.get(kind, 0) + 1
    for kind, n in sorted(folded.counts.items()):
        folded_entities.add_metric([kind], n - shown.get(kind, 0))
    return [rate, local_rate, bound, tokens, throttle, folded_entities]


# -- producer-id users (KIP-936) --------------------------------------------------------------

# Per-user gauges (name, help), in the order of the values measured; the rejected count comes last.
_USER_FAMILIES = (
    ("kqp_producer_ids_rate", "New producer ids per second (KIP-936 ProducerIds rate)"),
    ("kqp_producer_ids_quota", "producer_ids_rate in force: new ids per window"),
    ("kqp_producer_ids_tokens", "Tokens left: new producer ids admissible now"),
    ("kqp_producer_ids_throttle_time_ms", "What is left of the user's last producer-id throttle"),
    ("kqp_producer_ids_live_layers", "Live Bloom filter layers"),
    ("kqp_producer_ids_filter_bits_set", "Bits set over the live layers"),
    ("kqp_producer_ids_filter_bits", "Bits in the live layers"),
    ("kqp_producer_ids_filter_false_positive_rate",
     "Estimated chance that an unseen producer id is taken for a seen one"),
    ("kqp_producer_ids_filter_bytes", "Memory of the live layers"),
)
_FPR_FIELD = 7  # (other): the worst false-positive rate, not a sum


class ProducerIdCollector(Collector):
    """KIP-936's ProducerIds metrics (rate, tokens, throttle-time per user, within the series
    budget) and the state of each user's layered Bloom filter; plus the rate limiters' failure
    count."""

    def __init__(self, manager: ProducerIdQuotaManager, pid_filter: DelayCounts,
                 limiter_filter: FailureCounts, clock_ms: Callable[[], int],
                 max_entity_series: int = DEFAULT_MAX_ENTITY_SERIES) -> None:
        self._manager = manager
        self._pid_filter = pid_filter
        self._limiter_filter = limiter_filter
        self._clock_ms = clock_ms
        self._max_entity_series = max_entity_series
        self._users: KeySnapshot[str] = KeySnapshot()

    def collect(self) -> Iterator[Metric]:
        m = self._manager
        yield GaugeMetricFamily("kqp_producer_ids_tracked_users", "Users with producer-id state", value=m.tracked_users)
        yield CounterMetricFamily("kqp_producer_ids_new", "Producer ids admitted as new", value=m.new_ids_total)
        yield CounterMetricFamily(
            "kqp_producer_ids_rejected", "Produce requests rejected for new producer ids over the quota",
            value=m.rejected_total,
        )
        yield CounterMetricFamily(
            "kqp_producer_ids_shadow_rejected", "Produce requests a producer_ids_rate in shadow mode would have "
            "rejected (or, with reaction: delay, held); forwarded", value=m.shadow_rejected_total,
        )
        yield CounterMetricFamily(
            "kqp_producer_ids_delayed", "Produce requests held until the producer-id quota admitted them",
            value=self._pid_filter.delayed_total,
        )
        yield CounterMetricFamily(
            "kqp_producer_ids_users_removed", "Users dropped once no layer of theirs was live",
            value=m.users_removed_total,
        )
        yield counter_by("kqp_rate_limiter_failures", "Rate limiter calls that raised", "limiter",
                         self._limiter_filter.failures)
        yield from in_slices(self._user_steps(entity_budget(self._max_entity_series)))

    def _measure(self, user: str, now_ms: int) -> Measured | None:
        # ProducerIdQuotaManager.user_stats, one user at a time (quotas/ has no per-user form).
        s = self._manager._users.get(user)
        if s is None:
            return None
        bloom = s.filter
        bloom.cleanup(now_ms)
        left = s.last_throttle_ms - max(now_ms - s.last_throttle_at_ms, 0)
        throttle_ms = max(left, 0)
        rate = s.rate.rate_at(now_ms)
        values = (
            rate, s.resolved.quota, s.tokens.tokens_at(now_ms), throttle_ms, bloom.live_layers, bloom.bits_set(),
            sum(layer.filter.shape.bits for layer in bloom.layers), bloom.estimated_fpr(), bloom.memory_bytes,
            s.rejected,
        )
        return _PRODUCER_IDS, activity(throttle_ms, rate, s.resolved.quota), values

    def _user_steps(self, budget: int) -> Steps:
        with self._users.of(self._manager._users) as users:
            yield
            folded = yield from fold_entities(users, self._measure, self._clock_ms, budget, frozenset({_FPR_FIELD}))
            yield
        return (yield from _user_families(folded))


def _user_families(folded: Folded[str]) -> Steps:
    user = ["user"]
    families = [GaugeMetricFamily(name, doc, labels=user) for name, doc in _USER_FAMILIES]
    rejected = CounterMetricFamily(
        "kqp_producer_ids_user_rejected", "Produce requests of this user rejected for new producer ids "
        "(since the user's state was created)", labels=user,
    )
    rows = chain((([name], values) for name, values in folded.shown),
                 (([OTHER], sums) for sums in folded.other.values()))
    for i, (labels, values) in enumerate(rows):
        if i % (SAMPLES_PER_STEP // len(values)) == 0:
            yield
        for family, value in zip(families, values):
            family.add_metric(labels, value)
        rejected.add_metric(labels, values[len(families)])
    folded_users = sum(folded.counts.values()) - len(folded.shown)
    return [*families, rejected, GaugeMetricFamily(
        "kqp_producer_ids_folded_users", "Users summed into the (other) series: over metrics.max_entity_series",
        value=folded_users,
    )]
