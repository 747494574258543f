"""Seeing what a filter hands to the decode thread (proxy.cluster.offload.off_loop)."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.cluster import offload


def record_off_loop(monkeypatch: pytest.MonkeyPatch, module: Any) -> list[str]:
    """Replaces ``module.off_loop`` with one that runs as the real one and appends the name of
    each function it was given to the returned list, in order."""
    worked: list[str] = []

    async def recorded(fn: Any, *args: Any) -> Any:
        worked.append(fn.__name__)
        return await offload.off_loop(fn, *args)

    monkeypatch.setattr(module, "off_loop", recorded)
    return worked
