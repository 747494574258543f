"""``workers: 2``: two worker processes behind the same ports, with a real Tansu broker and the
proxy run as an operator runs it (``python -m proxy run``): connections spread over both, one
``/metrics`` for the host, one quota for a client whose sockets land on both workers, connection
limits for the host, and the supervisor's handling of a killed worker, SIGTERM and SIGHUP.

Which worker holds a connection is read from ``/proc`` (the proxy's end of the socket, and the
worker pid holding it): the kernel spreads connections by a hash, so a test that needs both
workers opens connections until each holds what it needs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from kafka.protocol.metadata import ApiVersionsRequest

from proxy.app import procnet
from tests.integration.test_greedy_clients import (
    QUOTA,
    RAW_RECORDS,
    RECORD,
    RUN_S,
    SOCKET_TIMEOUT_S,
    WINDOWS,
    ProduceMeter,
    Row,
    _assert_no_more_than_kafka,
    _drain,
    _raw_sender,
    _result,
    produce_frame,
)
from tests.support.polling import wait_for
from tests.support.proxy_process import ProxyProcess, sum_samples
from tests.support.rate_runs import fresh_topic
from tests.support.tansu import TansuBroker
from tests.support.wire import api_versions_round_trip, is_closed, read_frame, request_bytes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

WORKERS = {"workers": 2}


def worker_of(sock: socket.socket, pids: list[int]) -> int | None:
    """The worker pid holding the proxy's end of ``sock`` (None: none of ``pids``)."""
    inode = procnet.connection_inode(sock.getpeername()[:2], sock.getsockname()[:2])
    return None if inode is None else procnet.owner_of(inode, pids) if inode else None


def spread(address: tuple[str, int], pids: list[int], per_worker: int, attempts: int = 200) -> list[socket.socket]:
    """``per_worker`` connections held by each of ``pids`` (the others opened on the way are closed)."""
    kept: dict[int, list[socket.socket]] = {pid: [] for pid in pids}
    for _ in range(attempts):
        if all(len(v) >= per_worker for v in kept.values()):
            return [s for v in kept.values() for s in v]
        s = socket.create_connection(address, timeout=10)
        owner = wait_for(lambda s=s: worker_of(s, pids), 5, "the connection's worker")
        if len(kept[owner]) < per_worker:
            kept[owner].append(s)
        else:
            s.close()
    raise AssertionError(f"connections did not spread over {pids} in {attempts} tries")


def worker_pids(p: ProxyProcess) -> list[int]:
    return list(p.ready["workers"])


