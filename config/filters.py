"""``filters:``: filters of the operator's own, each named by its factory, ``package.module:Factory``
(as ``rate_limiters:`` names its classes), alone or with a ``config:`` mapping of its own.

Each factory is imported and called on its configuration when the file is read, and what it
returns must have the shape of a filter, so ``check-config``, a start and a reload all refuse a
broken entry with its YAML path: ``filters[0].factory`` for a factory that cannot be imported,
is not callable or returns something that is not a filter; ``filters[0].config`` for one that
raises on its configuration (``filters[0]`` for an entry written as the bare factory name).
The proxy calls the factory again when it builds its filter chain (and checks the filter again,
its ``FilterSpec`` included): a factory only builds, it starts nothing.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from quotas.plugins import load_attribute

from .model import FilterPlugin
from .validation import invalid, mapping

# The roles a filter's spec may declare, and the methods each then needs. The filter API's own
# table is proxy.dataplane.filters.api.ROLE_METHODS; config never imports proxy, so it is
# repeated here (tests/unit/test_filter_plugins.py keeps the two the same).
ROLE_METHODS: dict[str, tuple[str, ...]] = {
    "request": ("on_request",),
    "response": ("on_response",),
    "chunk": ("on_response", "on_response_chunk"),
    "stream": ("on_response", "on_stream_head", "on_stream_tail"),
}
_SPEC_FIELDS = ("request_keys", "response_keys", "chunk", "stream")
_SHAPES = "package.module:Factory, or {factory: package.module:Factory, config: {...}}"


def read_filters(data: Any, path: str) -> tuple[FilterPlugin, ...]:
    """The ``filters:`` list (as YAML loaded it): each valid entry, in order. An entry with an
    error is recorded (config.validation.invalid) and left out."""
    if data is None:
        return ()
    if not isinstance(data, list):
        return invalid(path, f"must be a list of {_SHAPES}, got {data!r}", ())
    plugins = (_plugin(entry, f"{path}[{i}]") for i, entry in enumerate(data))
    return tuple(p for p in plugins if p is not None)


def _plugin(entry: Any, path: str) -> FilterPlugin | None:
    """One entry of ``filters:``, None when it has an error (recorded)."""
    settings: Any = {}
    where = settings_path = path
    if isinstance(entry, dict):
        m = mapping(entry, path, {"factory", "config"})
        if "factory" not in m:
            return invalid(f"{path}.factory", "is required", None)
        target = m["factory"]
        settings = {} if m.get("config") is None else m["config"]
        where, settings_path = f"{path}.factory", f"{path}.config"
        if not isinstance(settings, dict):
            return invalid(settings_path, f"must be a mapping, got {settings!r}", None)
    else:
        target = entry
    if not isinstance(target, str):
        return invalid(where, f"must be package.module:Factory, got {target!r}", None)
    try:
        factory = load_factory(target)
    except ValueError as exc:
        return invalid(where, str(exc), None)
    frozen = MappingProxyType(settings)
    try:
        built = factory(frozen)
    except Exception as exc:  # the plug-in's own refusal, or its bug: the operator's to see
        return invalid(settings_path, f"{target} refused its config {settings!r}: {exc!r}", None)
    problem = filter_problem(built)
    if problem is not None:
        return invalid(where, f"{target} returned {_shown(built)}, not a filter: {problem}", None)
    return FilterPlugin(target, factory, frozen)


def load_factory(target: str) -> Any:
    """Imports ``package.module:Factory`` (the attribute may be dotted: ``Class.from_config``) and
    returns it. Raises ValueError saying what is wrong: the form, the import, the attribute, or an
    attribute that cannot be called."""
    obj = load_attribute(target, "package.module:Factory")
    if not callable(obj):
        raise ValueError(f"{target!r} is a {type(obj).__name__}, not a factory (a callable taking its config)")
    return obj


def filter_problem(obj: object) -> str | None:
    """Why ``obj`` is not a filter, as far as its shape shows; None when it looks like one: an
    instance with a ``spec`` holding FilterSpec's fields, and the methods of every role that spec
    declares."""
    if isinstance(obj, type):
        return "a class, where an instance was expected (the factory must build the filter)"
    try:
        spec = getattr(obj, "spec", None)
        if spec is None:
            return "it has no spec (a proxy.dataplane.filters.api.FilterSpec)"
        if not all(hasattr(spec, name) for name in _SPEC_FIELDS):
            return f"its spec is a {type(spec).__name__}, not a FilterSpec"
        declared = {
            "request": spec.request_keys is None or bool(spec.request_keys),
            "response": bool(spec.response_keys),
            "chunk": bool(spec.chunk),
            "stream": bool(spec.stream),
        }
    except Exception as exc:  # a spec property that raises
        return f"reading its spec raised {exc!r}"
    for role, methods in ROLE_METHODS.items():
        for method in methods if declared[role] else ():
            if not callable(getattr(obj, method, None)):
                return f"its spec declares the {role} role, and it has no {method}()"
    return None


def _shown(obj: object) -> str:
    """``obj`` for an error message: its repr, cut short."""
    text = repr(obj)
    return text if len(text) <= 80 else f"{text[:77]}..."
