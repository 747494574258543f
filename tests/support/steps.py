"""Driving a scanner that works in steps (protocol.records.scan_produce_steps and the like)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from protocol.errors import ProtocolError


def run_steps(steps: Iterator[object]) -> tuple[int, object]:
    """(how many steps paused, the result, or the message of the ProtocolError it raised)."""
    pauses = 0
    try:
        for result in steps:
            if result is None:
                pauses += 1
            else:
                return pauses, result
    except ProtocolError as exc:
        return pauses, str(exc)
    raise AssertionError("the steps ended without a result")


def one_piece(scan: Callable[..., object], *args: object) -> object:
    """What a scanner gives in one piece: its result, or the message of the ProtocolError it raised."""
    try:
        return scan(*args)
    except ProtocolError as exc:
        return str(exc)
