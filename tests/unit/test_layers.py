"""The layers import only downwards: the arrows are read from the source (``ast``), not trusted.

The rules (a package may import itself and the packages listed, nothing else of this project's):

- ``protocol``  nothing of ours: Kafka's wire format only;
- ``usage``     nothing of ours: the usage-log schema, shared by the proxy that writes the log and
                the pipeline that reads it;
- ``quotas``    nothing of ours: pure engines (``ANONYMOUS`` lives here, where both sides reach it);
- ``config``    quotas, protocol, usage: never proxy or pipeline;
- ``pipeline``  config, quotas, protocol, usage: never proxy, so a Spark job loads no asyncio;
- ``proxy``     anything.

Every ``import`` and ``from ... import`` counts, absolute or relative, at module level or inside
a function or an ``if TYPE_CHECKING:``, and so does ``importlib.import_module("<literal>")``.
No package of ours may import ``tests`` or ``bench``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = frozenset({"protocol", "usage", "quotas", "config", "pipeline", "proxy", "tests", "bench"})
ALLOWED: dict[str, frozenset[str]] = {
    "protocol": frozenset({"protocol"}),
    "usage": frozenset({"usage"}),
    "quotas": frozenset({"quotas"}),
    "config": frozenset({"config", "quotas", "protocol", "usage"}),
    "pipeline": frozenset({"pipeline", "config", "quotas", "protocol", "usage"}),
    "proxy": frozenset({"proxy", "config", "quotas", "protocol", "usage", "pipeline"}),
}


def imported_modules(module: str, source: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``, the source of ``module``
    (dotted name; ``is_package`` for an ``__init__.py``)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                found.append((node.lineno, node.module))
                continue
            parts = package.split(".") if package else []
            # A relative import climbing past the top level resolves to what it names.
            base = parts[:len(parts) - (node.level - 1)] if node.level - 1 < len(parts) else []
            target = ".".join([*base, node.module] if node.module else base)
            if node.module is None:  # from . import a, b: each name may be a module
                found.extend((node.lineno, f"{target}.{alias.name}" if target else alias.name)
                             for alias in node.names)
            else:
                found.append((node.lineno, target))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            found.append((node.lineno, node.args[0].value))
    return found


def forbidden_imports(module: str, source: str, is_package: bool = False) -> list[str]:
    """The imports in ``source`` (of ``module``) that break its layer's rule, as readable lines."""
    allowed = ALLOWED[module.partition(".")[0]]
    return [f"{module}:{line} imports {name}" for line, name in imported_modules(module, source, is_package)
            if name.partition(".")[0] in OURS - allowed]


def _modules(layer: str):
    for path in sorted((ROOT / layer).rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        is_package = rel.name == "__init__"
        yield ".".join(rel.parent.parts if is_package else rel.parts), path, is_package


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_each_layer_imports_only_what_its_rule_allows(layer):
    modules = list(_modules(layer))
    assert modules, f"no Python files under {layer}/"
    violations = [v for module, path, is_package in modules
                  for v in forbidden_imports(module, path.read_text(encoding="utf-8"), is_package)]
    assert violations == []


def test_every_top_level_package_has_a_rule():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "bench"}
    assert packages == set(ALLOWED)


@pytest.mark.parametrize("module, source, is_package, expected", [
    # The six arrows issue 17 found, as they were.
    ("pipeline.spark", "from proxy.observability.usage_log import COLUMN_NAMES\n", False,
     ["pipeline.spark:1 imports proxy.observability.usage_log"]),
    ("pipeline.recommend", "from proxy.identity.principal import ANONYMOUS\n", False,
     ["pipeline.recommend:1 imports proxy.identity.principal"]),
    ("pipeline.kinds", "from proxy.dataplane.filters.controller_mutation import STRICT_SINCE\n", False,
     ["pipeline.kinds:1 imports proxy.dataplane.filters.controller_mutation"]),
    # Forms: plain import, inside a function, under TYPE_CHECKING, relative, importlib.
    ("protocol.frames", "import quotas.rate\n", False, ["protocol.frames:1 imports quotas.rate"]),
    ("quotas.rate", "def f():\n    from config import Config\n", False, ["quotas.rate:2 imports config"]),
    ("quotas.entities", "if TYPE_CHECKING:\n    from usage.schema import OTHER\n", False,
     ["quotas.entities:2 imports usage.schema"]),
    ("config.loader", "from ..proxy import server\n", False, ["config.loader:1 imports proxy"]),
    ("config", "from .. import pipeline\n", True, ["config:1 imports pipeline"]),
    ("usage.schema", "import importlib\nimportlib.import_module('proxy.app.cli')\n", False,
     ["usage.schema:2 imports proxy.app.cli"]),
    ("pipeline.replay", "__import__('tests.support')\n", False, ["pipeline.replay:1 imports tests.support"]),
    # Allowed: its own package (relative or not), what the rule lists, third-party names.
    ("pipeline.report", "from . import demand\nfrom .spark import read_usage\nfrom config import load_config\n"
     "from usage.schema import OTHER\nfrom quotas.entities import ANONYMOUS\nimport pyspark\n", False, []),
    ("proxy.dataplane.filters.sasl", "from ..principal import ANONYMOUS\nfrom pipeline import report\n", False, []),
    ("protocol.apis", "from kafka.protocol.api_message import ApiMessage\nfrom .errors import ProtocolError\n",
     False, []),
    ("quotas", "from quotas.common import ADMIT\nfrom . import rate\n", True, []),
])
def test_the_checker_catches_a_planted_violation(module, source, is_package, expected):
    assert forbidden_imports(module, source, is_package) == expected


