"""Shadow mode is one mechanism (proxy.dataplane.filters.shadow), which every quota filter goes
through: an enforced decision comes back as it is; a shadow one is noted on the request (its
longest throttle, a refusal), logged at most ten lines a minute, and the filter is handed
ADMIT, so nothing is applied. No other filter module writes the shadow fields or logs them.
What each filter does with it, enforced against shadow, is tests/unit/test_shadow_mode.py's."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from proxy.dataplane.filters import shadow
from proxy.dataplane.filters.shadow import applied, enforced, note_shadow
from proxy.dataplane.inflight import InFlight
from proxy.observability.logs import LogLimiter
from quotas import ADMIT
from quotas.common import Decision, ShadowDecision
from quotas.entities import ResolvedQuota
from tests.support.filter_context import filter_context

FILTERS = Path(__file__).resolve().parents[2] / "proxy" / "dataplane" / "filters"


@pytest.fixture
def lines(monkeypatch, caplog):
    """The shadow log lines, with a fresh limiter (ten a minute) for this test alone."""
    monkeypatch.setattr(shadow, "_lines", LogLimiter(shadow.log, lines=10, interval_s=60.0))
    caplog.set_level(logging.INFO, logger="proxy.shadow")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "proxy.shadow"]


def entry() -> InFlight:
    return InFlight(7, 0, 9, 0.0)


@pytest.mark.parametrize("decision", [ADMIT, Decision(True, 50), Decision(False, 30)])
def test_an_enforced_decision_is_applied_as_it_is(decision, lines):
    e = entry()
    assert applied(filter_context("alice"), e, "request_rate", decision) is decision
    assert (e.shadow_throttle_ms, e.shadow_rejected, e.throttle_ms, e.rejected) == (0, False, 0, False)
    assert lines() == []


def test_a_shadow_throttle_is_noted_and_logged_and_nothing_is_applied(lines):
    e, ctx = entry(), filter_context("alice", client_id="app")
    assert applied(ctx, e, "request_rate", ShadowDecision(True, 40)) is ADMIT
    assert applied(ctx, e, "producer_byte_rate", ShadowDecision(True, 25)) is ADMIT
    assert (e.shadow_throttle_ms, e.shadow_rejected, e.throttle_ms) == (40, False, 0)  # the longest
    assert lines() == ["shadow: test (user=alice client_id=app) would have been throttled 40 ms by request_rate",
                       "shadow: test (user=alice client_id=app) would have been throttled 25 ms by producer_byte_rate"]


def test_a_shadow_refusal_is_noted_and_logged_and_the_request_admitted(lines):
    e = entry()
    decided = applied(filter_context("bob"), e, "producer_ids_rate", ShadowDecision(False, 70), "a Produce")
    assert decided is ADMIT and decided.admitted and decided.throttle_ms == 0
    assert (e.shadow_throttle_ms, e.shadow_rejected, e.rejected) == (70, True, False)
    assert lines() == ["shadow: test (user=bob client_id=c) would have had a Produce refused by producer_ids_rate "
                       "(THROTTLING_QUOTA_EXCEEDED, throttle 70 ms)"]


def test_a_shadow_decision_that_would_do_nothing_notes_nothing(lines):
    e = entry()
    assert applied(filter_context("alice"), e, "request_rate", ShadowDecision(True, 0)) is ADMIT
    note_shadow(filter_context("alice"), e, "SomeLimiter", 0)
    assert (e.shadow_throttle_ms, e.shadow_rejected) == (0, False) and lines() == []


def test_one_line_for_several_refusals(lines):
    e = entry()
    note_shadow(filter_context("alice"), e, "controller_mutation_rate", 900, "2 of 3 topics")
    assert e.shadow_rejected and e.shadow_throttle_ms == 900
    assert lines() == ["shadow: test (user=alice client_id=c) would have had 2 of 3 topics refused by "
                       "controller_mutation_rate (THROTTLING_QUOTA_EXCEEDED, throttle 900 ms)"]


def test_at_most_ten_lines_a_minute_every_request_noted(lines):
    entries = [entry() for _ in range(12)]
    for e in entries:
        applied(filter_context("alice"), e, "request_rate", ShadowDecision(True, 5))
    assert len(lines()) == 10
    assert all(e.shadow_throttle_ms == 5 for e in entries)


def test_enforced_is_the_quota_that_may_change_a_request():
    quota = ResolvedQuota("consumer_byte_rate", 100.0, "alice", None, 3)
    assert enforced(quota) is quota
    assert enforced(quota._replace(shadow=True)) is None
    assert enforced(None) is None


def test_no_filter_but_the_mechanism_writes_or_logs_what_shadow_mode_did():
    """The mechanism is the only place: the quota filters go through it."""
    writes = re.compile(r"\.shadow_throttle\(|\.shadow_rejected\s*=|\.shadow_throttle_ms\s*=|\"proxy\.shadow\"")
    offenders = [p.name for p in sorted(FILTERS.glob("*.py"))
                 if p.name != "shadow.py" and writes.search(p.read_text(encoding="utf-8"))]
    assert offenders == []
    users = {p.name for p in FILTERS.glob("*.py") if "from proxy.dataplane.filters.shadow import" in p.read_text()}
    assert users == {"quotas.py", "limiters.py", "producer_ids.py", "controller_mutation.py"}
