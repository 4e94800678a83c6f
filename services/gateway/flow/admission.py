"""Admission control: a bound on generation requests in flight in this gateway.

This count is the ceiling on the gateway's memory. Whether a request can start soon is
the scheduler's to say as it routes the request: past the estimated wait allowed
(--max-queue-delay-s) it is refused with 429 and the Retry-After of the estimate
(services/scheduler/wait_estimate.py); `refused` counts both kinds of refusal.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import Counter, Gauge

from meshserve.shared.errors import OverloadedError


class Admission:
    """Admits up to `limit` requests at once; the next one fails fast with OverloadedError.

    Failing fast (429 with Retry-After) rather than queueing keeps the gateway's memory
    and latency bounded; the scheduler's global queue is where requests wait for a worker.
    """

    def __init__(self, limit: int, in_flight: Gauge | None = None,
                 refusals: Counter | None = None) -> None:
        """`refusals`: a counter labelled by reason."""
        assert limit >= 1, f"limit must be >= 1, got {limit}"
        self.limit = limit
        self.in_flight = 0
        self._gauge = in_flight
        self._refusals = refusals

    def refused(self, error: OverloadedError) -> None:
        """Count a refusal (this gateway's ceiling, or the scheduler's bounds)."""
        if self._refusals is not None:
            self._refusals.labels(error.reason or "overloaded").inc()

    @contextmanager
    def slot(self) -> Iterator[None]:
        """Hold one slot for the duration of the block, or raise OverloadedError."""
        if self.in_flight >= self.limit:
            error = OverloadedError(f"the server is handling {self.limit} requests already "
                                    "(max_concurrent_requests); retry later", reason="ceiling")
            self.refused(error)
            raise error
        self.in_flight += 1
        if self._gauge is not None:
            self._gauge.inc()
        try:
            yield
        except OverloadedError as error:  # the scheduler refused it as it routed it
            self.refused(error)
            raise
        finally:
            self.in_flight -= 1
            if self._gauge is not None:
                self._gauge.dec()
