"""The pooling worker's model thread: embedding calls in, batched forwards, vectors out.

    batcher = EmbedBatcher(embedder, on_fatal=fatal)
    batcher.start()                                      # on the event loop
    result = await batcher.submit(inputs, dimensions=64, normalize=True)

A pooling worker runs no generation engine, so this thread owns the model (the GPU is
driven from one thread). Calls queue their inputs; the thread takes as many queued
inputs as one forward holds (the embedder's token and input budgets), from any number of
calls, in arrival order, runs them as one flat batch, and hands each call its vectors
once all of its inputs are done (a call of many inputs may span several forwards). A
call whose caller went away is skipped. Results go back to the event loop with
`call_soon_threadsafe`; the thread never waits for the loop, the loop never for the GPU.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from meshserve.services.worker.engine.device import make_current
from meshserve.services.worker.pooling.embedder import Embedder
from meshserve.services.worker.pooling.pooler import finish
from meshserve.shared.errors import InternalError
from meshserve.shared.worker_registry import WorkerLoad

log = logging.getLogger(__name__)
_STOP = object()


@dataclass(frozen=True)
class EmbedResult:
    """The vectors of one call."""

    vectors: bytes  # [N, dimensions] float32, little-endian, row-major
    dimensions: int
    num_tokens: int
    queued_ns: int  # arrival until its first input's forward began
    forward_ns: int  # forward time of the batches that carried its inputs


@dataclass
class _Call:
    """One submitted call, as the model thread tracks it."""

    inputs: list[list[int]]
    dimensions: int
    normalize: bool
    future: asyncio.Future[EmbedResult]
    loop: asyncio.AbstractEventLoop
    arrival_ns: int = field(default_factory=time.monotonic_ns)
    rows: list[torch.Tensor | None] = field(default_factory=list)  # each [H] float32
    remaining: int = 0
    started_ns: int = 0
    forward_ns: int = 0

    def __post_init__(self) -> None:
        self.rows = [None] * len(self.inputs)
        self.remaining = len(self.inputs)


class EmbedBatcher:
    """Runs every embedding call of the worker on one model thread (module doc)."""

    def __init__(self, embedder: Embedder,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self.embedder = embedder
        self.on_fatal = on_fatal
        self._commands: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Each counter is written by one thread only (submitted: the loop; taken, running:
        # the model thread), so heartbeats read a consistent-enough load without a lock.
        self._submitted = 0
        self._taken = 0  # inputs run or skipped
        self.num_running = 0  # inputs in the forward now
        self.forwards = 0

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def load(self) -> WorkerLoad:
        """A load snapshot for heartbeats: inputs running and waiting, no KV blocks."""
        return WorkerLoad(num_running=self.num_running,
                          num_waiting=max(0, self._submitted - self._taken - self.num_running),
                          snapshot_unix_ns=time.time_ns())

    def start(self) -> None:
        """Start the model thread (call on the event loop that awaits the results)."""
        assert self._thread is None, "EmbedBatcher.start() called twice"
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="embed-batcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Finish the queued calls' current forward and stop (idempotent)."""
        self._commands.put(_STOP)

    async def wait_stopped(self) -> None:
        while self._thread is not None and self._thread.is_alive():
            await asyncio.to_thread(self._stopped.wait, 1.0)

    def submit(self, inputs: Sequence[Sequence[int]], *, dimensions: int,
               normalize: bool) -> asyncio.Future[EmbedResult]:
        """Queue one call's inputs (validated by the caller); its vectors come back on the
        returned future. Cancel the future to drop inputs not yet run."""
        assert self._loop is not None, "submit() before start()"
        future: asyncio.Future[EmbedResult] = self._loop.create_future()
        call = _Call([list(ids) for ids in inputs], dimensions, normalize, future, self._loop)
        self._submitted += len(call.inputs)
        self._commands.put(call)
        return future

    # -- the model thread ----------------------------------------------------------------

    def _run(self) -> None:
        make_current(self.embedder.device)
        pending: deque[tuple[_Call, int]] = deque()  # (call, input index), arrival order
        try:
            while self._take(pending):
                batch = self._next_batch(pending)
                if batch:
                    self._forward(batch)
        except Exception as exc:  # a device or model error is fatal for the worker
            log.exception("embedding thread failed; the worker cannot serve any more")
            self._fail_all(pending, exc)
            self._tell_fatal(exc)
        finally:
            self._stopped.set()

    def _take(self, pending: deque[tuple[_Call, int]]) -> bool:
        """Move queued calls into `pending`, blocking while there is nothing to run;
        False once asked to stop."""
        block = not pending
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            if command is _STOP:
                self._fail_all(pending, InternalError("the worker stopped before this "
                                                      "request was embedded"))
                return False
            assert isinstance(command, _Call)
            pending.extend((command, i) for i in range(len(command.inputs)))
            block = False

    def _next_batch(self, pending: deque[tuple[_Call, int]]) -> list[tuple[_Call, int]]:
        """The longest run of pending inputs, in order, that fits one forward."""
        budget = self.embedder.max_batch_tokens
        batch: list[tuple[_Call, int]] = []
        tokens = 0
        while pending and len(batch) < self.embedder.max_batch_inputs:
            call, index = pending[0]
            if call.future.cancelled():  # the caller went away: skip what is left of it
                pending.popleft()
                self._taken += 1
                continue
            size = len(call.inputs[index])
            if tokens + size > budget:
                break
            batch.append(pending.popleft())
            tokens += size
        return batch

    def _forward(self, batch: list[tuple[_Call, int]]) -> None:
        started = time.monotonic_ns()
        self.num_running = len(batch)
        pooled = self.embedder.embed([call.inputs[i] for call, i in batch])  # [B, H]
        if pooled.is_cuda:
            torch.cuda.synchronize(pooled.device)  # honest forward times
        took = time.monotonic_ns() - started
        self._taken += len(batch)
        self.num_running = 0
        self.forwards += 1
        touched: dict[int, _Call] = {}
        for row, (call, index) in enumerate(batch):
            call.rows[index] = pooled[row]
            call.remaining -= 1
            if id(call) not in touched:
                touched[id(call)] = call
                call.started_ns = call.started_ns or started
                call.forward_ns += took
        for call in touched.values():
            if call.remaining == 0:
                self._complete(call)

    def _complete(self, call: _Call) -> None:
        rows = torch.stack([r for r in call.rows if r is not None])  # [N, H]
        vectors = finish(rows, call.dimensions, call.normalize).cpu()  # [N, dimensions]
        data = vectors.numpy().astype("<f4", copy=False).tobytes()
        result = EmbedResult(data, call.dimensions,
                             sum(len(ids) for ids in call.inputs),
                             call.started_ns - call.arrival_ns, call.forward_ns)
        call.loop.call_soon_threadsafe(_settle, call.future, result, None)

    def _fail_all(self, pending: deque[tuple[_Call, int]], error: BaseException) -> None:
        calls = {id(call): call for call, _ in pending}
        pending.clear()
        while True:  # calls submitted but not yet taken
            try:
                command = self._commands.get(block=False)
            except queue.Empty:
                break
            if isinstance(command, _Call):
                calls[id(command)] = command
        for call in calls.values():
            call.loop.call_soon_threadsafe(_settle, call.future, None, error)

    def _tell_fatal(self, error: BaseException) -> None:
        if self.on_fatal is None or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self.on_fatal, error)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            log.error("embedding thread failed after the event loop closed: %r", error)


def _settle(future: asyncio.Future[EmbedResult], result: EmbedResult | None,
            error: BaseException | None) -> None:
    """Resolve a call's future on the event loop (unless its caller already gave up)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        assert result is not None
        future.set_result(result)

