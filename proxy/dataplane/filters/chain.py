"""The per-API filter chain, built from the filters' declared specs.

Chain order is the order the filters are given in (see ``proxy.app.server.default_chain``): a
request meets them first to last, a response likewise. An API nobody filters costs one dict
miss per request; a version below every filter's ``*_since`` skips them all (and may take the
hot path); an idle filter is left out until :meth:`FilterChain.refresh` finds it busy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from protocol.apis import SPECS
from proxy.dataplane.filters.api import FilterSpec, RequestFilter, ResponseFilter, checked_spec
from proxy.dataplane.routes import UNROUTED, fast_route

_NEVER = UNROUTED[0]
UNFILTERED: tuple[int, tuple[Any, ...]] = (_NEVER, ())  # an entry: no filter looks at any version

RequestEntry = tuple[int, tuple[RequestFilter, ...]]
ResponseEntry = tuple[int, tuple[ResponseFilter, ...]]


class FilterChain:
    """Filters indexed by API key.

    ``request`` and ``response`` map an API key to ``(since, filters)``: a frame whose version
    is below ``since`` skips its filters. ``request`` has an entry for every API the proxy knows
    (``protocol.apis.SPECS``), so a miss there means an unknown API (``request_all`` then);
    ``request_without_uplift`` is the same without the filters whose spec ``needs_uplift``, for
    the connections whose broker asked for none. ``response_route`` is the route planner's table
    (see ``proxy.dataplane.routes.plan_route``). The proxy calls :meth:`refresh` whenever a reload changes
    what the filters enforce.
    """

    __slots__ = ("_request_filters", "_response_filters", "request", "request_all", "response", "response_route",
                 "request_without_uplift")

    def __init__(self, request_filters: Iterable[RequestFilter], response_filters: Iterable[ResponseFilter]) -> None:
        self._request_filters = tuple(request_filters)
        self._response_filters = tuple(response_filters)
        self.request: dict[int, RequestEntry] = {}
        self.request_without_uplift: dict[int, RequestEntry] = {}
        self.request_all: RequestEntry = UNFILTERED
        self.response: dict[int, ResponseEntry] = {}
        self.response_route: dict[int, tuple[int, Any]] = {}
        self.refresh()

    def refresh(self) -> None:
        """Rebuilds the per-API entries from the filters' specs now (which ones are idle, which
        APIs they see). Raises TypeError if a filter lacks a method of a role it declares."""
        request_specs = [(f, checked_spec(f)) for f in self._request_filters]
        self.request, self.request_all = _requests(request_specs, uplift=True)
        self.request_without_uplift, _ = _requests(request_specs, uplift=False)
        response: dict[int, list[tuple[int, ResponseFilter, FilterSpec]]] = {}
        for f in self._response_filters:
            spec = checked_spec(f)
            if spec.idle:
                continue
            for key in spec.response_keys:
                response.setdefault(key, []).append((spec.response_since.get(key, 0), f, spec))
        self.response = {key: _entry([(since, f) for since, f, _ in fs]) for key, fs in response.items()}
        self.response_route = {
            key: (self.response[key][0], fast_route(key, [f for _, f, _ in fs], [s.chunk for _, _, s in fs],
                                                    [s.stream for _, _, s in fs]))
            for key, fs in response.items()
        }


def _requests(filters: Sequence[tuple[RequestFilter, FilterSpec]],
              uplift: bool) -> tuple[dict[int, RequestEntry], RequestEntry]:
    every: list[RequestFilter] = []
    request: dict[int, list[tuple[int, RequestFilter]]] = {key: [] for key in SPECS}
    for f, spec in filters:
        if spec.idle or (not uplift and spec.needs_uplift):
            continue
        if spec.request_keys is None:
            every.append(f)
            for key in request:
                request[key].append((0, f))
        else:
            for key in spec.request_keys:
                request.setdefault(key, [(0, g) for g in every]).append((spec.request_since.get(key, 0), f))
    # Every known API has an entry; request_all is for the others.
    return {key: _entry(fs) for key, fs in request.items()}, ((0, tuple(every)) if every else UNFILTERED)


def _entry(filters: list[tuple[int, Any]]) -> tuple[int, tuple[Any, ...]]:
    return (min(since for since, _ in filters), tuple(f for _, f in filters)) if filters else UNFILTERED
