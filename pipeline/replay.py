"""What-if replay: a candidate configuration's quotas, applied to the recorded demand by the
proxy's own engines (``quotas.QuotaManager``, ``quotas.producer_ids.ProducerIdQuotaManager``,
built by ``config.engines`` exactly as the proxy builds them).

Each (proxy, user)'s usage rows are replayed in time order, in one group (state per user and
per (user, client id) lives in the same engines, as in the proxy). A row's requests are spread
evenly over its interval as up to ``max_events`` events that split its amounts; each event is
charged as the proxy charges a request, in the proxy's filter order:

- every request: ``request_rate``;
- Produce: ``producer_byte_rate``, then the new producer ids (``producer_ids_rate``; a rejected
  request charges no record quota), then ``producer_record_rate`` and ``producer_batch_rate``;
- Fetch response: ``consumer_byte_rate`` (a throttled one is emptied and un-recorded, as in
  ``KafkaApis``, so its records are not charged either), then ``consumer_record_rate``;
- CreateTopics, CreatePartitions, DeleteTopics: ``controller_mutation_rate``, strict (KIP-599).

The replay is open loop: a throttled or rejected client is assumed to send what it sent
anyway, so the counts say how much of the demand the candidate quotas would have held back,
not how the clients would have reacted.
"""

from __future__ import annotations

from functools import lru_cache

import yaml

from config.engines import producer_id_manager_for, quota_manager_for
from config.loader import parse_config
from quotas.common import (
    CONSUMER_BYTE_RATE, CONSUMER_RECORD_RATE, CONTROLLER_MUTATION_RATE, PRODUCER_BATCH_RATE,
    PRODUCER_BYTE_RATE, PRODUCER_IDS_RATE, PRODUCER_RECORD_RATE, REQUEST_RATE,
)

from .kinds import CREATE_PARTITIONS, CREATE_TOPICS, DELETE_TOPICS, FETCH, PRODUCE

ANY = "(any)"  # a request held back by any quota
REPLAY_SCHEMA = (
    "proxy string, user string, client_id string, kind string, requests long, demand double, "
    "throttled_requests long, throttle_time_ms double, rejected_requests long, rejected_amount double"
)
REPLAY_COLUMNS = ("interval_start", "interval_seconds", "client_id", "api_key", "requests", "request_bytes",
                  "response_bytes", "records", "batches", "partition_mutations", "new_producer_ids")
_MUTATING = frozenset({CREATE_TOPICS, DELETE_TOPICS, CREATE_PARTITIONS})


@lru_cache(maxsize=4)
def candidate(config_yaml: str):
    """The configuration a replay applies (parsed once per worker process)."""
    return parse_config(yaml.safe_load(config_yaml))


def _split(amount: int, n: int, k: int) -> int:
    """Event k's share of ``amount`` split into ``n`` integer parts (the first ones larger)."""
    base, extra = divmod(int(amount), n)
    return base + (1 if k < extra else 0)


def events(rows, max_events: int):
    """(time_ms, order, client_id, api_key, requests, request_bytes, response_bytes, records,
    batches, mutations, new_producer_ids) for every event of ``rows``, in time order."""
    out = []
    for i, r in enumerate(rows):
        start_ms = int(r["interval_start"])
        span_ms = int(r["interval_seconds"]) * 1000
        requests = int(r["requests"])
        n = max(1, min(requests, max_events))
        amounts = [int(r[c]) for c in ("requests", "request_bytes", "response_bytes", "records", "batches",
                                         "partition_mutations", "new_producer_ids")]
        for k in range(n):
            t = start_ms + (2 * k + 1) * span_ms // (2 * n)
            out.append((t, i, r["client_id"], int(r["api_key"]), *(_split(a, n, k) for a in amounts)))
    out.sort(key=lambda e: (e[0], e[1]))
    return out


class _Tally:
    __slots__ = ("requests", "demand", "throttled", "throttle_ms", "rejected", "rejected_amount")

    def __init__(self) -> None:
        self.requests = self.throttled = self.rejected = 0
        self.demand = self.throttle_ms = self.rejected_amount = 0.0


