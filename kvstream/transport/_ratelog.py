"""A logger wrapper that reports a repeating problem at most once per interval, with a count.

Garbage on the wire can arrive at line rate; every occurrence is counted by the caller, and
this keeps the log readable (and cheap) while still saying how many were suppressed.
"""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    """``warning(key, msg, *args)`` logs at most once per ``interval_s`` seconds per key."""

    __slots__ = ("_log", "_interval", "_last", "_suppressed")

    def __init__(self, log: logging.Logger, interval_s: float = 1.0) -> None:
        self._log = log
        self._interval = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, msg: str, *args: object, exc_info: bool = False) -> None:
        """Log ``msg % args`` unless ``key`` was logged less than the interval ago."""
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self._interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last[key] = now
        n = self._suppressed.pop(key, 0)
        if n:
            msg = msg + " (%d similar messages suppressed)"
            args = (*args, n)
        self._log.warning(msg, *args, exc_info=exc_info)
