"""``fleet.aggregation: owners``: each partition of the usage topic (its entities' usage) summed
by one member, every member reading the sums. Real proxy processes in front of one Tansu, greedy confluent-kafka
producers as in test_fleet: the semantics users rely on are the flat exchange's, and an owner
killed with SIGKILL hands its partitions over within ``member_timeout_ms`` + one interval."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from quotas import PRODUCER_BYTE_RATE
from quotas.fleet_totals import entity_partition, owner_of
from tests.integration.test_fleet import FLEET_AT_MOST, QUOTA, RUN_S, WINDOWS, greedy, run
from tests.support.proxy_process import ProxyProcess, start_proxies
from tests.support.rate_runs import fresh_topic
from tests.support.tansu import TansuBroker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PARTITIONS = 3
SYNC_MS = 250
TIMEOUT_MS = 2000
OWNERS = {"enabled": True, "aggregation": "owners", "partitions": PARTITIONS, "sync_interval_ms": SYNC_MS,
          "member_timeout_ms": TIMEOUT_MS}


@pytest.fixture
def broker():
    with TansuBroker() as b:
        yield b


def owners_fleet(broker: TansuBroker, client_ids: tuple[str, ...], n: int,
                 instance_ids: list[str] | None = None) -> list[ProxyProcess]:
    extra = {"quota_windows": WINDOWS, "fleet": OWNERS,
             "quotas": [{"user": "<default>", "client_id": c, "producer_byte_rate": QUOTA} for c in client_ids]}
    if instance_ids is None:
        return start_proxies([broker.bootstrap], n, extra)
    out: list[ProxyProcess] = []
    try:
        for instance_id in instance_ids:
            config = dict(extra, fleet=dict(OWNERS, instance_id=instance_id))
            out.append(ProxyProcess([broker.bootstrap], extra_config=config).start())
    except BaseException:
        for p in out:
            p.stop()
        raise
    return out


# The producers' entity (an anonymous principal, the client id's own entry): the partition its
# usage is summed in.
TENANT = (PRODUCER_BYTE_RATE, "ANONYMOUS", "tenant")


def victim_owns_the_tenant() -> list[str]:
    """Three instance ids, the last owning, while all three are live, the partition ``tenant``'s
    usage is summed in: killing it leaves the producers' usage unsummed until the takeover."""
    return next(ids for k in range(1000) for ids in [[f"a{k}", f"b{k}", f"v{k}"]]
                if owner_of(entity_partition(TENANT, PARTITIONS), ids) == ids[2])