def replay_user(proxy: str, user: str, rows, config, max_events: int = 10) -> list[tuple]:
    """Replays one (proxy, user)'s usage rows (dicts with ``REPLAY_COLUMNS``; interval_start in
    epoch ms) through fresh engines built from ``config``. Rows out match ``REPLAY_SCHEMA``."""
    quotas = quota_manager_for(config)
    producer_ids = producer_id_manager_for(config)
    tallies: dict[tuple[str, str], _Tally] = {}
    next_pid = 0

    def tally(client_id: str, kind: str, amount: float, requests: int, throttle_ms: int = 0,
              rejected: bool = False) -> None:
        t = tallies.get((client_id, kind))
        if t is None:
            t = tallies[(client_id, kind)] = _Tally()
        t.requests += requests
        t.demand += amount
        if throttle_ms:
            t.throttled += requests
            t.throttle_ms += throttle_ms
        if rejected:
            t.rejected += requests
            t.rejected_amount += amount

    for (now, _, client_id, api_key, requests, req_bytes, resp_bytes, records, batches, mutations,
         new_pids) in events(rows, max_events):
        throttle = quotas.check_and_record(user, client_id, REQUEST_RATE, requests, now).throttle_ms
        tally(client_id, REQUEST_RATE, requests, requests, throttle)
        rejected = False
        if api_key == PRODUCE:
            t = quotas.check_and_record(user, client_id, PRODUCER_BYTE_RATE, req_bytes, now).throttle_ms
            tally(client_id, PRODUCER_BYTE_RATE, req_bytes, requests, t)
            throttle = max(throttle, t)
            if new_pids:
                ids = range(next_pid, next_pid + new_pids)
                next_pid += new_pids
                decision = producer_ids.admit(user, ids, now)
                rejected = not decision.admitted
                tally(client_id, PRODUCER_IDS_RATE, new_pids, requests, decision.throttle_ms, rejected)
                throttle = max(throttle, decision.throttle_ms)
            if not rejected:
                for kind, amount in ((PRODUCER_RECORD_RATE, records), (PRODUCER_BATCH_RATE, batches)):
                    t = quotas.check_and_record(user, client_id, kind, amount, now).throttle_ms
                    tally(client_id, kind, amount, requests, t)
                    throttle = max(throttle, t)
        elif api_key == FETCH:
            t = quotas.check_and_record(user, client_id, CONSUMER_BYTE_RATE, resp_bytes, now).throttle_ms
            tally(client_id, CONSUMER_BYTE_RATE, resp_bytes, requests, t)
            throttle = max(throttle, t)
            if t:
                quotas.unrecord(user, client_id, CONSUMER_BYTE_RATE, resp_bytes, now)
            else:
                t = quotas.check_and_record(user, client_id, CONSUMER_RECORD_RATE, records, now).throttle_ms
                tally(client_id, CONSUMER_RECORD_RATE, records, requests, t)
                throttle = max(throttle, t)
        elif api_key in _MUTATING and mutations:
            decision = quotas.try_admit(user, client_id, CONTROLLER_MUTATION_RATE, mutations, now)
            rejected = not decision.admitted
            tally(client_id, CONTROLLER_MUTATION_RATE, mutations, requests, decision.throttle_ms, rejected)
            throttle = max(throttle, decision.throttle_ms)
        tally(client_id, ANY, requests, requests, throttle, rejected)
    return [
        (proxy, user, client_id, kind, t.requests, t.demand, t.throttled, t.throttle_ms, t.rejected,
         t.rejected_amount)
        for (client_id, kind), t in sorted(tallies.items())
    ]


def replay(usage, config_yaml: str, max_events: int = 10):
    """The replay as a DataFrame (``REPLAY_SCHEMA``): one group per (proxy, user), in parallel."""
    from pyspark.sql import functions as F

    candidate(config_yaml)  # a bad file fails here, on the driver, not in every task

    def per_user(pdf):
        import pandas as pd

        pdf = pdf.sort_values(["interval_start", "client_id", "api_key"], kind="stable")
        rows = pdf.to_dict("records")
        out = replay_user(pdf["proxy"].iloc[0], pdf["user"].iloc[0], rows, candidate(config_yaml), max_events)
        return pd.DataFrame(out, columns=[c.split()[0] for c in REPLAY_SCHEMA.split(", ")])

    cols = [F.col(c) for c in REPLAY_COLUMNS if c != "interval_start"]
    return (usage.select("proxy", "user", (F.unix_millis("interval_start")).alias("interval_start"), *cols)
            .groupBy("proxy", "user").applyInPandas(per_user, REPLAY_SCHEMA))
