"""Structured logging: ``key=value`` text or one JSON object per line."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from types import TracebackType

# What logging's ``exc_info`` takes (typeshed's private logging._ExcInfoType).
ExcInfo = (bool | BaseException | tuple[type[BaseException], BaseException, TracebackType | None]
           | tuple[None, None, None] | None)


class JsonFormatter(logging.Formatter):
    def __init__(self, worker: str | None = None) -> None:
        super().__init__()
        self._worker = worker

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if self._worker is not None:
            entry["worker"] = self._worker
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class TextFormatter(logging.Formatter):
    def __init__(self, worker: str | None = None) -> None:
        where = "" if worker is None else f"worker={worker} "
        super().__init__(f"ts=%(asctime)s level=%(levelname)s {where}logger=%(name)s msg=\"%(message)s\"")


def configure(level: str, fmt: str, worker: str | None = None) -> None:
    """Log lines of ``level`` and above to stderr, as ``fmt`` (text or json); with ``worker``,
    each line says which process of a host of workers wrote it (``supervisor``, or a number)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(worker) if fmt == "json" else TextFormatter(worker))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class LogLimiter:
    """A log line a client can trigger, at most ``lines`` times per ``interval_s``.

    Guarantees: however fast the events come, no more than ``lines`` lines go out per interval;
    the lines held back are counted, and the next line that goes out says how many there were.
    """

    __slots__ = ("_logger", "_lines", "_interval_s", "_clock", "_window_end", "_sent", "_held_back")

    def __init__(self, logger: logging.Logger, lines: int = 10, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._lines = lines
        self._interval_s = interval_s
        self._clock = clock
        self._window_end = float("-inf")
        self._sent = 0
        self._held_back = 0

    def log(self, level: int, msg: str, *args: object, exc_info: ExcInfo = None) -> bool:
        """Logs ``msg % args`` unless the interval's lines are spent; True if it went out."""
        now = self._clock()
        if now >= self._window_end:
            self._window_end = now + self._interval_s
            self._sent = 0
        if self._sent >= self._lines:
            self._held_back += 1
            return False
        self._sent += 1
        held_back, self._held_back = self._held_back, 0
        if held_back:
            msg += " (%d more like this not logged)"
            args = (*args, held_back)
        self._logger.log(level, msg, *args, exc_info=exc_info)
        return True
