"""Bloom filters over 64-bit producer ids, and KIP-936's time-layered Bloom filter.

Pure: time is an argument. A :class:`LayeredBloomFilter` is a list of :class:`Layer` (a Bloom
filter stamped with when it was opened and last written) managed by a :class:`LayerPolicy`
of three small pieces, after KIP-936's use of commons-collections' ``LayerManager``:

* ``extend_check`` — when to open a new layer: none yet, the newest is ``window / layer_count``
  old, or the newest is full;
* ``build`` — how to make one: a filter of the policy's shape, stamped now, grown when the
  previous layer held more distinct ids than that shape expects;
* ``cleanup`` — when to drop one: once its last write is a whole window old.

An id seen again is re-added to the newest layer, so every layer holds the ids active during
its span, not only the new ones: with more long-lived producers than a layer's share of the
quota, fixed-size layers would fill and close one after another at the request rate. So a
layer that filled up is followed by one twice its size, and a layer that closed on time by one
sized for what it held (plus a quarter), never less than the policy's shape and never more than
``max_expected``; re-adding an id the layer already has does not count towards filling it.

Layers are dropped by their last write, not their opening time (commons' ``TimestampedBloomFilter``
expires at creation + ttl): otherwise an id added late in a layer's span would be forgotten
before a whole window had passed, and the filter would report it as new while the quota still
counts it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

_MASK64 = (1 << 64) - 1
# An odd multiplier keeps the second hash odd; with a power-of-two-free bit count any odd step
# visits distinct positions (Kirsch-Mitzenmacher double hashing).
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: a bijection on 64 bits that spreads sequential ids apart."""
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def item_hashes(item: int) -> tuple[int, int]:
    """The two 64-bit hashes double hashing derives every position from."""
    h1 = _mix64(item & _MASK64)
    return h1, _mix64(h1) | 1


@functools.lru_cache(maxsize=1024)
def shape_for(expected: int, fpr: float) -> BloomShape:
    """:meth:`BloomShape.for_items`, the same object for the same arguments."""
    return BloomShape.for_items(expected, fpr)


@dataclass(frozen=True, slots=True)
class BloomShape:
    """``bits`` and ``hashes`` for ``expected`` items at false-positive rate ``fpr``."""

    expected: int
    fpr: float
    bits: int
    hashes: int

    @classmethod
    def for_items(cls, expected: int, fpr: float) -> BloomShape:
        """The textbook optimum (commons' ``Shape.fromNP``): m = −n·ln p / ln²2, k = m/n · ln 2."""
        if expected < 1:
            raise ValueError(f"expected items must be at least 1, got {expected!r}")
        if not 0 < fpr < 1:
            raise ValueError(f"false-positive rate must be in (0, 1), got {fpr!r}")
        bits = max(8, math.ceil(-expected * math.log(fpr) / (math.log(2) ** 2)))
        hashes = max(1, round(bits / expected * math.log(2)))
        return cls(expected, fpr, bits, hashes)

    def positions(self, item: int) -> list[int]:
        """The ``hashes`` bit positions of a 64-bit item (negative ids wrap to 64 bits)."""
        return self.positions_for(*item_hashes(item))

    def positions_for(self, h1: int, h2: int) -> list[int]:
        """Positions from an item's two hashes (:func:`item_hashes`), so an item hashed once can
        be looked up in filters of several shapes."""
        m = self.bits
        return [(h1 + i * h2) % m for i in range(self.hashes)]

    def fpr_at(self, bits_set: int) -> float:
        """Estimated false-positive rate with ``bits_set`` of ``bits`` set: (X / m)^k."""
        return (bits_set / self.bits) ** self.hashes


