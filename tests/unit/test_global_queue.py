"""Unit tests of the global queue: order, deadlines, overflow, wake-ups."""

from __future__ import annotations

import asyncio

import pytest

from meshserve.services.scheduler.queue import GlobalQueue
from meshserve.shared.errors import DeadlineExceededError, OverloadedError


class Slots:
    """A fake cluster: `free` places; an attempt takes one or returns None."""

    def __init__(self, free: int = 0) -> None:
        self.free = free
        self.placed: list[str] = []
        self.attempts: dict[str, int] = {}

    def attempt_for(self, name: str):
        async def attempt() -> str | None:
            self.attempts[name] = self.attempts.get(name, 0) + 1
            if self.free <= 0:
                return None
            self.free -= 1
            self.placed.append(name)
            return name
        return attempt


async def until(condition, max_yields: int = 100) -> None:
    """Let other tasks run until `condition()` holds (bounded)."""
    for _ in range(max_yields):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


async def enqueue(queue: GlobalQueue, slots: Slots, name: str, priority: int = 0,
                  deadline: float | None = None) -> asyncio.Task[str]:
    """Start a request and return once it waits in the queue."""
    before = len(queue)
    task = asyncio.create_task(queue.run(slots.attempt_for(name), priority=priority,
                                         deadline=deadline))
    await until(lambda: len(queue) == before + 1)
    return task


async def test_free_place_is_taken_without_queueing() -> None:
    queue, slots = GlobalQueue(capacity=0), Slots(free=1)
    assert await queue.run(slots.attempt_for("a")) == "a"
    assert len(queue) == 0


async def test_priority_then_arrival_order() -> None:
    queue, slots = GlobalQueue(capacity=10), Slots()
    tasks = [await enqueue(queue, slots, name, priority)
             for name, priority in [("p5", 5), ("p1-first", 1), ("p3", 3), ("p1-second", 1)]]
    for expected in ["p1-first", "p1-second", "p3", "p5"]:
        slots.free = 1
        queue.notify()
        await until(lambda: slots.placed[-1:] == [expected])  # noqa: B023 (awaited here)
    assert slots.placed == ["p1-first", "p1-second", "p3", "p5"]
    assert [await t for t in tasks] == ["p5", "p1-first", "p3", "p1-second"]
    assert len(queue) == 0


async def test_only_the_head_attempts() -> None:
    queue, slots = GlobalQueue(capacity=10), Slots()
    await enqueue(queue, slots, "a")
    second = await enqueue(queue, slots, "b")
    assert slots.attempts == {"a": 1}  # b saw a ahead of it and did not try
    queue.notify()
    await until(lambda: slots.attempts["a"] == 2)
    assert "b" not in slots.attempts
    slots.free = 2
    queue.notify()  # one change: a is placed, then b tries at once and fits too
    assert await second == "b"
    assert slots.placed == ["a", "b"]


async def test_deadline_expires_in_the_queue() -> None:
    queue, slots = GlobalQueue(capacity=10), Slots()
    loop = asyncio.get_running_loop()
    task = await enqueue(queue, slots, "a", deadline=loop.time() + 0.05)
    behind = await enqueue(queue, slots, "b")
    with pytest.raises(DeadlineExceededError):
        await task
    assert len(queue) == 1
    await until(lambda: slots.attempts.get("b") == 1)  # b became head and tried
    slots.free = 1
    queue.notify()
    assert await behind == "b"


async def test_past_deadline_fails_without_an_attempt() -> None:
    queue, slots = GlobalQueue(capacity=10), Slots(free=1)
    loop = asyncio.get_running_loop()
    with pytest.raises(DeadlineExceededError):
        await queue.run(slots.attempt_for("a"), deadline=loop.time() - 1)
    assert slots.attempts == {}


async def test_overflow_is_refused() -> None:
    queue, slots = GlobalQueue(capacity=1), Slots()
    waiting = await enqueue(queue, slots, "a")
    with pytest.raises(OverloadedError, match="1 of 1"):
        await queue.run(slots.attempt_for("b"))
    with pytest.raises(OverloadedError):
        await GlobalQueue(capacity=0).run(slots.attempt_for("c"))
    slots.free = 1
    queue.notify()
    assert await waiting == "a"


async def test_change_during_an_attempt_is_not_lost() -> None:
    queue = GlobalQueue(capacity=10)
    calls = []

    async def attempt() -> str | None:
        calls.append(len(calls))
        if len(calls) == 1:
            queue.notify()  # load changed while this attempt read the old state
            return None
        return "placed"

    assert await asyncio.wait_for(queue.run(attempt), 5) == "placed"
    assert calls == [0, 1]


async def test_cancelled_head_hands_over_and_errors_propagate() -> None:
    queue, slots = GlobalQueue(capacity=10), Slots()
    head = await enqueue(queue, slots, "a")
    behind = await enqueue(queue, slots, "b")
    head.cancel()
    await until(lambda: slots.attempts.get("b") == 1)
    assert len(queue) == 1

    async def broken() -> str | None:
        raise RuntimeError("redis down")

    slots.free = 0
    queue_two = GlobalQueue(capacity=10)
    with pytest.raises(RuntimeError, match="redis down"):
        await queue_two.run(broken)
    assert len(queue_two) == 0
    slots.free = 1
    queue.notify()
    assert await behind == "b"
