"""KIP-936 producer-id tracking: memory of one user's layered Bloom filter holding a window of
producer ids against a Python ``set`` of the same ids, its measured false-positive rate, and PID
checks per second (not a test: no assertions anywhere).

Run: ``python -m bench.producer_ids`` (about 2 minutes; ``--quick``: about 30 s, 200,000 ids).

Two kinds of ids: ``kafka`` — as a Kafka cluster allocates them (the controller hands out blocks
of 1,000 consecutive ids, starting at 0, to brokers; each broker gives its block's ids out in
order, and a new producer asks whichever broker it likes), and ``random`` — uniform 63-bit ids.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
import tracemalloc
from collections.abc import Iterator

from quotas import QuotaRule
from quotas.bloom import LayeredBloomFilter
from quotas.producer_ids import ProducerIdQuotaManager, ProducerIdSettings

USER = "tenant"
FPR = 0.001
SETTINGS = ProducerIdSettings(window_size_s=3600, layer_count=4, false_positive_rate=FPR)
WINDOW_MS = SETTINGS.window_ms
BLOCK = 1000  # Kafka's producer-id block size (ProducerIdManager)


def kafka_pids(seed: int, brokers: int = 3) -> Iterator[int]:
    """Producer ids in the order a cluster of ``brokers`` hands them out: blocks of 1,000 from a
    counter starting at 0, one current block per broker, each new producer on a random broker."""
    rng = random.Random(seed)
    next_block = 0
    current = []
    for _ in range(brokers):
        current.append([next_block * BLOCK, (next_block + 1) * BLOCK])
        next_block += 1
    while True:
        b = current[rng.randrange(brokers)]
        yield b[0]
        b[0] += 1
        if b[0] == b[1]:
            b[0], b[1] = next_block * BLOCK, (next_block + 1) * BLOCK
            next_block += 1


def random_pids(seed: int) -> Iterator[int]:
    rng = random.Random(seed)
    while True:
        yield rng.getrandbits(63)


def new_manager(quota: float) -> ProducerIdQuotaManager:
    return ProducerIdQuotaManager([QuotaRule(USER, None, {"producer_ids_rate": quota})], SETTINGS)


def fill(m: ProducerIdQuotaManager, pids: Iterator[int], n: int, batch: int) -> int:
    """``n`` new ids spread evenly over one window, ``batch`` to a request; returns the instant
    of the last request."""
    admit = m.admit
    t = 0
    for i in range(0, n, batch):
        t = i * WINDOW_MS // n
        admit(USER, tuple(next(pids) for _ in range(min(batch, n - i))), t)
    return t


def mib(b: float) -> str:
    return f"{b / 2**20:,.1f} MiB"


def memory_and_fpr(kind: str, n: int, probes: int, traced: bool) -> tuple[ProducerIdQuotaManager, int, list[int]]:
    """One user's window of ``n`` distinct ids: manager memory (tracemalloc around the filling,
    and the filter's own count of its bits), a set of the same ids, and the measured rate of
    false positives over ``probes`` ids never added."""
    make = kafka_pids if kind == "kafka" else random_pids
    m = new_manager(n)  # a quota of the whole window's ids: every one is admitted
    gc.collect()
    if traced:
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    now = fill(m, make(1), n, batch=1000)
    elapsed = time.perf_counter() - start
    if traced:
        gc.collect()
        manager_bytes = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
    stats = m.user_stats(now)[0]
    filter_bytes = stats.memory_bytes

    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    ids = set()
    add = ids.add
    pids = make(1)
    for _ in range(n):
        add(next(pids))  # fresh int objects, as a set-based tracker would hold
    set_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    table_bytes = sys.getsizeof(ids)

    bloom = m._users[USER].filter
    if kind == "kafka":
        unseen = (next(pids) for _ in range(probes))  # the ids the cluster hands out next
    else:
        rng = random.Random(936)
        unseen = (p for p in iter(lambda: rng.getrandbits(63), None) if p not in ids)
    hits = 0
    for _, p in zip(range(probes), unseen):
        hits += bloom.contains(p, now)
    measured = hits / probes
    sample = random.Random(7).sample(sorted(ids), min(100_000, n)) if kind == "kafka" else []
    del ids

    print(f"\n{kind} ids: {n:,} distinct producer ids over one {SETTINGS.window_size_s:.0f} s window, "
          f"false-positive rate {FPR} ({stats.live_layers} layers)")
    print(f"  filled through ProducerIdQuotaManager.admit in {elapsed:.1f} s"
          + (" (under tracemalloc)" if traced else ""))
    if traced:
        print(f"  manager, tracemalloc          {mib(manager_bytes):>12}  ({manager_bytes / n:.2f} bytes/id)")
    print(f"  filter memory_bytes           {mib(filter_bytes):>12}  ({filter_bytes / n:.2f} bytes/id, "
          f"{stats.bits / n:.1f} bits/id)")
    print(f"  Python set, tracemalloc       {mib(set_bytes):>12}  ({set_bytes / n:.1f} bytes/id: "
          f"table {mib(table_bytes)} + the int objects)")
    if traced:
        print(f"  set / manager (tracemalloc)   {set_bytes / manager_bytes:>12.1f}x   (target >= 10x)")
    print(f"  set / filter memory_bytes     {set_bytes / filter_bytes:>12.1f}x")
    print(f"  false positives               {measured:>12.5f}  ({hits:,} of {probes:,} ids never added; "
          f"configured {FPR}, estimated {stats.estimated_fpr:.5f})")
    return m, now, sample


def _best(fn, runs: int = 3) -> float:
    return min(fn(r) for r in range(runs))


def _report(label: str, n: int, seconds: float) -> None:
    print(f"  {label:<62} {n / seconds:>12,.0f} checks/s  ({seconds / n * 1e6:.2f} µs each)")


def throughput(
    n: int, seen_sample: list[int], filled: ProducerIdQuotaManager, filled_now: int, filled_ids: int
) -> None:
    print(f"\nPID checks per second (best of 3 runs of {n:,}; time advances 1 ms every 10 checks)")
    for kind, make in (("kafka", kafka_pids), ("random", random_pids)):
        for producers in (100, 10_000):
            m = new_manager(1_000_000)
            gen = make(2)
            pids = [next(gen) for _ in range(producers)]
            for i in range(0, producers, 100):
                m.admit(USER, tuple(pids[i:i + 100]), 0)
            requests = [(p,) for p in pids]

            def seen(r: int, m=m, requests=requests) -> float:
                admit, k = m.admit, len(requests)
                t0 = 1 + r * n // 10
                start = time.perf_counter()
                for i in range(n):
                    admit(USER, requests[i % k], t0 + i // 10)
                return time.perf_counter() - start

            best = _best(seen)
            layers = m.user_stats(1 + 3 * n // 10)[0].live_layers
            _report(f"admit, seen id ({kind}, {producers:,} producers in turn)", n, best)
            if layers > 1:
                print(f"    (the user's filter has {layers} layers after these checks, none due by time)")

    for kind, make in (("kafka", kafka_pids), ("random", random_pids)):
        m = new_manager(1_000_000)
        gen = make(3)

        def new(r: int, m=m, gen=gen) -> float:
            requests = [(next(gen),) for _ in range(n)]
            admit = m.admit
            t0 = r * n // 10
            start = time.perf_counter()
            for i in range(n):
                admit(USER, requests[i], t0 + i // 10)
            return time.perf_counter() - start

        _report(f"admit, new id admitted ({kind})", n, _best(new))

    bloom: LayeredBloomFilter = filled._users[USER].filter
    unseen_gen = random_pids(99)
    unseen = [next(unseen_gen) for _ in range(n)]
    seen_ids = (seen_sample * (n // max(1, len(seen_sample)) + 1))[:n]
    for label, ids in (("seen id", seen_ids), ("unseen id", unseen)):
        def contains(_r: int, ids=ids) -> float:
            c = bloom.contains
            start = time.perf_counter()
            for p in ids:
                c(p, filled_now)
            return time.perf_counter() - start

        _report(f"LayeredBloomFilter.contains, {label} (the {filled_ids:,}-id filter)", n, _best(contains))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="200,000 ids instead of 1,000,000; fewer probes and checks")
    args = parser.parse_args(argv)
    n = 200_000 if args.quick else 1_000_000
    probes = 50_000 if args.quick else 200_000
    checks = 50_000 if args.quick else 100_000
    print(f"Python {sys.version.split()[0]}; window {SETTINGS.window_size_s:.0f} s, {SETTINGS.layer_count} layers, "
          f"false-positive rate {FPR}")
    filled, now, sample = memory_and_fpr("kafka", n, probes, traced=True)
    memory_and_fpr("random", n, probes, traced=False)
    throughput(checks, sample, filled, now, n)


if __name__ == "__main__":
    main()
