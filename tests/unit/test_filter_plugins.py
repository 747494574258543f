"""Filters of the operator's own, loaded through ``filters:`` (``package.module:Factory``, as
``rate_limiters:`` names its classes): the example filter of docs/writing-a-filter.md, loaded
from the guide's own YAML, answers a request through a real connection, in its documented place
in the chain; a factory that cannot be imported, raises, or returns something that is not a
filter is a ConfigError naming its YAML path and value, at load (check-config, a start, a
reload) and again when the chain is built; a changed ``filters:`` needs a restart, and a reload
says so. And the filter API's typed note (``NoteKey``)."""

from __future__ import annotations

import asyncio
import logging
import re
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import yaml

from config import ConfigError, parse_config
from config import filters as config_filters
from protocol.apis import ApiKey
from proxy.app.cli import main
from proxy.app.server import ProxyServer
from proxy.dataplane.filters import api
from proxy.dataplane.filters.api import FilterSpec
from proxy.dataplane.filters.controller_mutation import ControllerMutationFilter
from proxy.dataplane.filters.endpoints import EndpointRewriteFilter
from proxy.dataplane.filters.topic_policy import TopicPrefixPolicyFilter
from proxy.dataplane.inflight import InFlight, NoteKey

from .test_connection_paths import BASE, Pair, list_offsets
from .test_topic_policy import (
    POLICY_VIOLATION,
    broker_answer,
    client_responses,
    create_topics,
    topics_seen_by_broker,
)

ROOT = Path(__file__).resolve().parents[2]
HERE = "tests.unit.test_filter_plugins"
THROTTLING_QUOTA_EXCEEDED = 89
LIST_OFFSETS = 2


