"""KIP-599 token bucket: rate Q, burst B = Q × samples × window, tokens may go negative.

Pure: every method takes ``now_ms``; nothing reads a clock. Time going backwards counts as no
time passing (the bucket remembers the latest instant it has seen and never refills twice for
the same stretch of time).
"""

from __future__ import annotations

from quotas.common import ADMIT, MAX_THROTTLE_MS, Decision, round_ms


def burst_for(rate_per_s: float, window_num: int, window_size_ms: int) -> float:
    """B = Q × S × W, multiplied in the order Kafka's ``TokenBucket.burst`` does."""
    return window_num * (window_size_ms / 1000.0) * rate_per_s


class TokenBucket:
    """Tokens ``K`` refilled at ``rate_per_s`` up to ``burst``.

    * refill: K = min(B, K + Q·Δt), Δt in seconds, never negative;
    * :meth:`record_at`: K = min(B, K − amount) (a negative amount gives tokens back);
    * :meth:`try_admit_at` (strict): admit iff K ≥ 0, then charge the whole amount;
    * :meth:`record_and_throttle_at` (permissive): always charge, throttle while K < 0;
    * throttle = −K / Q, in ms, rounded half up.
    """

    __slots__ = ("rate_per_s", "window_num", "window_size_ms", "burst", "tokens", "last_update_ms")

    def __init__(self, rate_per_s: float, window_num: int, window_size_ms: int, now_ms: int) -> None:
        if window_num < 1 or window_size_ms < 1:
            raise ValueError("window_num and window_size_ms must be at least 1")
        if not rate_per_s >= 0:
            raise ValueError(f"rate_per_s must be >= 0, got {rate_per_s!r}")
        self.rate_per_s = float(rate_per_s)
        self.window_num = window_num
        self.window_size_ms = window_size_ms
        self.burst = burst_for(self.rate_per_s, window_num, window_size_ms)
        # Kafka's TokenBucket starts at 0 tokens at epoch 0, so its first refill at a wall-clock
        # instant fills it: a new bucket is full.
        self.tokens = self.burst
        self.last_update_ms = now_ms

    def set_rate(self, rate_per_s: float) -> None:
        """A new quota keeps the tokens (capped at the new burst), as a changed MetricConfig does."""
        if not rate_per_s >= 0:
            raise ValueError(f"rate_per_s must be >= 0, got {rate_per_s!r}")
        self.rate_per_s = float(rate_per_s)
        self.burst = burst_for(self.rate_per_s, self.window_num, self.window_size_ms)
        if self.tokens > self.burst:
            self.tokens = self.burst

    def _refill(self, now_ms: int) -> None:
        elapsed_ms = now_ms - self.last_update_ms
        if elapsed_ms > 0:
            # TokenBucket.refill: K = min(B, K + Q × Δt in seconds).
            tokens = self.tokens + self.rate_per_s * (elapsed_ms / 1000.0)
            self.last_update_ms = now_ms
        else:
            # Time went backwards or stood still: no time passes (unlike Kafka, which would
            # subtract tokens and move lastUpdateMs back).
            tokens = self.tokens
        self.tokens = tokens if tokens < self.burst else self.burst

    def tokens_at(self, now_ms: int) -> float:
        """K after refilling up to ``now_ms`` (Kafka's ``tokens`` metric)."""
        self._refill(now_ms)
        return self.tokens

    def record_at(self, amount: float, now_ms: int) -> None:
        """Charges ``amount`` without any check (negative = give back, as Kafka's unrecord)."""
        self._refill(now_ms)
        tokens = self.tokens - amount
        # TokenBucket.record caps at the burst, so a give-back never overfills the bucket.
        self.tokens = tokens if tokens < self.burst else self.burst

    def throttle_ms_at(self, now_ms: int) -> int:
        """0 while K ≥ 0, else the time to refill to zero: −K / Q."""
        self._refill(now_ms)
        return self._throttle_ms()

    def _throttle_ms(self) -> int:
        tokens = self.tokens
        # Sensor.checkQuotas: a TokenBucket violates its quota only when strictly below zero.
        if tokens >= 0:
            return 0
        if self.rate_per_s <= 0:
            return MAX_THROTTLE_MS
        # ControllerMutationQuotaManager.throttleTimeMs: Math.round(-K / Q * 1000).
        return round_ms(-tokens / self.rate_per_s * 1000)

    def try_admit_at(self, amount: float, now_ms: int) -> Decision:
        """Strict mode: reject while in debt, else admit and charge everything, even into debt."""
        self._refill(now_ms)
        if self.tokens < 0:
            # StrictControllerMutationQuota: checkQuotas before record; the rejection carries
            # the throttle (which rounds to 0 for a tiny debt, and is still a rejection).
            return Decision(False, self._throttle_ms())
        tokens = self.tokens - amount
        self.tokens = tokens if tokens < self.burst else self.burst
        # StrictControllerMutationQuota: an admitted mutation is never throttled.
        return ADMIT

    def record_and_throttle_at(self, amount: float, now_ms: int) -> Decision:
        """Permissive mode: always admit and charge, throttle while the bucket is in debt."""
        # PermissiveControllerMutationQuota: Sensor.record(checkQuotas=true) — record, then check.
        self.record_at(amount, now_ms)
        throttle_ms = self._throttle_ms()
        return ADMIT if throttle_ms == 0 else Decision(True, throttle_ms)
