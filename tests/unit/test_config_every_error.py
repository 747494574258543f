"""A configuration's errors are found in one pass: every one named by its YAML path and value, a
misspelt key with the key it most likely meant; a number written as 1e6 is a number where a number
is expected; and a file with several errors is still refused as a whole, by a start, by
check-config and by a reload."""

from __future__ import annotations

import logging
from typing import ClassVar

import pytest

from config import ConfigError, ConfigErrors, parse_config
from config.loader import parse_quotas
from proxy.app.cli import main
from proxy.control.reload_watch import ConfigWatcher, read_config_file

UPSTREAM = {"bootstrap_servers": ["k:9092"]}

SEVERAL = """\
upstream:
  bootstrap_servers: ["k:9092", "no-port"]
  connect_timeout_s: ten
listen:
  bootstrap_port: 99999
metrics:
  prot: 9404
quotas:
  - user: alice
    producer_byte_rte: 1048576
  - client_id: app
    request_rate: -1
"""
SEVERAL_PATHS = [
    "quotas[0].producer_byte_rte",
    "quotas[1].request_rate",
    "upstream.bootstrap_servers[1]",
    "upstream.connect_timeout_s",
    "listen.bootstrap_port",
    "metrics.prot",
]


def _error(data) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return info.value


def test_every_error_of_a_file_is_reported_in_the_order_the_sections_are_read():
    import yaml

    error = _error(yaml.safe_load(SEVERAL))
    assert isinstance(error, ConfigErrors)
    assert [e.path for e in error.errors] == SEVERAL_PATHS
    assert error.path == SEVERAL_PATHS[0]
    messages = [str(e) for e in error.errors]
    assert "'no-port'" in messages[2] and "'ten'" in messages[3] and "99999" in messages[4]
    assert "-1" in messages[1]
    # One line holding them all: what a refused reload logs.
    assert "\n" not in str(error) and all(m in str(error) for m in messages)


def test_a_single_error_is_raised_as_before():
    error = _error({"upstream": UPSTREAM, "listen": {"bootstrap_port": 99999}})
    assert type(error) is ConfigError
    assert error.errors == (error,)
    assert str(error) == "listen.bootstrap_port: must be an integer in [0, 65535], got 99999"


@pytest.mark.parametrize("where, data, meant", [
    ("quotas[0].producer_byte_rte", {"quotas": [{"user": "a", "producer_byte_rte": 10}]}, "producer_byte_rate"),
    ("listen.bootstrap_prot", {"listen": {"bootstrap_prot": 1}}, "bootstrap_port"),
    ("qoutas", {"qoutas": []}, "quotas"),
    ("producer_id_quota.reacton", {"producer_id_quota": {"reacton": "delay"}}, "reaction"),
    ("upstream.sasl.pasword_file", {"upstream": {**UPSTREAM, "sasl": {
        "mechanism": "PLAIN", "username": "u", "password_file": "/p", "pasword_file": "/p"}}}, "password_file"),
])
def test_a_misspelt_key_names_the_key_it_most_likely_meant(where, data, meant):
    error = _error({"upstream": UPSTREAM, **data})
    assert error.path == where
    assert f"unknown key; did you mean {meant}?" in str(error)


def test_an_unknown_key_like_no_known_one_lists_the_allowed_keys():
    error = _error({"upstream": UPSTREAM, "metrics": {"zzz": 1}})
    assert "did you mean" not in str(error)
    assert "unknown key (allowed: enabled, host, max_entity_series, port)" in str(error)


def test_a_misspelt_quota_kind_is_not_also_reported_as_an_entry_with_no_quota():
    error = _error({"upstream": UPSTREAM, "quotas": [{"user": "a", "producer_byte_rte": 10}]})
    assert [e.path for e in error.errors] == ["quotas[0].producer_byte_rte"]


def test_a_section_that_is_not_a_mapping_is_one_error_not_one_per_required_key():
    error = _error({"upstream": "kafka:9092", "listen": {"tls": "on"}})
    assert [e.path for e in error.errors] == ["upstream", "listen.tls"]


