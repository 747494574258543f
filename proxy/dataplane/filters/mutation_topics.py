"""What the controller mutation filter knows of a request's topics (proxy.dataplane.filters.controller_mutation).

A request's topics come with what its decision reads of them as a whole (``Topics.sum_up``):
worked out where they are made, in the decode thread for a big request, so that no pass over
every topic runs on the event loop (a strict decision, topic by topic, is made in slices).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from protocol import errors
from proxy.dataplane.filters import mutation_checks as checks


@dataclass
class Topic:
    item: Any  # the request's entry for this topic (a DeleteTopics v0-v5 name)
    name: str | None
    topic_id: uuid.UUID | None
    mutations: int | None = None  # partitions it creates or deletes; None: not known yet
    refusal: checks.Refusal | None = None  # Kafka refuses it before charging (as far as the proxy knows)
    # What this request charged for it: 0 too for a topic a quota in shadow mode would have
    # refused (enforcing it would have charged nothing), which is settled as any uncharged one.
    charged: int = 0
    answer: checks.Refusal | None = None  # answered by the proxy: 89, or Kafka's refusal while in debt


class Topics(list[Topic]):
    """A request's topics, in its order, and what a decision reads of them as a whole."""

    unknown = False  # a topic of unknown cost that Kafka would not refuse first: the broker is asked
    mutations = 0  # what the topics Kafka would not refuse cost together
    but_last = 0  # the same without the last topic (a strict decision refuses one iff tokens - this < 0)
    # The names and ids to ask the broker for: of the topics whose cost is unknown, or (before
    # refusing any) of every topic whose state the cache gave or could not give.
    unknown_names: list[str]
    unknown_ids: list[uuid.UUID]
    asked_names: list[str]
    asked_ids: list[uuid.UUID]
    by_name: dict[str, Topic]  # the first entry of each name and id: what the broker's answer settles
    by_id: dict[uuid.UUID, Topic]

    def sum_up(self) -> Topics:
        """Works the above out, in one pass (again after the topics change); returns self."""
        self.unknown = False
        self.mutations = last = 0
        self.unknown_names, self.unknown_ids, self.asked_names, self.asked_ids = [], [], [], []
        self.by_name, self.by_id = {}, {}
        for t in self:
            last = 0
            if t.refusal is None:
                last = t.mutations or 0
                self.mutations += last
                if t.mutations is None:
                    self.unknown = True
                    if t.name:
                        self.unknown_names.append(t.name)
                    elif t.topic_id is not None:
                        self.unknown_ids.append(t.topic_id)
            if t.refusal is None or t.refusal.error_code in checks.CACHE_CODES:
                if t.name:
                    self.asked_names.append(t.name)
                elif t.topic_id is not None:
                    self.asked_ids.append(t.topic_id)
            if t.name:
                self.by_name.setdefault(t.name, t)
            if t.topic_id is not None:
                self.by_id.setdefault(t.topic_id, t)
        self.but_last = self.mutations - last
        return self


@dataclass
class Charges:
    """What a request charged, settled against the broker's answer."""

    user: str
    client_id: str
    limited: bool
    topics: Topics


@dataclass
class Strike:
    """What a strict decision made of a request's topics so far (ControllerMutationFilter._strict)."""

    enforcing: bool
    admitted: list[Topic] = field(default_factory=list)
    throttle: int = 0
    rejected: bool = False  # a topic answered THROTTLING_QUOTA_EXCEEDED
    # Topics a quota in shadow mode would have refused: how many, and the longest throttle.
    shadow_refused: int = 0
    shadow_throttle: int = 0

    def refuse(self, t: Topic, answer: checks.Refusal) -> None:
        t.answer = answer
        self.rejected = self.rejected or answer.error_code == errors.THROTTLING_QUOTA_EXCEEDED
