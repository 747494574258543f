"""The quota sections of the configuration: quotas, producer_id_quota (KIP-936) and
rate_limiters (KIP-731). Every error names the YAML path and the value."""

from __future__ import annotations

import pytest

from config import ConfigError, parse_config
from config.model import DEFAULT_RATE_LIMITERS, ProducerIdQuota
from quotas.limiters import BatchRateLimiter, RateLimiter, RecordRateLimiter

BASE = {"upstream": {"bootstrap_servers": ["k:9092"]}}


def cfg(**sections):
    return parse_config({**BASE, **sections})


def error(**sections) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        cfg(**sections)
    return info.value


class NotALimiter:
    pass


class ConfiguredLimiter(RateLimiter):
    def accumulate(self, usage, now_ms):
        pass

    def throttle_ms(self, usage, now_ms):
        return 0


def test_kip_936_settings_default_to_the_kip():
    c = cfg()
    p = c.producer_id_quota
    assert p == ProducerIdQuota()
    assert (p.producer_id_quota_window_size_seconds, p.producer_id_quota_window_num) == (3600, 11)
    assert (p.producer_id_quota_cache_layer_count, p.producer_id_quota_false_positive_rate) == (4, 0.001)
    assert p.producer_id_quota_cache_cleanup_interval_ms == 10
    assert p.reaction == "reject"
    s = p.settings()
    assert (s.window_ms, s.window_num, s.layer_count, s.false_positive_rate, s.cleanup_interval_ms) == (
        3_600_000, 11, 4, 0.001, 10)


def test_kip_936_settings_and_producer_ids_rate_load():
    c = cfg(
        producer_id_quota={"producer_id_quota_window_size_seconds": 2.5, "producer_id_quota_cache_layer_count": 5,
                           "producer_id_quota_false_positive_rate": 0.01, "reaction": "delay"},
        quotas=[{"user": "alice", "producer_ids_rate": 100}, {"user": "<default>", "producer_ids_rate": 5}],
    )
    assert c.producer_id_quota.settings().window_ms == 2500
    assert c.producer_id_quota.reaction == "delay"
    assert [dict(r.values) for r in c.quotas] == [{"producer_ids_rate": 100.0}, {"producer_ids_rate": 5.0}]


@pytest.mark.parametrize("key,value", [
    ("producer_id_quota_window_size_seconds", 0),
    ("producer_id_quota_window_size_seconds", "1h"),
    ("producer_id_quota_window_num", 0),
    ("producer_id_quota_cache_layer_count", 1.5),
    ("producer_id_quota_false_positive_rate", 0),
    ("producer_id_quota_false_positive_rate", 1),
    ("producer_id_quota_false_positive_rate", True),
    ("producer_id_quota_cache_cleanup_interval_ms", 0),
    ("reaction", "drop"),
])
def test_bad_kip_936_settings_name_path_and_value(key, value):
    e = error(producer_id_quota={key: value})
    assert e.path == f"producer_id_quota.{key}"
    assert repr(value) in str(e)


def test_unknown_kip_936_key_is_named():
    e = error(producer_id_quota={"producer.id.quota.window.num": 3})
    assert e.path == "producer_id_quota.producer.id.quota.window.num"


@pytest.mark.parametrize("entry,path", [
    ({"user": "alice", "client_id": "c", "producer_ids_rate": 10}, "quotas[0].producer_ids_rate"),
    ({"client_id": "c", "producer_ids_rate": 10}, "quotas[0].producer_ids_rate"),
    ({"user": "alice", "producer_ids_rate": 0.5}, "quotas[0].producer_ids_rate"),
    ({"user": "alice", "producer_ids_rate": -1}, "quotas[0].producer_ids_rate"),
    ({"user": "alice", "producer_record_rate": 0}, "quotas[0].producer_record_rate"),
    ({"user": "alice", "consumer_record_rate": "fast"}, "quotas[0].consumer_record_rate"),
])
def test_bad_quota_values(entry, path):
    assert error(quotas=[entry]).path == path


def test_record_quotas_load_with_the_built_in_limiters():
    c = cfg(quotas=[{"client_id": "connector-producer-orders-*", "producer_record_rate": 1000,
                     "producer_batch_rate": 50, "consumer_record_rate": 2000}])
    assert c.rate_limiters == DEFAULT_RATE_LIMITERS
    assert [s.cls for s in c.rate_limiters] == [RecordRateLimiter, BatchRateLimiter]


def test_rate_limiters_by_dotted_path_with_settings():
    c = cfg(rate_limiters=[
        "quotas.limiters:RecordRateLimiter",
        {"class": "tests.unit.test_quota_config:ConfiguredLimiter", "config": {"pause_ms": 5}},
    ])
    assert [s.cls for s in c.rate_limiters] == [RecordRateLimiter, ConfiguredLimiter]
    assert dict(c.rate_limiters[1].settings) == {"pause_ms": 5}


def test_a_record_quota_without_its_limiter_is_refused():
    e = error(rate_limiters=["quotas.limiters:BatchRateLimiter"],
              quotas=[{"user": "a", "producer_batch_rate": 5}, {"user": "b", "producer_record_rate": 5}])
    assert e.path == "quotas[1].producer_record_rate"
    assert "RecordRateLimiter" in str(e)
    e = error(rate_limiters=[], quotas=[{"user": "a", "producer_batch_rate": 5}])
    assert e.path == "quotas[0].producer_batch_rate"


@pytest.mark.parametrize("entry,path,words", [
    ("quotas.limiters.RecordRateLimiter", "rate_limiters[0]", "package.module:ClassName"),
    ("no_such_module_here:Limiter", "rate_limiters[0]", "cannot import"),
    ("quotas.limiters:NoSuchLimiter", "rate_limiters[0]", "has no"),
    ("tests.unit.test_quota_config:NotALimiter", "rate_limiters[0]", "not a quotas.limiters.RateLimiter"),
    (42, "rate_limiters[0]", "42"),
    ({"config": {}}, "rate_limiters[0].class", "required"),
    ({"class": "quotas.limiters:RecordRateLimiter", "config": [1]}, "rate_limiters[0].config", "mapping"),
    ({"class": "quotas.limiters:RecordRateLimiter", "cfg": {}}, "rate_limiters[0].cfg", "unknown key"),
])
def test_bad_rate_limiters_name_the_entry(entry, path, words):
    e = error(rate_limiters=[entry])
    assert e.path == path
    assert words in str(e)


def test_a_limiter_listed_twice_is_refused():
    e = error(rate_limiters=["quotas.limiters:RecordRateLimiter", "quotas.limiters:RecordRateLimiter"])
    assert e.path == "rate_limiters[1]"


class StrictLimiter(ConfiguredLimiter):
    @classmethod
    def check_settings(cls, settings):
        if not isinstance(settings.get("pause_ms"), int):
            raise ValueError(f"pause_ms must be an integer, got {settings.get('pause_ms')!r}")


def test_a_limiter_checks_its_own_settings_at_load_time():
    target = "tests.unit.test_quota_config:StrictLimiter"
    assert cfg(rate_limiters=[{"class": target, "config": {"pause_ms": 5}}]).rate_limiters[0].cls is StrictLimiter
    e = error(rate_limiters=["quotas.limiters:RecordRateLimiter", {"class": target, "config": {"pause_ms": "x"}}])
    assert e.path == "rate_limiters[1].config"
    assert "'x'" in str(e)
