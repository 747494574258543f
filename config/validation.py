"""Reading one YAML value at a time, and finding every error of a file in one pass.

Each reader checks one value and returns it typed. What it finds wrong is recorded with
:func:`invalid`: inside :func:`collecting` (which ``parse_config`` opens) the error is kept and
the reader returns a fallback, so the loader goes on and finds the file's other errors; the
collection then raises them together (:class:`ConfigErrors`). Nothing is built from a file with
an error in it: the fallbacks only let the reading go on.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import re
from collections.abc import Callable, Collection, Iterator, Sequence
from contextvars import ContextVar
from typing import Any, TypeVar

_T = TypeVar("_T")  # what a reader returns


class ConfigError(ValueError):
    """An invalid configuration. ``str()`` names the YAML path and the offending value;
    ``errors`` is every error found (this one alone, or those of :class:`ConfigErrors`)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.errors: tuple[ConfigError, ...] = (self,)


class ConfigErrors(ConfigError):
    """Several errors of one configuration, in the order the loader reads them (its quotas and
    rate_limiters first, then the other sections). ``path`` is the first one's; ``str()`` joins
    them all with "; " (one line: what a refused reload logs)."""

    def __init__(self, errors: Sequence[ConfigError]) -> None:
        found = tuple(e for error in errors for e in error.errors)
        ValueError.__init__(self, "; ".join(str(e) for e in found))
        self.path = found[0].path
        self.errors = found


def one_error(errors: Sequence[ConfigError]) -> ConfigError:
    """``errors`` (at least one) as one exception to raise: the error itself when alone."""
    return errors[0] if len(errors) == 1 else ConfigErrors(errors)


_found: ContextVar[list[ConfigError] | None] = ContextVar("config_errors_found", default=None)


@contextlib.contextmanager
def collecting() -> Iterator[list[ConfigError]]:
    """Errors recorded with :func:`invalid` meanwhile are kept, and raised together at the end
    (one ConfigError, or ConfigErrors). Nested in another collection, it adds to that one."""
    outer = _found.get()
    if outer is not None:
        yield outer
        return
    found: list[ConfigError] = []
    token = _found.set(found)
    try:
        yield found
    finally:
        _found.reset(token)
    if found:
        raise one_error(found)


def invalid(path: str, message: str, fallback: _T) -> _T:
    """Records an error at ``path`` and returns ``fallback`` for the reading to go on with;
    outside :func:`collecting`, raises it."""
    found = _found.get()
    if found is None:
        raise ConfigError(path, message)
    found.append(ConfigError(path, message))
    return fallback


def errors_so_far() -> int:
    """How many errors the collection in progress holds (0 outside one): a check that only makes
    sense when what it builds on was valid compares this before and after reading that."""
    found = _found.get()
    return len(found) if found is not None else 0


# YAML 1.1 (PyYAML's safe_load) reads a float only with a dot and a signed exponent: 1e6, 1.5e6
# and 2E-3 stay strings. Where a number is expected they mean the number they spell.
# One way to split the digits (no \d+\.?\d*), so a long run of digits fails in linear time.
_EXPONENT = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)[eE][-+]?\d+")


def as_number(v: Any) -> int | float | None:
    """``v`` as a number where one is expected: an int or a float as YAML read it, or a string in
    exponent notation (``1e6``); None for anything else (a bool, "10", "nan", a list...)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return v
    if isinstance(v, str) and _EXPONENT.fullmatch(v.strip()):
        return float(v)
    return None


def as_int(v: Any) -> int | None:
    """``v`` as an integer: an int, or exponent notation of a whole number (``1e6``, ``2.5e3``).
    A float as YAML read it (``2.0``) is refused, as it always was where an integer is expected."""
    if isinstance(v, str):
        n = as_number(v)
        return int(n) if isinstance(n, float) and n.is_integer() else None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def suggestion(key: Any, known: Collection[str]) -> str:
    """" did you mean X?" for the known key closest to a misspelt ``key``; "" when none is close."""
    close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def mapping(data: Any, path: str, allowed: Collection[str]) -> dict[str, Any]:
    """``data`` as a mapping of the ``allowed`` keys (None: empty). A key not allowed is an error
    of its own (with the allowed key it most likely meant) and is otherwise ignored; anything
    but a mapping is an error, read as an empty mapping."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        return invalid(path, f"must be a mapping, got {data!r}", {})
    for key in data:
        if key not in allowed:
            where = key if path == "$" else f"{path}.{key}"
            invalid(where, f"unknown key{suggestion(key, allowed)} (allowed: {', '.join(sorted(allowed))})", None)
    return {k: v for k, v in data.items() if k in allowed}


def read_str(m: dict[str, Any], key: str, path: str, default: str) -> str:
    v = m.get(key, default)
    if not isinstance(v, str) or not v:
        return invalid(f"{path}.{key}", f"must be a non-empty string, got {v!r}", default)
    return v


def read_bool(m: dict[str, Any], key: str, path: str, default: bool) -> bool:
    v = m.get(key, default)
    if not isinstance(v, bool):
        return invalid(f"{path}.{key}", f"must be true or false, got {v!r}", default)
    return v


def read_int(m: dict[str, Any], key: str, path: str, default: int, lo: int, hi: int) -> int:
    v = m.get(key, default)
    n = as_int(v)
    if n is None or not lo <= n <= hi:
        return invalid(f"{path}.{key}", f"must be an integer in [{lo}, {hi}], got {v!r}", default)
    return n


def read_number(m: dict[str, Any], key: str, path: str, default: float, lo: float) -> float:
    v = m.get(key, default)
    n = as_number(v)
    if n is None or not math.isfinite(n) or n < lo:
        return invalid(f"{path}.{key}", f"must be a finite number >= {lo}, got {v!r}", default)
    return float(n)


def read_optional(
    m: dict[str, Any], key: str, path: str, default: _T | None, read: Callable[..., _T], *bounds: float
) -> _T | None:
    """``read(m, key, path, default, *bounds)``, or None when the key is null (no limit)."""
    if m.get(key, default) is None:
        return None
    return read(m, key, path, default, *bounds)


def read_optional_str(m: dict[str, Any], key: str, path: str) -> None:
    if key in m and (not isinstance(m[key], str) or not m[key]):
        invalid(f"{path}.{key}", f"must be a non-empty string, got {m[key]!r}", None)


def port_value(v: Any, path: str) -> int:
    n = as_int(v)
    if n is None or not 0 <= n <= 65535:
        return invalid(path, f"must be a port in [0, 65535], got {v!r}", 0)
    return n


def host_port(s: Any, path: str) -> tuple[str, int]:
    if isinstance(s, str) and ":" in s:
        host, _, port = s.rpartition(":")
        host = host.strip("[]")
        if host and port.isdigit() and 0 < int(port) <= 65535:
            return host, int(port)
    return invalid(path, f"must be host:port, got {s!r}", ("", 0))


def split_host_port(s: str) -> tuple[str, int]:
    """Splits a validated ``host:port`` (IPv6 in brackets allowed); ConfigError otherwise."""
    host, port = host_port(s, "host:port")
    if not host:  # only inside a collection: the error is recorded, and this caller needs the value
        raise ConfigError("host:port", f"must be host:port, got {s!r}")
    return host, port


def section(data: Any, path: str, allowed: set[str]) -> dict[str, Any] | None:
    """:func:`mapping`, or None (the error recorded) when ``data`` is not a mapping: a section
    with required keys, whose own errors would only repeat that one."""
    if data is not None and not isinstance(data, dict):
        return invalid(path, f"must be a mapping, got {data!r}", None)
    return mapping(data, path, allowed)
