"""Shadow mode: what a quota in shadow mode decided is noted on the request (for the usage log)
and logged, rate-limited, and never applied: no throttle, mute, refusal or rewrite. The quota
engines count these decisions themselves (``kqp_quota_shadow_*``)."""

from __future__ import annotations

import logging

from proxy.observability.logs import LogLimiter

log = logging.getLogger("proxy.shadow")
# Every client can trigger these at will: ten lines a minute for the whole proxy, the rest counted.
_lines = LogLimiter(log, lines=10, interval_s=60.0)


def shadow_throttled(ctx, entry, kind: str, throttle_ms: int) -> None:
    """A quota in shadow mode would have throttled this request for ``throttle_ms``."""
    entry.shadow_throttle(throttle_ms)
    _lines.log(logging.INFO, "shadow: %s (user=%s client_id=%s) would have been throttled %d ms by %s",
               ctx.label, ctx.session.principal, ctx.session.client_id or "", throttle_ms, kind)


def shadow_rejected(ctx, entry, kind: str, throttle_ms: int, what: str) -> None:
    """A quota in shadow mode would have refused ``what`` (and throttled the client ``throttle_ms``)."""
    entry.shadow_rejected = True
    entry.shadow_throttle(throttle_ms)
    _lines.log(logging.INFO, "shadow: %s (user=%s client_id=%s) would have had %s refused by %s "
               "(THROTTLING_QUOTA_EXCEEDED, throttle %d ms)",
               ctx.label, ctx.session.principal, ctx.session.client_id or "", what, kind, throttle_ms)
