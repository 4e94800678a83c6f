"""Publishes the worker's KV events into the Redis block index, off the engine's path.

`put` (called on the event loop once per engine step that had events) only appends
to a buffer; one task writes the buffer in order, merging whatever accumulated
while the previous write was in flight into one `KVIndex.apply_events` call (one
pipelined round trip, numbered with the last merged batch's sequence number).
Redis being slow or down never blocks the engine: writes are retried with backoff
and, past `max_pending` buffered batches, the oldest are dropped and the holder's
entries are cleared before the next write, so the index never claims blocks the
worker may have evicted meanwhile (Redis is an index, not the source of truth).

The publisher also keeps the set of blocks its events say the worker holds. When a write
finds that the index no longer knows the worker (Redis restarted empty, or was flushed),
it restores that whole set in one more round trip, so that the index is truthful again
without waiting for the blocks to be stored anew.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from meshserve.services.worker.serving.engine_thread import KVEventBatch
from meshserve.shared.block_hash import BlockHash
from meshserve.shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from meshserve.shared.kv_index import Applied, KVIndex

log = logging.getLogger(__name__)


class KVEventPublisher:
    """Writes one holder's KV event batches to a KVIndex, in order and batched."""

    def __init__(self, index: KVIndex, holder: str, *, max_pending: int = 10_000,
                 max_merge: int = 256, retry_initial_s: float = 0.05,
                 retry_max_s: float = 2.0) -> None:
        assert max_pending > 0 and max_merge > 0, "max_pending and max_merge must be positive"
        self.index = index
        self.holder = holder
        self._max_pending = max_pending
        self._max_merge = max_merge
        self._retry = (retry_initial_s, retry_max_s)
        self._pending: deque[KVEventBatch] = deque()
        self._lost = False  # batches were dropped: clear the holder's entries first
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._held: set[BlockHash] = set()  # what the events put so far say is held
        self.num_written = 0
        self.num_restores = 0

    def start(self) -> None:
        """Start the writer task on the running loop."""
        assert self._task is None, "KVEventPublisher.start() called twice"
        self._task = asyncio.create_task(self._run(), name=f"kv-publisher-{self.holder}")

    def put(self, batch: KVEventBatch) -> None:
        """Queue one step's events (never blocks)."""
        if len(self._pending) >= self._max_pending:
            self._pending.popleft()
            if not self._lost:
                log.warning("KV event buffer full (%d batches); dropping the oldest and "
                            "clearing this worker's index entries", self._max_pending)
            self._lost = True
        self._pending.append(batch)
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self._held.difference_update(event.block_hashes)
            else:
                self._held.clear()
        self._idle.clear()
        self._wake.set()

    async def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything queued so far is written; False if `timeout_s` passed."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (within `timeout_s`), then stop the task."""
        if self._task is None:
            return
        if not await self.flush(timeout_s):
            log.warning("KV events still unwritten after %.1fs; giving up on %d batches",
                        timeout_s, len(self._pending))
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._task = None

    async def _run(self) -> None:
        delay = self._retry[0]
        while True:
            if not self._pending:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            batches = [self._pending.popleft()
                       for _ in range(min(len(self._pending), self._max_merge))]
            lost, self._lost = self._lost, False
            try:
                await self._write(batches, lost)
            except Exception as exc:  # noqa: BLE001 (Redis down or slow: retry, never crash)
                log.warning("writing KV events to Redis failed (%s); retrying in %.2fs",
                            exc, delay)
                self._requeue(batches, lost)
                await asyncio.sleep(delay)  # backoff between retries of a failed write
                delay = min(delay * 2, self._retry[1])
                continue
            delay = self._retry[0]
            self.num_written += len(batches)

    def _requeue(self, batches: list[KVEventBatch], lost: bool) -> None:
        """Put a failed write's batches back in front (dropping the oldest past the cap)."""
        self._lost = self._lost or lost
        room = self._max_pending - len(self._pending)
        if room < len(batches):
            self._lost = True
            batches = batches[len(batches) - max(room, 0):] if room > 0 else []
        self._pending.extendleft(reversed(batches))

    async def _write(self, batches: list[KVEventBatch], lost: bool) -> None:
        events: list[KVEvent] = [AllBlocksCleared()] if lost else []
        for batch in batches:
            events.extend(batch.events)
        last = batches[-1]
        applied = await self.index.apply_events(self.holder, last.epoch, last.seq, events)
        if applied == Applied.APPLIED_UNKNOWN and (self.num_written or last.seq > 0):
            # The index lost this worker's entries (Redis restarted empty): restore them.
            held = set(self._held)
            if await self.index.restore(self.holder, last.epoch, held):
                self.num_restores += 1
                log.warning("the Redis block index had lost this worker's blocks; restored %d",
                            len(held))
        if not applied:
            log.warning("Redis refused KV events of %s epoch %d seq %d (a newer epoch or "
                        "sequence number is recorded)", self.holder, last.epoch, last.seq)
