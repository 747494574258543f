"""What a proxy process sets on its own heap: the allocator's thresholds at start, and the heap
start-up made frozen out of the cyclic collector's full passes once it serves.

Both keep the event loop's cost per byte and per pass what the traffic makes it, not what the
allocator or the collector add (measured with ``make bench`` and ``python -m bench.stall``).
"""

from __future__ import annotations

import ctypes
import gc

# mallopt(3) parameters (glibc).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 8 << 20
TRIM_THRESHOLD_BYTES = 16 << 20


def tune_malloc() -> None:
    """Big blocks come from the heap and stay there, not from the kernel each time.

    The event loop reads a socket into a new bytes object of up to 256 KiB (its TLS layer into
    one of 256 KiB that it shrinks to what came), and a frame that filters must see whole is
    joined into one bytes object (a Produce of librdkafka's 1 MB batches, a Fetch response of
    several MB). glibc serves a block over its mmap threshold (128 KiB at start, raised only as
    far as the largest mmapped block freed, and never by a block shrunk in place) with mmap,
    every page of it faulted in anew and given back on free, and gives the top of its heap back
    to the kernel past its trim threshold: 60-130 page faults a MB through the proxy for Produce
    of 1 KiB records, 230-520 a MB with quotas on (frames joined), 15-25 µs a round trip over
    TLS. Blocks up to 8 MiB now come from the heap, which keeps up to 16 MiB free at its top:
    with quotas on, CPU per MB consumed 1.37 -> 0.57 ms, produced 1.14 -> 0.78 ms (bench.cpu_per_mb).
    Elsewhere than glibc, a no-op."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    except (OSError, AttributeError):
        pass


def freeze_start_up_heap() -> None:
    """Called once a proxy process serves: what start-up made and keeps (modules, the protocol
    classes, the configuration) is left out of the cyclic collector's full passes, each of which
    would otherwise scan it all, holding the event loop (about 10-15 ms a pass on its own).
    Garbage is collected first, so none of it is kept for ever; objects made later are collected
    as before."""
    gc.collect()
    gc.freeze()