def test_the_pipeline_loads_neither_the_proxy_nor_asyncio_nor_prometheus_client():
    modules = [m for m, _, _ in _modules("pipeline") if m != "pipeline"]
    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m.partition('.')[0] in ('proxy', 'asyncio', 'prometheus_client')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"


# The connection core: what carries out decisions. Filters see it only through the filter API
# (proxy.dataplane.filters.api: FilterContext, decisions), never as a connection.
CORE = frozenset({"proxy.dataplane.connection", "proxy.dataplane.requests", "proxy.dataplane.response_queue",
                  "proxy.dataplane.upstream", "proxy.dataplane.raw_sasl", "proxy.dataplane.flow",
                  "proxy.dataplane.environment", "proxy.app.server", "proxy.app.cli"})


def core_imports(module: str, source: str, is_package: bool = False) -> list[str]:
    return [f"{module}:{line} imports {name}" for line, name in imported_modules(module, source, is_package)
            if name in CORE or name.rpartition(".")[0] in CORE]


def test_filters_see_the_filter_api_not_the_connection():
    modules = [(m, p, pkg) for m, p, pkg in _modules("proxy") if m.startswith("proxy.dataplane.filters")]
    assert len(modules) > 8
    violations = [v for module, path, is_package in modules
                  for v in core_imports(module, path.read_text(encoding="utf-8"), is_package)]
    assert violations == []


@pytest.mark.parametrize("source, expected", [
    ("if TYPE_CHECKING:\n    from proxy.dataplane.connection import ClientConnection\n",
     ["proxy.dataplane.filters.quotas:2 imports proxy.dataplane.connection"]),
    ("from ..response_queue import ResponseQueue\n",
     ["proxy.dataplane.filters.quotas:1 imports proxy.dataplane.response_queue"]),
    ("from ..inflight import InFlight\nfrom .api import Forward\nfrom ..topics import TopicCache\n", []),
])
def test_the_filter_rule_catches_a_planted_violation(source, expected):
    assert core_imports("proxy.dataplane.filters.quotas", source) == expected


# The rooms of the proxy, lowest first: each may import itself and the rooms listed, nothing else
# of the proxy's. The application shell (``proxy.app``, with ``proxy`` and ``proxy.__main__``)
# wires the others; it is the only room that may import the pipeline.
ROOMS: dict[str, frozenset[str]] = {
    "proxy.observability": frozenset(),
    "proxy.identity": frozenset({"proxy.observability"}),
    "proxy.cluster": frozenset({"proxy.identity", "proxy.observability"}),
    "proxy.control": frozenset({"proxy.cluster", "proxy.identity", "proxy.observability"}),
    "proxy.dataplane": frozenset({"proxy.control", "proxy.cluster", "proxy.identity", "proxy.observability"}),
    "proxy.app": frozenset({"proxy.dataplane", "proxy.control", "proxy.cluster", "proxy.identity",
                            "proxy.observability", "pipeline"}),
}


def room_of(module: str) -> str:
    """The room ``module`` (a module of the proxy's) lives in."""
    parts = module.split(".")
    room = ".".join(parts[:2])
    return room if room in ROOMS else "proxy.app"  # proxy itself and proxy.__main__: the shell


def room_violations(module: str, source: str, is_package: bool = False) -> list[str]:
    own = room_of(module)
    allowed = ROOMS[own] | {own}
    found = []
    for line, name in imported_modules(module, source, is_package):
        top = name.partition(".")[0]
        if top == "proxy" and name != "proxy":
            target = room_of(name)
        elif top == "pipeline":
            target = "pipeline"
        else:
            continue
        if target not in allowed:
            found.append(f"{module}:{line} imports {name}")
    return found


