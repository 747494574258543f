"""The HTTP endpoint (``/metrics``, ``/healthz``, ``/readyz``) over real sockets: what it
answers, the budgets on what a client sends (414, 431, one deadline for the whole request,
a bound on connections), that nothing a client sends makes a traceback, and readiness."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from proxy.observability.http import HttpLimits, MetricsEndpoint, exposition_steps
from proxy.observability.quota_metrics import QuotaCollector
from proxy.observability.readiness import Readiness
from proxy.observability.stats import ProxyStats, StatsCollector, run_to_end
from quotas import QuotaManager, QuotaRule

# Short lingering after an error answer keeps the tests quick; every other limit is the default.
LIMITS = HttpLimits(linger_s=0.3)
GUARD_S = 10  # a test that waits longer than this has failed (not a timing assertion)


def ok() -> tuple[bool, str]:
    return True, "ok"


@contextlib.asynccontextmanager
async def serving(endpoint: MetricsEndpoint):
    server = await endpoint.start_server("127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


async def exchange(port: int, request: bytes, *, eof: bool = False) -> bytes:
    """Sends ``request`` and returns everything the endpoint answers until it closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        if eof:
            writer.write_eof()
        return await asyncio.wait_for(reader.read(), GUARD_S)
    finally:
        writer.close()


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def body_of(response: bytes) -> bytes:
    return response.split(b"\r\n\r\n", 1)[1]


def endpoint(registry=None, ready=None, limits=LIMITS) -> MetricsEndpoint:
    return MetricsEndpoint(registry or CollectorRegistry(), ok, ready, limits=limits)


