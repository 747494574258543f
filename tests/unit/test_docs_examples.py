"""Every YAML and shell example in README.md and docs/*.md is checked, and every relative link
in them leads somewhere.

How an example is read is said by an HTML comment on the line just above its fence:

- a ```yaml block with no comment is a complete configuration: ``config.parse_config`` loads it
  as it is (it must have ``upstream``);
- ``<!-- example: fragment -->``: some top-level sections of a configuration; a placeholder
  ``upstream`` is added when the block has none, then it is loaded the same way;
- ``<!-- example: fragment; plug-in package.module:Class -->``: the same, with a stand-in rate
  limiter importable under that name (a plug-in the example invents);
- ``<!-- example: not-config -->``: YAML that is not the proxy's configuration (a compose file,
  a Kubernetes manifest): it must parse, nothing more.

A ```sh (or bash, shell) block is read command by command (``\\`` joins lines, ``#`` starts a
comment, ``[...]`` marks an optional part, ``|``, ``&&`` and ``;`` separate commands): ``make``
targets and the variables given to them are the Makefile's, ``kafka-quota-proxy`` (however it is
invoked) is given only subcommands and options its parser has, ``python -m MODULE`` names a module
of the repository and options its source defines, a script named by its path exists and is
executable, a path into the repository names a file that exists, and any other command is one of
the few outside tools the docs use (``EXTERNAL``). Every fence has a language (```text for
output), so no example escapes by having none.

Each checker returns what is wrong with its input; ``test_a_planted_mistake_is_caught`` feeds each
a known-bad input and expects it to be caught."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from config import ConfigError, parse_config
from quotas.limiters import RateLimiter

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

YAML = {"yaml", "yml"}
SHELL = {"sh", "bash", "shell"}
# Languages of blocks that are not examples to check: output, properties files, code.
OTHER = {"text", "properties", "python", "json"}
# The outside tools the docs' commands use; anything else must be in the repository.
EXTERNAL = {"kafka-configs.sh", "kcat", "curl", "grep", "kill", "docker"}
PLACEHOLDER_UPSTREAM = {"bootstrap_servers": ["127.0.0.1:9092"]}

_FENCE = re.compile(r"^```(\S*)[ \t]*$")
_MARKER = re.compile(r"^<!--\s*example:\s*(.*?)\s*-->$")


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # of the opening fence, 1-based
    lang: str
    body: str
    marker: str | None  # what follows "example:" in the comment above the fence

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    lines = doc.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{doc.relative_to(ROOT)}:{i + 1}: a fence that is never closed"
        above = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = _MARKER.match(above)
        found.append(Block(doc, i + 1, opening.group(1), "\n".join(lines[i + 1:end]) + "\n",
                           marker.group(1) if marker else None))
        i = end + 1
    return found


ALL_BLOCKS = [b for doc in DOCS for b in blocks(doc)]
YAML_BLOCKS = [b for b in ALL_BLOCKS if b.lang in YAML]
SHELL_BLOCKS = [b for b in ALL_BLOCKS if b.lang in SHELL]


# --- YAML -----------------------------------------------------------------------------------


@contextmanager
def stand_in_limiters(targets: list[str]) -> Iterator[None]:
    """Makes each ``package.module:Class`` importable as a do-nothing rate limiter."""
    added: list[str] = []
    try:
        for target in targets:
            module_name, _, class_name = target.partition(":")
            parts = module_name.split(".")
            for k in range(1, len(parts) + 1):
                name = ".".join(parts[:k])
                if name not in sys.modules:
                    sys.modules[name] = types.ModuleType(name)
                    added.append(name)
                    if k > 1:
                        setattr(sys.modules[".".join(parts[:k - 1])], parts[k - 1], sys.modules[name])
            limiter = type(class_name, (RateLimiter,), {"accumulate": lambda self, usage, now_ms: None,
                                                        "throttle_ms": lambda self, usage, now_ms: 0})
            setattr(sys.modules[module_name], class_name, limiter)
        yield
    finally:
        for name in reversed(added):
            del sys.modules[name]


def yaml_problems(body: str, marker: str | None) -> list[str]:
    """What is wrong with a YAML example read as ``marker`` says (see the module's docstring)."""
    try:
        data = yaml.safe_load(body)
    except yaml.YAMLError as exc:
        return [f"not valid YAML: {exc}"]
    parts = [p.strip() for p in (marker or "").split(";") if p.strip()]
    kind = parts[0] if parts else "config"
    if kind not in {"config", "fragment", "not-config"}:
        return [f"unknown example kind {kind!r} (fragment, not-config, or no comment for a complete configuration)"]
    if kind == "not-config":
        return [] if data is not None else ["empty"]
    if not isinstance(data, dict):
        return [f"a configuration is a mapping, got {type(data).__name__}"]
    if kind == "fragment" and "upstream" not in data:
        data = {"upstream": PLACEHOLDER_UPSTREAM, **data}
    plugins = [p.split(None, 1)[1] for p in parts[1:] if p.startswith("plug-in ")]
    unknown = [p for p in parts[1:] if not p.startswith("plug-in ")]
    if unknown:
        return [f"unknown option {o!r} in the example's comment" for o in unknown]
    with stand_in_limiters(plugins):
        try:
            parse_config(data)
        except ConfigError as exc:
            return [str(e) for e in exc.errors]
    return []


@pytest.mark.parametrize("block", YAML_BLOCKS, ids=lambda b: b.name)
def test_a_yaml_example_is_valid(block):
    assert yaml_problems(block.body, block.marker) == [], block.name


# --- shell ----------------------------------------------------------------------------------


def cli_parser() -> argparse.ArgumentParser:
    """kafka-quota-proxy's own parser, wherever the CLI module lives."""
    for name in ("proxy.app.cli", "proxy.cli"):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and name.startswith(exc.name):
                continue  # that module does not exist; anything else missing is a real failure
            raise
        return module._parser()
    raise AssertionError("no CLI module: neither proxy.app.cli nor proxy.cli")


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def cli_problems(args: list[str], parser: argparse.ArgumentParser | None = None,
                 name: str = "kafka-quota-proxy") -> list[str]:
    """Subcommands and options of ``args`` the CLI does not have."""
    parser = parser or cli_parser()
    options = {s: a for a in parser._actions for s in a.option_strings}
    subs = _subparsers(parser)
    problems: list[str] = []
    expects_value = False
    for i, token in enumerate(args):
        if expects_value:
            expects_value = False
            continue
        if token.startswith("-"):
            flag, has_value, _ = token.partition("=")
            action = options.get(flag)
            if action is None:
                problems.append(f"{name}: no option {flag}")
            elif not has_value:
                expects_value = action.nargs != 0
            continue
        if subs is not None:
            if token in subs.choices:
                return problems + cli_problems(args[i + 1:], subs.choices[token], f"{name} {token}")
            return [*problems, f"{name}: no subcommand {token!r} (it has {', '.join(subs.choices)})"]
    if subs is not None and subs.required and not {"-h", "--help", "--version"} & set(args):
        problems.append(f"{name}: a subcommand is required")
    return problems


def makefile() -> tuple[set[str], dict[str, str], str]:
    """The Makefile's targets, its simple variables, and its text."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M))
    for phony in re.findall(r"^\.PHONY\s*:(.*)$", text, re.M):
        targets.update(phony.split())
    variables = dict(re.findall(r"^([A-Z_]+)\s*[:?]?=\s*(.*?)\s*$", text, re.M))
    return targets, variables, text


def _expand(text: str, variables: dict[str, str]) -> str:
    for _ in range(5):
        text = re.sub(r"\$\(([A-Z_]+)\)", lambda m: variables.get(m.group(1), m.group(0)), text)
    return text


def make_problems(args: list[str], depth: int) -> list[str]:
    targets, variables, text = makefile()
    problems = []
    for token in args:
        if token.startswith("-"):
            continue
        var, is_assignment, value = token.partition("=")
        if not is_assignment:
            if token not in targets:
                problems.append(f"make: no target {token!r}")
            continue
        recipe = next((line for line in text.splitlines() if f"$({var})" in line and line.startswith("\t")), None)
        if recipe is None:
            problems.append(f"make: no recipe uses {var}")
        elif depth < 2:  # what the variable adds to the recipe's command is checked as that command
            command = _expand(recipe.strip().replace(f"$({var})", value), variables)
            problems += [f"make {token}: {p}" for p in command_problems(command, depth + 1)]
    return problems


def module_problems(module: str, args: list[str]) -> list[str]:
    """``python -m module args``: a module of the repository, options its source defines."""
    if module == "proxy":
        return cli_problems(args)
    path = ROOT / module.replace(".", "/")
    source = path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__main__.py"
    if not source.is_file():
        return [f"python -m {module}: no such module in the repository"]
    text = source.read_text(encoding="utf-8")
    return [f"python -m {module}: no option {flag}" for flag in (t.partition("=")[0] for t in args)
            if flag.startswith("--") and f'"{flag}"' not in text]


_TOP = {p.name for p in ROOT.iterdir()} - {".venv"}


def path_problems(token: str) -> list[str]:
    """A token that names a path into the repository must name something there: a file (it has a
    suffix) that exists, or a directory that exists or can be made in one that does."""
    value = token.partition("=")[2] if token.startswith("-") else token
    if "/" not in value or value.startswith(("/", "$", "~", ".venv/")) or "://" in value:
        return []
    if value.split("/", 1)[0] not in _TOP:
        return []  # a path the command makes or the reader chooses (report/, certs/)
    path = ROOT / value
    if path.suffix:
        return [] if path.exists() else [f"{value}: no such file in the repository"]
    return [] if path.exists() or path.parent.is_dir() else [f"{value}: no such directory in the repository"]


def commands(body: str) -> list[list[str]]:
    """The commands of a shell block, each as its words: lines joined at a trailing backslash,
    comments dropped, optional parts' brackets and "..." taken away, redirections left out."""
    logical: list[str] = []
    current = ""
    for line in body.splitlines():
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    if current:
        logical.append(current)
    found: list[list[str]] = []
    for line in logical:
        words: list[str] = []
        skip_next = False
        for word in shlex.split(line, comments=True):
            if skip_next:
                skip_next = False
                continue
            if word in {"|", "||", "&&", ";"}:
                found.append(words)
                words = []
                continue
            if word in {">", ">>", "<", "2>"}:
                skip_next = True
                continue
            word = word.strip("[]")
            if word and word != "...":
                words.append(word)
        found.append(words)
    return [c for c in found if c]


def command_problems(command: str | list[str], depth: int = 0) -> list[str]:
    """What is wrong with one command (see the module's docstring)."""
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
        argv = argv[1:]  # VAR=value before the command
    if argv and argv[0] == "sudo":
        argv = argv[1:]
    if not argv:
        return []
    program, args = argv[0], argv[1:]
    problems = [p for a in args for p in path_problems(a)]
    if program == "make":
        return problems + make_problems(args, depth)
    if program == "kafka-quota-proxy" or program.endswith("/kafka-quota-proxy"):
        return problems + cli_problems(args)
    if re.fullmatch(r"(.*/)?python3?(\.\d+)?", program):
        if len(args) < 2 or args[0] != "-m":
            return [*problems, f"{program}: only `python -m MODULE` is checked, got {' '.join(args)!r}"]
        return problems + module_problems(args[1], args[2:])
    if program in {".", "source"}:
        return problems
    if program == "docker":
        files = [args[i + 1] for i, a in enumerate(args[:-1]) if a in {"-f", "--file"}]
        return problems + [f"docker: {f}: no such file" for f in files if not (ROOT / f).is_file()]
    if program in EXTERNAL:
        return problems
    if "/" in program:
        script = ROOT / program
        if not script.is_file():
            return [*problems, f"{program}: no such script in the repository"]
        if not script.stat().st_mode & 0o111:
            return [*problems, f"{program}: not executable"]
        return problems
    return [*problems, f"{program}: unknown command (not in the repository, nor one of {sorted(EXTERNAL)})"]


def shell_problems(body: str) -> list[str]:
    return [p for words in commands(body) for p in command_problems(words)]


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=lambda b: b.name)
def test_a_shell_example_names_real_things(block):
    assert commands(block.body), f"{block.name}: a shell block with no command"
    assert shell_problems(block.body) == [], block.name