def test_a_quota_entry_with_an_error_does_not_hide_the_next_entries_errors():
    error = _error({"upstream": UPSTREAM, "quotas": [
        {"user": "a", "producer_byte_rate": "fast"},
        {"user": "a", "client_id": "c", "producer_ids_rate": 5},
        {"client_id": "c", "mode": "dry-run", "request_rate": 1},
    ]})
    assert [e.path for e in error.errors] == [
        "quotas[0].producer_byte_rate", "quotas[1].producer_ids_rate", "quotas[2].mode"]


def test_record_quota_without_its_limiter_keeps_its_yaml_index_after_an_invalid_entry():
    error = _error({"upstream": UPSTREAM, "rate_limiters": ["quotas.limiters:BatchRateLimiter"], "quotas": [
        {"user": "a", "request_rate": 0},
        {"user": "b", "producer_record_rate": 10},
    ]})
    assert [e.path for e in error.errors] == ["quotas[0].request_rate", "quotas[1].producer_record_rate"]


def test_parse_quotas_reports_every_entry():
    with pytest.raises(ConfigErrors) as info:
        parse_quotas([{"user": "a", "request_rate": -1}, {"user": "b"}])
    assert [e.path for e in info.value.errors] == ["quotas[0].request_rate", "quotas[1]"]


# -- numbers written as 1e6 -------------------------------------------------------------------------


def _yaml_config(text: str):
    import yaml

    return parse_config(yaml.safe_load("upstream:\n  bootstrap_servers: ['k:9092']\n" + text))


def test_yaml_1_1_reads_1e6_as_a_string_so_the_loader_reads_it_as_the_number_it_spells():
    import yaml

    assert yaml.safe_load("x: 1e6") == {"x": "1e6"}  # PyYAML: a float needs a dot and a signed exponent
    c = _yaml_config("quotas:\n  - user: a\n    producer_byte_rate: 1e6\n    consumer_byte_rate: 2.5E+6\n"
                     "    request_rate: 1.5e3\n")
    assert dict(c.quotas[0].values) == {"producer_byte_rate": 1e6, "consumer_byte_rate": 2.5e6,
                                        "request_rate": 1500.0}


@pytest.mark.parametrize("text, read", [
    ("listen:\n  max_frame_bytes: 1e6\n", lambda c: c.listen.max_frame_bytes == 1_000_000),
    ("listen:\n  max_frame_bytes: 1.0e6\n", lambda c: c.listen.max_frame_bytes == 1_000_000),
    ("connections:\n  queued_max_request_bytes: 2e8\n", lambda c: c.connections.queued_max_request_bytes == 2 * 10**8),
    ("connections:\n  max_connection_creation_rate: 1e3\n",
     lambda c: c.connections.max_connection_creation_rate == 1000.0),
    ("connections:\n  connection_creation_rate_overrides: {10.0.0.1: 5e1}\n",
     lambda c: dict(c.connections.connection_creation_rate_overrides) == {"10.0.0.1": 50.0}),
    ("producer_id_quota:\n  producer_id_quota_false_positive_rate: 1e-3\n",
     lambda c: c.producer_id_quota.producer_id_quota_false_positive_rate == 0.001),
    ("quota_entities:\n  idle_seconds: 3.6e3\n", lambda c: c.quota_entities.idle_seconds == 3600.0),
    ("listen:\n  node_ports: {1: 2.9e4}\n", lambda c: dict(c.listen.node_ports) == {1: 29000}),
])
def test_exponent_notation_is_a_number_wherever_a_number_is_expected(text, read):
    assert read(_yaml_config(text))


