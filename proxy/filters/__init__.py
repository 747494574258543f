"""Request and response filters. A filter returns a decision; it never touches a socket."""

from .base import Answer, Close, FilterChain, Forward, RequestFilter, ResponseFilter

__all__ = ["Answer", "Close", "FilterChain", "Forward", "RequestFilter", "ResponseFilter"]
