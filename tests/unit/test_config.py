"""Config loading: the example loads; every error names the YAML path and the bad value."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import pytest

from config import Config, ConfigError, load_config, parse_config
from config.loader import split_host_port

EXAMPLE = Path(__file__).resolve().parents[2] / "config" / "example.yaml"

VALID = {
    "upstream": {"bootstrap_servers": ["kafka-1:9092", "[::1]:9093"]},
    "listen": {"bootstrap_port": 19092, "broker_port_base": 19100, "node_ports": {1: 29001}},
    "metrics": {"port": 9404, "enabled": False},
}


def _with(path: str, value):
    """VALID with the value at dotted ``path`` replaced (``...`` deletes it)."""
    data = copy.deepcopy(VALID)
    *parents, leaf = path.split(".")
    node = data
    for p in parents:
        node = node.setdefault(p, {})
    if value is ...:
        node.pop(leaf, None)
    else:
        node[leaf] = value
    return data


def test_example_config_loads():
    cfg = load_config(EXAMPLE)
    assert isinstance(cfg, Config)
    assert cfg.upstream.bootstrap_servers == ("127.0.0.1:9092",)
    assert cfg.upstream.connect_timeout_s == 10.0
    assert cfg.upstream.connect_attempts == 3
    assert cfg.upstream.metadata_refresh_interval_s == 30.0
    assert (cfg.listen.host, cfg.listen.advertised_host) == ("127.0.0.1", "127.0.0.1")
    assert (cfg.listen.bootstrap_port, cfg.listen.broker_port_base) == (19092, 19100)
    assert dict(cfg.listen.node_ports) == {}
    assert cfg.listen.max_frame_bytes == 104857600
    assert (cfg.metrics.host, cfg.metrics.port, cfg.metrics.enabled) == ("127.0.0.1", 9404, True)


def test_defaults_with_only_upstream():
    cfg = parse_config({"upstream": {"bootstrap_servers": ["k:9092"]}})
    assert cfg.listen.bootstrap_port == 9092
    assert cfg.listen.max_frame_bytes == 104_857_600
    assert cfg.metrics.enabled is True


def test_valid_config_values():
    cfg = parse_config(VALID)
    assert cfg.upstream.bootstrap_servers == ("kafka-1:9092", "[::1]:9093")
    assert dict(cfg.listen.node_ports) == {1: 29001}
    assert cfg.metrics.enabled is False


def test_config_is_frozen():
    cfg = parse_config(VALID)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.listen.bootstrap_port = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.listen.node_ports[2] = 1  # type: ignore[index]
    assert isinstance(cfg.upstream.bootstrap_servers, tuple)


def test_empty_sections_take_defaults():
    cfg = parse_config({"upstream": {"bootstrap_servers": ["k:1"]}, "listen": None, "metrics": {}})
    assert cfg.listen.host == "127.0.0.1"


@pytest.mark.parametrize(
    "data, path, value",
    [
        ({**VALID, "quotas_typo": {}}, "quotas_typo", "unknown key"),
        (_with("listen.bootstrap_prot", 1), "listen.bootstrap_prot", "unknown key"),
        (_with("upstream.servers", ["a:1"]), "upstream.servers", "unknown key"),
        (_with("metrics.path", "/m"), "metrics.path", "unknown key"),
    ],
)
def test_unknown_keys(data, path, value):
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert info.value.path == path
    assert str(info.value).startswith(f"{path}: ")
    assert value in str(info.value)


# (dotted path to change, bad value, the path the error must name[, the value it must show])
BAD_VALUES = [
    # wrong types
    ("listen.bootstrap_port", "19092", "listen.bootstrap_port"),
    ("listen.bootstrap_port", 19092.5, "listen.bootstrap_port"),
    ("listen.bootstrap_port", True, "listen.bootstrap_port"),
    ("listen.broker_port_base", [1], "listen.broker_port_base"),
    ("listen.host", 127, "listen.host"),
    ("listen.host", "", "listen.host"),
    ("listen.advertised_host", None, "listen.advertised_host"),
    ("listen.max_frame_bytes", "1MiB", "listen.max_frame_bytes"),
    ("listen.node_ports", [29001], "listen.node_ports"),
    ("upstream.connect_timeout_s", "10s", "upstream.connect_timeout_s"),
    ("upstream.connect_timeout_s", False, "upstream.connect_timeout_s"),
    ("upstream.connect_attempts", 2.5, "upstream.connect_attempts"),
    ("upstream.metadata_refresh_interval_s", None, "upstream.metadata_refresh_interval_s"),
    ("upstream.bootstrap_servers", "kafka:9092", "upstream.bootstrap_servers"),
    ("upstream.bootstrap_servers", [], "upstream.bootstrap_servers"),
    ("upstream.bootstrap_servers", ..., "upstream.bootstrap_servers"),
    ("metrics.enabled", "yes", "metrics.enabled"),
    ("metrics.host", ["a"], "metrics.host"),
    ("listen", ["not", "a", "mapping"], "listen"),
    ("upstream", "kafka:9092", "upstream"),
    # bad ports
    ("listen.bootstrap_port", -1, "listen.bootstrap_port"),
    ("listen.bootstrap_port", 65536, "listen.bootstrap_port"),
    ("listen.broker_port_base", 70000, "listen.broker_port_base"),
    ("metrics.port", -5, "metrics.port"),
    ("listen.node_ports", {1: 65536}, "listen.node_ports.1", 65536),
    ("listen.node_ports", {1: "29001"}, "listen.node_ports.1", "29001"),
    ("listen.node_ports", {-1: 29001}, "listen.node_ports.-1", -1),
    ("listen.node_ports", {"one": 29001}, "listen.node_ports.one", "one"),
    # out of range
    ("upstream.connect_timeout_s", 0, "upstream.connect_timeout_s"),
    ("upstream.connect_attempts", 0, "upstream.connect_attempts"),
    ("upstream.connect_attempts", 101, "upstream.connect_attempts"),
    ("upstream.metadata_refresh_interval_s", -1, "upstream.metadata_refresh_interval_s"),
    ("listen.max_frame_bytes", 100, "listen.max_frame_bytes"),
    ("listen.max_frame_bytes", 2**31, "listen.max_frame_bytes"),
]


def _value_in_message(value, message: str) -> bool:
    if value is ...:
        return "None" in message
    return repr(value) in message


@pytest.mark.parametrize("case", BAD_VALUES, ids=[f"{c[0]}={c[1]!r}" for c in BAD_VALUES])
def test_bad_values_name_path_and_value(case):
    where, value, path = case[:3]
    shown = case[3] if len(case) > 3 else value
    with pytest.raises(ConfigError) as info:
        parse_config(_with(where, value))
    message = str(info.value)
    assert info.value.path == path
    assert message.startswith(f"{path}: ")
    assert _value_in_message(shown, message), message


BAD_SERVERS = [
    "kafka", "kafka:", ":9092", "kafka:0", "kafka:65536", "kafka:abc", "kafka:-1", "kafka: 9092", 9092, None
]


@pytest.mark.parametrize("server", BAD_SERVERS, ids=[repr(s) for s in BAD_SERVERS])
def test_bad_host_port(server):
    data = _with("upstream.bootstrap_servers", ["good:9092", server])
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert info.value.path == "upstream.bootstrap_servers[1]"
    assert repr(server) in str(info.value)
    assert "host:port" in str(info.value)


@pytest.mark.parametrize(
    "server, expected",
    [("kafka:9092", ("kafka", 9092)), ("[::1]:9093", ("::1", 9093)), ("10.0.0.1:1", ("10.0.0.1", 1))],
)
def test_split_host_port(server, expected):
    assert split_host_port(server) == expected


def test_missing_upstream():
    with pytest.raises(ConfigError) as info:
        parse_config({"listen": {}})
    assert info.value.path == "upstream"
    assert "required" in str(info.value)


def test_root_must_be_a_mapping():
    with pytest.raises(ConfigError) as info:
        parse_config(["upstream"])
    assert "['upstream']" in str(info.value)


def test_load_config_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(missing)
    assert str(missing) in str(info.value)


def test_load_config_invalid_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("upstream: [unclosed\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert str(bad) in str(info.value) and "YAML" in str(info.value)
    assert f'in "{bad}", line 1' in str(info.value) and "<unicode string>" not in str(info.value)


def test_load_config_reports_yaml_path(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("upstream:\n  bootstrap_servers: ['k:9092']\nlisten:\n  bootstrap_port: 99999\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"^listen\.bootstrap_port: .*99999"):
        load_config(f)


@pytest.mark.parametrize("key", ["connect_timeout_s", "metadata_refresh_interval_s"])
def test_nan_durations_are_rejected(key):
    with pytest.raises(ConfigError) as info:
        parse_config(_with(f"upstream.{key}", math.nan))
    assert info.value.path == f"upstream.{key}"
    assert "nan" in str(info.value)


@pytest.mark.parametrize(("value", "count"), [(None, 1), (3, 3), ("auto", 0), ({"count": "auto"}, 0),
                                              ({"count": 2, "drain_timeout_ms": 0}, 2)])
def test_workers_is_a_count_auto_or_a_mapping(value, count):
    assert parse_config({**VALID, "workers": value}).workers.count == count


@pytest.mark.parametrize(("value", "where"), [
    (0, "workers"), ("many", "workers"), (True, "workers"), (257, "workers"), ({"count": 0}, "workers.count"),
    ({"heartbeat_timeout_ms": 1500}, "workers.heartbeat_timeout_ms"),
    ({"sync_interval_ms": 5}, "workers.sync_interval_ms"),
    ({"drain_ms": 1}, "workers.drain_ms"),
])
def test_a_bad_workers_setting_names_its_path(value, where):
    with pytest.raises(ConfigError) as err:
        parse_config({**VALID, "workers": value})
    assert str(err.value).startswith(f"{where}:"), err.value


def test_fleet_aggregation_is_flat_or_owners():
    assert parse_config(VALID).fleet.aggregation == "flat"
    assert parse_config({**VALID, "fleet": {"aggregation": "owners", "partitions": 32}}).fleet.aggregation == "owners"


@pytest.mark.parametrize(("fleet", "where", "said"), [
    ({"aggregation": "tree"}, "fleet.aggregation", "'tree'"),
    ({"aggregation": "owners", "topic": "t" * 243}, "fleet.topic", "-totals"),
])
def test_a_bad_fleet_aggregation_names_its_path(fleet, where, said):
    with pytest.raises(ConfigError) as err:
        parse_config({**VALID, "fleet": fleet})
    assert str(err.value).startswith(f"{where}:") and said in str(err.value), err.value
