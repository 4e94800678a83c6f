"""Admission control: a bound on generation requests in flight in this gateway."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import Gauge

from meshserve.shared.errors import OverloadedError


class Admission:
    """Admits up to `limit` requests at once; the next one fails fast with OverloadedError.

    Failing fast (429 with Retry-After) rather than queueing keeps the gateway's memory
    and latency bounded; the scheduler's global queue is where requests wait for a worker.
    """

    def __init__(self, limit: int, in_flight: Gauge | None = None) -> None:
        assert limit >= 1, f"limit must be >= 1, got {limit}"
        self.limit = limit
        self.in_flight = 0
        self._gauge = in_flight

    @contextmanager
    def slot(self) -> Iterator[None]:
        """Hold one slot for the duration of the block, or raise OverloadedError."""
        if self.in_flight >= self.limit:
            raise OverloadedError(
                f"the server is handling {self.limit} requests already "
                "(max_concurrent_requests); retry later")
        self.in_flight += 1
        if self._gauge is not None:
            self._gauge.inc()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self._gauge is not None:
                self._gauge.dec()
