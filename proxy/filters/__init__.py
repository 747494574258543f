"""Request and response filters. A filter returns a decision; it never touches a socket."""

from .base import Answer, Close, Defer, FilterChain, Forward, RequestFilter, ResponseFilter

__all__ = ["Answer", "Close", "Defer", "FilterChain", "Forward", "RequestFilter", "ResponseFilter"]
