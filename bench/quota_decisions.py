"""Decisions per second of QuotaManager.check_and_record / try_admit (not a test: no timing
assertions anywhere), and memory per live quota entity. Run: ``python -m bench.quota_decisions``."""

from __future__ import annotations

import gc
import time
import tracemalloc

from quotas import CONTROLLER_MUTATION_RATE, DEFAULT, PRODUCER_BYTE_RATE, QuotaManager, QuotaRule

RULES = [
    QuotaRule(DEFAULT, DEFAULT, {PRODUCER_BYTE_RATE: 1e6, CONTROLLER_MUTATION_RATE: 1e6}),
    QuotaRule("alice", "connect-*", {PRODUCER_BYTE_RATE: 5e5}),
]


def _once(
    qm: QuotaManager, calls: list[tuple[str, str]], n: int, kind: str, strict: bool, t0_ms: int
) -> float:
    m = len(calls)
    # Instants advance 1 ms every 10 decisions, so samples roll over as in real traffic.
    start = time.perf_counter()
    if strict:
        admit = qm.try_admit
        for i in range(n):
            user, client = calls[i % m]
            admit(user, client, CONTROLLER_MUTATION_RATE, 1, t0_ms + i // 10)
    else:
        check = qm.check_and_record
        for i in range(n):
            user, client = calls[i % m]
            check(user, client, kind, 1000, t0_ms + i // 10)
    return time.perf_counter() - start


def _run(label: str, qm: QuotaManager, calls: list[tuple[str, str]], n: int, kind: str, strict: bool) -> None:
    """Best of 5 runs (the machine may be shared); state carries over between runs."""
    best = min(_once(qm, calls, n, kind, strict, r * n) for r in range(5))
    print(f"{label:<48} {n / best:>12,.0f} decisions/s  ({best / n * 1e6:.2f} µs each)")


def main() -> None:
    n = 200_000
    one = [("alice", "app")]
    many = [(f"user-{i % 100}", f"client-{i}") for i in range(10_000)]
    _run("byte rate, 1 entity", QuotaManager(RULES), one, n, PRODUCER_BYTE_RATE, False)
    _run("byte rate, 10,000 entities (round robin)", QuotaManager(RULES), many, n, PRODUCER_BYTE_RATE, False)
    _run("byte rate, no rule applies", QuotaManager([]), many, n, PRODUCER_BYTE_RATE, False)
    _run("token bucket permissive, 1 entity", QuotaManager(RULES), one, n, CONTROLLER_MUTATION_RATE, False)
    _run("token bucket strict, 10,000 entities", QuotaManager(RULES), many, n, CONTROLLER_MUTATION_RATE, True)
    qm = QuotaManager(RULES)
    _once(qm, many, 10_000, PRODUCER_BYTE_RATE, False, 0)
    start = time.perf_counter()
    stats = qm.entity_stats(1_000)
    print(f"entity_stats over {len(stats):,} entities: {(time.perf_counter() - start) * 1e3:.1f} ms")
    _memory_per_entity(many)


def _memory_per_entity(calls: list[tuple[str, str]]) -> None:
    """Bytes held per live entity (windowed-rate state + entity table), by tracemalloc."""
    for kind in (PRODUCER_BYTE_RATE, CONTROLLER_MUTATION_RATE):
        gc.collect()
        tracemalloc.start()
        qm = QuotaManager(RULES)
        before = tracemalloc.get_traced_memory()[0]
        for i, (user, client) in enumerate(calls):
            qm.check_and_record(user, client, kind, 1000, i)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        print(f"memory per live entity ({kind}): {(after - before) / qm.live_entities:,.0f} bytes "
              f"({qm.live_entities:,} entities)")


if __name__ == "__main__":
    main()
