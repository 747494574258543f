"""Rate limiters loaded by dotted path from ``rate_limiters``, as an operator's plug-in would be.

``tests.support.custom_limiter:PauseLimiter`` asks for a fixed pause on every Produce request
of the client ids its ``client_id`` glob matches; ``tests.support.custom_limiter:BrokenLimiter``
raises from :meth:`accumulate`. The proxy process imports them like any other limiter: it runs
``python -m proxy`` with the repository root as its working directory, so the ``tests`` package
is on its ``sys.path``.
"""

from __future__ import annotations

import json
from fnmatch import fnmatchcase

from quotas.limiters import PRODUCE, LimiterContext, RateLimiter, Usage


class PauseLimiter(RateLimiter):
    """``{client_id: GLOB, pause_ms: N, calls_file: PATH}``: each Produce request of a matching
    client id earns a throttle of ``pause_ms``; every other request, none.

    With ``calls_file``, every Produce it is shown is appended to that file as one JSON line
    (``client_id``, ``api_version``, ``batches``, ``records``, ``size_bytes``) so a test can see
    what the proxy told it. The file is line-buffered: a line is in it once the proxy has
    answered the request it describes.
    """

    def __init__(self) -> None:
        self.client_id = ""
        self.pause_ms = 0
        self.api_keys = frozenset({PRODUCE})
        self.fetch_responses = False
        self._calls = None

    @classmethod
    def check_settings(cls, settings) -> None:
        client_id = settings.get("client_id")
        pause_ms = settings.get("pause_ms")
        if not isinstance(client_id, str) or not client_id:
            raise ValueError(f"PauseLimiter needs client_id (a client id or glob), got {client_id!r}")
        if not isinstance(pause_ms, int) or isinstance(pause_ms, bool) or pause_ms < 0:
            raise ValueError(f"PauseLimiter needs pause_ms (a non-negative integer), got {pause_ms!r}")

    def configure(self, context: LimiterContext) -> None:
        settings = context.settings
        self.client_id = settings["client_id"]
        self.pause_ms = settings["pause_ms"]
        calls_file = settings.get("calls_file")
        if calls_file and self._calls is None:
            self._calls = open(calls_file, "a", buffering=1, encoding="utf-8")

    def _applies(self, usage: Usage) -> bool:
        return usage.api_key == PRODUCE and not usage.response and fnmatchcase(usage.client_id, self.client_id)

    def accumulate(self, usage: Usage, now_ms: int) -> None:
        if self._calls is not None and usage.api_key == PRODUCE and not usage.response:
            self._calls.write(json.dumps({
                "client_id": usage.client_id, "api_version": usage.api_version, "batches": usage.batches,
                "records": usage.records, "size_bytes": usage.size_bytes, "now_ms": now_ms,
            }) + "\n")

    def throttle_ms(self, usage: Usage, now_ms: int) -> int:
        return self.pause_ms if self._applies(usage) else 0

    def close(self) -> None:
        if self._calls is not None:
            self._calls.close()
            self._calls = None


class BrokenLimiter(RateLimiter):
    """A plug-in with a bug: :meth:`accumulate` raises on every request it is shown (all APIs)."""

    api_keys = None  # every request
    fetch_responses = True  # and every Fetch response

    def accumulate(self, usage: Usage, now_ms: int) -> None:
        raise RuntimeError(f"BrokenLimiter cannot count api_key={usage.api_key} of {usage.client_id!r}")

    def throttle_ms(self, usage: Usage, now_ms: int) -> int:
        return 0
