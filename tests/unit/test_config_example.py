"""``config/example.yaml`` is the complete example docs/configuration.md says it is: every section
and every key the loader accepts is in it (a key commented out counts: ``# key:``), under the
section it belongs to, and the file passes ``check-config`` as it is.

The keys are the loader's own, not a list kept here: each section is read with an unknown key
planted in it, and the error's "(allowed: ...)" says what that section accepts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from config import ConfigError, parse_config
from proxy.app.cli import main

EXAMPLE = Path(__file__).resolve().parents[2] / "config" / "example.yaml"
UPSTREAM = {"bootstrap_servers": ["k:9092"]}
PROBE = "__probe__"

# Keys the loader knows only to refuse them with a better message than "unknown key": a secret
# is never written inline (config/network.py, _no_inline_secret). An example must not show them.
REFUSED = {"key_password", "password", "token"}

# Sections whose value is a list of entries, each probed with a valid entry of its own.
ENTRIES: dict[str, dict[str, Any]] = {
    "quotas": {"user": "alice", "request_rate": 1},
    "rate_limiters": {"class": "quotas.limiters:RecordRateLimiter"},
    "filters": {"factory": "proxy.dataplane.filters.topic_policy:topic_prefix_policy",
                "config": {"prefixes": ["tmp-"]}},
}
# Mappings inside a section: (section, key) and what else the section needs to be read.
NESTED = [("upstream", "tls", UPSTREAM), ("upstream", "sasl", UPSTREAM), ("listen", "tls", {})]


def allowed(data: dict[str, Any], where: str) -> set[str] | None:
    """The keys the loader accepts at ``where``, from the error the planted key there gets; None
    when ``where`` is not a mapping (the loader refuses the value before looking at keys)."""
    try:
        parse_config({"upstream": UPSTREAM, **data})
    except ConfigError as exc:
        for error in exc.errors:
            found = re.search(r"\(allowed: ([^)]*)\)$", str(error))
            if error.path == f"{where}.{PROBE}".removeprefix("$.") and found:
                return set(found.group(1).split(", "))
        return None
    raise AssertionError(f"a key planted at {where} was not refused")


def schema() -> dict[str, set[str]]:
    """Per top-level section, every key the loader accepts in it (its nested mappings' too)."""
    sections = allowed({PROBE: 1}, "$")
    assert sections and "upstream" in sections
    keys: dict[str, set[str]] = {}
    for section in sorted(sections):
        value: dict[str, Any] = {**UPSTREAM, PROBE: 1} if section == "upstream" else {PROBE: 1}
        if section in ENTRIES:
            found = allowed({section: [{**ENTRIES[section], PROBE: 1}]}, f"{section}[0]")
        else:
            found = allowed({section: value}, section)
        keys[section] = found or set()
    for section, key, needs in NESTED:
        found = allowed({section: {**needs, key: {PROBE: 1}}}, f"{section}.{key}")
        assert found, f"{section}.{key} is not a mapping any more: update NESTED"
        keys[section] |= found
    return keys


def blocks(text: str, sections: set[str]) -> dict[str, str]:
    """The example's text per top-level section: from its line (``section:`` or ``# section:``)
    to the next section's."""
    out: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        top = re.match(r"(?:# ?)?([a-z_]+):", line)
        if top and top.group(1) in sections:
            current = top.group(1)
        if current is not None:
            out[current] = out.get(current, "") + line + "\n"
    return out


def test_the_probe_reads_the_loaders_keys():
    keys = schema()
    assert {"bootstrap_servers", "tls", "sasl", "ca", "mechanism", "token_file"} <= keys["upstream"]
    assert {"user", "client_id", "mode", "producer_ids_rate"} <= keys["quotas"]
    assert keys["filters"] == {"factory", "config"} and keys["mode"] == set()
    assert {"count", "drain_timeout_ms"} <= keys["workers"]


def test_the_example_names_every_section_and_key():
    keys = schema()
    found = blocks(EXAMPLE.read_text(encoding="utf-8"), set(keys))
    missing_sections = sorted(set(keys) - set(found))
    assert missing_sections == [], f"config/example.yaml lacks these sections: {missing_sections}"
    missing = [f"{section}.{key}" for section, names in sorted(keys.items()) for key in sorted(names - REFUSED)
               if not re.search(rf"^[ #-]*{re.escape(key)}:", found[section], re.M)]
    assert missing == [], f"config/example.yaml lacks these keys (commented out is fine): {missing}"
    shown = [f"{section}.{key}" for section in keys for key in REFUSED
             if re.search(rf"^[ #-]*{key}:", found[section], re.M)]
    assert shown == [], f"an inline secret in the example: {shown}"


@pytest.mark.parametrize("text, missing", [
    ("upstream:\n  bootstrap_servers: []\n", "listen"),
    ("upstream:\n  bootstrap_servers: []\n  # tls:\n  #   ca: x\nlisten:\n  host: h\n", "upstream.connect_timeout_s"),
])
def test_a_missing_section_or_key_would_be_found(text, missing):
    keys = schema()
    found = blocks(text, set(keys))
    absent = set(keys) - set(found)
    absent |= {f"{s}.{k}" for s in found for k in keys[s] - REFUSED if not re.search(rf"^[ #-]*{k}:", found[s], re.M)}
    assert missing in absent


def test_the_example_passes_check_config(capsys):
    assert main(["check-config", str(EXAMPLE)]) == 0
    assert capsys.readouterr().out == f"{EXAMPLE}: ok\n"