def get(url: str) -> tuple[int, str]:
    """An HTTP GET's status and body (a 503 included)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def answered(sock: socket.socket, correlation_id: int) -> bool:
    try:
        return api_versions_round_trip(sock, correlation_id) == correlation_id
    except OSError:
        return False


@pytest.fixture
def broker():
    with TansuBroker() as b:
        yield b


def test_connections_spread_over_both_workers_and_metrics_count_them_once(broker):
    with ProxyProcess([broker.bootstrap], extra_config=WORKERS) as p:
        pids = worker_pids(p)
        assert len(pids) == 2 and p.pid not in pids
        socks = [socket.create_connection(p.address, timeout=10) for _ in range(40)]
        try:
            owners = [wait_for(lambda s=s: worker_of(s, pids), 5, "owner") for s in socks]
            for i, s in enumerate(socks):
                assert answered(s, 100 + i)
            by_worker = {pid: owners.count(pid) for pid in pids}
            print(f"\n40 connections by worker: {by_worker}")
            assert all(n > 0 for n in by_worker.values()), f"one worker holds them all: {by_worker}"
            m = p.metrics()
            assert sum_samples(m, "kqp_requests_total", api="ApiVersions") == 40
            assert sum_samples(m, "kqp_open_connections") == 40
            assert sum_samples(m, "kqp_workers_running") == 2
        finally:
            for s in socks:
                s.close()
        (health_status, health), (ready_status, ready) = get(p.healthz_url), get(p.healthz_url.replace("healthz",
                                                                                                      "readyz"))
        assert (health_status, ready_status) == (200, 200), (health, ready)
        assert health.startswith("ok; 2 workers") and ready.startswith("ready; 2 workers"), (health, ready)
        assert "worker=0" in p.log_text() and "worker=1" in p.log_text() and "worker=supervisor" in p.log_text()


def test_max_connections_holds_for_the_host(broker):
    with ProxyProcess([broker.bootstrap], extra_config={**WORKERS, "connections": {"max_connections": 10}}) as p:
        socks = [socket.create_connection(p.address, timeout=10) for _ in range(20)]
        try:
            served = [s for i, s in enumerate(socks) if answered(s, 200 + i)]
            assert len(served) == 10, f"{len(served)} of 20 served with max_connections 10 on 2 workers"
            for s in socks:
                if s not in served:
                    assert is_closed(s)
            owners = {worker_of(s, worker_pids(p)) for s in served}
            print(f"\nthe 10 served are on workers {owners}")
            assert p.metric_sum("kqp_connections_closed_total", reason="max_connections") == 10
        finally:
            for s in socks:
                s.close()


@pytest.mark.slow
def test_one_greedy_client_on_both_workers_gets_one_quota():
    """4 sockets of one client id, 2 on each worker, pipelining Produce for 30 s under
    producer_byte_rate 1 MiB/s: what reaches the broker is within Kafka's model for one greedy
    client with 4 connections (the bar of test_greedy_clients), not twice the quota."""
    row = Row("workers-raw-4", "raw", sockets=4, acks=1)
    meter = ProduceMeter().start()
    try:
        with TansuBroker(advertised_port=meter.port) as tansu:
            meter.target = (tansu.host, tansu.port)
            topic = fresh_topic(tansu, "greedy-workers")
            with ProxyProcess([meter.bootstrap], extra_config={
                **WORKERS, "quota_windows": dict(WINDOWS),
                "quotas": [{"client_id": row.client_id, "producer_byte_rate": QUOTA}],
            }) as p:
                socks = spread(p.address, worker_pids(p), per_worker=2)
                out: dict = {}
                stop = threading.Event()
                threads = []
                for s in socks:
                    s.settimeout(SOCKET_TIMEOUT_S)
                begin = time.monotonic()
                for s in socks:
                    threads.append(threading.Thread(target=_raw_sender, daemon=True, args=(
                        s, produce_frame(topic, row.acks, row.client_id), begin + RUN_S)))
                    threads.append(threading.Thread(target=_drain, args=(s, stop), daemon=True))
                for t in threads:
                    t.start()
                for t in threads[::2]:
                    t.join(RUN_S + 10)
                stop.set()
                for s in socks:
                    s.close()
                out["begin"] = begin
                result = _result(row, out, meter)
                assert result.connections == 4
                assert abs(result.request_bytes - RAW_RECORDS * len(RECORD)) < 4096
                _assert_no_more_than_kafka(result)
                assert p.metric_sum("kqp_worker_restarts_total") == 0
    finally:
        meter.stop()


def test_a_killed_worker_is_replaced_and_the_other_workers_clients_see_nothing(broker):
    with ProxyProcess([broker.bootstrap], extra_config=WORKERS) as p:
        pids = worker_pids(p)
        victim, survivor = pids
        socks = spread(p.address, pids, per_worker=3)
        on_survivor = [s for s in socks if worker_of(s, pids) == survivor]
        on_victim = [s for s in socks if s not in on_survivor]
        stop = threading.Event()
        errors: list[str] = []

        def keep_asking(s: socket.socket, base: int) -> None:  # the survivor's clients, under load
            n = 0
            while not stop.is_set():
                n += 1
                if not answered(s, base + n):
                    errors.append(f"a request on the surviving worker failed after {n - 1} answers")
                    return

        load = [threading.Thread(target=keep_asking, args=(s, 10_000 * (i + 1)), daemon=True)
                for i, s in enumerate(on_survivor)]
        for t in load:
            t.start()
        try:
            time.sleep(0.5)
            killed_at = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            for s in on_victim:
                assert is_closed(s), "a connection of the killed worker stayed open"

            def replaced() -> bool:
                status, health = get(p.healthz_url)
                return status == 200 and str(victim) not in health

            wait_for(replaced, 10, "a replacement worker")
            replaced_s = time.monotonic() - killed_at
            # The ready file was rewritten for the replacement: it names the workers running now.
            ready = json.loads(p.ready_path.read_text())
            assert ready["pid"] == p.pid and victim not in ready["workers"], ready
            assert sorted(ready["workers"]) == sorted(procnet_pids(p)), (ready, procnet_pids(p))
            fresh = [socket.create_connection(p.address, timeout=10) for _ in range(20)]
            try:
                assert all(answered(s, 500 + i) for i, s in enumerate(fresh)), "a new connection not answered"
                new_pids = {worker_of(s, procnet_pids(p)) for s in fresh}
            finally:
                for s in fresh:
                    s.close()
            time.sleep(0.5)
        finally:
            stop.set()
            for t in load:
                t.join(10)
            for s in socks:
                s.close()
        # How soon is bounded by wait_for's deadline above: a worker's start is the machine's speed.
        print(f"\nreplacement serving {replaced_s:.2f} s after the SIGKILL; new connections on {new_pids}")
        assert new_pids - {survivor, None}, "the replacement took none of 20 new connections"
        assert not errors, errors
        assert p.metric_sum("kqp_worker_restarts_total") == 1
        assert "worker 0 (pid" in p.log_text() or "worker 1 (pid" in p.log_text()
        assert "killed by signal 9" in p.log_text()


def procnet_pids(p: ProxyProcess) -> list[int]:
    """The supervisor's children now (a replacement has a pid the ready file never saw)."""
    children = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
    return [int(c) for c in children]


