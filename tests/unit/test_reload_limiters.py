"""Reload swaps the rate limiters and the producer-id reaction along with the quotas; a limiter
that refuses its new configuration leaves everything as it was."""

from __future__ import annotations

import pytest

from config import ConfigError, parse_config
from proxy.app.server import ProxyServer
from quotas.limiters import BatchRateLimiter, RecordRateLimiter
from tests.unit.test_quota_config import ConfiguredLimiter

BASE = {"upstream": {"bootstrap_servers": ["127.0.0.1:9"]}, "metrics": {"enabled": False}}


class Refusing(ConfiguredLimiter):
    closed = 0

    def configure(self, context):
        if context.settings.get("refuse"):
            raise ValueError("not today")

    def close(self):
        Refusing.closed += 1


def server(**sections) -> ProxyServer:
    return ProxyServer(parse_config({**BASE, **sections}))


def test_reload_adds_a_limiter_so_a_new_record_quota_is_enforced():
    s = server(rate_limiters=["quotas.limiters:BatchRateLimiter"])
    assert s.limiter_filter._by_key == {}
    s.reload(parse_config({**BASE, "rate_limiters": ["quotas.limiters:BatchRateLimiter",
                                                     "quotas.limiters:RecordRateLimiter"],
                           "quotas": [{"client_id": "x", "producer_record_rate": 10}],
                           "producer_id_quota": {"reaction": "delay"}}))
    assert [type(lim) for lim in s.limiters] == [BatchRateLimiter, RecordRateLimiter]
    assert [type(lim) for lim in s.limiter_filter._by_key[0]] == [RecordRateLimiter]
    assert s.producer_id_filter.reaction == "delay"
    assert s.config.producer_id_quota.reaction == "delay"


def test_a_refused_reload_changes_nothing_and_removed_limiters_are_closed():
    target = "tests.unit.test_reload_limiters:Refusing"
    s = server(rate_limiters=[target], quotas=[{"user": "a", "request_rate": 5}])
    before = list(s.limiters)
    with pytest.raises(ConfigError) as info:
        s.reload(parse_config({**BASE, "rate_limiters": [{"class": target, "config": {"refuse": True}}],
                               "quotas": [{"user": "a", "request_rate": 1}]}))
    assert info.value.path == "rate_limiters[0]"
    assert s.limiters == before and s.quotas.rules[0].values["request_rate"] == 5
    closed = Refusing.closed
    s.reload(parse_config({**BASE, "rate_limiters": ["quotas.limiters:RecordRateLimiter"]}))
    assert Refusing.closed == closed + 1
