"""How long a request that finds every worker full would wait to start: the estimate
behind refusing it at once (429 + Retry-After) rather than queueing it for minutes.

    waits = WaitEstimator()
    waits.observe(seconds)                        # a routed request was released
    waits.estimate(ahead=len(queue), in_service=len(inflight), age_s=...)   # s, or None
    error = waits.refusal(ahead, in_service, bound_s, age_s=...)  # OverloadedError or None

By Little's law the requests in service (routed by this replica and not yet released)
leave at `in_service / service_s` a second, `service_s` being the mean time from route to
release (a moving average over releases). A request with `ahead` requests queued before
it starts after `ahead + 1` departures:

    wait = (ahead + 1) * service_s / in_service

Pure logic, O(1) per request: the queue's length and the requests in flight are counts
the scheduler keeps anyway, and every release passes through it already (no message is
added anywhere). Until a first release is seen (a fresh scheduler), the mean age of the
requests in service (`age_s`: how long they have been in service, on average) stands in
for the service time: none has ended, so each takes at least that long. A first burst
therefore queues as the fixed bounds allow, but a first wave that runs for minutes stops
admitting more behind it. While nothing is in service there is no estimate.
"""

from __future__ import annotations

import math

from meshserve.shared.errors import OverloadedError

SMOOTHING = 0.1
"""Weight of one release in the moving average of service time: the last few dozen
releases count, so a change of load shows within a second or two of busy serving."""


class WaitEstimator:
    """The mean service time and the wait estimate from it (see the module doc)."""

    def __init__(self, smoothing: float = SMOOTHING) -> None:
        assert 0 < smoothing <= 1, f"smoothing must be in (0, 1], got {smoothing}"
        self._smoothing = smoothing
        self.service_s: float | None = None
        """Moving average of route-to-release seconds; None until the first release."""

    def observe(self, seconds: float) -> None:
        """A routed request ended `seconds` after it was routed."""
        seconds = max(0.0, seconds)
        if self.service_s is None:
            self.service_s = seconds
        else:
            self.service_s += self._smoothing * (seconds - self.service_s)

    def estimate(self, ahead: int, in_service: int, age_s: float | None = None) -> float | None:
        """Seconds until a request with `ahead` requests queued before it starts, while
        `in_service` requests run, on average `age_s` old; None when unknown (nothing in
        service, or no release seen and no age)."""
        service_s = self.service_s if self.service_s is not None else age_s
        if not service_s or in_service <= 0:
            return None
        return (ahead + 1) * service_s / in_service

    def refusal(self, ahead: int, in_service: int, bound_s: float,
                age_s: float | None = None) -> OverloadedError | None:
        """The error that refuses a request whose estimated wait passes `bound_s` (its
        Retry-After: when the queue will have drained enough to admit it, at least 1 s);
        None when it may queue (within the bound, or no estimate)."""
        wait = self.estimate(ahead, in_service, age_s)
        if wait is None or wait <= bound_s:
            return None
        return OverloadedError(
            f"every worker is full and the estimated wait to start, {wait:.1f}s "
            f"({ahead} requests queued ahead), passes the {bound_s:.1f}s this request may "
            "wait (max_queue_delay_s, or its deadline); retry later",
            retry_after_s=retry_after(wait, bound_s), reason="queue_delay")


def retry_after(wait_s: float, bound_s: float) -> int:
    """Whole seconds until a wait of `wait_s` shrinks to `bound_s` (at least 1)."""
    return max(1, math.ceil(wait_s - bound_s))
