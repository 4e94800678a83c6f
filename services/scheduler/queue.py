"""The bounded global queue: requests wait here while every worker is full.

Order is priority (lower first), then arrival. Only the head of the queue tries to
place itself; it tries again whenever `notify()` says that load changed (a heartbeat,
a release, a new worker). When the head is placed, the next entry becomes head and
tries at once, so one change in load can drain several entries. A request whose
deadline passes leaves with DeadlineExceededError; a request that finds the queue full
is refused with OverloadedError, and so is one that `admit` refuses as it would join the
queue (its estimated wait passes its bound: wait_estimate.py). Nothing polls: every
waiter sleeps on its own event.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from meshserve.shared.errors import ConfigError, DeadlineExceededError, OverloadedError

T = TypeVar("T")


@dataclass(order=True)
class _Entry:
    priority: int
    arrival: int
    wake: asyncio.Event = field(compare=False, default_factory=asyncio.Event)


class GlobalQueue:
    """Priority-then-arrival queue of placement attempts, bounded by `capacity` waiters."""

    def __init__(self, capacity: int) -> None:
        """`capacity`: most requests waiting at once (0: never wait, refuse at once)."""
        if capacity < 0:
            raise ConfigError(f"queue capacity must be >= 0, got {capacity}", param="capacity")
        self.capacity = capacity
        self._heap: list[_Entry] = []
        self._arrivals = itertools.count()
        # Bumped by notify(): an attempt that overlapped a change must not sleep through it.
        self._generation = 0

    def __len__(self) -> int:
        """Requests waiting now."""
        return len(self._heap)

    def notify(self) -> None:
        """Load changed: the head tries to place itself again."""
        self._generation += 1
        if self._heap:
            self._heap[0].wake.set()

    async def run(self, attempt: Callable[[], Awaitable[T | None]], *, priority: int = 0,
                  deadline: float | None = None,
                  admit: Callable[[int], None] | None = None) -> T:
        """Call `attempt` until it returns a placement, waiting in turn in between.

        `attempt` returns None when there is no room now; its exceptions end the wait
        and propagate. `deadline` is in the event loop's clock (loop.time()). `admit`,
        called with the number of requests waiting (those ahead, at most) just before the
        request would join them, raises to refuse it instead.
        """
        loop = asyncio.get_running_loop()
        if deadline is not None and loop.time() >= deadline:
            raise DeadlineExceededError("request deadline passed before routing",
                                        param="deadline")
        entry = _Entry(priority, next(self._arrivals))
        generation = self._generation
        if not self._heap or entry < self._heap[0]:  # nobody ahead: try before queueing
            result = await attempt()
            if result is not None:
                return result
        if len(self._heap) >= self.capacity:
            raise OverloadedError(f"every worker is full and the global queue holds "
                                  f"{len(self._heap)} of {self.capacity} requests; retry later",
                                  reason="queue_full")
        if admit is not None:
            admit(len(self._heap))
        heapq.heappush(self._heap, entry)
        if self._generation != generation:
            entry.wake.set()
        try:
            return await self._wait_turns(entry, attempt, deadline)
        finally:
            self._remove(entry)

    async def _wait_turns(self, entry: _Entry, attempt: Callable[[], Awaitable[T | None]],
                          deadline: float | None) -> T:
        while True:
            await self._sleep(entry, deadline)
            if self._heap[0] is not entry:  # woken as head, then overtaken: wait again
                entry.wake.clear()
                continue
            entry.wake.clear()  # a notify() during the attempt sets it again
            result = await attempt()
            if result is not None:
                return result

    async def _sleep(self, entry: _Entry, deadline: float | None) -> None:
        try:
            async with asyncio.timeout_at(deadline):
                await entry.wake.wait()
        except TimeoutError:
            raise DeadlineExceededError("request deadline passed while waiting in the "
                                        "global queue for a worker", param="deadline") from None

    def _remove(self, entry: _Entry) -> None:
        was_head = bool(self._heap) and self._heap[0] is entry
        self._heap.remove(entry)
        heapq.heapify(self._heap)
        if was_head and self._heap:  # the next in line may fit where this one did
            self._heap[0].wake.set()
