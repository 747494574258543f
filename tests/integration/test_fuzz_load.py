"""Malformed frames by the thousand, over many connections, through the real proxy process in
front of Tansu: the proxy stays small, logs a bounded number of lines and no traceback, and a
client beside the attack is served throughout.

The frames are the malformed bodies of tests/unit/test_malformed_bodies.py (truncated,
bit-flipped, lying lengths) for every (API, version) the proxy's filters parse, with every
quota configured (far above what the load reaches, so each request is parsed and charged but
never throttled).
"""

from __future__ import annotations

import asyncio
import random
import re
import struct
import threading
import time

import pytest

from protocol.apis import SPECS
from tests.support.proxy_process import ProxyProcess
from tests.support.tansu import TansuBroker
from tests.support.wire import api_versions
from tests.unit.test_malformed_bodies import Proxy as InProcessChain
from tests.unit.test_malformed_bodies import body_variants, request_frame, request_pairs

pytestmark = pytest.mark.integration

CONNECTIONS = 2000
FRAMES_PER_CONNECTION = 10
EVERY_QUOTA = {kind: 1e12 for kind in (
    "request_rate", "producer_byte_rate", "consumer_byte_rate", "producer_record_rate", "consumer_record_rate",
    "producer_batch_rate")} | {"controller_mutation_rate": 1e9, "producer_ids_rate": 1e9}


def _malformed_frames(tmp_path, n: int) -> list[bytes]:
    """``n`` size-prefixed malformed request frames, a seeded sample over every pair."""
    chain = InProcessChain(tmp_path).chain
    frames = []
    for key, version in request_pairs(chain):
        if version > SPECS[key].max_version:
            continue
        frame, offset = request_frame(key, version)
        frames += [f for _, f in body_variants(SPECS[key].request, key, version, frame, offset, "request")]
    rng = random.Random(16)
    return [struct.pack(">i", len(f)) + f for f in rng.sample(frames, min(n, len(frames)))]


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


async def _attack(address, frames: list[bytes]) -> int:
    """Every connection sends its frames and waits for the proxy to close it (or answer all);
    returns how many the proxy closed."""
    sem = asyncio.Semaphore(200)

    async def one(i: int) -> bool:
        async with sem:
            reader, writer = await asyncio.open_connection(*address)
            try:
                chunk = b"".join(frames[(i * FRAMES_PER_CONNECTION + j) % len(frames)]
                                 for j in range(FRAMES_PER_CONNECTION))
                writer.write(chunk)
                try:
                    while await asyncio.wait_for(reader.read(1 << 16), 10):
                        pass
                    return True  # closed by the proxy
                except TimeoutError:
                    return False  # answered and left open
            except ConnectionError:
                return True
            finally:
                writer.close()

    return sum(await asyncio.gather(*(one(i) for i in range(CONNECTIONS))))


def test_malformed_frames_by_the_thousand_cost_little_memory_and_few_log_lines(tmp_path):
    frames = _malformed_frames(tmp_path, 5000)
    assert len(frames) == 5000
    with TansuBroker() as broker, ProxyProcess([broker.bootstrap], extra_config={
        "quotas": [{"user": "<default>", **{k: v for k, v in EVERY_QUOTA.items() if k != "producer_ids_rate"}},
                   {"user": "ANONYMOUS", "producer_ids_rate": 1e9}],
    }) as p:
        for _ in range(5):
            assert api_versions(p.address).error_code == 0
        time.sleep(1.0)
        idle_kib = _rss_kib(p.pid)
        peak = [idle_kib]
        bystander_errors: list[str] = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], _rss_kib(p.pid))
                try:
                    if api_versions(p.address).error_code != 0:
                        bystander_errors.append("error code")
                except Exception as exc:
                    bystander_errors.append(repr(exc))
                done.wait(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        started = time.monotonic()
        try:
            closed = asyncio.run(_attack(p.address, frames))
        finally:
            done.set()
            watcher.join()
        took_s = time.monotonic() - started
        log = p.log_text()
        metrics = p.metrics()

    rejected = sum(v for (name, _), v in metrics.items() if name == "kqp_frames_rejected_total")
    warnings = [line for line in log.splitlines() if "level=WARNING" in line or "level=ERROR" in line]
    print(f"\n{CONNECTIONS} connections x {FRAMES_PER_CONNECTION} frames in {took_s:.1f} s: {closed} closed by the "
          f"proxy, {rejected:.0f} rejections counted, {len(warnings)} warning/error lines, "
          f"RSS idle {idle_kib / 1024:.1f} MiB, peak {peak[0] / 1024:.1f} MiB")
    assert "Traceback" not in log, log[-5000:]
    assert closed >= CONNECTIONS // 2 and rejected >= closed // 2
    # At most 10 lines per reason per 10 s (a handful of reasons), however many connections.
    assert len(warnings) <= 10 * 8 * (took_s / 10 + 2), warnings[:40]
    assert peak[0] <= 2 * idle_kib
    assert not bystander_errors, bystander_errors[:5]
