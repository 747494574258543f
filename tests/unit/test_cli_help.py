"""The first things a new operator types: ``--help`` lists every subcommand with a sentence and
reads as plain text, and the README's "Running it" commands work as typed after the set-up
command and the virtualenv's activation the README asks for (the tool on the PATH, the example
configuration where the README says)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.app.cli import _parser, main

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_every_subcommand_with_a_sentence_in_plain_text(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "``" not in text and ":class:" not in text
    subcommands = next(a for a in _parser()._actions if a.dest == "command").choices
    assert set(subcommands) == {"run", "check-config", "demo", "report", "generate-usage", "quotas"}
    for name in subcommands:
        assert re.search(rf"^    {re.escape(name)}\s+\S", text, re.M), f"{name} has no line of its own"
    assert ".venv/bin/activate" in text and "config/example.yaml" in text


def running_it_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Running it", 1)[1].split("\n## ", 1)[0]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    return [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_the_readme_running_it_commands_work_as_typed():
    readme = (ROOT / "README.md").read_text()
    assert "```sh\n. .venv/bin/activate\n```" in readme.split("## Running it", 1)[0]  # said before them
    commands = running_it_commands()
    assert all(c.split()[0] in ("kafka-quota-proxy", "python") for c in commands), commands
    for command in commands:
        if " run " in command:
            continue  # needs a cluster; its configuration is the one check-config validates below
        argv = command.split()
        # The venv running this test is the one make installs and the README activates: its
        # interpreter stands for `python`, and the console script is `python -m proxy`.
        exe = [sys.executable] if argv[0] == "python" else [sys.executable, "-m", "proxy"]
        done = subprocess.run(exe + argv[1:], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (command, done.stdout, done.stderr)
    config = next(c for c in commands if "check-config" in c).split()[-1]
    assert config == "config/example.yaml" and (ROOT / config).is_file()
