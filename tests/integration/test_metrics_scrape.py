"""/metrics, /healthz and /readyz of the real proxy process in front of a real Tansu broker:
the per-entity series budget, readiness following the broker, and a hostile HTTP client."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request

import pytest
from kafka.protocol.metadata import ApiVersionsRequest

from tests.support.wire import read_frame, request_bytes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

GUARD_S = 30  # waiting longer than this for a state the proxy must reach is a failure
REQUEST_RATE = 1000.0  # per client id: never reached here


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def ready_url(p) -> str:
    return p.healthz_url.replace("/healthz", "/readyz")


def api_versions_as(address: tuple[str, int], client_id: str) -> None:
    with socket.create_connection(address, timeout=10) as s:
        s.sendall(request_bytes(ApiVersionsRequest[0](), 1, client_id=client_id))
        assert read_frame(s) is not None


def test_entity_series_stay_within_the_budget_and_the_rest_is_summed(tansu, proxy):
    p = proxy([tansu.bootstrap], extra_config={
        "metrics": {"max_entity_series": 2},
        "quotas": [{"client_id": "<default>", "request_rate": REQUEST_RATE}],
    })
    clients = [f"tenant-{i}" for i in range(5)]
    for client_id in clients:
        api_versions_as(p.address, client_id)

    metrics = p.metrics()

    def series(name: str) -> dict[str, float]:
        return {dict(labels)["client_id"]: value for (sample, labels), value in metrics.items() if sample == name}

    rates = series("kqp_quota_rate")
    assert len(rates) == 2 + 1 and "(other)" in rates
    assert set(rates) - {"(other)"} <= set(clients)
    assert series("kqp_quota_bound")["(other)"] == 3 * REQUEST_RATE  # three entities summed
    assert p.metric_sum("kqp_quota_folded_entities", kind="request_rate") == 3
    assert p.metric_sum("kqp_quota_live_entities") == 5
    assert "Traceback" not in p.log_text()


def test_readyz_follows_the_broker_while_healthz_stays_a_liveness_check(tansu, proxy):
    p = proxy([tansu.bootstrap], extra_config={
        "upstream": {"metadata_refresh_interval_s": 0.5, "connect_timeout_s": 0.5},
    })
    status, detail = get(ready_url(p))
    assert status == 200, detail  # the refresh at start found the broker

    tansu.stop()
    deadline = time.monotonic() + GUARD_S
    while status == 200 and time.monotonic() < deadline:
        time.sleep(0.2)  # an orchestrator's probe period, shortened
        status, detail = get(ready_url(p))

    assert status == 503 and "no metadata refresh succeeded" in detail
    assert get(p.healthz_url)[0] == 200


def test_a_hostile_http_client_gets_4xx_and_the_proxy_logs_no_traceback(tansu, proxy):
    p = proxy([tansu.bootstrap])
    host, port = p.ready["metrics"]
    for request, status in ((b"GET /" + b"a" * 1_000_000 + b" HTTP/1.1\r\n\r\n", b"414"),
                            (b"GET /metrics HTTP/1.1\r\nX: " + b"b" * 1_000_000 + b"\r\n\r\n", b"431"),
                            (b"\x16\x03\x01\x00\xff" + bytes(range(256)) + b"\r\n\r\n", b"400")):
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(request)
            answer = s.recv(4096)
        assert answer.split(b" ", 2)[1] == status

    assert get(p.metrics_url)[0] == 200
    assert "Traceback" not in p.log_text()


def test_the_latency_the_proxy_adds_is_the_latency_less_the_brokers_time(tansu):
    """A Fetch the broker holds (long poll on an empty topic) spends nearly all of its latency in
    the broker: kqp_request_upstream_seconds_total says how much, so the dashboard can show what
    the proxy itself added (kqp_request_latency_seconds_sum minus it)."""
    from confluent_kafka.admin import AdminClient, NewTopic

    from protocol.apis import SPECS, ApiKey
    from tests.support.inproc import InProcessProxy

    topic = "latency-empty"
    admin = AdminClient({"bootstrap.servers": tansu.bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(30)
    R = SPECS[ApiKey.FETCH].request[12]
    T = R.FetchTopic
    fetch = R(replica_id=-1, max_wait_ms=600, min_bytes=1, max_bytes=1 << 20, isolation_level=0, session_id=0,
              session_epoch=-1, topics=[T(topic=topic, partitions=[T.FetchPartition(
                  partition=0, current_leader_epoch=-1, fetch_offset=0, last_fetched_epoch=-1, log_start_offset=-1,
                  partition_max_bytes=1 << 20)])], forgotten_topics_data=[], rack_id="")
    with InProcessProxy([tansu.bootstrap]) as p:
        with socket.create_connection(p.address, timeout=10) as s:
            started = time.monotonic()
            for i in range(3):
                s.sendall(request_bytes(fetch, i, client_id="long-poll"))
                assert read_frame(s) is not None
            took = time.monotonic() - started
        latency = p.metric("kqp_request_latency_seconds_sum", api="Fetch")
        upstream = p.metric("kqp_request_upstream_seconds_total", api="Fetch")
        assert p.metric("kqp_request_latency_seconds_count", api="Fetch") == 3
        scraped = time.monotonic() - started
    # Tansu holds an empty fetch for part of max_wait_ms. The proxy stops its clock after the write
    # returns, which may be after the client has read the answer (by as long as the machine keeps
    # the proxy's thread waiting): so no later than the scrape. Its event loop handles one request
    # at a time on this connection, so the three latencies do not overlap.
    assert 0.2 < upstream <= latency <= scraped, (upstream, latency, took, scraped)
    assert latency - upstream < 0.1  # what the proxy added to three round trips
