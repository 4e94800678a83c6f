"""The gateway's stop: refuse new work, let what runs finish within a grace, end the rest.

    drain = Drain()
    with drain.track():          # around each generation request
        ...
    await drain.run(grace_s)     # on SIGTERM: 503 + Retry-After for new requests from now on

During the grace, requests already running go on; once it is over, each one still running
is cancelled with DRAIN_MESSAGE, which a streaming handler turns into an error event and
`data: [DONE]` (its client learns why, and no stream is cut without an ending).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from meshserve.shared.errors import UnavailableError

_log = logging.getLogger(__name__)
DRAIN_MESSAGE = "meshserve gateway drain"
# How long cancelled requests get to write their last event after the grace.
_END_GRACE_S = 5.0


class Drain:
    """Tracks the generation requests in flight; ends them when the gateway stops."""

    def __init__(self) -> None:
        self.draining = False
        self.ending = False  # the grace is over: running requests are being cancelled
        self._tasks: set[asyncio.Task[object]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def refuse_if_draining(self) -> None:
        """UnavailableError (503 with Retry-After) once the drain has begun."""
        if self.draining:
            raise UnavailableError("the gateway is shutting down; retry the request")

    @contextmanager
    def track(self) -> Iterator[None]:
        """Count the current task as a request in flight while the block runs."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._idle.clear()
        try:
            yield
        finally:
            self._tasks.discard(task)
            if not self._tasks:
                self._idle.set()

    def ended_by_drain(self, error: BaseException) -> bool:
        """Whether a CancelledError is the drain's (not the client's disconnect)."""
        return self.ending and isinstance(error, asyncio.CancelledError) and \
            DRAIN_MESSAGE in error.args

    async def run(self, grace_s: float) -> None:
        """Refuse new requests; wait up to `grace_s` for those in flight; cancel the rest."""
        self.draining = True
        running = len(self._tasks)
        if running:
            _log.info("draining %d request(s) for up to %.1fs", running, grace_s)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=grace_s)
            return
        except TimeoutError:
            pass
        self.ending = True
        left = list(self._tasks)
        _log.warning("drain grace of %.1fs is over: ending %d request(s)", grace_s, len(left))
        for task in left:
            task.cancel(DRAIN_MESSAGE)
        await asyncio.wait(left, timeout=_END_GRACE_S)
