"""Filters of the operator's own (``filters:``, see config.filters), built when the chain is.

The file was read with each factory tried on its configuration; here each is called again, and
what it returns is checked against the filter API itself (its spec a FilterSpec, the methods of
every role it declares), so a factory that behaves differently now still cannot put something
else in the chain: a ConfigError naming ``filters[i]``, as a refused rate limiter is named.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from config import ConfigError
from config.model import FilterPlugin
from proxy.dataplane.filters.api import (
    Filter,
    RequestFilter,
    ResponseFilter,
    checked_spec,
    is_request_filter,
    is_response_filter,
)


class PluginFilters(NamedTuple):
    """The plug-ins that can have the request role, and those that can have the response role
    (a filter may be in both, as a built-in one may; its spec says what it sees)."""

    request: list[RequestFilter]
    response: list[ResponseFilter]


def build_plugins(plugins: Sequence[FilterPlugin]) -> PluginFilters:
    """Each plug-in's filter, built by its factory from its settings, in order. Raises ConfigError
    naming ``filters[i]`` when a factory raises or builds something that is not a filter."""
    built: list[Filter] = []
    for i, plugin in enumerate(plugins):
        where = f"filters[{i}]"
        try:
            f = plugin.factory(plugin.settings)
        except Exception as exc:  # the plug-in's own refusal, or its bug: the operator's to see
            raise ConfigError(where, f"{plugin.target} refused its config {dict(plugin.settings)!r}: {exc!r}") from exc
        try:
            checked_spec(f)
        except TypeError as exc:
            raise ConfigError(where, f"{plugin.target} did not build a filter: {exc}") from exc
        built.append(f)  # type: ignore[arg-type]  # checked_spec: it has a FilterSpec
    return PluginFilters([f for f in built if is_request_filter(f)], [f for f in built if is_response_filter(f)])