class Tracebacks(logging.Handler):
    """Every log record carrying an exception, and every error asyncio reports from a loop."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or record.levelno >= logging.ERROR:
            self.seen.append(record.getMessage())


@pytest.fixture
def tracebacks():
    handler = Tracebacks()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler.seen
    finally:
        root.removeHandler(handler)


def run(coro):
    """asyncio.run, with the loop's own error reports (an exception a handler let escape)
    logged on the ``asyncio`` logger, where the ``tracebacks`` fixture sees them."""
    async def main():
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, context: logging.getLogger("asyncio").error("loop error: %s", context.get("message")))
        return await coro
    return asyncio.run(main())


# -- what it answers ------------------------------------------------------------------------


def test_metrics_health_and_unknown_paths_are_answered():
    registry = CollectorRegistry()
    registry.register(StatsCollector(ProxyStats()))

    async def go():
        async with serving(endpoint(registry)) as port:
            metrics = await exchange(port, b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n")
            health = await exchange(port, b"GET /healthz HTTP/1.1\r\n\r\n")
            head = await exchange(port, b"HEAD /metrics HTTP/1.0\r\n\r\n")
            missing = await exchange(port, b"GET /nothing HTTP/1.1\r\n\r\n")
            post = await exchange(port, b"POST /metrics HTTP/1.1\r\n\r\n")
            no_readiness = await exchange(port, b"GET /readyz HTTP/1.1\r\n\r\n")
            return metrics, health, head, missing, post, no_readiness

    metrics, health, head, missing, post, no_readiness = run(go())
    assert status_of(metrics) == 200 and b"kqp_open_connections 0.0" in body_of(metrics)
    assert status_of(health) == 200 and body_of(health) == b"ok\n"
    assert status_of(head) == 200 and body_of(head) == b"" and b"Content-Length: 0" not in head
    assert status_of(missing) == 404
    assert status_of(post) == 405
    assert status_of(no_readiness) == 404  # an endpoint without a readiness check


def test_the_sliced_text_is_what_generate_latest_writes():
    registry = CollectorRegistry()
    stats = ProxyStats()
    for key in range(60):
        for version in range(12):
            stats.requests.add(key, version)
        stats.latency.histogram(key).observe(0.003)
    stats.requests.add(500, 1)  # past the count slots
    registry.register(StatsCollector(stats))
    manager = QuotaManager([QuotaRule(None, "<default>", {"producer_byte_rate": 100.0})])
    for i in range(50):
        manager.check_and_record("", f"c-{i}", "producer_byte_rate", float(i), 1000)
    registry.register(QuotaCollector(manager, lambda: 1000))

    sliced = run(endpoint(registry).render())

    # The same families and samples (the sliced scrape puts per-entity families last).
    assert families(sliced.decode()) == families(generate_latest(registry).decode())


def test_a_family_formatted_in_pieces_is_byte_for_byte_generate_latest():
    family = GaugeMetricFamily("kqp_test", "A family with\nmany series", labels=["user"])
    for i in range(1000):
        family.add_metric([f'u"{i}\\'], i / 7)
    assert run_to_end(exposition_steps([family])) == generate_latest(SimpleNamespace(collect=lambda: [family]))


def families(text: str) -> dict:
    return {f.name: sorted((s.name, tuple(sorted(s.labels.items())), s.value) for s in f.samples)
            for f in text_string_to_metric_families(text)}


# -- budgets on what a client sends ---------------------------------------------------------


def test_an_oversized_request_line_is_answered_414_without_a_traceback(tracebacks):
    async def go():
        async with serving(endpoint()) as port:
            return await exchange(port, b"GET /" + b"a" * 1_000_000 + b" HTTP/1.1\r\n\r\n")

    assert status_of(run(go())) == 414
    assert tracebacks == []


@pytest.mark.parametrize("headers", [
    b"X-Big: " + b"b" * 1_000_000 + b"\r\n",  # one header line past the limit
    b"X-Some: " + b"s" * 8000 + b"\r\n" + b"X-More: " + b"m" * 8000 + b"\r\n" + b"X-Last: " + b"l" * 8000 + b"\r\n",
    b"".join(b"X-%d: 1\r\n" % i for i in range(LIMITS.max_headers + 1)),  # too many
], ids=["one-line", "all-lines", "too-many"])
def test_oversized_headers_are_answered_431_without_a_traceback(headers, tracebacks):
    async def go():
        async with serving(endpoint()) as port:
            return await exchange(port, b"GET /metrics HTTP/1.1\r\n" + headers + b"\r\n")

    assert status_of(run(go())) == 431
    assert tracebacks == []


def test_headers_within_the_limits_are_served():
    headers = b"".join(b"X-%d: %s\r\n" % (i, b"v" * 100) for i in range(LIMITS.max_headers))

    async def go():
        async with serving(endpoint()) as port:
            return await exchange(port, b"GET /healthz HTTP/1.1\r\n" + headers + b"\r\n")

    assert status_of(run(go())) == 200


def test_one_deadline_covers_the_whole_request_however_steadily_headers_trickle(tracebacks):
    # Every header line arrives well within the deadline: a deadline per line would wait forever
    # (the trickle outlasts GUARD_S, and stays under max_headers, so nothing but 408 can end it).
    limits = HttpLimits(request_timeout_s=0.5)

    async def go():
        loop = asyncio.get_running_loop()
        async with serving(endpoint(limits=limits)) as port:
            sock = socket.create_connection(("127.0.0.1", port))
            sock.setblocking(False)

            async def trickle():
                try:
                    await loop.sock_sendall(sock, b"GET /metrics HTTP/1.1\r\n")
                    for i in range(10 * GUARD_S):
                        await loop.sock_sendall(sock, b"X-Slow-%d: 1\r\n" % i)
                        await asyncio.sleep(0.1)
                except OSError:
                    pass  # the endpoint closed the connection: what it answered is read below

            async def answer() -> bytes:
                # The endpoint closes right after its 408 (it does not linger, as it does after a
                # 4xx it refuses): a header line that reached it after its last read makes that
                # close a reset. The kernel still hands over what arrived before the reset; a
                # StreamReader would not (read() raises once the reset is seen, dropping what it
                # had), so a loaded machine, where the deadline and a line meet, failed the test.
                received = b""
                try:
                    while chunk := await loop.sock_recv(sock, 65536):
                        received += chunk
                except ConnectionResetError:
                    pass
                return received

            sender = asyncio.create_task(trickle())
            try:
                return await asyncio.wait_for(answer(), GUARD_S)
            finally:
                sender.cancel()
                sock.close()

    assert status_of(run(go())) == 408
    assert tracebacks == []


GARBAGE = [
    b"",
    b"\r\n\r\n",
    b"GET\r\n\r\n",
    b"GET /metrics\r\n\r\n",  # HTTP/0.9: no version
    b"GET /metrics HTTP/1.1 extra\r\n\r\n",
    b"GET /metrics SPDY/3\r\n\r\n",
    b"G\xc3\xa9T /m\xff HTTP/1.1\r\n\r\n",
    b"\x00" * 5000,
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)),  # a TLS ClientHello
    b"GET /metrics HTTP/1.1\r\nHost: a",  # closes mid-header
    b"GET /metrics HTTP/1.1\r\nNo colon\r\n:\r\n" + b"\n" * 3,  # lax: a bare LF ends the headers
    b"\n" * 20_000,
    bytes(random.Random(7).randrange(256) for _ in range(50_000)),
]


@pytest.mark.parametrize("garbage", GARBAGE, ids=range(len(GARBAGE)))
def test_garbage_is_answered_or_closed_never_a_traceback(garbage, tracebacks):
    async def go():
        async with serving(endpoint()) as port:
            answer = await exchange(port, garbage, eof=True)
            # The endpoint still serves afterwards.
            return answer, await exchange(port, b"GET /healthz HTTP/1.1\r\n\r\n")

    answer, health = run(go())
    assert answer == b"" or status_of(answer) in (200, 400, 404, 405, 414, 431)
    assert status_of(health) == 200
    assert tracebacks == []


def test_connections_beyond_the_bound_are_answered_503_unread(tracebacks):
    limits = HttpLimits(max_connections=2, linger_s=0.3)

    async def go():
        async with serving(endpoint(limits=limits)) as port:
            idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            await asyncio.sleep(0.05)  # both accepted and waiting for a request line
            refused = await exchange(port, b"")  # answered without being read
            for _, writer in idle:
                writer.close()
            await asyncio.sleep(0.05)  # their handlers see the close
            served = await exchange(port, b"GET /healthz HTTP/1.1\r\n\r\n")
            return refused, served

    refused, served = run(go())
    assert status_of(refused) == 503
    assert status_of(served) == 200
    assert tracebacks == []


# -- readiness ------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def readiness(clock: Clock) -> tuple[Readiness, ProxyStats, SimpleNamespace]:
    stats = ProxyStats()
    cluster = SimpleNamespace(brokers={})
    return Readiness(stats, cluster, max_silence_s=60, clock_s=clock), stats, cluster


def test_readyz_is_503_until_a_broker_is_known_and_answered_then_200():
    clock = Clock()
    ready, stats, cluster = readiness(clock)

    async def ask(port):
        return await exchange(port, b"GET /readyz HTTP/1.1\r\n\r\n")

    async def go():
        async with serving(endpoint(ready=lambda: ready.check(True))) as port:
            before = await ask(port)
            stats.metadata_refreshes["failure"] += 1  # a bootstrap server did not answer
            failing = await ask(port)
            stats.metadata_refreshes["success"] += 1
            cluster.brokers[1] = ("127.0.0.1", 9092)
            after = await ask(port)
            return before, failing, after

    before, failing, after = run(go())
    assert status_of(before) == 503
    assert b"no broker known" in body_of(before) and b"no metadata refresh has succeeded" in body_of(before)
    assert status_of(failing) == 503
    assert status_of(after) == 200 and b"brokers known: [1]" in body_of(after)


def test_readiness_lapses_when_refreshes_stop_succeeding_and_returns_with_the_next():
    clock = Clock()
    ready, stats, cluster = readiness(clock)
    cluster.brokers[1] = ("127.0.0.1", 9092)
    stats.metadata_refreshes["success"] += 1
    assert ready.check(True)[0]

    clock.now_s += 59
    stats.metadata_refreshes["periodic_leaders_failure"] += 1
    assert ready.check(True)[0]  # within the allowed silence
    clock.now_s += 2
    ok, detail = ready.check(True)
    assert not ok and "no metadata refresh succeeded for 61 s" in detail

    stats.metadata_refreshes["periodic_leaders"] += 1  # the proxy's periodic refresh answered
    assert ready.check(True)[0]
    ok, detail = ready.check(False)
    assert not ok and "listeners not serving" in detail


def test_health_is_answered_while_a_scrape_renders():
    # One scrape renders at a time; /healthz and /readyz never wait for it.
    async def go():
        ep = endpoint()
        async with serving(ep) as port:
            async with ep._render_lock:  # as a scrape in progress holds it
                return await exchange(port, b"GET /healthz HTTP/1.1\r\n\r\n")

    assert status_of(run(go())) == 200


def test_a_collector_that_raises_is_a_500_logged_once(caplog):
    class Broken:
        def describe(self):
            return []

        def collect(self):
            raise RuntimeError("a collector bug")

    registry = CollectorRegistry()
    registry.register(Broken())

    async def go():
        async with serving(endpoint(registry)) as port:
            return [await exchange(port, b"GET /metrics HTTP/1.1\r\n\r\n") for _ in range(3)]

    with caplog.at_level(logging.ERROR, logger="proxy.observability.http"):
        answers = run(go())
    assert [status_of(a) for a in answers] == [500, 500, 500]
    assert [r.getMessage() for r in caplog.records].count(
        "/metrics failed to render (logged at most once a minute)") == 1


def test_readiness_detail_names_everything_missing():
    clock = Clock()
    ready, _, _ = readiness(clock)
    ok, detail = ready.check(False)
    assert not ok
    assert detail == ("not ready: listeners not serving; no broker known (no metadata yet); "
                      "no metadata refresh has succeeded yet")
