"""Proxy counters kept as plain Python numbers and exported at scrape time.

The hot paths only increment ints in flat lists (see VersionCounts); a prometheus-client custom
collector turns them into metric families when ``/metrics`` is read (no ``.labels()`` lookups
per request).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Generator, Iterable, Iterator, Mapping
from contextvars import ContextVar, Token
from itertools import accumulate, compress
from typing import TypeVar, cast

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from protocol.apis import api_name

LATENCY_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)


# The hot paths count into flat lists, not dicts keyed by tuples: on a machine where the client
# and the broker run between any two callbacks, every C function and dict a count touches is a
# cache miss per request, and a list index is neither. Keys and versions past these go to dicts.
SLOT_KEYS = 128  # Kafka's API keys are below 100
SLOT_VERSIONS = 64  # and their versions below 20


class VersionCounts(Mapping[tuple[int, int], int]):
    """A count per (API key, version), read as a mapping of the pairs counted at least once.

    ``slots[key * SLOT_VERSIONS + version]`` is the count of a key below SLOT_KEYS at a version
    below SLOT_VERSIONS (what the hot paths increment); :meth:`add` takes any pair."""

    __slots__ = ("slots", "_others")

    def __init__(self) -> None:
        self.slots = [0] * (SLOT_KEYS * SLOT_VERSIONS)
        self._others: defaultdict[tuple[int, int], int] = defaultdict(int)

    @staticmethod
    def slot(key: int, version: int) -> int:
        """The index of the pair's count in ``slots``; -1: it has none."""
        return key * SLOT_VERSIONS + version if 0 <= key < SLOT_KEYS and 0 <= version < SLOT_VERSIONS else -1

    def add(self, key: int, version: int, n: int = 1) -> None:
        i = self.slot(key, version)
        if i >= 0:
            self.slots[i] += n
        else:
            self._others[(key, version)] += n

    def __getitem__(self, pair: tuple[int, int]) -> int:
        i = self.slot(*pair)
        n = self.slots[i] if i >= 0 else self._others.get(pair, 0)
        if n == 0:
            raise KeyError(pair)
        return n

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for i, n in enumerate(self.slots):
            if n:
                yield divmod(i, SLOT_VERSIONS)
        yield from (pair for pair, n in self._others.items() if n)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class LatencyHistogram:
    __slots__ = ("counts", "sum_s", "upstream_ms")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.sum_s = 0.0
        # Of sum_s, the time the broker took (from the request written upstream to its response
        # read back), summed: the rest is what the proxy added, throttle holds included.
        self.upstream_ms = 0.0

    def observe(self, seconds: float) -> None:
        # A Prometheus bucket counts observations <= its bound: bisect_left finds the first
        # bound not below ``seconds``. Most round trips fall in the first bucket.
        self.counts[0 if seconds <= LATENCY_BUCKETS_S[0] else bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        self.sum_s += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)


class LatencyByApi(Mapping[int, LatencyHistogram]):
    """A latency histogram per API key, read as a mapping of the keys observed at least once.
    ``slots[key]`` is the histogram of a key below SLOT_KEYS; :meth:`histogram` takes any key."""

    __slots__ = ("slots", "_others")

    def __init__(self) -> None:
        self.slots = [LatencyHistogram() for _ in range(SLOT_KEYS)]
        self._others: defaultdict[int, LatencyHistogram] = defaultdict(LatencyHistogram)

    def histogram(self, key: int) -> LatencyHistogram:
        return self.slots[key] if 0 <= key < SLOT_KEYS else self._others[key]

    def __getitem__(self, key: int) -> LatencyHistogram:
        h = self.slots[key] if 0 <= key < SLOT_KEYS else self._others.get(key)
        if h is None or not h.count:
            raise KeyError(key)
        return h

    def __iter__(self) -> Iterator[int]:
        yield from (key for key, h in enumerate(self.slots) if h.count)
        yield from (key for key, h in self._others.items() if h.count)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class ProxyStats:
    """Everything the proxy counts. Mutated only from the event loop thread."""

    def __init__(self) -> None:
        self.requests = VersionCounts()
        self.responses = VersionCounts()
        self.latency = LatencyByApi()
        self.bytes_client_to_upstream = 0
        self.bytes_upstream_to_client = 0
        self.open_connections = 0
        self.muted_connections = 0
        self.mutes_total = 0  # times a connection stopped being read for a throttle (KIP-219)
        self.decode_failures = 0
        self.unknown_api_requests = 0
        self.upstream_connect_failures = 0
        self.frames_rejected: defaultdict[str, int] = defaultdict(int)
        self.tls_handshake_failures: defaultdict[str, int] = defaultdict(int)  # by reason (proxy.identity.tls)
        # The proxy's TLS handshakes and SASL authentications brokers refused, by (kind, reason).
        self.upstream_auth_failures: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.certificate_reloads: defaultdict[str, int] = defaultdict(int)  # by outcome (proxy.control.cert_reload)
        self.local_responses: defaultdict[int, int] = defaultdict(int)
        self.broker_listeners = 0
        self.metadata_refreshes: defaultdict[str, int] = defaultdict(int)
        # Metadata responses whose topics the proxy read (proxy.cluster.metadata_learner), by
        # outcome: "responses" (learned), "unchanged" (the same topics as the last: not walked),
        # "malformed", "dropped" (too many bytes waiting).
        self.metadata_learned: defaultdict[str, int] = defaultdict(int)
        # Record sets whose batch headers could not be read (forwarded as they are, uncharged).
        self.records_scan_failures: defaultdict[str, int] = defaultdict(int)
        # KIP-951: per NOT_LEADER / FENCED_LEADER_EPOCH partition, where its leader hint came
        # from: "broker", "proxy" (filled from the leader cache) or "none".
        self.leader_hints: defaultdict[str, int] = defaultdict(int)
        self.uplifted_requests: defaultdict[str, int] = defaultdict(int)
        # Per API key: responses longer than the chunk they began in that went to the client as
        # they arrived (nothing changed them, or their filters could tell from their head).
        self.responses_streamed: defaultdict[int, int] = defaultdict(int)