def _fetch_frame(topic: str, correlation_id: int, wait_ms: int) -> bytes:
    from kafka.protocol.consumer import FetchRequest

    T = FetchRequest[4].FetchTopic
    request = FetchRequest[4](
        replica_id=-1, max_wait_ms=wait_ms, min_bytes=1, max_bytes=1 << 20, isolation_level=0,
        topics=[T(topic=topic, partitions=[T.FetchPartition(partition=0, fetch_offset=0,
                                                             partition_max_bytes=1 << 20)])])
    return request_bytes(request, correlation_id, "drain-test")


def test_sigterm_drains_both_workers(broker):
    """A Fetch waiting at the broker when SIGTERM comes is answered before its connection closes;
    every process exits 0 and a new connection is refused."""
    topic = fresh_topic(broker, "drain")
    with ProxyProcess([broker.bootstrap], extra_config={**WORKERS, "workers": {"count": 2,
                                                                                "drain_timeout_ms": 10_000}}) as p:
        pids = worker_pids(p)
        socks = spread(p.address, pids, per_worker=1)
        waits = []
        for i, s in enumerate(socks):
            # The broker's address to fetch from: the one metadata gave is the bootstrap's own broker.
            s.sendall(_fetch_frame(topic, 900 + i, 1500))
            waits.append(s)
        time.sleep(0.3)
        os.kill(p.pid, signal.SIGTERM)
        for i, s in enumerate(waits):
            s.settimeout(10)
            frame = read_frame(s)
            assert frame is not None and int.from_bytes(frame[:4], "big") == 900 + i, "the Fetch in flight was dropped"
            assert is_closed(s)
        assert p.process.wait(20) == 0
        for pid in pids:
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
        with pytest.raises(OSError):
            socket.create_connection(p.address, timeout=2)
        log = p.log_text()
        assert log.count("stopping: draining connections") == 2, log[-3000:]


def test_sighup_reloads_every_worker_and_a_broken_file_reaches_none(broker):
    with ProxyProcess([broker.bootstrap], extra_config={**WORKERS, "reload": {"require_atomic_rename": True}}) as p:
        config = dict(p.config)
        config["quotas"] = [{"client_id": "hup", "producer_byte_rate": 12345}]
        p.config_path.write_text(yaml.safe_dump(config))  # in place: applied only by SIGHUP
        os.kill(p.pid, signal.SIGHUP)
        for worker in (0, 1):
            wait_for(lambda w=worker: f'worker={w} logger=proxy.app.server msg="reloaded: 1 quota entry'
                     in p.log_text(), 10, f"worker {worker}'s reload")
        config["quotas"] = [{"client_id": "hup", "producer_byte_rate": -5}]
        p.config_path.write_text(yaml.safe_dump(config))
        os.kill(p.pid, signal.SIGHUP)
        wait_for(lambda: "reload of" in p.log_text() and "rejected" in p.log_text(), 10, "the refusal")
        time.sleep(1)
        log = p.log_text()
        assert log.count('msg="reloaded: 1 quota entry') == 2, "a broken file reached a worker"
        rejected = [line for line in log.splitlines() if "rejected" in line]
        assert rejected and all("worker=supervisor" in line for line in rejected), rejected
        assert "quotas[0].producer_byte_rate" in rejected[0]
        pids = worker_pids(p)
        assert all(Path(f"/proc/{pid}").exists() for pid in pids)


