"""Partition counts of topics, learned from Metadata responses the proxy decodes anyway and,
when a controller mutation needs a topic nobody asked about yet, from the broker directly."""

from __future__ import annotations

import uuid
from typing import Any


class TopicCache:
    """Topic name -> partition count, topic id -> name. Bounded: a flood of topic names
    cannot grow it without limit (the oldest half is dropped when full)."""

    def __init__(self, max_topics: int = 200_000) -> None:
        self.partitions: dict[str, int] = {}
        self.names: dict[uuid.UUID, str] = {}
        self.num_partitions_default: int | None = None  # the broker's num.partitions, once known
        self._max = max_topics

    def observe_metadata(self, resp: Any) -> None:
        """Records every topic of a MetadataResponse that came back without error (a decoded
        kafka-python response, untyped)."""
        for t in resp.topics:
            if t.error_code == 0 and t.name:
                self.put(t.name, len(t.partitions), getattr(t, "topic_id", None))

    def put(self, name: str, partitions: int, topic_id: uuid.UUID | None = None) -> None:
        if len(self.partitions) >= self._max:
            for stale in list(self.partitions)[: self._max // 2]:
                del self.partitions[stale]
            self.names = {i: n for i, n in self.names.items() if n in self.partitions}
        self.partitions[name] = partitions
        if topic_id is not None and topic_id.int:
            self.names[topic_id] = name

    def forget(self, name: str) -> None:
        self.partitions.pop(name, None)

    def count(self, name: str | None = None, topic_id: uuid.UUID | None = None) -> int | None:
        if name is None and topic_id is not None:
            name = self.names.get(topic_id)
        return None if name is None else self.partitions.get(name)
