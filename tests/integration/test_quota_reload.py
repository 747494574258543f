"""Quota reload in the real proxy process: on a change of the file and on SIGHUP.

One client connection stays open through every step, so each step also shows that a reload
keeps connections (the same socket keeps being answered, and the proxy counts one connection).

1. ``request_rate: 5`` for the client id: back-to-back requests are throttled.
2. The file is rewritten with ``request_rate: 5000``: the watcher reloads it ("reloaded" in the
   log) and within a few seconds the same connection is no longer throttled.
3. The file is rewritten with ``request_rate: -1``: "reload of <file> rejected" names the YAML
   path ``quotas[0].request_rate``, and 5000 stays in force.
4. The file is rewritten with ``request_rate: 10`` keeping its size and modification time, so the
   watcher cannot see it: nothing changes until SIGHUP, which reloads it and throttles again.
"""

from __future__ import annotations

import copy
import os
import re
import signal
import socket
import struct
import time

import pytest
import yaml
from kafka.protocol.metadata import ApiVersionsRequest, ApiVersionsResponse

from tests.support.tansu import TansuBroker
from tests.support.wire import read_frame, request_bytes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

CLIENT_ID = "reload-client"
WINDOWS = {"quota_window_num": 2, "quota_window_size_seconds": 1}  # request throttles ≤ 1 s


@pytest.fixture
def broker():
    with TansuBroker() as b:
        yield b


class Client:
    """One raw connection sending ApiVersions back to back (each waits for its answer)."""

    def __init__(self, address) -> None:
        self.sock = socket.create_connection(address, timeout=10)
        self.local_address = self.sock.getsockname()
        self.correlation_id = 0

    def round_trip(self) -> int:
        """The answer's throttle_time_ms."""
        self.correlation_id += 1
        request = ApiVersionsRequest[3](client_software_name="it-reload", client_software_version="1")
        self.sock.sendall(request_bytes(request, self.correlation_id, CLIENT_ID))
        frame = read_frame(self.sock)
        assert frame is not None, "the proxy closed the connection"
        assert struct.unpack(">i", frame[:4])[0] == self.correlation_id
        resp = ApiVersionsResponse.decode(frame[4:], version=3)
        assert resp.error_code == 0
        return resp.throttle_time_ms

    def throttles(self, n: int) -> list[int]:
        """The throttle_time_ms of ``n`` round trips."""
        return [self.round_trip() for _ in range(n)]

    def close(self) -> None:
        self.sock.close()


def _config_with_rate(p, request_rate) -> str:
    config = copy.deepcopy(p.config)
    config["quotas"] = [{"client_id": CLIENT_ID, "request_rate": request_rate}]
    return yaml.safe_dump(config)


def _replace_config(p, text: str, keep_stat: bool = False) -> None:
    """Atomically replaces the config file (the watcher never reads half a file); with
    ``keep_stat`` the file is instead rewritten in place (same inode) with its old size and
    modification time, a change no stat can see."""
    path = p.config_path
    old = os.stat(path)
    if keep_stat:
        assert len(text.encode()) == old.st_size
        with open(path, "r+b") as f:
            f.write(text.encode())
        os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))
        return
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    os.replace(tmp, path)


def _count(p, pattern: str) -> int:
    return len(re.findall(pattern, p.log_text()))


def _wait_for_log(p, pattern: str, count: int, timeout_s: float = 15.0) -> float:
    """Waits until ``pattern`` occurs ``count`` times in the proxy's log; returns when."""
    deadline = time.monotonic() + timeout_s
    while _count(p, pattern) < count:
        assert time.monotonic() < deadline, f"{pattern!r} not logged {count} times:\n{p.log_text()[-3000:]}"
        time.sleep(0.05)
    return time.monotonic()


def _bound(p) -> float:
    return p.metric_sum("kqp_quota_bound", kind="request_rate", client_id=CLIENT_ID)


RELOADED = r'msg="reloaded: 1 quota entry in force \(0 added, 0 removed, 1 changed\), 2 rate limiters"'


def test_reload_on_file_change_and_sighup_keeps_connections(broker, proxy):
    p = proxy([broker.bootstrap], extra_config={
        "quota_windows": dict(WINDOWS), "quotas": [{"client_id": CLIENT_ID, "request_rate": 5}],
    })
    client = Client(p.address)
    try:
        # 1. Throttled at 5 requests/s.
        assert max(client.throttles(12)) > 0
        assert _bound(p) == 5

        # 2. A valid file with a higher quota: the same connection stops being throttled.
        # Applied when the watcher sees it settle (how soon is the machine's business); every
        # request decided after that (the log line comes once the new rules are in force) is
        # answered unthrottled.
        written = time.monotonic()
        _replace_config(p, _config_with_rate(p, 5000))
        reloaded = _wait_for_log(p, RELOADED, 1)
        print(f"\nfile change: reloaded within {reloaded - written:.2f} s of the write")
        assert client.throttles(20) == [0] * 20
        assert _count(p, RELOADED) == 1
        assert _bound(p) == 5000
        assert p.metric_sum("kqp_open_connections") == 1
        assert client.sock.getsockname() == client.local_address

        # 3. An invalid file: rejected with its YAML path, the previous quota stays in force.
        _replace_config(p, _config_with_rate(p, -1))
        _wait_for_log(p, r"reload of \S+ rejected", 1)
        [line] = [ln for ln in p.log_text().splitlines() if "reload of" in ln]
        assert f"reload of {p.config_path} rejected" in line
        assert "quotas[0].request_rate: must be a positive number, got -1" in line
        assert _count(p, RELOADED) == 1
        assert _bound(p) == 5000
        assert client.throttles(30) == [0] * 30

        # 4. A change the watcher cannot see (same size and mtime): only SIGHUP applies it.
        _replace_config(p, _config_with_rate(p, 10), keep_stat=True)
        time.sleep(1.5)  # more than the watcher's 1 s poll
        assert _count(p, RELOADED) == 1 and _bound(p) == 5000
        signalled = time.monotonic()
        os.kill(p.pid, signal.SIGHUP)
        reloaded = _wait_for_log(p, RELOADED, 2)
        print(f"SIGHUP: reloaded within {reloaded - signalled:.2f} s")
        assert _bound(p) == 10
        # The same connection is throttled again (its recent requests count under the new bound).
        assert any(client.round_trip() > 0 for _ in range(30))
        assert p.metric_sum("kqp_open_connections") == 1
        assert client.sock.getsockname() == client.local_address
    finally:
        client.close()

    assert p.stop() == 0
    log = p.log_text()
    assert "Traceback" not in log
    errors = [ln for ln in log.splitlines() if "level=ERROR" in ln]
    assert len(errors) == 1 and "reload of" in errors[0], errors