def test_every_module_of_the_proxy_is_in_a_room():
    loose = [m for m, _, _ in _modules("proxy")
             if ".".join(m.split(".")[:2]) not in ROOMS and m not in ("proxy", "proxy.__main__")]
    assert loose == []


def test_each_room_imports_only_the_rooms_below_it():
    modules = list(_modules("proxy"))
    assert {".".join(m.split(".")[:2]) for m, _, _ in modules} >= set(ROOMS)
    violations = [v for module, path, is_package in modules
                  for v in room_violations(module, path.read_text(encoding="utf-8"), is_package)]
    assert violations == []


@pytest.mark.parametrize("module, source, expected", [
    # The back-edges the rooms were made without: a type-only import counts.
    ("proxy.dataplane.connection", "if TYPE_CHECKING:\n    from proxy.app.server import ProxyServer\n",
     ["proxy.dataplane.connection:2 imports proxy.app.server"]),
    ("proxy.observability.readiness", "from proxy.cluster.brokers import Cluster\n",
     ["proxy.observability.readiness:1 imports proxy.cluster.brokers"]),
    ("proxy.identity.tls", "from proxy.dataplane.guard import ConnectionGuard\n",
     ["proxy.identity.tls:1 imports proxy.dataplane.guard"]),
    ("proxy.control.fleet", "from pipeline.fleet import fleet_notes\n",
     ["proxy.control.fleet:1 imports pipeline.fleet"]),
    # Allowed: downwards, within the room, and the shell importing the pipeline.
    ("proxy.dataplane.filters.client_quotas", "from proxy.control.quota_store import QuotaStore\n", []),
    ("proxy.cluster.dialer", "from proxy.identity.tls import client_tls\nfrom proxy.cluster import refresh\n", []),
    ("proxy.app.cli", "from pipeline.report import main\nfrom proxy.dataplane.connection import CLOSED\n", []),
])
def test_the_room_rule_catches_a_planted_violation(module, source, expected):
    assert room_violations(module, source) == expected


def import_circles(layers: list[str]) -> list[list[str]]:
    """The import circles (strongly connected components of more than one module) among the
    modules of ``layers``, largest first; every import counts, type-only ones too."""
    modules = {m: (path, pkg) for layer in layers for m, path, pkg in _modules(layer)}
    edges: dict[str, set[str]] = {}
    for m, (path, pkg) in modules.items():
        targets = set()
        for _, name in imported_modules(m, path.read_text(encoding="utf-8"), pkg):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != m:
                targets.add(name)
        edges[m] = targets
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(circles, key=len, reverse=True)


def test_no_import_circle_is_larger_than_six_modules():
    circles = import_circles(sorted(ALLOWED))
    assert [c for c in circles if len(c) > 6] == []


def test_the_circle_finder_finds_a_circle(tmp_path, monkeypatch):
    for name, source in {"a": "from proxy.b import x\n", "b": "from proxy.c import y\n",
                         "c": "if TYPE_CHECKING:\n    from proxy.a import z\n", "d": "from proxy.a import x\n"}.items():
        (tmp_path / "proxy").mkdir(exist_ok=True)
        (tmp_path / "proxy" / f"{name}.py").write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert import_circles(["proxy"]) == [["proxy.a", "proxy.b", "proxy.c"]]



MAX_MODULE_LINES = 500


def test_no_module_of_the_product_passes_500_lines():
    """A module a reader can hold in mind: split by what it guarantees before it grows past this."""
    sizes = {str(path.relative_to(ROOT)): len(path.read_text(encoding="utf-8").splitlines())
             for layer in sorted(ALLOWED) for _, path, _ in _modules(layer)}
    assert len(sizes) > 100
    assert {path: n for path, n in sizes.items() if n > MAX_MODULE_LINES} == {}


# Pure modules inside the proxy's rooms: no I/O, no asyncio, nothing of the proxy's but each other.
PURE = frozenset({"proxy.identity.java_regex", "proxy.identity.distinguished_name", "proxy.identity.ssl_principal"})
IO_MODULES = frozenset({"asyncio", "socket", "selectors", "subprocess", "threading", "uvloop"})


def test_the_pure_modules_of_the_proxy_import_no_io():
    modules = [(m, p, pkg) for m, p, pkg in _modules("proxy") if m in PURE]
    assert {m for m, _, _ in modules} == PURE
    violations = [f"{module}:{line} imports {name}" for module, path, pkg in modules
                  for line, name in imported_modules(module, path.read_text(encoding="utf-8"), pkg)
                  if name.partition(".")[0] in IO_MODULES or (name.startswith("proxy.") and name not in PURE)]
    assert violations == []
