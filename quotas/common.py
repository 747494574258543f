"""Small pieces shared by the quota engines: the decision type, quota kinds, ms rounding."""

from __future__ import annotations

import math
from typing import NamedTuple

# Quota kinds, named as Kafka names the quota configs.
PRODUCER_BYTE_RATE = "producer_byte_rate"
CONSUMER_BYTE_RATE = "consumer_byte_rate"
REQUEST_RATE = "request_rate"
CONTROLLER_MUTATION_RATE = "controller_mutation_rate"
PRODUCER_IDS_RATE = "producer_ids_rate"
# KIP-731's record and batch limits, enforced by the built-in rate limiters (quotas.limiters).
PRODUCER_RECORD_RATE = "producer_record_rate"
CONSUMER_RECORD_RATE = "consumer_record_rate"
PRODUCER_BATCH_RATE = "producer_batch_rate"
RECORD_KINDS = frozenset({PRODUCER_RECORD_RATE, CONSUMER_RECORD_RATE, PRODUCER_BATCH_RATE})

RATE_KINDS = frozenset({PRODUCER_BYTE_RATE, CONSUMER_BYTE_RATE, REQUEST_RATE}) | RECORD_KINDS
TOKEN_BUCKET_KINDS = frozenset({CONTROLLER_MUTATION_RATE})
# KIP-936: producer_ids_rate applies to /config/users/<user> and /config/users/<default> only.
USER_LEVEL_ONLY_KINDS = frozenset({PRODUCER_IDS_RATE})
ALL_KINDS = RATE_KINDS | TOKEN_BUCKET_KINDS | USER_LEVEL_ONLY_KINDS

# A quota entry's mode: enforced, or computed and counted without being applied (shadow).
ENFORCE = "enforce"
SHADOW = "shadow"
MODES = (ENFORCE, SHADOW)

# throttle_time_ms is an int32 on the wire; a longer throttle is reported as this.
MAX_THROTTLE_MS = 2**31 - 1


class Decision(NamedTuple):
    """The answer to one quota check.

    ``admitted`` False only for a strict (KIP-599, error 89) rejection; a rate quota always
    admits and asks for a throttle instead (KIP-219: answer at once, then mute). ``shadow``: the
    quota that decided is in shadow mode, so ``admitted`` and ``throttle_ms`` say what enforcing
    it would do, and the caller applies neither (it counts them).
    """

    admitted: bool
    throttle_ms: int

    @property
    def shadow(self) -> bool:
        return False


class ShadowDecision(Decision):
    """A decision of a quota in shadow mode: what enforcing it would do, for the caller to count."""

    __slots__ = ()

    @property
    def shadow(self) -> bool:
        return True


ADMIT = Decision(True, 0)


def round_ms(value_ms: float) -> int:
    """Rounds half up like Java's ``Math.round``, clamped to [0, int32 max]."""
    if value_ms != value_ms:  # NaN: no usable throttle
        return 0
    if value_ms >= MAX_THROTTLE_MS:
        return MAX_THROTTLE_MS
    # QuotaUtils / ControllerMutationQuotaManager use Math.round (half up), not banker's rounding.
    rounded = math.floor(value_ms + 0.5)
    return rounded if rounded > 0 else 0