class BloomFilter:
    """A plain Bloom filter: bits in a ``bytearray``, ``count`` the items added to it."""

    __slots__ = ("shape", "bits", "count")

    def __init__(self, shape: BloomShape) -> None:
        self.shape = shape
        self.bits = bytearray((shape.bits + 7) // 8)
        self.count = 0

    def contains_positions(self, positions: Iterable[int]) -> bool:
        bits = self.bits
        for p in positions:
            if not bits[p >> 3] & (1 << (p & 7)):
                return False
        return True

    def add_positions(self, positions: Iterable[int]) -> None:
        bits = self.bits
        for p in positions:
            bits[p >> 3] |= 1 << (p & 7)
        self.count += 1

    def __contains__(self, item: int) -> bool:
        return self.contains_positions(self.shape.positions(item))

    def add(self, item: int) -> None:
        self.add_positions(self.shape.positions(item))

    @property
    def is_full(self) -> bool:
        return self.count >= self.shape.expected

    def bits_set(self) -> int:
        return int.from_bytes(self.bits, "little").bit_count()

    @property
    def memory_bytes(self) -> int:
        return len(self.bits)


# Ids known to be in a layer, kept exactly for the newest layer so that a producer seen again
# (the common case) costs a set lookup instead of hashing; bounded, cleared when full.
_CONFIRMED_MAX = 4096
# The largest layer a policy grows to (about 2.2 MB at a per-layer false-positive rate of 0.025%).
MAX_LAYER_IDS = 1 << 20


class Layer:
    """One time layer: a Bloom filter, when it was opened and last written, and the policy shape
    it was built under (its own shape may be larger)."""

    __slots__ = ("filter", "opened_ms", "last_write_ms", "confirmed", "base")

    def __init__(self, bloom: BloomFilter, now_ms: int, base: BloomShape | None = None) -> None:
        self.filter = bloom
        self.opened_ms = now_ms
        self.last_write_ms = now_ms
        self.confirmed: set[int] = set()
        self.base = base or bloom.shape

    def confirm(self, item: int) -> None:
        confirmed = self.confirmed
        if len(confirmed) >= _CONFIRMED_MAX:
            confirmed.clear()
        confirmed.add(item)


@dataclass(frozen=True, slots=True)
class LayerPolicy:
    """When to add a layer, how to build one, when to drop one (KIP-936's three pieces)."""

    window_ms: int
    layer_count: int
    shape: BloomShape
    max_expected: int = MAX_LAYER_IDS

    @property
    def layer_span_ms(self) -> float:
        return self.window_ms / self.layer_count

    def extend_check(self, layers: list[Layer], now_ms: int) -> bool:
        """A new layer is due: there is none, the newest has had its time, is full, or was
        built under another policy shape (the quota changed)."""
        if not layers:
            return True
        newest = layers[-1]
        return (now_ms - newest.opened_ms >= self.layer_span_ms or newest.filter.is_full
                or newest.base is not self.shape)

    def build(self, now_ms: int, previous: Layer | None = None) -> Layer:
        """A layer of the policy's shape, or larger when ``previous`` held more than that."""
        base = self.shape
        expected = base.expected
        if previous is not None and previous.base is base:
            held = previous.filter.count
            if previous.filter.is_full and now_ms - previous.opened_ms < self.layer_span_ms:
                expected = max(expected, 2 * previous.filter.shape.expected)  # it filled up early
            elif held > expected:
                expected = math.ceil(held * 1.25)
            expected = min(expected, max(self.max_expected, base.expected))
        shape = base if expected == base.expected else shape_for(expected, base.fpr)
        return Layer(BloomFilter(shape), now_ms, base)

    def cleanup(self, layers: list[Layer], now_ms: int) -> list[Layer]:
        """The layers still holding an id written within the window (oldest first)."""
        window_ms = self.window_ms
        return [layer for layer in layers if now_ms - layer.last_write_ms < window_ms]

    def next_cleanup_ms(self, layers: list[Layer]) -> int | None:
        """When the oldest layer will be due for dropping (None: no layers)."""
        return min(layer.last_write_ms for layer in layers) + self.window_ms if layers else None


class LayeredBloomFilter:
    """The producer ids one user was seen with during the last window.

    :meth:`track` answers "seen in the window?" and makes sure the id is in the newest layer, so
    an id that keeps appearing is never forgotten however many layers rotate past.
    """

    __slots__ = ("policy", "layers")

    def __init__(self, policy: LayerPolicy) -> None:
        self.policy = policy
        self.layers: list[Layer] = []

    def cleanup(self, now_ms: int) -> None:
        layers = self.layers
        # Only the newest layer is written, so the first layer has the oldest last write.
        if layers and now_ms - layers[0].last_write_ms >= self.policy.window_ms:
            self.layers = self.policy.cleanup(layers, now_ms)

    def contains(self, item: int, now_ms: int) -> bool:
        """Seen within the window (no false negatives; false positives at the shape's rate)."""
        self.cleanup(now_ms)
        return _in_any(self.layers, item_hashes(item))

    def track(self, item: int, now_ms: int) -> bool:
        """Records ``item`` as seen now; True if it had been seen within the window."""
        if self.refresh(item, now_ms):
            return True
        self._add(item, item_hashes(item), now_ms)
        return False

    def refresh(self, item: int, now_ms: int) -> bool:
        """If ``item`` was seen within the window: makes sure the newest layer has it and returns
        True. Otherwise changes nothing and returns False."""
        self.cleanup(now_ms)
        layers = self.layers
        if not layers:
            return False
        newest = layers[-1]
        if item in newest.confirmed and not self.policy.extend_check(layers, now_ms):
            newest.last_write_ms = now_ms
            return True
        hashes = item_hashes(item)
        if not _in_any(layers, hashes):
            return False
        # Re-added to the newest layer even when an older one has it: KIP-936, rejected
        # alternative 8 ("ensure that the PID is listed in a filter after the oldest one").
        self._add(item, hashes, now_ms)
        return True

    def _add(self, item: int, hashes: tuple[int, int], now_ms: int) -> None:
        layers = self.layers
        policy = self.policy
        if policy.extend_check(layers, now_ms):
            layers.append(policy.build(now_ms, layers[-1] if layers else None))
        newest = layers[-1]
        if item not in newest.confirmed:
            bloom = newest.filter
            positions = bloom.shape.positions_for(*hashes)
            if not bloom.contains_positions(positions):  # only a new id counts towards full
                bloom.add_positions(positions)
            newest.confirm(item)
        newest.last_write_ms = now_ms

    @property
    def live_layers(self) -> int:
        return len(self.layers)

    def bits_set(self) -> int:
        return sum(layer.filter.bits_set() for layer in self.layers)

    def estimated_fpr(self) -> float:
        """Chance an unseen id is taken for seen: 1 − Π(1 − fpr of each layer)."""
        miss = 1.0
        for layer in self.layers:
            miss *= 1.0 - layer.filter.shape.fpr_at(layer.filter.bits_set())
        return 1.0 - miss

    @property
    def memory_bytes(self) -> int:
        return sum(layer.filter.memory_bytes for layer in self.layers)


def _in_any(layers: list[Layer], hashes: tuple[int, int]) -> bool:
    """Whether any layer holds the item with these hashes (layers of one shape share positions)."""
    shape = positions = None
    for layer in layers:
        bloom = layer.filter
        if bloom.shape is not shape:
            shape = bloom.shape
            positions = shape.positions_for(*hashes)
        # positions is set on the first layer (shape starts as None, a layer's shape never is).
        if bloom.contains_positions(positions):  # type: ignore[arg-type]
            return True
    return False
