"""The configuration watcher (``proxy.control.reload_watch.ConfigWatcher``) on a real file, with time
passed in.

Each test writes the file the way a tool would (in place in parts, cut short, removed, replaced
by a rename) and calls ``poll_at`` at chosen instants, so the debounce is exercised without
waiting for it, or ``reload_now`` as SIGHUP does. ``FakeServer`` records what was applied. Then
a file that leaves out a section in force (refused on both paths), and what ``ProxyServer.reload``
logs about the quotas it changes.
"""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
import yaml

from config import parse_config
from config.model import DEFAULT_RATE_LIMITERS
from proxy.app.server import ProxyServer
from proxy.control import reload_watch
from proxy.control.reload_watch import ConfigWatcher, read_config_file, watch_config
from quotas.changes import quota_changes
from quotas.entities import QuotaRule

HEAD = """\
upstream:
  bootstrap_servers: ["127.0.0.1:9"]
metrics:
  enabled: false
reload:
  debounce_ms: {debounce_ms}
  require_atomic_rename: {atomic}
"""
QUOTAS = """\
quotas:
  - user: alice
    client_id: app-1
    producer_byte_rate: 1048576
  - client_id: other
    request_rate: {request_rate}
"""
DEBOUNCE_S = 0.5


class FakeServer:
    """Stands for ProxyServer: holds the configuration in force, records each reload."""

    def __init__(self, config) -> None:
        self.config = config
        self.applied = []

    def reload(self, config) -> None:
        self.applied.append(config)
        self.config = config


def head(atomic: bool = False) -> str:
    return HEAD.format(debounce_ms=int(DEBOUNCE_S * 1000), atomic=str(atomic).lower())


def full(request_rate: int = 10, atomic: bool = False) -> str:
    return head(atomic) + QUOTAS.format(request_rate=request_rate)


@pytest.fixture
def path(tmp_path):
    p = tmp_path / "config.yaml"
    p.write_text(full())
    return p


def watching(path) -> tuple[ConfigWatcher, FakeServer]:
    loaded = read_config_file(str(path))
    server = FakeServer(loaded.config)
    return ConfigWatcher(server, loaded), server


