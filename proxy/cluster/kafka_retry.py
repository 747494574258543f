"""When the proxy's own Kafka clients (the quota store's producer and follower) try again: the
policy of Kafka's own clients, pure, with time passed in.

- **What is retried.** An error the broker answered is retried when Kafka's client would retry
  it (a ``RetriableException``; kafka-python's ``retriable`` mirrors it): RETRIABLE. Any other
  answer ends the operation at once: FATAL. A cluster that does not answer at all (connection
  refused or closed, TLS or SASL refused, no answer in time) is UNREACHABLE: retried while it
  has been so for less than ``unreachable_s`` in a row (a broker that closed an idle connection
  is reconnected to), then the operation ends. An answer, even a retriable error, ends the run.
- **How often.** Kafka's ``ExponentialBackoff`` with the clients' defaults: ``retry.backoff.ms``
  100, doubling up to ``retry.backoff.max.ms`` 1000, each wait varied by ±20 % (jitter), so
  retries are bounded in number whatever the failure, and instances do not retry in step.
- **Until when.** The caller's deadline, which is not kept here: an asyncio timeout around the
  whole operation ends it, waits included.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

RETRIABLE: Final = "retriable"  # the broker answered an error Kafka's clients retry
UNREACHABLE: Final = "unreachable"  # no answer: the connection failed, or the request timed out
FATAL: Final = "fatal"  # the broker answered an error that retrying would not change


@dataclass(frozen=True)
class Backoff:
    """Kafka's ``ExponentialBackoff``: ``initial_s`` × ``multiplier``^retries, the exponent
    capped where the term reaches ``max_s``, times a random factor in [1 − jitter, 1 + jitter),
    then capped at ``max_s``."""

    initial_s: float = 0.1  # retry.backoff.ms
    max_s: float = 1.0  # retry.backoff.max.ms
    multiplier: float = 2.0  # CommonClientConfigs.RETRY_BACKOFF_EXP_BASE
    jitter: float = 0.2  # CommonClientConfigs.RETRY_BACKOFF_JITTER

    def delay_s(self, retries: int, rand: float) -> float:
        """The wait before retry number ``retries`` + 1; ``rand`` uniform in [0, 1)."""
        if self.max_s <= self.initial_s:
            return self.max_s  # Kafka: no growth, no jitter
        exp_max = math.log(self.max_s / self.initial_s) / math.log(self.multiplier)
        term = self.initial_s * math.pow(self.multiplier, min(max(retries, 0), exp_max))
        factor = 1 - self.jitter + 2 * self.jitter * rand
        return min(term * factor, self.max_s)


KAFKA_BACKOFF: Final = Backoff()


class Retries:
    """The attempts of one operation: after each failure, how long to wait before the next
    attempt, or that there is none (see the module docstring)."""

    def __init__(self, unreachable_s: float, backoff: Backoff = KAFKA_BACKOFF,
                 rand: Callable[[], float] = random.random) -> None:
        self.unreachable_s = unreachable_s
        self.backoff = backoff
        self._rand = rand
        self.failures = 0  # failed attempts so far
        self._unreachable_since: float | None = None  # start of the first attempt of a run without answer

    def delay_at(self, now: float, failure: str, started_at: float) -> float | None:
        """An attempt that started at ``started_at`` failed at ``now`` (``failure``: RETRIABLE,
        UNREACHABLE or FATAL): seconds to wait before the next attempt, or None: give up now.
        Time going backwards counts as no time passing."""
        self.failures += 1
        if failure == FATAL:
            return None
        if failure == UNREACHABLE:
            if self._unreachable_since is None:
                self._unreachable_since = started_at
            if now - self._unreachable_since >= self.unreachable_s:
                return None
        else:
            self._unreachable_since = None  # the cluster answered: it is there
        return self.backoff.delay_s(self.failures - 1, self._rand())
