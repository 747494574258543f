"""Request and response filters. A filter declares a FilterSpec and returns decisions; it never
touches a socket (see proxy/filters/api.py and docs/writing-a-filter.md)."""

from proxy.dataplane.filters.api import (
    Answer,
    Close,
    Defer,
    FilterContext,
    FilterContractError,
    FilterSpec,
    Forward,
    Hold,
    RequestFilter,
    ResponseFilter,
)
from proxy.dataplane.filters.chain import FilterChain

__all__ = ["Answer", "Close", "Defer", "FilterChain", "FilterContext", "FilterContractError", "FilterSpec",
           "Forward", "Hold", "RequestFilter", "ResponseFilter"]
