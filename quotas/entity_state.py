"""One quota entity's state: its windowed rate (and token bucket), its throttles, and its part of
the fleet's usage; what a scrape reads of it.

Pure: time is an argument. Guarantees: ``record_and_throttle_at`` charges the entity and returns
the throttle its quota asks for (Kafka's ClientQuotaManager for rates, KIP-599's token bucket for
``controller_mutation_rate``); usage the other fleet members report (``add_remote_at``) counts
against the quota as this instance's own does, and is kept apart (``local_rate_at``).
"""

from __future__ import annotations

from typing import NamedTuple

from quotas.entities import ResolvedQuota
from quotas.rate import WindowedRate
from quotas.token_bucket import TokenBucket


class EntityStats(NamedTuple):
    """One live entity's state for a scrape. Labels are "" when not part of the entity."""

    kind: str
    user: str
    client_id: str
    quota: float
    rate: float  # per second, over the quota window
    tokens: float | None  # token-bucket kinds only
    throttle_ms: int  # what is left of the last throttle at the scrape instant
    last_throttle_ms: int  # the last throttle (or rejection) handed out, 0 if none yet


class KindCounters(NamedTuple):
    kind: str
    throttled: int  # admitted with a throttle
    rejected: int  # strict rejections (THROTTLING_QUOTA_EXCEEDED)
    # What quotas in shadow mode would have done: the same counts, nothing applied.
    shadow_throttled: int = 0
    shadow_rejected: int = 0


class EntityState:
    """One entity's quota in force, its rate and throttles, and its share of the fleet's usage."""

    __slots__ = (
        "resolved",
        "quota",
        "rate",
        "last_used_ms",
        "last_throttle_ms",
        "last_throttle_at_ms",
        "pending",
        "reported",
        "reported_last",
        "remote",
        "local_share",
        "remote_rate",
        "shared_until_ms",
    )

    def __init__(self, resolved: ResolvedQuota, rate: WindowedRate, now_ms: int) -> None:
        self.resolved = resolved
        self.quota = resolved.quota
        self.rate = rate
        self.last_used_ms = now_ms
        self.last_throttle_ms = 0
        self.last_throttle_at_ms = now_ms
        self.pending = 0.0  # charged here since the fleet was last told (quotas.fleet)
        self.reported = 0.0  # what the reports still on their way told (the others may not have read it)
        self.reported_last = 0.0  # what the last report told
        self.remote = 0.0  # the other members' usage read since the last report
        self.local_share = 1.0  # this instance's part of the fleet's recent usage (moving average)
        self.remote_rate: WindowedRate | None = None  # the other members' part of ``rate``, once they had any
        # Until then the fleet shares this entity (a member reported it): every amount charged
        # here is reported, however small (QuotaManager.take_local_usage).
        self.shared_until_ms = 0

    def set_quota(self, resolved: ResolvedQuota, share: int = 1) -> None:
        """The rule's bound, divided by ``share`` (the fleet's fallback: a bound per instance)."""
        self.resolved = resolved
        self.quota = resolved.quota / share

    def add_remote_at(self, amount: float, now_ms: int) -> None:
        """Another fleet member's usage, into the same samples as this instance's own (and into
        ``remote_rate``, per report, never per request, so the local part can be told apart)."""
        self.remote += amount
        self.mark_shared(now_ms)
        self.rate.record_at(amount, now_ms)
        remote_rate = self.remote_rate
        if remote_rate is None:
            remote_rate = self.remote_rate = WindowedRate(self.rate.window_num, self.rate.window_size_ms)
        remote_rate.record_at(amount, now_ms)

    def mark_shared(self, now_ms: int) -> None:
        """The fleet shares this entity for one quota window from ``now_ms``."""
        self.shared_until_ms = now_ms + self.rate.window_num * self.rate.window_size_ms

    def local_rate_at(self, now_ms: int) -> float:
        """This instance's part of ``rate``: all of it outside a fleet. The two rates' samples
        start at different moments, so the part is the remote total's share of the window's."""
        rate = self.rate.rate_at(now_ms)
        if self.remote_rate is None or rate <= 0:
            return rate
        total = self.rate.total_at(now_ms)
        local = total - self.remote_rate.total_at(now_ms)
        return rate * local / total if local > 0 else 0.0

    def remaining_throttle_ms_at(self, now_ms: int) -> int:
        # AbstractControllerMutationQuota.throttleTime: the last throttle minus the time since.
        elapsed_ms = now_ms - self.last_throttle_at_ms
        left = self.last_throttle_ms - (elapsed_ms if elapsed_ms > 0 else 0)
        return left if left > 0 else 0

    def stats_at(self, now_ms: int) -> EntityStats:
        r = self.resolved
        return EntityStats(
            r.kind,
            r.user or "",
            r.client_id or "",
            self.quota,
            self.rate.rate_at(now_ms),
            self.tokens_at(now_ms),
            self.remaining_throttle_ms_at(now_ms),
            self.last_throttle_ms,
        )

    def tokens_at(self, now_ms: int) -> float | None:
        return None

    def record_and_throttle_at(self, amount: float, now_ms: int) -> int:
        raise NotImplementedError

    def unrecord_at(self, amount: float, now_ms: int) -> None:
        raise NotImplementedError


class RateState(EntityState):
    __slots__ = ("max_throttle_ms",)

    def __init__(
        self, resolved: ResolvedQuota, rate: WindowedRate, now_ms: int, max_throttle_ms: int
    ) -> None:
        super().__init__(resolved, rate, now_ms)
        self.max_throttle_ms = max_throttle_ms

    def record_and_throttle_at(self, amount: float, now_ms: int) -> int:
        self.pending += amount
        return self.rate.record_and_throttle_at(amount, self.quota, now_ms, self.max_throttle_ms)

    def unrecord_at(self, amount: float, now_ms: int) -> None:
        self.pending -= amount
        self.rate.unrecord_at(amount, now_ms)


class BucketState(EntityState):
    __slots__ = ("bucket",)

    def __init__(self, resolved: ResolvedQuota, rate: WindowedRate, bucket: TokenBucket, now_ms: int) -> None:
        super().__init__(resolved, rate, now_ms)
        self.bucket = bucket

    def set_quota(self, resolved: ResolvedQuota, share: int = 1) -> None:
        super().set_quota(resolved, share)
        self.bucket.set_rate(self.quota)

    def add_remote_at(self, amount: float, now_ms: int) -> None:
        # KIP-599's bucket is debited by what the other members admitted.
        super().add_remote_at(amount, now_ms)
        self.bucket.record_at(amount, now_ms)

    def tokens_at(self, now_ms: int) -> float | None:
        return self.bucket.tokens_at(now_ms)

    def record_and_throttle_at(self, amount: float, now_ms: int) -> int:
        self.pending += amount
        self.rate.record_at(amount, now_ms)
        return self.bucket.record_and_throttle_at(amount, now_ms).throttle_ms

    def unrecord_at(self, amount: float, now_ms: int) -> None:
        self.pending -= amount
        self.rate.unrecord_at(amount, now_ms)
        self.bucket.record_at(-amount, now_ms)
