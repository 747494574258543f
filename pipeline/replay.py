"""What-if replay: a candidate configuration's quotas, applied to the recorded demand by the
proxy's own engines (``quotas.QuotaManager``, ``quotas.producer_ids.ProducerIdQuotaManager``,
built by ``config.engines`` exactly as the proxy builds them).

Each (proxy, user)'s usage rows are replayed in time order, all through one set of fresh engines
(state per user and per (user, client id) lives in the same engines, as in the proxy). A row's
requests are spread evenly over its interval as up to ``max_events`` events that split its
amounts; each event is
charged as the proxy charges a request, in the proxy's filter order:

- every request: ``request_rate``;
- Produce: ``producer_byte_rate``, then the new producer ids (``producer_ids_rate``; a rejected
  request charges no record quota), then ``producer_record_rate`` and ``producer_batch_rate``;
- Fetch response: ``consumer_byte_rate`` (a throttled one is emptied and un-recorded, as in
  ``KafkaApis``, so its records are not charged either), then ``consumer_record_rate``;
- ShareFetch response: the same, except that a throttled one is delivered (the proxy never
  empties a share fetch, whose records the broker acquired), so its records are charged;
- CreateTopics, CreatePartitions, DeleteTopics: ``controller_mutation_rate``, strict (KIP-599).

The replay is open loop: a throttled or rejected client is assumed to send what it sent
anyway, so the counts say how much of the demand the candidate quotas would have held back,
not how the clients would have reacted.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING

import yaml

from config.engines import producer_id_manager_for, quota_manager_for
from config.loader import parse_config
from config.model import Config
from quotas import QuotaManager
from quotas.common import (
    CONSUMER_BYTE_RATE,
    CONSUMER_RECORD_RATE,
    CONTROLLER_MUTATION_RATE,
    PRODUCER_BATCH_RATE,
    PRODUCER_BYTE_RATE,
    PRODUCER_IDS_RATE,
    PRODUCER_RECORD_RATE,
    REQUEST_RATE,
)
from quotas.entities import EntityResolver
from quotas.producer_ids import ProducerIdQuotaManager
from usage.schema import OTHER

from .frames import PandasFrame
from .groups import per_group, tasks_for
from .kinds import ANY as ANY
from .kinds import DEMAND, FETCH, MUTATING, PER_WINDOW, PRODUCE, SHARE_FETCH
from .replay_arrays import run_arrays

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray
    from pyspark.sql import DataFrame

REPLAY_SCHEMA = (
    "proxy string, user string, client_id string, kind string, requests long, demand double, "
    "throttled_requests long, throttle_time_ms double, rejected_requests long, rejected_amount double"
)
_AMOUNTS = ("requests", "request_bytes", "response_bytes", "records", "batches", "partition_mutations",
            "new_producer_ids")
REPLAY_COLUMNS = ("interval_start", "interval_seconds", "client_id", "api_key", *_AMOUNTS)
ReplayRow = tuple[str | float, ...]  # a row of REPLAY_SCHEMA


@lru_cache(maxsize=4)
def candidate(config_yaml: str) -> Config:
    """The configuration a replay applies (parsed once per worker process)."""
    return parse_config(yaml.safe_load(config_yaml), filters=False)  # the proxy's filters: not its to load


@lru_cache(maxsize=4)
def candidate_rules(config_yaml: str) -> EntityResolver:
    """The candidate's quotas indexed once per worker process: every user's fresh engines share
    it (indexing thousands of rules per user was most of the replay's time)."""
    return EntityResolver(candidate(config_yaml).quotas)


def events(rows: PandasFrame, max_events: int
           ) -> tuple[NDArray[np.intp], NDArray[np.int64], list[NDArray[np.int64]]]:
    """The events of ``rows`` (a pandas DataFrame with ``REPLAY_COLUMNS``; interval_start in epoch
    ms) in time order: (row index, time ms, and each of ``_AMOUNTS`` as this event's share).

    A row with n requests becomes min(n, max_events) events (at least one) at the middles of
    equal slices of its interval; each amount is split in whole parts, the first ones larger.
    """
    import numpy as np

    n = np.clip(rows["requests"].to_numpy(np.int64), 1, max_events)
    row = np.repeat(np.arange(len(n)), n)
    k = np.arange(len(row)) - np.repeat(np.cumsum(n) - n, n)
    per = n[row]
    span_ms = rows["interval_seconds"].to_numpy(np.int64)[row] * 1000
    t = rows["interval_start"].to_numpy(np.int64)[row] + (2 * k + 1) * span_ms // (2 * per)
    shares = []
    for column in _AMOUNTS:
        amount = rows[column].to_numpy(np.int64)[row]
        shares.append(amount // per + (k < amount % per))
    order = np.lexsort((row, t))
    return row[order], t[order], [a[order] for a in shares]


_CHARGES = {**DEMAND, **PER_WINDOW}  # kind → the usage column it charges, and on which APIs


def _demand(rows: PandasFrame) -> dict[tuple[str, str], list[float]]:
    """(client_id, kind) → [requests, demand] straight from the rows (quota or not): for each
    kind, the rows of its APIs with some of its amount."""
    import numpy as np
    import pandas as pd

    codes, names = pd.factorize(rows["client_id"])
    n = len(names)
    api = rows["api_key"].to_numpy()
    requests = rows["requests"].to_numpy(np.int64)
    out: dict[tuple[str, str], list[float]] = {}
    for kind, (column, apis) in _CHARGES.items():
        amount = rows[column].to_numpy(np.int64)
        on = amount > 0 if apis is None else np.isin(api, sorted(apis)) & (amount > 0)
        present = np.bincount(codes[on], minlength=n)
        asked = np.bincount(codes[on], weights=requests[on], minlength=n)  # whole numbers below 2**53: exact
        total = np.bincount(codes[on], weights=amount[on], minlength=n)
        for c in np.flatnonzero(present).tolist():
            out[(str(names[c]), kind)] = [int(asked[c]), float(total[c])]
    every = np.bincount(codes, weights=requests, minlength=n)
    for c in range(n):
        out[(str(names[c]), ANY)] = [int(every[c]), float(every[c])]
    return out


def replay_user(proxy: str, user: str, rows: PandasFrame, config: Config, max_events: int = 10,
                arrays: bool = True, rules: EntityResolver | None = None) -> list[ReplayRow]:
    """Replays one (proxy, user)'s usage rows (a pandas DataFrame with ``REPLAY_COLUMNS``;
    interval_start in epoch ms) through fresh engines built from ``config``. Rows out match
    ``REPLAY_SCHEMA``: every (client id, kind) with demand, and (client id, "(any)"). With
    ``arrays`` (the default), the windowed rates are computed per entity over whole arrays
    (pipeline.replay_arrays); without, every event goes through the engines (:func:`run_events`):
    the same results, which the tests compare. ``rules``: ``config.quotas`` already indexed."""
    quotas = quota_manager_for(config, rules)
    producer_ids = producer_id_manager_for(config, rules)
    demand = _demand(rows)
    held: dict[tuple[str, str], list[float]] = {key: [0, 0.0, 0, 0.0] for key in demand}
    # Which quotas apply to each client id of this user (the engines answer ADMIT for the rest).
    pid_rule = producer_ids.resolve(user) is not None
    limited = {cid: {k for k in _CHARGES if k != PRODUCER_IDS_RATE and quotas.resolve(user, cid, k)}
               for cid in rows["client_id"].unique()}
    if any(limited.values()) or pid_rule:
        run = run_arrays if arrays else run_events
        run(user, rows, quotas, producer_ids, limited, pid_rule, held, max_events)
    return [(proxy, user, cid, kind, req, amount, *held[(cid, kind)])
            for (cid, kind), (req, amount) in sorted(demand.items())]


def run_events(user: str, rows: PandasFrame, quotas: QuotaManager, producer_ids: ProducerIdQuotaManager,
                limited: dict[str, set[str]], pid_rule: bool, held: dict[tuple[str, str], list[float]],
                max_events: int) -> None:
    """Charges every event in time order, in the proxy's filter order; adds to ``held``:
    (client id, kind) → [throttled requests, throttle ms, rejected requests, rejected amount]."""
    row, times, (reqs, req_bytes, resp_bytes, records, batches, mutations, new_ids) = events(rows, max_events)
    client_ids = rows["client_id"].to_numpy()[row].tolist()
    api_keys = rows["api_key"].to_numpy()[row].tolist()
    check = quotas.check_and_record
    next_pid = 0

    def hold(cid: str, kind: str, n: int, throttle_ms: int, rejected: float = 0.0) -> None:
        h = held[(cid, kind)]
        if throttle_ms:
            h[0] += n
            h[1] += throttle_ms
        if rejected:
            h[2] += n
            h[3] += rejected

    for i, (now, n) in enumerate(zip(times.tolist(), reqs.tolist())):
        cid, api = client_ids[i], api_keys[i]
        kinds = limited[cid]
        throttle, rejected = 0, 0.0
        if REQUEST_RATE in kinds:
            throttle = check(user, cid, REQUEST_RATE, n, now).throttle_ms
            hold(cid, REQUEST_RATE, n, throttle)
        if api == PRODUCE:
            if PRODUCER_BYTE_RATE in kinds and req_bytes[i]:
                t = check(user, cid, PRODUCER_BYTE_RATE, int(req_bytes[i]), now).throttle_ms
                hold(cid, PRODUCER_BYTE_RATE, n, t)
                throttle = max(throttle, t)
            if pid_rule and new_ids[i]:
                ids = range(next_pid, next_pid + int(new_ids[i]))
                next_pid += int(new_ids[i])
                decision = producer_ids.admit(user, ids, now)
                if not decision.admitted:
                    rejected = float(new_ids[i])
                hold(cid, PRODUCER_IDS_RATE, n, decision.throttle_ms, rejected)
                throttle = max(throttle, decision.throttle_ms)
            if not rejected:  # a rejected Produce is not shown to the record limiters
                for kind, amounts in ((PRODUCER_RECORD_RATE, records), (PRODUCER_BATCH_RATE, batches)):
                    if kind in kinds and amounts[i]:
                        t = check(user, cid, kind, int(amounts[i]), now).throttle_ms
                        hold(cid, kind, n, t)
                        throttle = max(throttle, t)
        elif api == FETCH or api == SHARE_FETCH:
            t = 0
            if CONSUMER_BYTE_RATE in kinds and resp_bytes[i]:
                t = check(user, cid, CONSUMER_BYTE_RATE, int(resp_bytes[i]), now).throttle_ms
                hold(cid, CONSUMER_BYTE_RATE, n, t)
                if t and api == FETCH:  # KafkaApis: answered empty, its bytes un-recorded, no records
                    quotas.unrecord(user, cid, CONSUMER_BYTE_RATE, int(resp_bytes[i]), now)
                throttle = max(throttle, t)
            emptied = t and api == FETCH
            if not emptied and CONSUMER_RECORD_RATE in kinds and records[i]:
                t = check(user, cid, CONSUMER_RECORD_RATE, int(records[i]), now).throttle_ms
                hold(cid, CONSUMER_RECORD_RATE, n, t)
                throttle = max(throttle, t)
        elif api in MUTATING and CONTROLLER_MUTATION_RATE in kinds and mutations[i]:
            decision = quotas.try_admit(user, cid, CONTROLLER_MUTATION_RATE, int(mutations[i]), now)
            if not decision.admitted:
                rejected = float(mutations[i])
            hold(cid, CONTROLLER_MUTATION_RATE, n, decision.throttle_ms, rejected)
            throttle = max(throttle, decision.throttle_ms)
        hold(cid, ANY, n, throttle, float(n) if rejected else 0.0)


EVENT_ORDER = ("interval_start", "client_id", "api_key")  # of one user's rows, as replay_user takes them


def replay(usage: DataFrame, config_yaml: str, max_events: int = 10, rows: int | None = None) -> DataFrame:
    """The replay as a DataFrame (``REPLAY_SCHEMA``): the (proxy, user)s spread over tasks, each
    user's rows sorted by Spark and replayed whole (:func:`pipeline.groups.per_group`), one user
    at a time in a worker's memory (``rows``: about how many usage rows, for the tasks)."""
    from pyspark.sql import functions as F

    candidate(config_yaml)  # a bad file fails here, on the driver, not in every task

    def build() -> Callable[[PandasFrame], list[ReplayRow]]:
        config, rules = candidate(config_yaml), candidate_rules(config_yaml)
        return lambda rows: replay_user(rows["proxy"].iat[0], rows["user"].iat[0], rows, config, max_events,
                                        rules=rules)

    cols = [F.col(c) for c in REPLAY_COLUMNS if c != "interval_start"]
    # An (other) row sums many principals: no single entity's quota applies to it.
    return per_group(usage.where(F.col("user") != OTHER)
                     .select("proxy", "user", F.unix_millis("interval_start").alias("interval_start"), *cols),
                     ("proxy", "user"), EVENT_ORDER, tasks_for(usage, rows), build, REPLAY_SCHEMA)