# --- fences and links ------------------------------------------------------------------------


def test_every_fence_says_its_language():
    unknown = [f"{b.name}: ```{b.lang}" for b in ALL_BLOCKS if b.lang not in YAML | SHELL | OTHER]
    assert unknown == [], "a block without a known language would escape the checks"


def test_every_example_comment_is_above_a_yaml_block():
    """A marker above anything else (or above nothing) is a mistake the YAML check would miss."""
    stray = []
    for doc in DOCS:
        lines = doc.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if _MARKER.match(line.strip()):
                after = next((lines[j] for j in range(i + 1, len(lines)) if lines[j].strip()), "")
                fence = _FENCE.match(after)
                if fence is None or fence.group(1) not in YAML:
                    stray.append(f"{doc.relative_to(ROOT)}:{i + 1}")
    assert stray == []


def _without_code(text: str) -> str:
    text = re.sub(r"^```.*?^```[ \t]*$", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(doc: Path) -> set[str]:
    """GitHub's anchors for the headings of ``doc``."""
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.sub(r"^```.*?^```[ \t]*$", "", doc.read_text(
            encoding="utf-8"), flags=re.S | re.M), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def link_problems(doc: Path, text: str) -> list[str]:
    """Relative links of ``text`` (in ``doc``) that lead nowhere."""
    problems = []
    for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", _without_code(text)):
        if re.match(r"^[a-z]+:", target):
            continue  # http:, https:, mailto:
        path_part, _, anchor = target.partition("#")
        path = (doc.parent / path_part).resolve() if path_part else doc
        if not path.exists() or ROOT not in (path, *path.parents):
            problems.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            problems.append(f"{target}: no heading #{anchor} in {path.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_relative_link_leads_somewhere(doc):
    assert link_problems(doc, doc.read_text(encoding="utf-8")) == []


def _ignored_dirs() -> list[str]:
    """Directories .gitignore leaves out: what the docs name there exists only once made."""
    lines = (ROOT / ".gitignore").read_text(encoding="utf-8").splitlines()
    return [line.strip().strip("/") + "/" for line in lines if line.strip().endswith("/")]


def named_path_problems(text: str) -> list[str]:
    """Paths into the repository named in inline code (`proxy/app/cli.py`, `deploy/tls/`) that
    do not exist: what a move of files leaves behind in prose."""
    ignored = _ignored_dirs()
    problems = []
    for span in re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```[ \t]*$", "", text, flags=re.S | re.M)):
        for word in span.split():
            if not re.fullmatch(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*/?", word) or "/" not in word:
                continue
            if word.split("/", 1)[0] not in _TOP or any(word.startswith(d) for d in ignored):
                continue
            if not (ROOT / word).exists():
                problems.append(f"{word}: no such file or directory in the repository")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_repository_path_named_exists(doc):
    assert named_path_problems(doc.read_text(encoding="utf-8")) == []


def test_the_examples_are_found():
    """The extraction itself: the docs have examples of both kinds, and the README's set-up
    commands and first configuration are among them."""
    assert len(YAML_BLOCKS) >= 10 and len(SHELL_BLOCKS) >= 10
    readme = [b for b in ALL_BLOCKS if b.doc.name == "README.md"]
    assert any("make demo" in b.body and b.lang in SHELL for b in readme)
    assert any(b.lang in YAML and b.marker is None for b in readme)


# --- the checks can fail ---------------------------------------------------------------------

PLANTED = [
    ("yaml", "upstream:\n  bootstrap_servers: ['k:9092']\nquotas:\n  - user: alice\n    producer_byte_rte: 1\n", None),
    ("yaml", "quotas:\n  - user: alice\n    producer_byte_rate: 1\n", None),  # no upstream, not a fragment
    ("yaml", "listen:\n  bootstrap_port: 'x'\n", "fragment"),
    ("yaml", "rate_limiters:\n  - nowhere.at.all:Limiter\n", "fragment"),
    ("yaml", "quotas: [\n", "not-config"),
    ("yaml", "quotas: []\n", "fragmnet"),
    ("sh", "make tset\n", None),
    ("sh", "make demo DEMO_ARGS=--kepp\n", None),
    ("sh", ".venv/bin/kafka-quota-proxy chek-config config/example.yaml\n", None),
    ("sh", "kafka-quota-proxy run --confg first.yaml\n", None),
    ("sh", "kafka-quota-proxy quotas set --bootstrap-server p:9092 --user alice \\\n  --ad x=1  # a comment\n", None),
    ("sh", "kafka-quota-proxy check-config config/exmaple.yaml\n", None),
    ("sh", ".venv/bin/python -m bench.nothere\n", None),
    ("sh", ".venv/bin/python -m bench.run --no-such-flag\n", None),
    ("sh", "deploy/tls/make-certz.sh certs\n", None),
    ("sh", "docker compose -f deploy/nothere.yml up\n", None),
    ("sh", "frobnicate --now\n", None),
    ("link", "see [the limits](docs/limts.md)\n", None),
    ("link", "see [shadow mode](docs/quotas.md#shadow-mode-nowhere)\n", None),
    ("path", "the filter API is in `proxy/filters/nowhere.py`\n", None),
]


@pytest.mark.parametrize("kind, text, marker", PLANTED, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(PLANTED)])
def test_a_planted_mistake_is_caught(kind, text, marker):
    if kind == "yaml":
        assert yaml_problems(text, marker)
    elif kind == "sh":
        assert shell_problems(text)
    elif kind == "link":
        assert link_problems(ROOT / "README.md", text)
    else:
        assert named_path_problems(text)


def test_the_same_examples_without_the_mistake_pass():
    """The planted mistakes are caught for the mistake, not for the shape of the example."""
    assert yaml_problems("upstream:\n  bootstrap_servers: ['k:9092']\nquotas:\n  - user: alice\n"
                         "    producer_byte_rate: 1\n", None) == []
    assert yaml_problems("listen:\n  bootstrap_port: 9092\n", "fragment") == []
    assert yaml_problems("rate_limiters:\n  - nowhere.at.all:Limiter\n",
                         "fragment; plug-in nowhere.at.all:Limiter") == []
    assert "nowhere" not in sys.modules
    assert shell_problems("make test\nmake demo DEMO_ARGS=--keep\n") == []
    assert shell_problems(".venv/bin/kafka-quota-proxy check-config config/example.yaml\n") == []
    assert shell_problems("kafka-quota-proxy quotas set --bootstrap-server p:9092 --user alice \\\n"
                          "  --add x=1  # a comment --ad\n") == []
    assert shell_problems(".venv/bin/python -m bench.run --configs direct --repeats 3\n") == []
    assert shell_problems("deploy/tls/make-certs.sh deploy/tls/certs\n") == []
    assert link_problems(ROOT / "README.md", "see [the limits](docs/limits.md) and "
                         "[shadow mode](docs/quotas.md#shadow-mode-see-what-a-quota-would-do-before-it-bites)\n") == []
    assert named_path_problems("`config/example.yaml`, `deploy/tls/`, `bench/results/latest.json`, `report/`") == []
