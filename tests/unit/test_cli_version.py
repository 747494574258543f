"""``--version`` says which version runs, and every option and argument of every subcommand has
a line of help."""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import proxy.app.cli
from proxy.app.cli import _parser, main, package_version

ROOT = Path(__file__).resolve().parents[2]


def test_version_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"kafka-quota-proxy {metadata.version('kafka-quota-proxy')}\n"


def test_python_m_proxy_version():
    done = subprocess.run([sys.executable, "-m", "proxy", "--version"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("kafka-quota-proxy ") and done.stdout.split()[1][0].isdigit()


def test_a_source_tree_never_installed_reads_its_pyproject(monkeypatch):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert package_version() == declared


def test_without_metadata_or_pyproject_the_version_is_unknown(monkeypatch, tmp_path):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    monkeypatch.setattr(proxy.app.cli, "__file__", str(tmp_path / "proxy" / "app" / "cli.py"))
    assert package_version() == "unknown"
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "something-else"\nversion = "9.9"\n')
    assert package_version() == "unknown"


def _parsers(parser: argparse.ArgumentParser, name: str):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_argument_of_every_subcommand_has_help():
    missing = []
    for name, parser in _parsers(_parser(), "kafka-quota-proxy"):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                listed = {a.dest for a in action._choices_actions if a.help}
                missing += [f"{name} {sub}" for sub in action.choices if sub not in listed]
            elif not action.help:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert missing == []


def test_every_subcommands_help_shows(capsys):
    for name, _ in _parsers(_parser(), "kafka-quota-proxy"):
        with pytest.raises(SystemExit) as done:
            main([*name.split()[1:], "--help"])
        assert done.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: {name}")
