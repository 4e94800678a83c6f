"""Handing the allocator's free memory back to the system once the engine goes idle.

A burst leaves glibc's malloc arenas holding hundreds of MB that are free inside malloc
but still resident: on the 2-core CPU a worker's RSS rose 600 MB during 400 requests and
stayed there idle, with 13 MB more in use (loadtest/reports/memory/README.md).
`malloc_trim(0)` releases those free pages. The engine thread calls it only after
`idle_s` without a step, at most once every `interval_s`, and only when steps ran since
the last trim, so that a loaded engine never pays for it.

    trim = IdleTrim(interval_s=10.0)
    trim.busy()             # the engine stepped
    trim.wait_s()           # how long an idle engine waits before idle(); None: forever
    trim.idle()             # that wait passed with nothing to do: trims if due
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


def libc_malloc_trim() -> Callable[[], int] | None:
    """glibc's `malloc_trim(0)` (returns 1 when memory was released), or None where the C
    library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        function = ctypes.CDLL(name or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return lambda: int(function(0))


class IdleTrim:
    """When an idle engine trims the heap: after `idle_s` idle, at most every `interval_s`."""

    def __init__(self, interval_s: float, *, idle_s: float = 1.0,
                 trim: Callable[[], int] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert interval_s > 0 and idle_s > 0, "interval_s and idle_s must be positive"
        self.interval_s = interval_s
        self.idle_s = idle_s
        self._trim = trim
        self._clock = clock
        self._dirty = False  # steps ran since the last trim
        self._last = -interval_s  # the last trim's time
        self.trims = 0

    def busy(self) -> None:
        """The engine ran a step."""
        self._dirty = True

    def wait_s(self) -> float | None:
        """How long an idle engine may wait for work before calling `idle()` (None: as long
        as it likes, nothing is left to trim)."""
        if not self._dirty or self._trim is None:
            return None
        return max(self.idle_s, self._last + self.interval_s - self._clock())

    def idle(self) -> bool:
        """The engine waited `wait_s()` with nothing to do: trim if due; whether it did."""
        now = self._clock()
        if not self._dirty or self._trim is None or now - self._last < self.interval_s:
            return False
        started = time.perf_counter()
        released = self._trim()
        self._last, self._dirty = now, False
        self.trims += 1
        log.debug("idle: malloc_trim took %.1f ms (released: %s)",
                  (time.perf_counter() - started) * 1e3, bool(released))
        return True