def settled(fleet: list[ProxyProcess], timeout_s: float = 20.0) -> float:
    """Seconds until every member counts them all and the partitions have one owner each."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if (all(p.metric_sum("kqp_fleet_members") == len(fleet) for p in fleet)
                and sum(p.metric_sum("kqp_fleet_partitions_owned") for p in fleet) == PARTITIONS):
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError("the fleet did not settle: " + str(
        [(p.metric_sum("kqp_fleet_members"), p.metric_sum("kqp_fleet_partitions_owned")) for p in fleet]))


@pytest.mark.slow
def test_owners_hold_one_producer_byte_rate_across_the_fleet(broker):
    """As test_fleet's flat exchange: a greedy producer through each of three members holds
    ``tenant`` to what one proxy alone lets through, and a principal on one member keeps its
    whole quota; the usage went through the owners' totals, and the members' reports were read
    by their owners only."""
    alone = start_proxies([broker.bootstrap], 1, {"quota_windows": WINDOWS, "quotas": [
        {"user": "<default>", "client_id": "solo", "producer_byte_rate": QUOTA}]})
    fleet = owners_fleet(broker, ("tenant", "lonely"), 3)
    try:
        settled(fleet)
        topics = {c: fresh_topic(broker, c) for c in ("solo", "tenant", "lonely")}
        loads = ([(alone[0].bootstrap, "solo", topics["solo"], 1.0)]
                 + [(p.bootstrap, "tenant", topics["tenant"], 1.0) for p in fleet]
                 + [(fleet[0].bootstrap, "lonely", topics["lonely"], 1.0)])
        results = run(loads)
        solo, shared, lonely = results[0][0], sum(r[0] for r in results[1:4]), results[4][0]
        ratio = shared / solo
        print(f"owners: three members together {ratio:.3f} x one proxy alone; per member "
              f"{[round(r[0] / solo, 3) for r in results[1:4]]}; one member alone {lonely / solo:.3f}")
        assert 0.8 <= ratio <= FLEET_AT_MOST, ratio
        assert 0.8 <= lonely / solo <= 1.1, lonely / solo
        for p in fleet:
            assert p.metric_sum("kqp_fleet_fallback") == 0
            assert p.metric_sum("kqp_fleet_remote_entries_total") > 0
        assert sum(p.metric_sum("kqp_fleet_totals_sent_total") for p in fleet) > 0
    finally:
        for p in alone + fleet:
            p.stop()


@pytest.mark.slow
def test_a_killed_owner_is_taken_over_without_a_burst(broker):
    """Three members, greedy producers of ``tenant`` through two of them; the third, which owns
    the partition ``tenant`` is summed in, is killed with SIGKILL. The survivors own
    every partition again within ``member_timeout_ms`` + one interval (and some slack for this
    machine's scheduling), and what the two producers get over the run stays within what the
    fleet lets through with no failure (the burst pacing holds each member to its part of what
    the window allows while the others' usage is late)."""
    fleet = owners_fleet(broker, ("tenant",), 3, victim_owns_the_tenant())
    try:
        settled(fleet)
        victim = 2
        assert fleet[victim].metric_sum("kqp_fleet_partitions_owned") >= 1
        survivors = [p for i, p in enumerate(fleet) if i != victim]
        topic = fresh_topic(broker, "tenant")
        start = threading.Barrier(3)
        results: list[list[int]] = [[], []]
        threads = [threading.Thread(target=greedy, args=(p.bootstrap, "tenant", topic, start, RUN_S, results[i]),
                                    daemon=True) for i, p in enumerate(survivors)]
        for t in threads:
            t.start()
        start.wait(60)
        time.sleep(RUN_S / 2)
        os.kill(fleet[victim].process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while sum(p.metric_sum("kqp_fleet_partitions_owned") for p in survivors) < PARTITIONS:
            assert time.monotonic() - killed_at < 3 * (TIMEOUT_MS + SYNC_MS) / 1000, "not taken over"
            time.sleep(0.02)
        takeover_s = time.monotonic() - killed_at
        for t in threads:
            t.join(RUN_S + 60)
        got = sum(r[0] for r in results) / RUN_S / QUOTA
        print(f"partitions taken over {takeover_s:.2f} s after the SIGKILL (member timeout {TIMEOUT_MS} ms); "
              f"two producers got {got:.3f} x the quota")
        # The takeover: the member timeout, then the next read of the totals (one interval).
        assert takeover_s <= (TIMEOUT_MS + 2 * SYNC_MS) / 1000 + 0.5, takeover_s
        for p in survivors:
            assert p.metric_sum("kqp_fleet_members") == 2
        # One burst at most: the quota over the run plus what the window allows once more.
        assert got <= 1 + WINDOWS["quota_window_num"] / RUN_S, got
    finally:
        for p in fleet:
            p.stop()


def test_hostile_records_on_the_totals_topic_change_nothing(broker):
    """Garbage, a cut record, a made-up owner's totals of a huge amount, totals of a partition
    that does not exist and, under the real owner's id, a NaN and an impossible range, written
    to the totals topic by another producer: each counted by reason, none applied, no one made a
    member, no fallback."""
    import math
    import struct

    from kafka import KafkaProducer

    from quotas.fleet import UsageEntry
    from quotas.fleet_totals import Totals, encode_totals

    (p,) = owners_fleet(broker, ("tenant",), 1, ["owner-a"])
    try:
        settled([p])
        partition = entity_partition(TENANT, PARTITIONS)

        def totals(owner: str, amount: float, start: int = 0, end: int = 1, at: int = partition) -> bytes:
            return encode_totals(Totals(owner, 1, at, start, end, int(time.time() * 1000), 250,
                                        (UsageEntry(*TENANT, amount),)))[0]

        good = totals("owner-a", 1.0)
        records = {
            "not_totals": b"\x00garbage\xff" * 3,
            "truncated": good[:-3],
            "not_owner": totals("mallory", 1e12),
            "bad_amount": good[:-8] + struct.pack(">d", math.nan),
            "bad_range": good[:17] + struct.pack(">qq", 10, 5) + good[33:],
        }
        writer = KafkaProducer(bootstrap_servers=broker.bootstrap)
        for value in records.values():
            writer.send("__kqp_quota_usage-totals", value)
        writer.send("__kqp_quota_usage-totals", totals("owner-a", 1e6, at=PARTITIONS + 5))  # no such partition
        writer.flush(10)
        writer.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and p.metric_sum("kqp_fleet_records_ignored_total") < 6:
            time.sleep(0.1)
        for reason in ("not_totals", "truncated", "bad_amount", "bad_range"):
            assert p.metric_sum("kqp_fleet_records_ignored_total", reason=reason) == 1, reason
        assert p.metric_sum("kqp_fleet_records_ignored_total", reason="not_owner") == 2
        assert p.metric_sum("kqp_fleet_remote_entries_total") == 0
        assert p.metric_sum("kqp_fleet_members") == 1
        assert p.metric_sum("kqp_fleet_partitions_owned") == PARTITIONS
        assert p.metric_sum("kqp_fleet_fallback") == 0
        assert "Traceback" not in p.log_text()
    finally:
        p.stop()


@pytest.mark.slow
def test_a_restarted_member_reads_the_totals_inside_the_window_and_does_not_burst(broker):
    """As with the flat exchange: a member started while the tenant's window is full of the
    fleet's usage reads the totals inside it first (whoever owned them then), so a greedy
    producer through it gets no fresh burst."""
    fleet = owners_fleet(broker, ("tenant",), 2)
    late: list[ProxyProcess] = []
    try:
        settled(fleet)
        topic = fresh_topic(broker, "restart")
        run([(p.bootstrap, "tenant", topic, 4.0 / RUN_S) for p in fleet])  # 4 s: the window fills up
        fleet[1].process.kill()
        fleet[1].process.wait(5)
        deadline = time.monotonic() + TIMEOUT_MS / 1000 + 10
        while fleet[0].metric_sum("kqp_fleet_members") != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        late = owners_fleet(broker, ("tenant",), 1)
        settled([fleet[0], late[0]])
        (after_restart,) = run([(late[0].bootstrap, "tenant", topic, 2.0 / RUN_S)])[0]
        print(f"owners: restarted member admitted {after_restart / QUOTA:.2f} x quota in 2 s")
        assert after_restart <= 3.0 * QUOTA, after_restart / QUOTA  # a fresh burst would be ~10 x quota
    finally:
        for p in fleet + late:
            p.stop()
