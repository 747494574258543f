"""Partition counts of topics, learned from the Metadata responses clients receive
(proxy.cluster.metadata_learner) and, when a controller mutation needs a topic nobody asked about
yet, from the broker directly."""

from __future__ import annotations

import uuid

_NO_ID = bytes(16)


class TopicCache:
    """Topic name -> partition count, topic id -> name. Bounded: a flood of topic names
    cannot grow it without limit (the oldest half is dropped when full). About 200 bytes a
    topic: its name (shared with the leader cache), two dict entries, the id's 16 bytes."""

    def __init__(self, max_topics: int = 200_000) -> None:
        self.partitions: dict[str, int] = {}
        self._ids: dict[bytes, str] = {}  # the 16 bytes of a topic id → its name
        self.num_partitions_default: int | None = None  # the broker's num.partitions, once known
        self._max = max_topics
        self.generation = 0  # counts forgets and evictions: what was learned may be gone

    def put(self, name: str, partitions: int, topic_id: uuid.UUID | None = None) -> None:
        self.put_scanned(name, partitions, None if topic_id is None else topic_id.bytes)

    def put_scanned(self, name: str, partitions: int, topic_id: bytes | None) -> None:
        """As :meth:`put`, the id as the 16 bytes a response carries (all zeros: none)."""
        if name not in self.partitions and len(self.partitions) >= self._max:
            for stale in list(self.partitions)[: self._max // 2]:
                del self.partitions[stale]
            self.generation += 1
            self._ids = {i: n for i, n in self._ids.items() if n in self.partitions}
        self.partitions[name] = partitions
        if topic_id is not None and topic_id != _NO_ID:
            self._ids[topic_id] = name

    def name_of(self, topic_id: uuid.UUID) -> str | None:
        return self._ids.get(topic_id.bytes)

    def forget(self, name: str) -> None:
        if self.partitions.pop(name, None) is not None:
            self.generation += 1

    def count(self, name: str | None = None, topic_id: uuid.UUID | None = None) -> int | None:
        if name is None and topic_id is not None:
            name = self.name_of(topic_id)
        return None if name is None else self.partitions.get(name)
