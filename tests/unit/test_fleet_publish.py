"""How a fleet member sends a report too large for one record: each record in a batch of its own,
and what landed is not carried to the next report (the topic's records are written by a fake
here: a broker refusing the second batch, as one refuses a batch over max.message.bytes, is what
no real broker here can be made to do on cue)."""

from __future__ import annotations

import asyncio

import pytest

from config.model import FleetConfig
from proxy.control.fleet import FleetExchange
from quotas import PRODUCER_BYTE_RATE, QuotaManager
from quotas.fleet import UsageEntry, UsageReport, decode_report, encode_chunks


def exchange() -> FleetExchange:
    return FleetExchange(FleetConfig(enabled=True, instance_id="a:9092"), None, QuotaManager([]),  # type: ignore[arg-type]
                         timeout_s=1.0, window_ms=1000)


def carried(n: int) -> dict[tuple[str, str | None, str | None], float]:
    return {(PRODUCER_BYTE_RATE, f"user-{i:05d}", None): float(i + 1) for i in range(n)}


def test_each_record_goes_alone_and_only_what_did_not_land_is_carried():
    fleet = exchange()
    fleet._carry = carried(2000)
    written: list[bytes] = []

    async def write(value: bytes, partition: int) -> None:
        assert partition == fleet.partition
        if len(written) == 2:
            raise OSError("MESSAGE_TOO_LARGE")
        written.append(value)

    fleet._write = write  # type: ignore[method-assign]
    report = UsageReport("a:9092", fleet.incarnation, 0, 0, 250,
                         tuple(UsageEntry(k, u, c, a) for (k, u, c), a in fleet._carry.items()))
    chunks = encode_chunks(report, max_bytes=4096)
    assert len(chunks) > 3
    with pytest.raises(OSError):
        asyncio.run(fleet._send(chunks, fleet.partition))
    sent = [e for v in written for e in decode_report(v).entries]
    assert fleet._seq == 2 and fleet.reports_sent == 2
    # What landed is not told twice; the rest is, under the next sequence numbers.
    assert not {(e.kind, e.user, e.client_id) for e in sent} & fleet._carry.keys()
    assert len(sent) + len(fleet._carry) == 2000


def test_chunks_carry_the_entries_their_records_hold():
    entries = tuple(UsageEntry(PRODUCER_BYTE_RATE, f"user-{i:05d}", None, float(i)) for i in range(2000))
    for value, carried_entries in encode_chunks(UsageReport("a", 1, 10, 5, 250, entries), max_bytes=4096):
        assert decode_report(value).entries == carried_entries


def test_the_fallback_starts_on_time_while_writes_and_reads_hang():
    """A usage topic that never answers (every write and read hangs until the 30 s timeout) still
    starts the fallback once ``member_timeout_ms`` has passed without a write or read: the check
    runs on a clock of its own, not after a hanging operation ends."""
    config = FleetConfig(enabled=True, instance_id="a:9092", sync_interval_ms=50, member_timeout_ms=300,
                         fallback="local")
    fleet = FleetExchange(config, None, QuotaManager([]), timeout_s=30.0, window_ms=1000)  # type: ignore[arg-type]

    async def hang(*_args) -> None:
        await asyncio.Event().wait()

    fleet._write = hang  # type: ignore[method-assign]
    fleet._reader.run = hang  # type: ignore[method-assign]

    async def scenario() -> tuple[bool, float]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        fleet.start("a:9092")
        try:
            await asyncio.sleep(0.1)
            early = fleet.fallback  # 100 ms in: well inside the member timeout
            while not fleet.fallback and loop.time() - started < 10:
                await asyncio.sleep(0.01)
            return early, loop.time() - started
        finally:
            await fleet.stop()

    early, engaged_s = asyncio.run(scenario())
    assert not early
    assert fleet.fallback and fleet.fallback_total == 1
    # Not before the member timeout; long before the hanging operations' 30 s timeout.
    assert 0.3 <= engaged_s < 10, engaged_s