def counter_by(name: str, doc: str, label: str, counts: Mapping[str, int]) -> CounterMetricFamily:
    """A counter family with one series per key of ``counts``, under one label."""
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, n in sorted(counts.items()):
        family.add_metric([str(key)], n)
    return family


class StatsCollector(Collector):
    """Builds metric families from :class:`ProxyStats` at scrape time, in slices within a
    :class:`Scrape` (all APIs at all versions make ~3,000 samples: ~5 ms in one go)."""

    def __init__(self, stats: ProxyStats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        yield from in_slices(self._steps())

    def _steps(self) -> Steps:
        s = self._stats
        families: list[Metric] = []
        for name, doc, counts in (("kqp_requests", "Requests received from clients", s.requests),
                                  ("kqp_responses", "Responses sent to clients", s.responses)):
            family = CounterMetricFamily(name, doc, labels=["api", "version"])
            for i, (key, ver, n) in enumerate(_counted(counts)):
                if i % SAMPLES_PER_STEP == 0:
                    yield
                family.add_metric([api_name(key), str(ver)], n)
            families.append(family)
        local = CounterMetricFamily(
            "kqp_local_responses", "Responses the proxy answered itself", labels=["api"]
        )
        for key, n in sorted(s.local_responses.items()):
            local.add_metric([api_name(key)], n)
        families.append(local)
        yield
        families.extend((yield from _latency_family(s.latency)))
        b = CounterMetricFamily("kqp_bytes", "Bytes forwarded", labels=["direction"])
        b.add_metric(["client_to_upstream"], s.bytes_client_to_upstream)
        b.add_metric(["upstream_to_client"], s.bytes_upstream_to_client)
        families.append(b)
        families.extend(self._gauges_and_counters())
        return families

    def _gauges_and_counters(self) -> list[Metric]:
        s = self._stats
        return [
            GaugeMetricFamily("kqp_open_connections", "Open client connections", value=s.open_connections),
            GaugeMetricFamily(
                "kqp_muted_connections", "Client connections muted for a throttle", value=s.muted_connections
            ),
            CounterMetricFamily("kqp_mutes", "Times a client connection was muted for a throttle (KIP-219)",
                                value=s.mutes_total),
            GaugeMetricFamily("kqp_broker_listeners", "Per-broker listeners open", value=s.broker_listeners),
            CounterMetricFamily(
                "kqp_decode_failures", "Frames the proxy needed to read but could not decode",
                value=s.decode_failures,
            ),
            CounterMetricFamily(
                "kqp_unknown_api_requests", "Requests for API keys the proxy cannot decode (forwarded)",
                value=s.unknown_api_requests,
            ),
            CounterMetricFamily(
                "kqp_upstream_connect_failures", "Failed attempts to connect to a broker",
                value=s.upstream_connect_failures,
            ),
            counter_by(
                "kqp_responses_streamed",
                "Responses longer than their first chunk sent on as they arrived, not assembled first",
                "api", {api_name(key): n for key, n in s.responses_streamed.items()},
            ),
            counter_by(
                "kqp_frames_rejected", "Client frames that closed their connection", "reason", s.frames_rejected
            ),
            counter_by(
                "kqp_tls_handshake_failures", "Client TLS handshakes that failed or stalled (the connection closed)",
                "reason", s.tls_handshake_failures,
            ),
            _upstream_auth_failures(s.upstream_auth_failures),
            counter_by("kqp_certificate_reloads", "Reloads of the TLS files (on change or SIGHUP)", "outcome",
                       s.certificate_reloads),
            counter_by(
                "kqp_records_scan_failures",
                "Produce requests / Fetch responses whose record-batch headers were malformed (forwarded uncharged)",
                "api", s.records_scan_failures,
            ),
            counter_by("kqp_metadata_refreshes", "The proxy's own metadata refreshes", "outcome",
                       s.metadata_refreshes),
            counter_by("kqp_metadata_responses_learned",
                       "Metadata responses whose topics the proxy read for its caches, by outcome", "outcome",
                       s.metadata_learned),
        ]


def _upstream_auth_failures(counts: dict[tuple[str, str], int]) -> CounterMetricFamily:
    family = CounterMetricFamily(
        "kqp_upstream_authentication_failures",
        "TLS handshakes to brokers and SASL authentications of the proxy's own connections that failed",
        labels=["kind", "reason"],
    )
    for (kind, reason), n in sorted(counts.items()):
        family.add_metric([kind, reason], n)
    return family


def _counted(counts: VersionCounts) -> list[tuple[int, int, int]]:
    """(API key, version, count) of every pair counted, sorted; the slots are scanned at C
    speed (iterating the mapping looks at all 8,192 of them in Python: ~0.5 ms)."""
    slots = counts.slots
    found = [(*divmod(i, SLOT_VERSIONS), slots[i]) for i in compress(range(len(slots)), slots)]
    found += [(key, ver, n) for (key, ver), n in counts._others.items() if n]
    return sorted(found)


def _latency_family(latency: LatencyByApi) -> Steps:
    hist = HistogramMetricFamily(
        "kqp_request_latency_seconds",
        "Time from a request's arrival from the client to its response being written back",
        labels=["api"],
    )
    upstream = CounterMetricFamily(
        "kqp_request_upstream_seconds",
        "Of kqp_request_latency_seconds_sum, the time the broker took (request written to it until its "
        "response was read back); the difference is what the proxy added", labels=["api"],
    )
    bounds = [*(repr(bound) for bound in LATENCY_BUCKETS_S), "+Inf"]
    for i, (key, h) in enumerate(sorted(latency.items())):
        if i % (SAMPLES_PER_STEP // len(bounds)) == 0:
            yield
        hist.add_metric([api_name(key)], list(zip(bounds, accumulate(h.counts))), h.sum_s)
        upstream.add_metric([api_name(key)], h.upstream_ms / 1000)
    return [hist, upstream]


# -- scrapes in slices --------------------------------------------------------------------------

# A collector's work is a step generator: it yields when the event loop may run other work,
# and returns its metric families.
Steps = Generator[None, None, list[Metric]]
_T = TypeVar("_T")
SAMPLES_PER_STEP = 32  # samples built or formatted between two chances to yield (~0.15 ms)


class Scrape:
    """One ``/metrics`` request: the per-entity series budget, and the steps collectors hand
    over (see :func:`in_slices`) for the endpoint to run in slices.

    Used as ``with Scrape(budget) as scrape:`` around the collection; collectors find it with
    :func:`current_scrape` while their ``collect()`` runs."""

    def __init__(self, max_entity_series: int) -> None:
        self.max_entity_series = max_entity_series
        self.deferred: list[Steps] = []
        self._token: Token[Scrape | None] | None = None

    def __enter__(self) -> Scrape:
        self._token = _SCRAPE.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _SCRAPE.reset(cast("Token[Scrape | None]", self._token))  # set by __enter__


# A context variable, not an argument: prometheus_client's registry calls collect() with none.
_SCRAPE: ContextVar[Scrape | None] = ContextVar("kqp_scrape", default=None)


def current_scrape() -> Scrape | None:
    return _SCRAPE.get()


def in_slices(steps: Steps) -> Iterable[Metric]:
    """The families ``steps`` returns: handed to the current scrape, which runs the steps in
    slices (nothing is yielded here then), or built at once when there is no scrape."""
    scrape = current_scrape()
    if scrape is None:
        return run_to_end(steps)
    scrape.deferred.append(steps)
    return ()


def run_to_end(steps: Generator[None, None, _T]) -> _T:
    """Runs a step generator without yielding the loop; returns what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            value: _T = stop.value  # the generator's return value (StopIteration.value is untyped)
            return value
