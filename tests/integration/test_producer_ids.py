"""KIP-936 producer-id quota end to end: the proxy process, the real broker, real producers.

Two tenants need two principals, and Tansu cannot authenticate, so Tansu sits behind
:class:`tests.support.sasl_front.SaslFront`, which answers SASL PLAIN and relays everything
else; the producers authenticate through the proxy, which believes a user only once the front
says yes (see tests/integration/test_sasl_front.py).

The quota window is shortened to WINDOW_S with LAYERS layers, so one run crosses several
windows and many layer rotations.

What the clients do with THROTTLING_QUOTA_EXCEEDED (89) on a Produce, as seen here:

* confluent-kafka / librdkafka 2.16: the error is permanent for the message; the delivery
  report fails at once with THROTTLING_QUOTA_EXCEEDED (and ``throttle_cb`` reports the throttle).
* kafka-python 3.0.12: ``ThrottlingQuotaExceededError`` is retriable; the batch is retried after
  the mute and succeeds once a token is back (if ``delivery_timeout_ms`` allows).
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
import uuid

import pytest

from tests.support.proxy_process import sum_samples
from tests.support.sasl_front import tansu_behind_sasl_front
from tests.support.tansu import TansuBroker
from tests.support.wire import is_closed
from tests.unit.test_records import batch, produce_frame

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

USERS = {"steady": "s-secret", "rogue-ck": "r1-secret", "rogue-kp": "r2-secret"}
QUOTA = 3  # new producer ids per window, every user (<default>)
WINDOW_S = 6.0
LAYERS = 3  # a new Bloom filter layer every 2 s
RUN_S = 14.0  # more than two windows, seven layer rotations
THROTTLING_QUOTA_EXCEEDED = 89


def _pid_quota(reaction: str = "reject", window_s: float = WINDOW_S, quota: int = QUOTA) -> dict:
    return {
        "quotas": [{"user": "<default>", "producer_ids_rate": quota}],
        "producer_id_quota": {
            "producer_id_quota_window_size_seconds": window_s,
            "producer_id_quota_cache_layer_count": LAYERS,
            "reaction": reaction,
        },
    }


def _topic(bootstrap: str) -> str:
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    name = f"pids-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10000, bootstrap_timeout_ms=10000)
    try:
        admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1)])
    finally:
        admin.close()
    return name


def _confluent(p, user: str, client_id: str, **extra):
    from confluent_kafka import Producer

    return Producer({"client.id": client_id, "bootstrap.servers": p.bootstrap, "security.protocol": "SASL_PLAINTEXT",
                     "sasl.mechanism": "PLAIN", "sasl.username": user, "sasl.password": USERS[user],
                     "enable.idempotence": True, "acks": "all", "linger.ms": 1, **extra})


def _kafka_python(p, user: str, **extra):
    from kafka import KafkaProducer

    return KafkaProducer(bootstrap_servers=p.bootstrap, security_protocol="SASL_PLAINTEXT",
                         sasl_mechanism="PLAIN", sasl_plain_username=user, sasl_plain_password=USERS[user],
                         enable_idempotence=True, acks="all", linger_ms=1, bootstrap_timeout_ms=10000,
                         **extra)


def _steady_confluent(p, topic: str, stop: threading.Event, out: dict) -> None:
    """One long-lived idempotent producer sending a record every 50 ms until told to stop."""
    throttles, errors, offsets = [], [], []
    producer = _confluent(p, "steady", throttle_cb=lambda e: throttles.append(e.throttle_time),
                          client_id="steady-ck")

    def on_delivery(err, msg):
        (errors if err is not None else offsets).append(err or msg.offset())

    sent_at: list[float] = []
    while not stop.is_set():
        sent_at.append(time.monotonic())
        producer.produce(topic, b"steady-ck-%d" % len(sent_at), on_delivery=on_delivery)
        producer.poll(0.05)
    producer.flush(30)
    out.update(sent=len(sent_at), sent_at=sent_at, offsets=offsets, errors=errors, throttles=throttles)


def _steady_kafka_python(p, topic: str, stop: threading.Event, out: dict) -> None:
    producer = _kafka_python(p, "steady", client_id="steady-kp", request_timeout_ms=10000)
    futures = []
    sent_at: list[float] = []
    try:
        while not stop.is_set():
            sent_at.append(time.monotonic())
            futures.append(producer.send(topic, b"steady-kp-%d" % len(futures)))
            time.sleep(0.05)
        producer.flush(30)
        results = []
        for f in futures:
            try:
                results.append(f.get(timeout=10).offset)
            except Exception as exc:  # collected, asserted empty below
                results.append(exc)
        out.update(sent=len(futures), sent_at=sent_at, offsets=[r for r in results if isinstance(r, int)],
                   errors=[r for r in results if not isinstance(r, int)])
    finally:
        producer.close(timeout=10)


ROGUE_CK_LOOPS = 2  # restart loops at once: a librdkafka producer takes 0.5-2.5 s to get its id


def _rogue_confluent(p, topic: str, stop: threading.Event, out: dict) -> None:
    """A new idempotent producer (so a new producer id) for every single record, in
    ROGUE_CK_LOOPS loops at once, so that new ids come faster than the quota's refill (QUOTA a
    window) however slowly one librdkafka producer starts."""
    # (before the producer was created, when its delivery report came, error code or 0): the
    # proxy decided on its new id somewhere between the two.
    outcomes: list[tuple[float, float, int]] = []

    def loop(k: int) -> None:
        n = 0
        while not stop.is_set():
            result: list[tuple[float, float, int]] = []
            created = time.monotonic()
            producer = _confluent(p, "rogue-ck", client_id=f"rogue-ck-{k}-{n}", **{"message.timeout.ms": 15000})
            producer.produce(topic, b"rogue-ck-%d-%d" % (k, n),
                             on_delivery=lambda err, _m, result=result, created=created: result.append(
                                 (created, time.monotonic(), err.code() if err else 0)))
            producer.flush(20)
            outcomes.extend(result)
            n += 1

    loops = [threading.Thread(target=loop, args=(k,)) for k in range(ROGUE_CK_LOOPS)]
    for t in loops:
        t.start()
    for t in loops:
        t.join(60)
    out.update(outcomes=sorted(outcomes))


def _rogue_kafka_python(p, topic: str, stop: threading.Event, out: dict) -> None:
    from kafka.errors import KafkaError

    outcomes: list[tuple[float, float, str]] = []  # (before the producer was created, the outcome's instant, what)
    n = 0
    while not stop.is_set():
        created = time.monotonic()
        producer = _kafka_python(p, "rogue-kp", client_id=f"rogue-kp-{n}", request_timeout_ms=5000,
                                 delivery_timeout_ms=15000)
        try:
            producer.send(topic, b"rogue-kp-%d" % n).get(timeout=20)
            outcomes.append((created, time.monotonic(), "ok"))
        except KafkaError as exc:
            outcomes.append((created, time.monotonic(), type(exc).__name__))
        finally:
            producer.close(timeout=5)
        n += 1
    out.update(outcomes=outcomes)


def _max_surely_in_one_window(spans: list[tuple[float, float]], window_s: float) -> int:
    """The most admissions that certainly fell inside one window of ``window_s``: each happened
    somewhere in its (from, to) span, so a set of them is certainly inside a window when the
    latest ``to`` is less than ``window_s`` after the earliest ``from``."""
    best = 0
    for start, _ in spans:
        best = max(best, sum(1 for a, b in spans if a >= start and b < start + window_s))
    return best


def _tokens_back_s(window_s: float) -> float:
    """At most how long after it was spent a producer-id token is back: a window, rounded up to
    the end of its slot (quotas/producer_ids.py WindowTokens, 256 slots), plus the millisecond clock."""
    return window_s + window_s / 256 + 0.001


@pytest.mark.slow
def test_rogue_tenants_are_rejected_while_long_lived_producers_never_are(proxy):
    with tansu_behind_sasl_front(USERS) as behind:
        p = proxy([behind.bootstrap], extra_config=_pid_quota())
        topic = _topic(p.bootstrap)
        stop = threading.Event()
        results = {name: {} for name in ("steady-ck", "steady-kp", "rogue-ck", "rogue-kp")}
        workers = [
            threading.Thread(target=_steady_confluent, args=(p, topic, stop, results["steady-ck"])),
            threading.Thread(target=_steady_kafka_python, args=(p, topic, stop, results["steady-kp"])),
        ]
        for w in workers:
            w.start()
        time.sleep(1.0)  # the steady producers have their ids before the rogues start
        rogues = [
            threading.Thread(target=_rogue_confluent, args=(p, topic, stop, results["rogue-ck"])),
            threading.Thread(target=_rogue_kafka_python, args=(p, topic, stop, results["rogue-kp"])),
        ]
        rogues_started = time.monotonic()
        for w in rogues:
            w.start()
        time.sleep(RUN_S)
        stopped_at = time.monotonic()
        stop.set()
        for w in workers + rogues:
            w.join(60)
        metrics = p.metrics()
        log = p.log_text()

    # The well-behaved tenant: two long-lived producers (one per client library), never rejected
    # across every layer rotation and window of the run.
    for name in ("steady-ck", "steady-kp"):
        r = results[name]
        assert r["errors"] == [], (name, r["errors"][:3])
        assert len(r["offsets"]) == r["sent"], name
        # It produced all through the rogues' run: a record in every layer's time (a new layer
        # every WINDOW_S / LAYERS) from before the rogues started to after they were told to stop,
        # however slowly this machine let it send.
        layer_s = WINDOW_S / LAYERS
        sent_at = r["sent_at"]
        assert sent_at[0] < rogues_started and sent_at[-1] >= stopped_at - layer_s, name
        gaps = [b - a for a, b in itertools.pairwise(sent_at)]
        assert max(gaps) < layer_s, (name, round(max(gaps), 3))
    assert results["steady-ck"]["throttles"] in ([], [0.0] * len(results["steady-ck"]["throttles"]))
    assert sum_samples(metrics, "kqp_producer_ids_user_rejected_total", user="steady") == 0
    assert sum_samples(metrics, "kqp_producer_ids_quota", user="steady") == QUOTA

    # librdkafka: a producer over the quota gets THROTTLING_QUOTA_EXCEEDED at once, and only then:
    # every refusal comes when QUOTA new ids were admitted in the window before it. Each decision
    # fell between its producer's creation and its delivery report, so an admission may count
    # towards a refusal when their spans allow it to lie within the time a token stays out.
    ck = sorted(results["rogue-ck"]["outcomes"], key=lambda o: o[1])
    shown = [(round(a - ck[0][0], 2), round(b - ck[0][0], 2), c) for a, b, c in ck]
    codes = [code for _, _, code in ck]
    assert set(codes) == {0, THROTTLING_QUOTA_EXCEEDED}, shown
    assert min(ck, key=lambda o: o[0])[2] == 0, shown  # the first producer created got its id
    admitted = [(a, b) for a, b, code in ck if code == 0]
    back_s = _tokens_back_s(WINDOW_S)
    for refused_from, refused_to in ((a, b) for a, b, code in ck if code == THROTTLING_QUOTA_EXCEEDED):
        spent = sum(1 for a, b in admitted if b > refused_from - back_s and a <= refused_to)
        assert spent >= QUOTA, shown
    # Never more than the quota in one window, and new ids again once tokens came back: over the
    # time from the first creation to the last report, at most QUOTA per started window.
    assert _max_surely_in_one_window(admitted, WINDOW_S) <= QUOTA, shown
    ck_span_s = max(b for _, b, _ in ck) - min(a for a, _, _ in ck)
    assert QUOTA < len(admitted) <= QUOTA * (1 + int(ck_span_s // WINDOW_S)), (ck_span_s, shown)

    # kafka-python retries error 89 after the mute: its producers all get through, slowly.
    kp = results["rogue-kp"]["outcomes"]
    kp_ok = [(a, b) for a, b, what in kp if what == "ok"]
    kp_span_s = max(b for _, b, _ in kp) - min(a for a, _, _ in kp)
    assert len(kp_ok) <= QUOTA * (1 + int(kp_span_s // WINDOW_S)), (kp_span_s, len(kp_ok))
    assert _max_surely_in_one_window(kp_ok, WINDOW_S) <= QUOTA
    assert sum_samples(metrics, "kqp_producer_ids_user_rejected_total", user="rogue-kp") > 0
    # Every refusal counted (the per-user count starts again when a user's state is dropped, once
    # no layer of it is live; the proxy-wide one never does).
    assert sum_samples(metrics, "kqp_producer_ids_rejected_total") >= len(ck) - len(admitted)
    # Every admitted id was counted once: two steady producers, and each rogue's admissions.
    assert sum_samples(metrics, "kqp_producer_ids_new_total") >= 2 + len(admitted) + len(kp_ok)
    # The three users, and no other: a rogue whose last new id is a window old by the time the
    # last of its producers has closed may have been dropped already (its layers expired).
    tracked = sum_samples(metrics, "kqp_producer_ids_tracked_users")
    assert 1 <= tracked <= 3
    assert tracked + sum_samples(metrics, "kqp_producer_ids_users_removed_total") >= 3
    assert "Traceback" not in log and "level=ERROR" not in log, log[-4000:]


def test_delay_reaction_holds_a_new_producer_until_a_token_comes_back(proxy):
    window_s = 3.0
    with tansu_behind_sasl_front(USERS) as behind:
        p = proxy([behind.bootstrap], extra_config=_pid_quota("delay", window_s=window_s, quota=1))
        topic = _topic(p.bootstrap)
        first_created = time.monotonic()  # its id was admitted after this
        first = _confluent(p, "rogue-ck", client_id="first")
        done: list[tuple[float, object]] = []
        first.produce(topic, b"first", on_delivery=lambda err, _m: done.append((time.monotonic(), err)))
        assert first.flush(10) == 0
        second = _confluent(p, "rogue-ck", client_id="second", **{"request.timeout.ms": 10000})
        second.produce(topic, b"second", on_delivery=lambda err, _m: done.append((time.monotonic(), err)))
        assert second.flush(20) == 0
        metrics = p.metrics()
    (t1, err1), (t2, err2) = done
    assert err1 is None and err2 is None  # librdkafka never sees an error: it only waited
    # The second id was admitted no sooner than a window after the first (whose admission came
    # after first_created, and whose report, t1, may come late), and reported after that.
    assert t1 >= first_created
    assert t2 - first_created >= window_s, (round(t2 - first_created, 3), round(t2 - t1, 3))
    assert sum_samples(metrics, "kqp_producer_ids_delayed_total") == 1
    assert sum_samples(metrics, "kqp_producer_ids_user_rejected_total", user="rogue-ck") == 0


def test_acks_0_produce_over_the_quota_closes_the_connection(proxy):
    """An acks=0 Produce gets no answer, so a rejection can only be told by closing; other
    connections keep working. (Raw frames: no client library sends idempotent acks=0.)"""
    from tests.support.wire import api_versions

    with TansuBroker() as broker:
        p = proxy([broker.bootstrap], extra_config=_pid_quota(quota=1))
        topic = _topic(p.bootstrap)
        host, port = p.address
        with socket.create_connection((host, port), timeout=5) as sock:
            for correlation_id, pid in ((1, 1001), (2, 1001), (3, 1002)):
                frame = bytearray(produce_frame(9, {topic: {0: batch(1, pid=pid, epoch=0, seq=correlation_id - 1)}},
                                                acks=0))
                frame[4:8] = correlation_id.to_bytes(4, "big")
                sock.sendall(len(frame).to_bytes(4, "big") + frame)
            assert is_closed(sock), "the proxy kept the connection of a rejected acks=0 produce"
        assert api_versions(p.address) is not None  # the proxy itself is fine
        metrics = p.metrics()
        log = p.log_text()
    assert sum_samples(metrics, "kqp_producer_ids_new_total") == 1
    assert sum_samples(metrics, "kqp_frames_rejected_total", reason="filter_close") == 1
    assert "acks=0" in log
