"""Shadow mode, in one place: what a quota in shadow mode decided is noted on the request (for
the usage log) and logged, rate-limited, and never applied: no throttle, mute, refusal or rewrite.
The quota engines count these decisions themselves (``kqp_quota_shadow_*``).

A filter asks only two things, whatever its quota:

- :func:`applied`: what to apply of an engine's :class:`quotas.common.Decision`. The decision
  itself when its quota is enforced; in shadow mode it is noted and :data:`quotas.ADMIT` (admitted,
  no throttle) comes back, so the filter goes on exactly as when nothing was exceeded;
- :func:`enforced`: the quota that may change a request before it is decided (a cap on a Fetch),
  or None: none applies, or the one that applies is in shadow mode.

:func:`note_shadow` is what :func:`applied` does with a shadow decision, for the deciders that
give their shadow throttle apart (KIP-731 rate limiters) or one for several decisions (the topics
of one CreateTopics).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from proxy.observability.logs import LogLimiter
from quotas.common import ADMIT, Decision
from quotas.entities import ResolvedQuota

if TYPE_CHECKING:
    from proxy.dataplane.filters.api import FilterContext
    from proxy.dataplane.inflight import InFlight

log = logging.getLogger("proxy.shadow")
# Every client can trigger these at will: ten lines a minute for the whole proxy, the rest counted.
_lines = LogLimiter(log, lines=10, interval_s=60.0)


def applied(ctx: FilterContext, entry: InFlight, kind: str, decision: Decision,
            refused: str = "the request") -> Decision:
    """What a filter applies of ``decision``, the ``kind`` quota's: the decision itself when that
    quota is enforced. In shadow mode, what enforcing it would have done (a refusal of
    ``refused``, or a throttle) is noted on ``entry`` and logged, and ADMIT comes back."""
    if decision is ADMIT or not decision.shadow:  # ADMIT: what nearly every check gives, tested first
        return decision
    note_shadow(ctx, entry, kind, decision.throttle_ms, None if decision.admitted else refused)
    return ADMIT


def enforced(resolved: ResolvedQuota | None) -> ResolvedQuota | None:
    """``resolved`` if it is a quota to enforce; None for no quota, or one in shadow mode (which
    changes nothing in a request: it only decides, through :func:`applied`)."""
    return None if resolved is None or resolved.shadow else resolved


def note_shadow(ctx: FilterContext, entry: InFlight, kind: str, throttle_ms: int, refused: str | None = None) -> None:
    """A quota in shadow mode would have refused ``refused`` (None: nothing) and throttled the
    client ``throttle_ms``: noted on ``entry`` (its longest shadow throttle, a shadow refusal) and
    logged, rate-limited. Nothing would have happened (no refusal, no throttle): nothing is done."""
    session = ctx.session
    if refused is not None:
        entry.shadow_rejected = True
        entry.shadow_throttle(throttle_ms)
        _lines.log(logging.INFO, "shadow: %s (user=%s client_id=%s) would have had %s refused by %s "
                   "(THROTTLING_QUOTA_EXCEEDED, throttle %d ms)",
                   ctx.label, session.principal, session.client_id or "", refused, kind, throttle_ms)
    elif throttle_ms > 0:
        entry.shadow_throttle(throttle_ms)
        _lines.log(logging.INFO, "shadow: %s (user=%s client_id=%s) would have been throttled %d ms by %s",
                   ctx.label, session.principal, session.client_id or "", throttle_ms, kind)
