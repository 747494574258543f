"""Safe reload in the real proxy process, in front of a real Tansu broker.

The issue's row: "config file truncated by a non-atomic write, before ``quotas:`` — applied:
every quota dropped, the producer ran at 115 × its old quota". Here a producer sends Produce
requests back to back under ``producer_byte_rate``, and the configuration file (``quotas:``
last, as a hand-written file often has it) goes through:

A. an in-place write in two parts: everything before ``quotas:`` (a valid configuration with no
   quotas), a pause longer than the old watcher's 1 s poll but shorter than the debounce, then
   the rest, which changes another entry. Only the complete file is applied, once: the
   producer's quota never leaves (no removal logged, its ``kqp_quota_bound`` stays, its rate
   stays near the quota);
B. a rename that really removes an entry: applied, with that entity named at WARNING;
C. an in-place write that stays cut before ``quotas:``: refused at ERROR (``quotas`` missing while
   quotas are in force), by the watcher once and by SIGHUP again; the producer stays held to
   its quota (before: SIGHUP applied the cut file, and the producer ran at 64 × its quota);
D. an explicit ``quotas: []`` and SIGHUP: applied, the producer's lost quota named at WARNING.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import struct
import threading
import time

import pytest
import yaml
from kafka.protocol.producer import ProduceRequest, ProduceResponse
from kafka.record import MemoryRecordsBuilder

from tests.support.polling import wait_for
from tests.support.rate_runs import fresh_topic, rate_in_window
from tests.support.tansu import TansuBroker
from tests.support.wire import read_frame, request_bytes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

PRODUCER = "reload-producer"
QUOTA = 64 * 1024  # producer_byte_rate, bytes/s
DEBOUNCE_MS = 2000
PAUSE_S = 1.1  # between the two parts of write A: > the old 1 s poll, < the debounce
PRODUCE_VERSION = 7

PRODUCER_QUOTA = f"  - client_id: {PRODUCER}\n    producer_byte_rate: {QUOTA}\n"
OTHER_QUOTA = "  - client_id: other-app\n    request_rate: {rate}\n"


@pytest.fixture
def broker():
    with TansuBroker() as b:
        yield b


class GreedyProducer(threading.Thread):
    """Produce requests of ~8 KiB back to back on one raw connection (acks=1); keeps an
    ``(instant, request bytes)`` event per acknowledged request."""

    def __init__(self, address, topic: str) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_connection(address, timeout=10)
        self.topic = topic
        self.events: list[tuple[float, int]] = []
        self.throttled = 0
        self.failure: BaseException | None = None
        self.stopping = threading.Event()

    def run(self) -> None:
        try:
            correlation_id = 0
            while not self.stopping.is_set():
                correlation_id += 1
                self._round_trip(correlation_id)
        except BaseException as exc:  # reported by stop()
            self.failure = exc

    def _round_trip(self, correlation_id: int) -> None:
        data = request_bytes(self._request(), correlation_id, PRODUCER)
        self.sock.sendall(data)
        frame = read_frame(self.sock)
        assert frame is not None, "the proxy closed the producer's connection"
        assert struct.unpack(">i", frame[:4])[0] == correlation_id
        resp = ProduceResponse.decode(frame[4:], version=PRODUCE_VERSION)
        assert resp.responses[0].partition_responses[0].error_code == 0, resp
        self.throttled += resp.throttle_time_ms > 0
        self.events.append((time.monotonic(), len(data)))

    def _request(self):
        b = MemoryRecordsBuilder(2, 0, 1 << 20)
        b.append(timestamp=int(time.time() * 1000), key=None, value=b"v" * 8000, headers=[])
        b.close()
        T = ProduceRequest[PRODUCE_VERSION].TopicProduceData
        return ProduceRequest[PRODUCE_VERSION](transactional_id=None, acks=1, timeout_ms=5000, topic_data=[
            T(name=self.topic, partition_data=[T.PartitionProduceData(index=0, records=bytes(b.buffer()))])])

    def stop(self) -> None:
        self.stopping.set()
        self.join(10)
        self.sock.close()
        if self.failure is not None:
            raise self.failure


def _write_in_place(path, text: str, mode: str = "w") -> None:
    with open(path, mode) as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _replace(path, text: str) -> None:
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    os.replace(tmp, path)


def _lines(p, pattern: str) -> list[str]:
    return [ln for ln in p.log_text().splitlines() if re.search(pattern, ln)]


def _wait_for_log(p, pattern: str, count: int = 1, timeout_s: float = 15.0) -> float:
    """Waits until ``pattern`` occurs ``count`` times in the proxy's log (a file written by
    another process: nothing to wait on but the file itself); returns when."""
    deadline = time.monotonic() + timeout_s
    while len(_lines(p, pattern)) < count:
        assert time.monotonic() < deadline, f"{pattern!r} not logged {count} times:\n{p.log_text()[-3000:]}"
        time.sleep(0.05)
    return time.monotonic()


def _bound(p) -> float:
    return p.metric_sum("kqp_quota_bound", kind="producer_byte_rate", client_id=PRODUCER)


def test_a_config_cut_short_by_a_write_in_place_never_drops_the_quota(broker, proxy):
    topic = fresh_topic(broker, "reload-safety")
    p = proxy([broker.bootstrap], extra_config={
        "quota_windows": {"quota_window_num": 2, "quota_window_size_seconds": 1},  # 1 s of burst
        "reload": {"debounce_ms": DEBOUNCE_MS},
        "quotas": [{"client_id": PRODUCER, "producer_byte_rate": QUOTA},
                   {"client_id": "other-app", "request_rate": 100}],
    })
    path = p.config_path
    # The same settings with quotas: last, as a hand-written file often has it.
    head = yaml.safe_dump({k: v for k, v in p.config.items() if k != "quotas"})
    producer = GreedyProducer(p.address, topic)
    producer.start()
    try:
        # Past the first burst a fresh entity may send (one 1 s window of quota): throttled once.
        wait_for(lambda: producer.throttled > 0, what="the producer's first throttle")
        assert _bound(p) == QUOTA

        # A. In place, in two parts, the first of which is a valid file with no quotas.
        written = time.monotonic()
        _write_in_place(path, head)
        time.sleep(PAUSE_S)
        _write_in_place(path, "quotas:\n" + PRODUCER_QUOTA + OTHER_QUOTA.format(rate=200), mode="a")
        reloaded = _wait_for_log(p, r"reloaded: 2 quota entries in force \(0 added, 0 removed, 1 changed\)")
        time.sleep(0.5)
        rate = rate_in_window(producer.events, written, time.monotonic())
        print(f"\nwrite A applied {reloaded - written:.2f} s after it began; "
              f"producer at {rate / QUOTA:.2f} x its quota")
        assert rate < 1.5 * QUOTA, f"the producer ran at {rate / QUOTA:.1f} x its quota during the write"
        assert _lines(p, "reload removes|refused") == []
        assert len(_lines(
            p, r'level=INFO .*msg="reload changes request_rate of client_id=other-app from 100 to 200"')) == 1
        assert _bound(p) == QUOTA

        # B. A rename that really removes an entry: applied, the entity named at WARNING.
        _replace(path, head + "quotas:\n" + PRODUCER_QUOTA)
        _wait_for_log(p, r"reloaded: 1 quota entry in force \(0 added, 1 removed, 0 changed\)")
        [removed] = _lines(p, "reload removes")
        assert 'level=WARNING logger=proxy.app.server msg="reload removes the quotas of client_id=other-app ' \
               '(request_rate=200)"' in removed
        assert _bound(p) == QUOTA

        # C. Cut before quotas: and left so: refused by the watcher, then by SIGHUP; the quota stays.
        throttled = producer.throttled
        cut = time.monotonic()
        _write_in_place(path, head)
        _wait_for_log(p, "refused")
        os.kill(p.pid, signal.SIGHUP)
        sighup = _wait_for_log(p, "refused", count=2)
        time.sleep(3.0)
        rate = rate_in_window(producer.events, cut, time.monotonic())
        print(f"cut file refused, SIGHUP refused: producer at {rate / QUOTA:.2f} x its quota "
              f"over the {time.monotonic() - cut:.1f} s from the cut write ({time.monotonic() - sighup:.1f} s "
              "after SIGHUP)")
        refusals = _lines(p, "refused")
        assert len(refusals) == 2  # once by the watcher (however many polls), once for SIGHUP
        for refused in refusals:
            assert "level=ERROR" in refused
            assert (f"reload of {path} refused, the configuration in force stays: quotas: missing (no key, or "
                    "nothing under it) while 1 quota entry is in force") in refused
            assert "write quotas: []" in refused
        assert _lines(p, f"reload removes the quotas of client_id={PRODUCER}|reloaded: 0") == []
        assert _bound(p) == QUOTA
        assert producer.throttled > throttled  # still held to its quota
        assert rate < 1.5 * QUOTA, f"the producer ran at {rate / QUOTA:.1f} x its quota after the cut file"

        # D. The explicit removal, applied by SIGHUP (at once: within the watcher's debounce).
        _write_in_place(path, head + "quotas: []\n")
        os.kill(p.pid, signal.SIGHUP)
        _wait_for_log(p, r"reloaded: 0 quota entries in force \(0 added, 1 removed, 0 changed\)")
        assert len(_lines(p, f'level=WARNING .*reload removes the quotas of client_id={PRODUCER} '
                             f'\\(producer_byte_rate={QUOTA}\\)')) == 1
        assert _bound(p) == 0
    finally:
        producer.stop()

    assert p.stop() == 0
    log = p.log_text()
    errors = [ln for ln in log.splitlines() if "level=ERROR" in ln]
    assert "Traceback" not in log and errors == refusals, log[-3000:]
