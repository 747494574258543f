"""KIP-731 rate limiters: a pluggable way to say how long a client should pause.

A :class:`RateLimiter` is told what each request (and each Fetch or ShareFetch response) carried —
:meth:`~RateLimiter.accumulate` — and asked how long the client that sent it should wait —
:meth:`~RateLimiter.throttle_ms`. The proxy applies the longest throttle of all limiters and
quotas once (KIP-731: "a collection of RateLimiters should only sleep by the max throttleTime").
Limiters are loaded by dotted path (``package.module:ClassName``) from the ``rate_limiters``
list in the configuration, configured at start and again on every reload, and closed at exit.

The built-in :class:`RecordRateLimiter` and :class:`BatchRateLimiter` enforce the
``producer_record_rate``, ``consumer_record_rate`` and ``producer_batch_rate`` quotas with the
windowed rate of the byte quotas, so a throttle is the smallest wait that brings the rate back
to the bound (``QuotaUtils.throttleTime``), not a penalty.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

from quotas.common import CONSUMER_RECORD_RATE, PRODUCER_BATCH_RATE, PRODUCER_RECORD_RATE
from quotas.entities import QuotaRule
from quotas.plugins import load_attribute

PRODUCE = 0
FETCH = 1
SHARE_FETCH = 78  # KIP-932: a share consumer's fetch, its records charged as a Fetch's
_FETCHES = frozenset({FETCH, SHARE_FETCH})


@dataclass(frozen=True, slots=True)
class Usage:
    """What one request, or one Fetch response, carried, and whose it was.

    ``response`` is False for a request (``size_bytes`` is the request's size; ``batches`` and
    ``records`` are those of a Produce request) and True for a Fetch or ShareFetch response (the
    records it delivers; ``api_key`` says which). Record counts come from batch headers; nothing is decompressed.
    """

    user: str
    client_id: str
    api_key: int
    api_version: int
    size_bytes: int
    batches: int = 0
    records: int = 0
    response: bool = False


@dataclass(frozen=True, slots=True)
class LimiterContext:
    """Given to :meth:`RateLimiter.configure` at start and on every reload."""

    rules: tuple[QuotaRule, ...]
    quota_window_num: int
    quota_window_size_s: float
    # The proxy's quota engine (quotas.QuotaManager): a limiter may keep its state there, so it
    # shows in the quota metrics and follows entity expiry and reloads.
    manager: Any
    settings: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


class RateLimiter(ABC):
    """KIP-731's ``RateLimiter``, for a proxy: one instance sees every client's usage.

    ``kinds`` names the quota kinds a limiter enforces, so a configuration that sets such a
    quota without the limiter that enforces it is refused. ``api_keys`` are the request APIs it
    wants to see (None: all); ``fetch_responses`` whether it wants Fetch and ShareFetch responses
    too. Both are read after :meth:`configure`, so a limiter with nothing to enforce can ask for
    nothing.
    Every method is called on the proxy's event loop and must not block.
    """

    kinds: ClassVar[frozenset[str]] = frozenset()
    api_keys: frozenset[int] | None = None
    fetch_responses: bool = False

    @classmethod
    def check_settings(cls, settings: Mapping[str, Any]) -> None:
        """Raises ValueError saying what is wrong with the limiter's own settings (KIP-731's
        ``config()`` ConfigDef). Called by ``check-config`` and before every :meth:`configure`,
        so a bad setting is a configuration error, never a crash. Accepts anything by default."""

    def configure(self, context: LimiterContext) -> None:
        """Takes the rules and the limiter's own settings (``rate_limiters[i].config``); called
        at start and on every reload. Raising ValueError refuses the configuration (at start the
        proxy exits with it; on reload the old configuration stays), so refuse before changing
        anything."""

    @abstractmethod
    def accumulate(self, usage: Usage, now_ms: int) -> None:
        """Accounts for what one request or response carried."""

    @abstractmethod
    def throttle_ms(self, usage: Usage, now_ms: int) -> int:
        """How long the client of ``usage`` should pause now (0: not at all)."""

    def charge(self, usage: Usage, now_ms: int) -> tuple[int, int]:
        """What the proxy calls once per usage: :meth:`accumulate`, then the throttle to apply
        (:meth:`throttle_ms`) and, when that is 0, the one its quotas in shadow mode would
        apply (:meth:`shadow_throttle_ms`). A limiter may answer it in one step; the
        answer must be the same."""
        self.accumulate(usage, now_ms)
        throttle_ms = self.throttle_ms(usage, now_ms)
        return throttle_ms, 0 if throttle_ms else self.shadow_throttle_ms(usage, now_ms)

    def shadow_throttle_ms(self, usage: Usage, now_ms: int) -> int:
        """How long the client of ``usage`` would pause now if the limiter's quotas in shadow
        mode (``QuotaRule.shadow``) were enforced; asked after :meth:`throttle_ms`, counted and
        never applied. A limiter that knows no shadow mode keeps this default: 0."""
        return 0

    def close(self) -> None:
        """Called once when the proxy stops."""


class _QuotaKindLimiter(RateLimiter):
    """Charges one quota kind per API to the shared quota engine."""

    request_kinds: ClassVar[Mapping[int, str]] = MappingProxyType({})
    response_kind: ClassVar[str | None] = None
    _one_step: ClassVar[bool] = True  # charge() without the three calls (see __init_subclass__)

    def __init__(self) -> None:
        self.manager = None
        self.api_keys = frozenset()
        self.fetch_responses = False
        # What _record gave for the last usage, so the entity is looked up once.
        self._last: tuple[Usage | None, int, bool] = (None, 0, False)

    def configure(self, context: LimiterContext) -> None:
        self.manager = context.manager
        used = {kind for rule in context.rules for kind in rule.values}
        self.api_keys = frozenset(k for k, kind in self.request_kinds.items() if kind in used)
        self.fetch_responses = self.response_kind in used

    def _kind(self, usage: Usage) -> str | None:
        if usage.response:
            return self.response_kind if usage.api_key in _FETCHES else None
        return self.request_kinds.get(usage.api_key)

    def _amount(self, usage: Usage) -> int:
        return usage.records

    def accumulate(self, usage: Usage, now_ms: int) -> None:
        self._record(usage, now_ms)

    def _record(self, usage: Usage, now_ms: int) -> tuple[int, bool]:
        """Charges ``usage`` to its kind (nothing for a kind this limiter does not enforce):
        the throttle Sensor.record with checkQuotas gives, and whether its quota is in shadow
        mode; kept for the throttle_ms and shadow_throttle_ms calls that follow."""
        kind = self._kind(usage)
        if kind is None or self.manager is None:
            return 0, False
        decision = self.manager.check_and_record(usage.user, usage.client_id, kind, self._amount(usage), now_ms)
        self._last = (usage, decision.throttle_ms, decision.shadow)
        return decision.throttle_ms, decision.shadow

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A subclass that changes what one of the three calls does is charged through them.
        cls._one_step = all(getattr(cls, name) is getattr(_QuotaKindLimiter, name)
                            for name in ("accumulate", "throttle_ms", "shadow_throttle_ms", "_decided", "_record"))

    def charge(self, usage: Usage, now_ms: int) -> tuple[int, int]:
        # accumulate, throttle_ms and shadow_throttle_ms in one step: the entity is looked up
        # and charged once (Sensor.record with checkQuotas gives the throttle).
        if not self._one_step:
            return super().charge(usage, now_ms)
        throttle_ms, shadow = self._record(usage, now_ms)
        return (0, throttle_ms) if shadow else (throttle_ms, 0)

    def _decided(self, usage: Usage, now_ms: int) -> tuple[int, bool]:
        last_usage, last_throttle_ms, last_shadow = self._last
        if usage is last_usage:
            return last_throttle_ms, last_shadow
        kind = self._kind(usage)
        if kind is None or self.manager is None:
            return 0, False
        resolved = self.manager.resolve(usage.user, usage.client_id, kind)
        if resolved is None:
            return 0, False
        return self.manager.throttle_ms(usage.user, usage.client_id, kind, now_ms), resolved.shadow

    def throttle_ms(self, usage: Usage, now_ms: int) -> int:
        throttle_ms, shadow = self._decided(usage, now_ms)
        return 0 if shadow else throttle_ms

    def shadow_throttle_ms(self, usage: Usage, now_ms: int) -> int:
        throttle_ms, shadow = self._decided(usage, now_ms)
        return throttle_ms if shadow else 0


class RecordRateLimiter(_QuotaKindLimiter):
    """``producer_record_rate`` (records in Produce requests) and ``consumer_record_rate``
    (records in Fetch responses), per second, per quota entity."""

    kinds = frozenset({PRODUCER_RECORD_RATE, CONSUMER_RECORD_RATE})
    request_kinds = MappingProxyType({PRODUCE: PRODUCER_RECORD_RATE})
    response_kind = CONSUMER_RECORD_RATE


class BatchRateLimiter(_QuotaKindLimiter):
    """``producer_batch_rate``: record batches in Produce requests per second."""

    kinds = frozenset({PRODUCER_BATCH_RATE})
    request_kinds = MappingProxyType({PRODUCE: PRODUCER_BATCH_RATE})

    def _amount(self, usage: Usage) -> int:
        return usage.batches


BUILT_IN = ("quotas.limiters:RecordRateLimiter", "quotas.limiters:BatchRateLimiter")


def load_limiter_class(target: str) -> type[RateLimiter]:
    """Imports ``package.module:ClassName``. Raises ValueError saying what is wrong."""
    obj = load_attribute(target, "package.module:ClassName")
    if not isinstance(obj, type) or not issubclass(obj, RateLimiter):
        raise ValueError(f"{target!r} is not a quotas.limiters.RateLimiter subclass")
    return obj