def write_in_place(path, text: str, mode: str = "w") -> None:
    """One write(2) into the same inode, as a tool that does not rename does."""
    with open(path, mode) as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def replace_atomically(path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def rates(config) -> dict:
    return {(r.user, r.client_id): dict(r.values) for r in config.quotas}


def messages(caplog, level=logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


# -- debounce ---------------------------------------------------------------------------------


def test_a_file_written_in_place_in_two_parts_is_applied_once_complete_and_once_only(path, caplog):
    watcher, server = watching(path)
    write_in_place(path, head())  # cut before quotas: a valid configuration without quotas
    assert not watcher.poll_at(10.0)
    assert not watcher.poll_at(10.0 + DEBOUNCE_S - 0.1)  # not settled yet
    write_in_place(path, QUOTAS.format(request_rate=20), mode="a")
    assert not watcher.poll_at(10.45)  # changed again: the debounce starts over
    assert not watcher.poll_at(10.45 + DEBOUNCE_S - 0.01)
    assert watcher.poll_at(10.45 + DEBOUNCE_S)
    assert [rates(c)[(None, "other")] for c in server.applied] == [{"request_rate": 20.0}]
    assert not any(watcher.poll_at(t) for t in (12.0, 13.0, 20.0))
    assert len(server.applied) == 1
    assert messages(caplog) == []  # the part without quotas was never even considered


def test_a_file_written_again_just_as_it_is_read_is_read_again_once_settled(path, monkeypatch):
    watcher, server = watching(path)
    write_in_place(path, head())
    read = reload_watch.read_config_file

    def read_while_the_writer_resumes(p):
        monkeypatch.setattr(reload_watch, "read_config_file", read)
        loaded = read(p)
        write_in_place(path, QUOTAS.format(request_rate=25), mode="a")
        return loaded

    monkeypatch.setattr(reload_watch, "read_config_file", read_while_the_writer_resumes)
    watcher.poll_at(0.0)
    assert not watcher.poll_at(DEBOUNCE_S)  # the bytes read were not the file's last word
    assert server.applied == []
    watcher.poll_at(1.0)
    assert watcher.poll_at(1.0 + DEBOUNCE_S)
    assert [rates(c)[(None, "other")] for c in server.applied] == [{"request_rate": 25.0}]


def test_polls_are_faster_while_a_change_settles(path):
    watcher, _ = watching(path)
    assert watcher.poll_interval_s == ConfigWatcher.IDLE_POLL_S
    write_in_place(path, full(request_rate=11))
    watcher.poll_at(0.0)
    assert watcher.poll_interval_s == DEBOUNCE_S / 4
    watcher.poll_at(DEBOUNCE_S)
    assert watcher.poll_interval_s == ConfigWatcher.IDLE_POLL_S


def test_a_file_cut_inside_an_entry_is_applied_only_if_valid(path, caplog):
    watcher, server = watching(path)
    text = full()
    write_in_place(path, text[: text.index("producer_byte_rate")])  # alice's entry sets no quota
    watcher.poll_at(0.0)
    assert not watcher.poll_at(DEBOUNCE_S)
    [error] = messages(caplog, logging.ERROR)
    assert "rejected, the previous configuration stays in force: quotas[0]: sets no quota" in error

    write_in_place(path, text[: text.index("  - client_id: other")])  # a whole entry less: valid
    watcher.poll_at(1.0)
    assert watcher.poll_at(1.0 + DEBOUNCE_S)
    assert rates(server.config) == {("alice", "app-1"): {"producer_byte_rate": 1048576.0}}


def test_an_empty_file_is_never_applied(path, caplog):
    watcher, server = watching(path)
    write_in_place(path, "")
    watcher.poll_at(0.0)
    assert not watcher.poll_at(DEBOUNCE_S)
    assert server.applied == []
    assert "upstream: is required" in messages(caplog, logging.ERROR)[0]


def test_a_missing_file_is_waited_for_logged_once_and_its_return_applied_if_changed(path, caplog):
    watcher, server = watching(path)
    path.unlink()
    assert not any(watcher.poll_at(t) for t in (0.0, 1.0, 2.0))
    [gone] = messages(caplog)
    assert f"{path} is gone; waiting for it to come back" in gone

    path.write_text(full())  # back as it was (an editor's swap): nothing to reload
    watcher.poll_at(3.0)
    assert not watcher.poll_at(3.0 + DEBOUNCE_S)
    path.unlink()
    watcher.poll_at(4.0)
    assert len(messages(caplog)) == 2  # once per disappearance
    path.write_text(full(request_rate=30))
    watcher.poll_at(5.0)
    assert watcher.poll_at(5.0 + DEBOUNCE_S)
    assert [rates(c)[(None, "other")] for c in server.applied] == [{"request_rate": 30.0}]


def test_the_same_bytes_written_again_are_not_reloaded(path, caplog):
    caplog.set_level(logging.INFO)
    watcher, server = watching(path)
    replace_atomically(path, full())
    watcher.poll_at(0.0)
    assert not watcher.poll_at(DEBOUNCE_S)
    assert server.applied == []
    assert any("holds the configuration in force" in m for m in messages(caplog, logging.INFO))


def test_a_zero_debounce_applies_at_the_first_poll_that_sees_the_change(tmp_path):
    p = tmp_path / "config.yaml"
    p.write_text(full().replace("debounce_ms: 500", "debounce_ms: 0"))
    watcher, _server = watching(p)
    replace_atomically(p, full(request_rate=40).replace("debounce_ms: 500", "debounce_ms: 0"))
    assert watcher.poll_at(0.0)
    assert watcher.poll_interval_s == ConfigWatcher.IDLE_POLL_S


# -- require_atomic_rename --------------------------------------------------------------------


def test_require_atomic_rename_ignores_a_write_in_place_and_applies_a_rename(tmp_path, caplog):
    p = tmp_path / "config.yaml"
    p.write_text(full(atomic=True))
    watcher, server = watching(p)
    write_in_place(p, full(request_rate=50, atomic=True))
    watcher.poll_at(0.0)
    assert not watcher.poll_at(DEBOUNCE_S)
    assert not watcher.poll_at(3.0)
    assert messages(caplog) == [
        f"{p} written in place; reload.require_atomic_rename is on: send SIGHUP to apply"]
    assert server.applied == []

    replace_atomically(p, full(request_rate=60, atomic=True))
    watcher.poll_at(4.0)
    assert watcher.poll_at(4.0 + DEBOUNCE_S)
    assert [rates(c)[(None, "other")] for c in server.applied] == [{"request_rate": 60.0}]


def test_sighup_applies_a_write_in_place_at_once_and_the_watcher_does_not_apply_it_again(tmp_path, caplog):
    p = tmp_path / "config.yaml"
    p.write_text(full(atomic=True))
    watcher, server = watching(p)
    write_in_place(p, full(request_rate=70, atomic=True))
    assert watcher.reload_now()
    assert not any(watcher.poll_at(t) for t in (0.0, DEBOUNCE_S, 5.0))
    assert [rates(c)[(None, "other")] for c in server.applied] == [{"request_rate": 70.0}]
    assert messages(caplog) == []  # nothing left to warn about: SIGHUP applied it


def test_sighup_with_an_invalid_file_keeps_the_configuration_in_force(path, caplog):
    watcher, server = watching(path)
    write_in_place(path, "upstream: [")
    assert not watcher.reload_now()
    assert server.applied == []
    assert "not valid YAML" in messages(caplog, logging.ERROR)[0]


# -- a section left out while it is in force --------------------------------------------------

# Per section a reload applies: the section as written at start (not its default), the same key
# with nothing under it (what a file cut just after the key looks like), its explicit removal,
# the section written at its default, and what the explicit removal puts in force.
SECTIONS = {
    "quotas": (QUOTAS.format(request_rate=10), "quotas:\n", "quotas: []\n", "quotas: []\n", lambda c: c.quotas == ()),
    "rate_limiters": ("rate_limiters:\n  - quotas.limiters:RecordRateLimiter\n", "rate_limiters:\n",
                      "rate_limiters: [quotas.limiters:RecordRateLimiter, quotas.limiters:BatchRateLimiter]\n",
                      "rate_limiters: [quotas.limiters:RecordRateLimiter, quotas.limiters:BatchRateLimiter]\n",
                      lambda c: c.rate_limiters == DEFAULT_RATE_LIMITERS),
    "mode": ("mode: shadow\n", None, "mode: enforce\n", "mode: enforce\n", lambda c: c.mode == "enforce"),
    "producer_id_quota": ("producer_id_quota:\n  reaction: delay\n", "producer_id_quota:\n",
                          "producer_id_quota: {}\n", "producer_id_quota:\n  reaction: reject\n",
                          lambda c: c.producer_id_quota.reaction == "reject"),
}


# What each refusal says is in force and what leaving the section out would do.
WHY = {
    "quotas": "while 2 quota entries are in force, as in a file cut short before quotas: (to remove them all, "
              "write quotas: [])",
    "rate_limiters": "while rate_limiters: [quotas.limiters:RecordRateLimiter] is in force, which the defaults "
                     "([quotas.limiters:RecordRateLimiter, quotas.limiters:BatchRateLimiter]) would replace (write "
                     "the list wanted, [] for none)",
    "mode": "while mode: shadow is in force, and every quota entry without a mode of its own would switch to "
            "enforce (to mean it, write mode: enforce)",
    "producer_id_quota": "while reaction: delay is in force, which would switch to reject (to mean it, write "
                         "producer_id_quota: {} for every setting at its default, or the reaction)",
}


def with_section(key: str, section: str, request_rate: int = 10) -> str:
    """The test file with ``section`` (text) standing for ``key``: for quotas, the quotas
    themselves are left out (``section`` replaces them)."""
    if key == "quotas":
        return head() + section
    return full(request_rate) + section


def reload_by(how: str, watcher: ConfigWatcher, at_s: float) -> bool:
    """SIGHUP, or the watcher once the change has settled (polled four more times after)."""
    if how == "sighup":
        return watcher.reload_now()
    watcher.poll_at(at_s)
    applied = watcher.poll_at(at_s + DEBOUNCE_S)
    return any([applied, *(watcher.poll_at(at_s + DEBOUNCE_S + i) for i in (0.1, 1, 2, 3))])


def refusals(caplog) -> list[str]:
    return [m for m in messages(caplog, logging.ERROR) if " refused, the configuration in force stays: " in m]


@pytest.mark.parametrize("how", ["sighup", "watcher"])
@pytest.mark.parametrize("key", SECTIONS)
def test_a_section_in_force_left_out_is_refused_and_its_explicit_removal_applied(tmp_path, caplog, key, how):
    in_force, nulled, removal, _, removed = SECTIONS[key]
    p = tmp_path / "config.yaml"
    p.write_text(with_section(key, in_force))
    watcher, server = watching(p)
    start = server.config
    assert not removed(start)

    write_in_place(p, with_section(key, ""))  # cut short before the section
    assert not reload_by(how, watcher, 0.0)
    assert server.applied == [] and server.config is start
    [refused] = refusals(caplog)  # the watcher: once for this version, however many polls
    assert refused.startswith(f"reload of {p} refused, the configuration in force stays: {key}: missing ")
    assert WHY[key] in refused
    if nulled is not None:  # the key with nothing under it: refused the same way
        write_in_place(p, with_section(key, nulled))
        assert not reload_by(how, watcher, 10.0)
        assert server.applied == [] and len(refusals(caplog)) == 2
        assert f"stays: {key}: missing (no key, or nothing under it)" in refusals(caplog)[1]

    write_in_place(p, with_section(key, removal))  # the explicit removal
    assert reload_by(how, watcher, 20.0)
    [applied] = server.applied
    assert removed(applied)


def test_mode_with_nothing_under_it_is_invalid_and_changes_nothing(tmp_path, caplog):
    p = tmp_path / "config.yaml"
    p.write_text(full() + "mode: shadow\n")
    watcher, server = watching(p)
    write_in_place(p, full() + "mode:\n")
    assert not watcher.reload_now()
    assert server.applied == []
    assert "mode: must be enforce or shadow, got None" in messages(caplog, logging.ERROR)[0]


def test_the_refusal_of_quotas_says_how_many_are_in_force_and_how_to_remove_them(path, caplog):
    watcher, server = watching(path)
    write_in_place(path, head())
    assert not watcher.reload_now()
    assert not watcher.reload_now()  # SIGHUP is answered every time
    assert refusals(caplog) == 2 * [
        f"reload of {path} refused, the configuration in force stays: quotas: missing (no key, or nothing under "
        "it) while 2 quota entries are in force, as in a file cut short before quotas: (to remove them all, write "
        "quotas: [])"]
    assert server.applied == []


@pytest.mark.parametrize("how", ["sighup", "watcher"])
@pytest.mark.parametrize("key", SECTIONS)
def test_a_section_never_written_may_stay_out(tmp_path, caplog, key, how):
    p = tmp_path / "config.yaml"
    p.write_text(with_section(key, ""))
    watcher, server = watching(p)
    write_in_place(p, with_section(key, "# changed\n", request_rate=20))
    assert reload_by(how, watcher, 0.0)
    assert len(server.applied) == 1
    assert refusals(caplog) == []


@pytest.mark.parametrize("key", SECTIONS)
def test_a_section_written_at_its_default_may_be_dropped_it_changes_nothing(tmp_path, caplog, key):
    _, _, _, at_default, is_default = SECTIONS[key]
    p = tmp_path / "config.yaml"
    p.write_text(with_section(key, at_default))
    watcher, server = watching(p)
    write_in_place(p, with_section(key, "", request_rate=20))
    assert watcher.reload_now()
    assert refusals(caplog) == []
    assert is_default(server.applied[0])


def test_a_file_cut_before_quotas_is_refused_by_the_watcher_then_applied_once_completed(path, caplog):
    watcher, server = watching(path)
    write_in_place(path, head())  # stays cut past the debounce: refused, once
    assert not any(watcher.poll_at(t) for t in (0.0, DEBOUNCE_S, 2.0, 3.0))
    assert len(refusals(caplog)) == 1
    write_in_place(path, QUOTAS.format(request_rate=20), mode="a")  # the same file completed
    watcher.poll_at(4.0)
    assert watcher.poll_at(4.0 + DEBOUNCE_S)
    assert [rates(c)[(None, "other")] for c in server.applied] == [{"request_rate": 20.0}]
    assert messages(caplog) == []  # no WARNING: nothing was removed


def test_a_refused_reload_changes_nothing_in_the_proxy_and_names_every_section_left_out(tmp_path, caplog):
    p = tmp_path / "config.yaml"
    p.write_text(full() + "".join(SECTIONS[key][0] for key in SECTIONS))
    loaded = read_config_file(str(p))
    server = ProxyServer(loaded.config)
    watcher = ConfigWatcher(server, loaded)
    config, rules, limiters = server.config, server.rules_in_force, list(server.limiters)
    engine_rules = server.quotas.rules

    write_in_place(p, head() + "mode: enforce\n")  # cut: quotas, rate_limiters, producer_id_quota left out
    assert not watcher.reload_now()
    [refused] = refusals(caplog)
    assert [part.split(":")[0] for part in refused.split("stays: ")[1].split("; ")] == [
        "quotas", "rate_limiters", "producer_id_quota"]
    assert "; rate_limiters: missing (no key, or nothing under it) while rate_limiters: " \
           "[quotas.limiters:RecordRateLimiter] is in force" in refused
    assert "; producer_id_quota: missing (no key, or nothing under it) while reaction: delay is in force, which " \
           "would switch to reject" in refused
    # Nothing of it applied: not mode (enforce was written), not a limiter, not a quota.
    assert server.config is config and server.config.mode == "shadow"
    assert server.rules_in_force is rules and all(r.shadow for r in rules)
    assert server.limiters == limiters and all(a is b for a, b in zip(server.limiters, limiters))
    assert server.producer_id_filter.reaction == "delay"
    assert server.quotas.rules == engine_rules and len(engine_rules) == 2


# -- the polling task -------------------------------------------------------------------------


def test_watch_config_applies_a_change_on_its_own(tmp_path):
    p = tmp_path / "config.yaml"
    p.write_text(full().replace("debounce_ms: 500", "debounce_ms: 20"))
    watcher, server = watching(p)
    watcher.IDLE_POLL_S = 0.02
    applied = asyncio.Event()
    reload = server.reload
    server.reload = lambda config: (reload(config), applied.set())

    async def go():
        task = asyncio.create_task(watch_config(watcher))
        replace_atomically(p, full(request_rate=80).replace("debounce_ms: 500", "debounce_ms: 20"))
        await asyncio.wait_for(applied.wait(), 5)
        task.cancel()

    asyncio.run(go())
    assert [rates(c)[(None, "other")] for c in server.applied] == [{"request_rate": 80.0}]


# -- what a reload logs about the quotas it changes -------------------------------------------


def test_quota_changes_names_entities_and_values():
    before = [QuotaRule("alice", "app-1", {"producer_byte_rate": 1048576, "request_rate": 10}),
              QuotaRule(None, "other", {"request_rate": 10, "consumer_byte_rate": 2.5}),
              QuotaRule("bob", None, {"request_rate": 1})]
    after = [QuotaRule(None, "other", {"request_rate": 20, "producer_byte_rate": 5}),
             QuotaRule("bob", None, {"request_rate": 1}),
             QuotaRule("<default>", None, {"request_rate": 3})]
    assert [(c.removes_a_quota, c.describe()) for c in quota_changes(before, after)] == [
        (True, "removes the quotas of user=alice client_id=app-1 (producer_byte_rate=1048576, request_rate=10)"),
        (True, "removes consumer_byte_rate=2.5 of client_id=other (its other quotas stay)"),
        (False, "adds producer_byte_rate=5 to client_id=other"),
        (False, "changes request_rate of client_id=other from 10 to 20"),
        (False, "adds the quotas of user=<default> (request_rate=3)"),
    ]
    assert quota_changes(before, before) == []


def test_proxy_server_reload_logs_each_removed_entity_at_warning_and_changes_at_info(caplog):
    caplog.set_level(logging.INFO, logger="proxy.app.server")
    server = ProxyServer(read_config(full()))
    server.reload(read_config(head() + "quotas:\n  - client_id: other\n    request_rate: 20\n"))
    assert messages(caplog) == [
        "reload removes the quotas of user=alice client_id=app-1 (producer_byte_rate=1048576)"]
    info = messages(caplog, logging.INFO)
    assert "reload changes request_rate of client_id=other from 10 to 20" in info
    assert "reloaded: 1 quota entry in force (0 added, 1 removed, 1 changed), 2 rate limiters" in info


def test_proxy_server_reload_says_the_reload_section_needs_a_restart(caplog):
    server = ProxyServer(read_config(full()))
    server.reload(read_config(full(atomic=True)))
    assert messages(caplog) == ["reload applied quotas, mode, rate_limiters and producer_id_quota.reaction; "
                                "changed settings that need a restart: reload"]
    assert server.config.reload.require_atomic_rename is False


def read_config(text: str):
    return parse_config(yaml.safe_load(text))


def test_the_reload_summary_counts_entries_added_removed_and_changed(caplog):
    caplog.set_level(logging.INFO, logger="proxy.app.server")
    server = ProxyServer(read_config(full() + "  - user: bob\n    request_rate: 1\n"
                                              "  - user: carol\n    request_rate: 1\n"))
    server.reload(read_config(head() + """\
quotas:
  - client_id: other
    request_rate: 20
  - user: bob
    request_rate: 1
    mode: shadow
  - user: carol
    request_rate: 1
  - user: dave
    request_rate: 3
"""))
    # alice removed, dave added, other's value and bob's mode changed, carol as she was.
    assert messages(caplog, logging.INFO)[-1] == \
        "reloaded: 4 quota entries in force (1 added, 1 removed, 2 changed), 2 rate limiters"
    server.reload(read_config(head() + "quotas:\n  - user: dave\n    request_rate: 3\n"
                                       "rate_limiters: [quotas.limiters:RecordRateLimiter]\n"))
    assert messages(caplog, logging.INFO)[-1] == \
        "reloaded: 1 quota entry in force (0 added, 3 removed, 0 changed), 1 rate limiter"


def test_an_explicit_empty_quotas_is_applied_by_the_watcher_naming_each_removed_quota(path, caplog):
    caplog.set_level(logging.INFO, logger="proxy.app.server")
    loaded = read_config_file(str(path))
    server = ProxyServer(loaded.config)
    watcher = ConfigWatcher(server, loaded)
    write_in_place(path, head() + "quotas: []\n")
    watcher.poll_at(0.0)
    assert watcher.poll_at(DEBOUNCE_S)
    assert server.rules_in_force == () and server.quotas.rules == ()
    assert messages(caplog) == [
        "reload removes the quotas of user=alice client_id=app-1 (producer_byte_rate=1048576)",
        "reload removes the quotas of client_id=other (request_rate=10)"]
    assert messages(caplog, logging.INFO)[-1] == \
        "reloaded: 0 quota entries in force (0 added, 2 removed, 0 changed), 2 rate limiters"