def guide_example() -> dict[str, Any]:
    """The ``filters:`` block of docs/writing-a-filter.md's "Loading it" section, as YAML loads it."""
    guide = (ROOT / "docs" / "writing-a-filter.md").read_text(encoding="utf-8")
    section = guide.split("### Loading it: `filters:`", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None, "the guide's filters: example"
    data = yaml.safe_load(block.group(1))
    assert list(data) == ["filters"]
    return data


# -- plug-ins the tests load ----------------------------------------------------------------


class Recorder:
    """Sees ListOffsets requests and responses; records which, and whose."""

    spec = FilterSpec(request_keys=frozenset({LIST_OFFSETS}), response_keys=frozenset({LIST_OFFSETS}))

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.seen: list[tuple[str, int]] = []

    def on_request(self, ctx: api.FilterContext, header: Any, frame: api.Frame, entry: InFlight) -> None:
        self.seen.append(("request", header.correlation_id))

    def on_response(self, ctx: api.FilterContext, entry: InFlight, frame: api.Frame) -> api.Frame:
        self.seen.append(("response", entry.correlation_id))
        return frame


BUILT: list[Recorder] = []


def recorder(config: Any) -> Recorder:
    f = Recorder(config.get("tag", ""))
    BUILT.append(f)
    return f


def refusing(config: Any) -> Recorder:
    raise ValueError(f"no tag in {dict(config)}")


def returns_none(config: Any) -> None:
    return None


class NoOnRequest:
    spec = FilterSpec(request_keys=frozenset({LIST_OFFSETS}))


def no_on_request(config: Any) -> NoOnRequest:
    return NoOnRequest()


class LooksLikeASpec:
    """FilterSpec's fields, but not a FilterSpec: the loader (which cannot import the filter
    API) lets it through; the chain does not."""

    request_keys = frozenset({LIST_OFFSETS})
    response_keys: frozenset[int] = frozenset()
    chunk = stream = False


class DuckSpec(NoOnRequest):
    spec = LooksLikeASpec()  # type: ignore[assignment]

    def on_request(self, *args: Any) -> None:
        return None


def duck_spec(config: Any) -> DuckSpec:
    return DuckSpec()


CALLS = {"n": 0}


def fails_the_second_time(config: Any) -> Recorder:
    """A factory that behaves at load and not when the chain is built."""
    CALLS["n"] += 1
    if CALLS["n"] % 2 == 0:
        raise RuntimeError("second call")
    return Recorder("")


NOT_CALLABLE = 42


def config_with(*entries: Any, **sections: Any) -> dict[str, Any]:
    return {**BASE, **sections, "filters": list(entries)}


# -- the guide's example, through filters: ----------------------------------------------------


def test_the_guides_example_loads_through_filters_and_answers_a_request():
    text = yaml.safe_dump({**BASE, **guide_example()})
    config = parse_config(yaml.safe_load(text))
    (plugin,) = config.filters
    assert plugin.target == "proxy.dataplane.filters.topic_policy:topic_prefix_policy"
    assert isinstance(plugin.settings, MappingProxyType)

    async def go():
        pair = Pair(server=ProxyServer(config))
        (policy,) = [f for f in pair.server.chain.request[ApiKey.CREATE_TOPICS][1]
                     if isinstance(f, TopicPrefixPolicyFilter)]
        assert policy.prefixes == ("tmp-", "scratch-")
        pair.conn.data_received(create_topics(6, ["tmp-x"], 7))
        assert pair.requests_seen_by_broker() == []
        (resp,) = client_responses(pair, 6)
        assert [(t.name, t.error_code) for t in resp.topics] == [("tmp-x", POLICY_VIOLATION)]
        pair.conn.data_received(create_topics(6, ["orders"], 8))  # not reserved: forwarded as sent
        assert [[t.name for t in topics] for topics in topics_seen_by_broker(pair, 6)] == [["orders"]]
        pair.conn._teardown()

    asyncio.run(go())


def test_plug_ins_meet_requests_before_the_quota_filters_and_responses_after_the_proxys_own():
    config = parse_config(config_with(
        {"factory": "proxy.dataplane.filters.topic_policy:topic_prefix_policy", "config": {"prefixes": ["tmp-"]}},
        f"{HERE}:recorder",
        quotas=[{"client_id": "app", "controller_mutation_rate": 0.1}],
    ))
    chain = ProxyServer(config).chain
    create = [type(f) for f in chain.request[ApiKey.CREATE_TOPICS][1]]
    assert create.index(TopicPrefixPolicyFilter) < create.index(ControllerMutationFilter)
    assert chain.request[LIST_OFFSETS][1][-1] is BUILT[-1]  # nothing after it sees ListOffsets
    metadata = chain.response[ApiKey.METADATA][1]
    assert [type(f) for f in metadata] == [EndpointRewriteFilter]  # a plug-in sees only what its spec says
    assert chain.response[LIST_OFFSETS][1] == (BUILT[-1],)


def test_a_refused_topic_is_never_charged_a_controller_mutation():
    """The policy, loaded through filters:, runs before the strict controller_mutation_rate (as
    Kafka checks its policy before the quota): tmp-a is refused by the policy, orders goes into
    debt, billing is refused by the quota; each merges its own refusals back."""
    raw = config_with({"factory": "proxy.dataplane.filters.topic_policy:topic_prefix_policy",
                       "config": {"prefixes": ["tmp-"]}},
                      quotas=[{"client_id": "app", "controller_mutation_rate": 0.1}])

    async def go():
        pair = Pair(server=ProxyServer(parse_config(raw)))
        pair.conn.data_received(create_topics(6, ["tmp-a", "orders", "billing"], 5))
        async with asyncio.timeout(10):  # billing is looked up first (127.0.0.1:1 refuses at once)
            while not pair.requests_seen_by_broker():
                await asyncio.sleep(0.01)
        assert [[t.name for t in topics] for topics in topics_seen_by_broker(pair, 6)] == [["orders"]]
        answer, _ = broker_answer(6, 5, ["orders"])
        pair.up.data_received(answer)
        (resp,) = client_responses(pair, 6)
        assert [(t.name, t.error_code) for t in resp.topics] == [
            ("tmp-a", POLICY_VIOLATION), ("orders", 0), ("billing", THROTTLING_QUOTA_EXCEEDED)]
        pair.conn._teardown()

    asyncio.run(go())


def test_a_plug_in_sees_requests_and_responses_through_a_connection():
    config = parse_config(config_with({"factory": f"{HERE}:recorder", "config": {"tag": "a"}}))

    async def go():
        pair = Pair(server=ProxyServer(config))
        f = BUILT[-1]
        assert f.tag == "a"
        pair.conn.data_received(list_offsets(3, "app"))
        assert len(pair.requests_seen_by_broker()) == 1
        body = b"\0\0\0\x03" + b"\0\0\0\0"  # ListOffsets v1: correlation id 3, no topics
        pair.up.data_received(len(body).to_bytes(4, "big") + body)
        assert f.seen == [("request", 3), ("response", 3)]
        assert pair.client.bytes()[4:] == body
        pair.conn._teardown()

    asyncio.run(go())


def test_no_filters_is_the_default_and_changes_nothing():
    assert parse_config(BASE).filters == () == parse_config({**BASE, "filters": None}).filters
    assert parse_config({**BASE, "filters": []}).filters == ()


# -- errors: each names its YAML path and the value -------------------------------------------


@pytest.mark.parametrize("entry,path,words", [
    ("no_such_package.filters:make", "filters[0]", ["cannot import 'no_such_package.filters'",
                                                   "no_such_package.filters:make"]),
    ({"factory": "no_such_package.filters:make"}, "filters[0].factory", ["cannot import", "no_such_package"]),
    ({"factory": f"{HERE}:nothing_here"}, "filters[0].factory", [f"'{HERE}' has no 'nothing_here'"]),
    ({"factory": f"{HERE}:NOT_CALLABLE"}, "filters[0].factory", ["is a int, not a factory"]),
    ({"factory": "no colon"}, "filters[0].factory", ["must be package.module:Factory, got 'no colon'"]),
    ({"factory": 7}, "filters[0].factory", ["must be package.module:Factory, got 7"]),
    ({"config": {}}, "filters[0].factory", ["is required"]),
    ({"factory": f"{HERE}:recorder", "config": ["tag"]}, "filters[0].config", ["must be a mapping, got ['tag']"]),
    ({"factory": f"{HERE}:refusing", "config": {"tag": 1}}, "filters[0].config",
     [f"{HERE}:refusing refused its config {{'tag': 1}}", "ValueError(\"no tag in {'tag': 1}\")"]),
    (f"{HERE}:refusing", "filters[0]", ["refused its config {}"]),
    ({"factory": f"{HERE}:returns_none"}, "filters[0].factory",
     [f"{HERE}:returns_none returned None, not a filter: it has no spec"]),
    ({"factory": f"{HERE}:no_on_request"}, "filters[0].factory",
     ["not a filter: its spec declares the request role, and it has no on_request()"]),
    ({"factory": "builtins:dict"}, "filters[0].factory", ["returned {}, not a filter: it has no spec"]),
    ({"factory": f"{HERE}:recorder", "confg": {}}, "filters[0].confg", ["unknown key; did you mean config?"]),
])
def test_a_bad_entry_is_an_error_naming_its_path_and_value(entry, path, words):
    with pytest.raises(ConfigError) as info:
        parse_config(config_with(f"{HERE}:recorder", entry))
    error = next(e for e in info.value.errors if e.path.startswith("filters[1]"))
    assert error.path == path.replace("[0]", "[1]")
    for word in words:
        assert word in str(error), str(error)


def test_a_factory_that_returns_a_class_is_refused():
    with pytest.raises(ConfigError, match=r"filters\[0\]: .*not a filter: a class"):
        parse_config(config_with("builtins:type"))  # type({}) is dict: a class


def test_filters_must_be_a_list_and_every_bad_entry_is_reported():
    with pytest.raises(ConfigError, match=r"^filters: must be a list"):
        parse_config({**BASE, "filters": {"factory": f"{HERE}:recorder"}})
    with pytest.raises(ConfigError) as info:
        parse_config(config_with(f"{HERE}:returns_none", f"{HERE}:recorder", "nowhere:x"))
    assert [e.path for e in info.value.errors] == ["filters[0]", "filters[2]"]


def test_the_chain_checks_again_what_the_loader_could_only_see_the_shape_of():
    config = parse_config(config_with(f"{HERE}:duck_spec"))  # its spec has FilterSpec's fields
    with pytest.raises(ConfigError) as info:
        ProxyServer(config)
    assert info.value.path == "filters[0]"
    assert ("did not build a filter: DuckSpec has no FilterSpec (its spec attribute is LooksLikeASpec)"
            in str(info.value))


def test_a_factory_that_fails_when_the_chain_is_built_is_named():
    CALLS["n"] = 0
    config = parse_config(config_with(f"{HERE}:recorder", f"{HERE}:fails_the_second_time"))
    with pytest.raises(ConfigError) as info:
        ProxyServer(config)
    assert info.value.path == "filters[1]"
    assert f"{HERE}:fails_the_second_time refused its config {{}}: RuntimeError('second call')" in str(info.value)


def test_the_loaders_role_table_is_the_filter_apis():
    assert config_filters.ROLE_METHODS == api.ROLE_METHODS


# -- check-config, start, reload ---------------------------------------------------------------


BAD_FILE = """\
upstream:
  bootstrap_servers: ["127.0.0.1:9092"]
filters:
  - factory: proxy.dataplane.filters.topic_policy:topic_prefix_policy
    config: {prefixes: [tmp-]}
  - factory: proxy.dataplane.filters.topic_policy:no_such_factory
"""


def test_check_config_imports_and_tries_every_factory(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_FILE)
    assert main(["check-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"invalid configuration: {bad}: filters[1].factory: 'proxy.dataplane.filters.topic_policy' "
                          "has no 'no_such_factory'"), err
    good = tmp_path / "good.yaml"
    good.write_text(BAD_FILE.rsplit("  - factory:", 1)[0])
    assert main(["check-config", str(good)]) == 0
    assert capsys.readouterr().out == f"{good}: ok\n"


def test_check_config_as_an_operator_runs_it(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_FILE.replace("topic_policy:no_such_factory", "topic_policy:topic_prefix_policy\n"
                                    "    config: {prefixes: tmp-}"))
    done = subprocess.run([sys.executable, "-m", "proxy", "check-config", str(bad)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert done.stderr.startswith(f"invalid configuration: {bad}: filters[1].config: "
                                  "proxy.dataplane.filters.topic_policy:topic_prefix_policy refused its config "
                                  "{'prefixes': 'tmp-'}: ValueError("), done.stderr


def test_a_changed_filters_section_needs_a_restart_and_a_reload_says_so(caplog):
    first = {"factory": "proxy.dataplane.filters.topic_policy:topic_prefix_policy", "config": {"prefixes": ["tmp-"]}}
    server = ProxyServer(parse_config(config_with(first)))

    def policies() -> list[TopicPrefixPolicyFilter]:
        return [f for f in server.chain.request[ApiKey.CREATE_TOPICS][1] if isinstance(f, TopicPrefixPolicyFilter)]

    before = policies()
    with caplog.at_level(logging.WARNING, logger="proxy.app.server"):
        server.reload(parse_config(config_with(first, quotas=[{"user": "a", "request_rate": 5}])))
    assert "need a restart" not in caplog.text  # the same filters: read again, equal
    caplog.clear()
    changed = {**first, "config": {"prefixes": ["scratch-"]}}
    with caplog.at_level(logging.WARNING, logger="proxy.app.server"):
        server.reload(parse_config(config_with(changed)))
    assert re.search(r"changed settings that need a restart: .*\bfilters\b", caplog.text), caplog.text
    assert policies() == before and before[0].prefixes == ("tmp-",)  # the policy built at start
    assert server.config.filters == parse_config(config_with(first)).filters


# -- the typed note ----------------------------------------------------------------------------


def test_a_note_is_its_keys_alone():
    a: NoteKey[int] = NoteKey("a")
    b: NoteKey[int] = NoteKey("a")  # the same name, still a note of its own
    entry, other = InFlight(1, 0, 9, 0.0), InFlight(2, 0, 9, 0.0)
    assert a.get(entry) is None
    a.set(entry, 5)
    assert (a.get(entry), b.get(entry), a.get(other)) == (5, None, None)
    b.set(entry, 6)
    a.set(entry, 7)
    assert (a.get(entry), b.get(entry)) == (7, 6)
    assert repr(a) == "NoteKey('a')"


def test_reading_a_note_writes_nothing():
    entry = InFlight(1, 0, 9, 0.0)
    key: NoteKey[str] = NoteKey("untouched")
    assert key.get(entry) is None
    assert vars(entry) == {}


MISUSE = """\
from proxy.dataplane.inflight import InFlight, NoteKey

KEY: NoteKey[int] = NoteKey("k")
entry = InFlight(1, 0, 9, 0.0)
KEY.set(entry, "not an int")
text: str = KEY.get(entry)
entry.note = 1
"""


def test_mypy_holds_a_note_to_its_type(tmp_path):
    mypy_api = pytest.importorskip("mypy.api")
    source = tmp_path / "misuse.py"
    source.write_text(MISUSE)
    out, _, status = mypy_api.run(["--strict", "--follow-imports=silent", "--no-incremental",
                                   "--cache-dir", str(tmp_path / "cache"), str(source)])
    assert status == 1
    lines = [line.split(": error: ", 1)[1] for line in out.splitlines() if ": error: " in line]
    assert any('"set" of "NoteKey" has incompatible type "str"' in line for line in lines), out
    assert any('"int | None", variable has type "str"' in line for line in lines), out
    assert any('"InFlight" has no attribute "note"' in line for line in lines), out


def test_a_reader_of_the_quotas_leaves_filters_unloaded():
    """The pipeline parses an operator's configuration for its quotas: a plug-in there is the
    proxy's code, never imported or called in a Spark process (not even a broken one)."""
    raw = {"upstream": {"bootstrap_servers": ["127.0.0.1:9092"]},
           "filters": ["no_such_package.anywhere:Factory", {"factory": 7}],
           "quotas": [{"user": "alice", "producer_byte_rate": 1000}]}
    with pytest.raises(ConfigError):
        parse_config(raw)
    config = parse_config(raw, filters=False)
    assert config.filters == () and [r.user for r in config.quotas] == ["alice"]
    code = ("import sys\nfrom pipeline.replay import candidate\n"
            "candidate('upstream: {bootstrap_servers: [\"h:1\"]}\\nfilters: "
            "[\"proxy.dataplane.filters.topic_policy:topic_prefix_policy\"]\\n')\n"
            "print(sorted(m for m in sys.modules if m == 'proxy' or m.startswith('proxy.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    assert out.strip() == "[]"