def test_the_admin_apis_memory_store_answers_alike_on_every_worker(broker, capsys):
    """An AlterClientQuotas on one worker (quota_admin.store: memory) is what every worker
    describes, and what a replacement worker starts with."""
    from proxy.app.cli import main

    admin = {"enabled": True, "store": "memory", "principals": ["ANONYMOUS"]}
    with ProxyProcess([broker.bootstrap], extra_config={**WORKERS, "quota_admin": admin}) as p:
        b = ("--bootstrap-server", p.bootstrap)

        def describe() -> dict:
            assert main(["quotas", "describe", *b, "--user", "alice"]) == 0
            return yaml.safe_load(capsys.readouterr().out)

        assert main(["quotas", "set", *b, "--user", "alice", "--add", "producer_byte_rate=2048"]) == 0
        capsys.readouterr()
        want = {"quotas": [{"user": "alice", "producer_byte_rate": 2048}]}
        # Each describe is a new connection, on either worker (the kernel's hash): 12 make both likely.
        seen = [describe() for _ in range(12)]
        assert all(s == want for s in seen), seen
        os.kill(worker_pids(p)[0], signal.SIGKILL)
        wait_for(lambda: get(p.healthz_url)[0] == 200 and "not running" not in get(p.healthz_url)[1], 10,
                 "the replacement")
        assert all(describe() == want for _ in range(12))


def test_a_hung_worker_is_replaced(broker):
    """A worker whose event loop stops (SIGSTOP) sends no heartbeat: killed and started again."""
    config = {"workers": {"count": 2, "heartbeat_timeout_ms": 2000}}
    with ProxyProcess([broker.bootstrap], extra_config=config) as p:
        hung = worker_pids(p)[0]
        os.kill(hung, signal.SIGSTOP)
        wait_for(lambda: "sent no heartbeat" in p.log_text(), 10, "the heartbeat timeout")
        wait_for(lambda: get(p.healthz_url)[0] == 200 and str(hung) not in get(p.healthz_url)[1], 10,
                 "the replacement")
        fresh = [socket.create_connection(p.address, timeout=10) for _ in range(10)]
        try:
            assert all(answered(s, 700 + i) for i, s in enumerate(fresh))
        finally:
            for s in fresh:
                s.close()
        assert p.metric_sum("kqp_worker_restarts_total") == 1


def test_workers_that_keep_dying_stop_the_supervisor_with_an_error(broker):
    with ProxyProcess([broker.bootstrap], extra_config=WORKERS) as p:
        killed: set[int] = set()
        deadline = time.monotonic() + 30
        while p.process.poll() is None and time.monotonic() < deadline:
            for pid in procnet_pids(p):
                if pid not in killed:
                    killed.add(pid)
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        assert p.process.wait(10) == 1
        assert "times in a row within" in p.log_text() and "giving up" in p.log_text()
        assert not [pid for pid in killed if Path(f"/proc/{pid}").exists()
                    and "zombie" not in Path(f"/proc/{pid}/status").read_text()]


def test_with_the_fleet_each_worker_is_a_member_and_writes_its_own_usage_files(broker, tmp_path):
    import pyarrow.parquet as pq

    usage = tmp_path / "usage"
    config = {**WORKERS, "fleet": {"enabled": True, "sync_interval_ms": 100, "member_timeout_ms": 2000},
              "usage_log": {"directory": str(usage), "interval_seconds": 1, "proxy_name": "host-a"},
              "quotas": [{"client_id": "spread", "producer_byte_rate": 1 << 20}]}
    with ProxyProcess([broker.bootstrap], extra_config=config) as p:
        socks = spread(p.address, worker_pids(p), per_worker=1)
        for i, s in enumerate(socks):
            s.sendall(request_bytes(ApiVersionsRequest[0](), 800 + i, "spread"))
            assert int.from_bytes(read_frame(s)[:4], "big") == 800 + i
        wait_for(lambda: p.metric_sum("kqp_fleet_members") == 2, 15, "both workers in the fleet")
        log = p.log_text()
        assert "/w0 sharing usage" in log and "/w1 sharing usage" in log, log[-3000:]
        for s in socks:
            s.close()
        wait_for(lambda: len({f.name.rsplit("-", 1)[-1] for f in usage.rglob("*.parquet")}) >= 2, 10,
                 "a usage file from each worker")
    rows = [r for f in usage.rglob("*.parquet") for r in pq.read_table(f).to_pylist()]
    assert {r["proxy"] for r in rows} == {"host-a"}
    assert sum(r["requests"] for r in rows if r["client_id"] == "spread") == 2
