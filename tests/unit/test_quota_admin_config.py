"""The quota_admin section: who may describe and alter client quotas through the Admin API.
Every error names the YAML path and the value."""

from __future__ import annotations

import pytest

from config import ConfigError, parse_config
from config.model import QuotaAdminConfig

BASE = {"upstream": {"bootstrap_servers": ["k:9092"]}}


def admin(**settings) -> QuotaAdminConfig:
    return parse_config({**BASE, "quota_admin": settings}).quota_admin


def error(**settings) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        admin(**settings)
    return info.value


def test_defaults_off_admins_only_and_the_topic():
    a = parse_config(BASE).quota_admin
    assert a == QuotaAdminConfig()
    assert (a.enabled, a.principals, a.describe, a.topic) == (False, (), "admins", "__kqp_client_quotas")
    assert not a.may_alter("ANONYMOUS") and not a.may_describe("ANONYMOUS")


def test_principals_are_plain_names_and_kafka_user_prefix_is_removed():
    a = admin(enabled=True, principals=["alice", "User:bob", "ANONYMOUS", "alice"])
    assert a.principals == ("alice", "bob", "ANONYMOUS")  # each once, in order
    assert a.may_alter("bob") and not a.may_alter("User:bob")
    assert a.may_describe("alice") and not a.may_describe("carol")


def test_describe_anyone_lets_every_principal_describe_but_not_alter():
    a = admin(enabled=True, principals=["alice"], describe="anyone")
    assert a.may_describe("carol") and not a.may_alter("carol")


def test_a_null_section_is_the_defaults():
    assert parse_config({**BASE, "quota_admin": None}).quota_admin == QuotaAdminConfig()


@pytest.mark.parametrize("topic", ["quotas", "a" * 249, "my.quotas_v-1", "..."])
def test_topic_names_kafka_accepts(topic):
    assert admin(topic=topic).topic == topic


@pytest.mark.parametrize(("settings", "path", "message"), [
    ({"enabled": "yes"}, "quota_admin.enabled", "must be true or false, got 'yes'"),
    ({"principals": "alice"}, "quota_admin.principals", "must be a list of principal names, got 'alice'"),
    ({"principals": ["alice", ""]}, "quota_admin.principals[1]", "got ''"),
    ({"principals": ["User:"]}, "quota_admin.principals[0]", "got 'User:'"),
    ({"principals": [7]}, "quota_admin.principals[0]", "got 7"),
    ({"principals": [None]}, "quota_admin.principals[0]", "got None"),
    ({"describe": "everyone"}, "quota_admin.describe", "must be anyone or admins, got 'everyone'"),
    ({"describe": True}, "quota_admin.describe", "got True"),
    ({"topic": ""}, "quota_admin.topic", "must be a Kafka topic name"),
    ({"topic": "a" * 250}, "quota_admin.topic", "1 to 249"),
    ({"topic": "my topic"}, "quota_admin.topic", "got 'my topic'"),
    ({"topic": "quotas/v1"}, "quota_admin.topic", "got 'quotas/v1'"),
    ({"topic": "."}, "quota_admin.topic", "not . or .."),  # Kafka's Topic.validate
    ({"topic": ".."}, "quota_admin.topic", "got '..'"),
    ({"topic": 5}, "quota_admin.topic", "got 5"),
    ({"principal": ["alice"]}, "quota_admin.principal", "unknown key"),
])
def test_errors_name_the_path_and_the_value(settings, path, message):
    exc = error(**settings)
    assert exc.path == path
    assert str(exc).startswith(f"{path}: ")
    assert message in str(exc)


def test_the_section_must_be_a_mapping():
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, "quota_admin": ["alice"]})
    assert info.value.path == "quota_admin"


def test_the_store_is_the_topic_unless_memory_is_asked():
    assert admin().store == "topic"
    assert admin(store="memory").store == "memory"
    e = error(store="redis")
    assert e.path == "quota_admin.store" and "'redis'" in str(e)
