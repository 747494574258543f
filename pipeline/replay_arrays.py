"""The replay of one (proxy, user) with its windowed rates computed over whole arrays
(pipeline.rate_arrays) instead of one engine call per event: the same charges, in the same
filter order, with the same results as :func:`pipeline.replay.run_events` (the engines event by
event), which the tests hold it to.

What still goes through the engines event by event, in time order, because a decision changes
what is charged next: the KIP-936 producer ids (a rejected Produce charges no record quota), the
KIP-599 bucket (a rejected mutation takes no tokens), and ``consumer_byte_rate`` for an entity
with a throttled Fetch (answered empty and its bytes un-recorded, so its records are not
charged either). Every other windowed rate, the bulk of the events, is computed per entity in
one pass.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from quotas import QuotaManager
from quotas.common import (
    CONSUMER_BYTE_RATE,
    CONSUMER_RECORD_RATE,
    CONTROLLER_MUTATION_RATE,
    MAX_THROTTLE_MS,
    PRODUCER_BATCH_RATE,
    PRODUCER_BYTE_RATE,
    PRODUCER_IDS_RATE,
    PRODUCER_RECORD_RATE,
    REQUEST_RATE,
)
from quotas.producer_ids import ProducerIdQuotaManager

from .frames import PandasFrame
from .kinds import ANY, FETCH, MUTATING, PRODUCE, SHARE_FETCH
from .rate_arrays import SampleWindows, sample_windows, throttles_ms

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

Held = dict[tuple[str, str], list[float]]


def run_arrays(user: str, rows: PandasFrame, quotas: QuotaManager, producer_ids: ProducerIdQuotaManager,
               limited: dict[str, set[str]], pid_rule: bool, held: Held, max_events: int) -> None:
    """Adds to ``held`` what :func:`pipeline.replay.run_events` adds: (client id, kind) →
    [throttled requests, throttle ms, rejected requests, rejected amount]."""
    import numpy as np
    import pandas as pd

    from .replay import events

    row, times, (reqs, req_bytes, resp_bytes, records, batches, mutations, new_ids) = events(rows, max_events)
    n_events = len(times)
    codes_of_rows, names = pd.factorize(rows["client_id"])
    code = codes_of_rows[row]  # the client id of each event, as an index into names
    names = [str(n) for n in names]
    apis = rows["api_key"].to_numpy()[row]
    produce, fetch = apis == PRODUCE, apis == FETCH
    fetches = fetch | (apis == SHARE_FETCH)
    throttle_any = np.zeros(n_events, dtype=np.int64)
    rejected_any = np.zeros(n_events, dtype=bool)

    def charged(kind: str, on: NDArray[np.bool_], amounts: NDArray[np.int64] | None) -> NDArray[np.bool_]:
        """The events ``kind`` charges: ``on``, a client id it limits, and a positive amount
        (any amount with None: request_rate charges every request event, as run_events does)."""
        limits = np.array([kind in limited[n] for n in names], dtype=bool)[code]
        return np.asarray(on & limits if amounts is None else on & (amounts > 0) & limits, dtype=bool)

    def present(where: NDArray[np.bool_]) -> list[int]:
        """The client ids (codes) with an event ``where``."""
        return np.flatnonzero(np.bincount(code[where], minlength=len(names))).tolist()

    def hold(kind: str, where: NDArray[np.bool_], throttle: NDArray[np.int64]) -> None:
        hit = where & (throttle > 0)
        requests = np.bincount(code[hit], weights=reqs[hit], minlength=len(names))
        ms = np.bincount(code[hit], weights=throttle[hit], minlength=len(names))
        for c in present(where):
            h = held[(names[c], kind)]
            h[0] += int(requests[c])
            h[1] += int(ms[c])

    def entities(kind: str, where: NDArray[np.bool_]) -> list[tuple[NDArray[np.bool_], float]]:
        """The events ``where`` of each entity ``kind`` charges, and its bound."""
        members: dict[object, tuple[list[int], float]] = {}
        for c in present(where):
            resolved = quotas.resolve(user, names[c], kind)
            assert resolved is not None  # limited holds only the kinds a rule gives
            members.setdefault(resolved.key, ([], resolved.quota))[0].append(c)
        return [(where & np.isin(code, cs), quota) for cs, quota in members.values()]

    def max_ms(kind: str) -> int:
        return quotas.request_max_throttle_ms if kind == REQUEST_RATE else MAX_THROTTLE_MS

    known: dict[bytes, SampleWindows] = {}

    def windows(mine: NDArray[np.bool_]) -> SampleWindows:
        """The samples of the events ``mine``, shared by every kind that charges just those
        (keyed by a digest: a user's entities may be many, each mask as long as its events)."""
        key = hashlib.blake2b(np.packbits(mine).tobytes(), digest_size=16).digest()
        if key not in known:
            known[key] = sample_windows(times[mine], quotas.quota_window_num, quotas.quota_window_size_ms)
        return known[key]

    # -- first what later charges depend on -------------------------------------------------
    rejected_pid = np.zeros(n_events, dtype=bool)
    if pid_rule:
        next_pid = 0
        for i in np.flatnonzero(produce & (new_ids > 0)).tolist():
            decision = producer_ids.admit(user, range(next_pid, next_pid + int(new_ids[i])), int(times[i]))
            next_pid += int(new_ids[i])
            rejected_pid[i] = _decided(held[(names[code[i]], PRODUCER_IDS_RATE)], int(reqs[i]), decision.admitted,
                                       decision.throttle_ms, float(new_ids[i]))
            throttle_any[i] = max(throttle_any[i], decision.throttle_ms)
    mutating = np.isin(apis, sorted(MUTATING))
    for i in np.flatnonzero(charged(CONTROLLER_MUTATION_RATE, mutating, mutations)).tolist():
        cid = names[code[i]]
        decision = quotas.try_admit(user, cid, CONTROLLER_MUTATION_RATE, int(mutations[i]), int(times[i]))
        rejected_any[i] = _decided(held[(cid, CONTROLLER_MUTATION_RATE)], int(reqs[i]), decision.admitted,
                                   decision.throttle_ms, float(mutations[i]))
        throttle_any[i] = max(throttle_any[i], decision.throttle_ms)
    # consumer_byte_rate: a throttled Fetch is answered empty and its bytes un-recorded
    # (KafkaApis), so what each Fetch leaves recorded depends on the decisions before it.
    where = charged(CONSUMER_BYTE_RATE, fetches, resp_bytes)
    throttle = np.zeros(n_events, dtype=np.int64)
    for mine, quota in entities(CONSUMER_BYTE_RATE, where):
        throttle[mine] = _unrecording(times[mine], resp_bytes[mine], fetch[mine], quota, quotas, windows(mine))
    hold(CONSUMER_BYTE_RATE, where, throttle)
    np.maximum(throttle_any, throttle, out=throttle_any)
    emptied = (throttle > 0) & fetch

    # -- the windowed rates nothing else depends on, per entity at once ---------------------
    for kind, on, amounts, positive in (
        (REQUEST_RATE, np.ones(n_events, dtype=bool), reqs, False),
        (PRODUCER_BYTE_RATE, produce, req_bytes, True),
        (PRODUCER_RECORD_RATE, produce & ~rejected_pid, records, True),
        (PRODUCER_BATCH_RATE, produce & ~rejected_pid, batches, True),
        (CONSUMER_RECORD_RATE, fetches & ~emptied, records, True),
    ):
        where = charged(kind, on, amounts if positive else None)
        if not where.any():
            continue
        throttle = np.zeros(n_events, dtype=np.int64)
        for mine, quota in entities(kind, where):
            throttle[mine] = throttles_ms(times[mine], amounts[mine], quota, quotas.quota_window_num,
                                          quotas.quota_window_size_ms, max_ms(kind), windows=windows(mine))
        hold(kind, where, throttle)
        np.maximum(throttle_any, throttle, out=throttle_any)

    rejected_any |= rejected_pid
    throttled = np.bincount(code, weights=np.where(throttle_any > 0, reqs, 0), minlength=len(names))
    ms = np.bincount(code, weights=throttle_any, minlength=len(names))
    rejected = np.bincount(code, weights=np.where(rejected_any, reqs, 0), minlength=len(names))
    for c in range(len(names)):  # every client id of the rows has events
        h = held[(names[c], ANY)]
        h[0] += int(throttled[c])
        h[1] += int(ms[c])
        h[2] += int(rejected[c])
        h[3] += float(rejected[c])


def _decided(h: list[float], requests: int, admitted: bool, throttle_ms: int, amount: float) -> bool:
    """Adds one decided event to its [throttled requests, throttle ms, rejected requests,
    rejected amount]; True when it was rejected."""
    if throttle_ms:
        h[0] += requests
        h[1] += throttle_ms
    if not admitted:
        h[2] += requests
        h[3] += amount
    return not admitted


MAX_ROUNDS = 64  # of the fixed point below, before the engine takes over


def _unrecording(times: NDArray[np.int64], amounts: NDArray[np.int64], fetch: NDArray[np.bool_], quota: float,
                 quotas: QuotaManager, windows: SampleWindows) -> NDArray[np.int64]:
    """One ``consumer_byte_rate`` entity's throttles, a throttled Fetch taking its bytes back.

    What each event leaves recorded is the unique solution of "0 for a throttled Fetch, its
    amount otherwise", each decision depending only on the events before it; every round
    recomputes all decisions from the last round's answer, which makes at least the first wrong
    one right, so the rounds end at that solution. A sequence that needs more than
    ``MAX_ROUNDS`` goes event by event through the engine's own windowed rate."""
    import numpy as np

    kept = amounts
    for _ in range(MAX_ROUNDS):
        throttle = throttles_ms(times, amounts, quota, quotas.quota_window_num, quotas.quota_window_size_ms,
                                kept=kept, windows=windows)
        answer = np.where((throttle > 0) & fetch, 0, amounts)
        if np.array_equal(answer, kept):
            return throttle
        kept = answer
    from quotas.rate import WindowedRate

    rate = WindowedRate(quotas.quota_window_num, quotas.quota_window_size_ms)
    out = np.zeros(len(times), dtype=np.int64)
    for i, (now, amount, is_fetch) in enumerate(zip(times.tolist(), amounts.tolist(), fetch.tolist())):
        out[i] = rate.record_and_throttle_at(float(amount), quota, now)
        if out[i] and is_fetch:
            rate.unrecord_at(float(amount), now)
    return out