@pytest.mark.parametrize("text, path, shown", [
    ("listen:\n  max_frame_bytes: 1e12\n", "listen.max_frame_bytes", "'1e12'"),  # the range still holds
    ("listen:\n  max_frame_bytes: 1.0e2\n", "listen.max_frame_bytes", "'1.0e2'"),  # below 1024
    ("listen:\n  bootstrap_port: 1.55e1\n", "listen.bootstrap_port", "'1.55e1'"),  # 15.5: not a whole number
    ("listen:\n  bootstrap_port: 1.9e+4\n", "listen.bootstrap_port", "19000.0"),  # a YAML float, as before
    ("quotas:\n  - user: a\n    producer_byte_rate: nan\n", "quotas[0].producer_byte_rate", "'nan'"),
    ("quotas:\n  - user: a\n    producer_byte_rate: inf\n", "quotas[0].producer_byte_rate", "'inf'"),
    ("quotas:\n  - user: a\n    producer_byte_rate: .inf\n", "quotas[0].producer_byte_rate", "inf"),
    ("quotas:\n  - user: a\n    producer_byte_rate: -1e6\n", "quotas[0].producer_byte_rate", "'-1e6'"),
    ("quotas:\n  - user: a\n    producer_ids_rate: 5e-1\n", "quotas[0].producer_ids_rate", "'5e-1'"),
    ("producer_id_quota:\n  producer_id_quota_false_positive_rate: 1e0\n",
     "producer_id_quota.producer_id_quota_false_positive_rate", "'1e0'"),
    ("quota_entities:\n  idle_seconds: 1e400\n", "quota_entities.idle_seconds", "'1e400'"),  # inf
    ("listen:\n  bootstrap_port: '19092'\n", "listen.bootstrap_port", "'19092'"),  # a quoted number stays text
])
def test_exponent_notation_is_still_checked_and_nan_and_inf_are_refused(text, path, shown):
    with pytest.raises(ConfigError) as info:
        _yaml_config(text)
    assert info.value.path == path
    assert shown in str(info.value), str(info.value)


def test_exponent_notation_is_not_read_where_text_is_expected():
    c = _yaml_config("quotas:\n  - client_id: 1e6\n    request_rate: 10\n")
    assert c.quotas[0].client_id == "1e6"


# -- refused as a whole -----------------------------------------------------------------------------


def test_check_config_lists_every_error_one_per_line(tmp_path, capsys):
    path = tmp_path / "several.yaml"
    path.write_text(SEVERAL)
    assert main(["check-config", str(path)]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    lines = out.err.splitlines()
    assert lines[0] == f"invalid configuration: {len(SEVERAL_PATHS)} errors in {path}"
    assert [line.split(":", 1)[0].strip() for line in lines[1:]] == SEVERAL_PATHS
    assert "did you mean producer_byte_rate?" in lines[1]


def test_check_config_names_the_file_whatever_the_error(tmp_path, capsys):
    """One error names the file as several do: a YAML syntax error with the file's own line and
    column (not PyYAML's "<unicode string>"), and a bad value before its YAML path."""
    broken = tmp_path / "broken.yaml"
    broken.write_text("upstream:\n  bootstrap_servers: ['k:9092']\nlisten:\n  host: 0.0.0.0\n  port: [1, 2\n")
    assert main(["check-config", str(broken)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"invalid configuration: {broken}: not valid YAML: "), err
    assert f'in "{broken}", line 5, column 9' in err and "<unicode string>" not in err, err
    one = tmp_path / "one.yaml"
    one.write_text("upstream:\n  bootstrap_servers: ['k:9092']\nlisten:\n  bootstrap_port: 99999\n")
    assert main(["check-config", str(one)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"invalid configuration: {one}: listen.bootstrap_port: must be an integer"), err
    assert err.count("\n") == 1, err


def test_a_reload_of_a_file_with_several_errors_changes_nothing_and_logs_them_all(tmp_path, caplog):
    path = tmp_path / "config.yaml"
    path.write_text("upstream:\n  bootstrap_servers: ['k:9092']\nmetrics:\n  enabled: false\n"
                    "quotas:\n  - user: alice\n    producer_byte_rate: 1e6\n")
    loaded = read_config_file(str(path))

    class Server:
        config = loaded.config
        applied: ClassVar[list[object]] = []

        def reload(self, config) -> None:
            self.applied.append(config)

    server = Server()
    watcher = ConfigWatcher(server, loaded)
    path.write_text("upstream:\n  bootstrap_servers: ['k:9092']\nmetrics:\n  enabled: false\n"
                    "quotas:\n  - user: alice\n    producer_byte_rate: 2e6\n"
                    "  - user: bob\n    producer_byte_rte: 1e6\nlisten:\n  bootstrap_port: -1\n")
    with caplog.at_level(logging.ERROR):
        assert not watcher.reload_now()
    assert server.applied == []
    (logged,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "previous configuration stays in force" in logged
    assert "quotas[1].producer_byte_rte: unknown key; did you mean producer_byte_rate?" in logged
    assert "listen.bootstrap_port: must be an integer in [0, 65535], got -1" in logged
