"""The engine loop in its own thread, bridged to asyncio by queues (decision 6).

    thread = EngineThread(engine, epoch=epoch, on_kv_events=publisher.put, on_fatal=fatal)
    thread.start()                                  # on the event loop
    stream = thread.submit("req-1", [prompt_ids], params)
    while (update := await stream.next()) is not None:
        ...                                         # every token since the last update

Commands (add, abort, stop) go in through a thread-safe queue that the thread
drains at the top of each step; with nothing to run it blocks on that queue (once
idle a while, it trims malloc's free memory first: idle_trim.py). Each
step's results (outputs of every request, add errors, KV events) come back as ONE
batch handed to the event loop with `call_soon_threadsafe`, and are routed to the
requests' streams there. A stream merges what its reader has not yet taken, so a
slow reader gets all its tokens in the next message instead of a backlog. The
engine never waits for the event loop and the event loop never waits for a step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from meshserve.services.worker.engine.device import make_current
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.engine.images import PromptImage
from meshserve.services.worker.engine.sequence import SequenceOutput, SequenceState
from meshserve.services.worker.serving.idle_trim import IdleTrim
from meshserve.services.worker.serving.request_stream import (
    RequestStream,
    SequenceTimes,
    StepTiming,
)
from meshserve.services.worker.serving.step_trace import StepRecord, device_fields
from meshserve.services.worker.structured.hook import StructuredOutputsHook
from meshserve.shared.errors import InternalError, InvalidRequestError, MeshError
from meshserve.shared.kv_events import KVEvent
from meshserve.shared.sampling_params import SamplingParams
from meshserve.shared.worker_registry import WorkerLoad

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVEventBatch:
    """The KV events of one engine step, numbered per worker epoch (1, 2, ...)."""

    epoch: int
    seq: int
    events: tuple[KVEvent, ...]


@dataclass(frozen=True)
class _Add:
    engine_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    lora_id: int | None
    arrival: float
    resumed: dict[int, list[int]] | None = None  # the engine request's own indices
    store_lookup: bool = True
    grammar: Any = None  # params.structured compiled (set once the compile is done)
    bad_words_ids: tuple[tuple[int, ...], ...] | None = None  # params.bad_words tokenized
    images: tuple[PromptImage, ...] = ()  # the prompt's images (vision-language models)
    # Whether encoder services were asked for the images' rows (None: not yet).
    images_fetched: bool | None = None


@dataclass(frozen=True)
class _Abort:
    engine_id: str
    indices: list[int] | None = None  # the request's own sequence indices; None: all


@dataclass(frozen=True)
class _Compiled:
    """Work a request needed before the engine (its grammar compiled, its bad words
    tokenized) is done, or failed; `field` of `add` takes the result."""

    add: _Add
    field: str
    future: Future[Any]


_STOP = object()
_Command = _Add | _Abort | _Compiled | object


@dataclass
class _StepBatch:
    """One step's results, handed to the event loop in one call."""

    outputs: list[SequenceOutput] = field(default_factory=list)
    times: dict[str, SequenceTimes] = field(default_factory=dict)
    errors: list[tuple[str, MeshError]] = field(default_factory=list)
    kv: KVEventBatch | None = None
    timing: StepTiming | None = None


@dataclass
class _Route:
    stream: RequestStream
    offset: int  # sequence index of the engine request's first sample (prompt p: p * n)


class EngineThread:
    """Runs `LLMEngine.step()` in a thread of its own; requests are `RequestStream`s."""

    def __init__(self, engine: LLMEngine, *, epoch: int = 0,
                 on_kv_events: Callable[[KVEventBatch], None] | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        """`on_kv_events` and `on_fatal` are called on the event loop; `epoch`,
        `on_kv_events` and `on_fatal` may be set until `start()`."""
        self.engine = engine
        structured = engine.hook(StructuredOutputsHook)
        assert structured is not None, "an engine built without its structured-outputs hook"
        self._grammars = structured.grammars  # compiles ahead of admission, off this thread
        self.epoch = epoch
        self.on_kv_events = on_kv_events
        self.on_fatal = on_fatal
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = asyncio.Event()
        # Event-loop side: engine request id -> its stream; request id -> its engine ids.
        self._routes: dict[str, _Route] = {}
        self._streams: dict[str, tuple[RequestStream, list[str]]] = {}
        # Engine-thread side: the sequences of each engine request, for their timestamps.
        self._sequences: dict[str, list[SequenceState]] = {}
        # Engine requests whose first-token time has been read (see _step).
        self._first_timed: set[str] = set()
        self._pending_errors: list[tuple[str, MeshError]] = []
        # Engine-thread side: constrained requests whose grammar is compiling, and the
        # sequences aborted meanwhile (None: all of them).
        self._compiling: dict[str, _Add] = {}
        self._kv_seq = 0
        # Engine steps whose results reached the event loop, the latest one's timing, and
        # totals for the step-rate metrics (time in step(), tokens produced).
        self.steps_delivered = 0
        self.last_timing: StepTiming | None = None
        self.step_ns_total = 0
        self.tokens_delivered = 0
        # Diagnostics (set before start()): one StepRecord per loop turn that stepped.
        self.step_trace: list[StepRecord] | None = None
        # Set before start(): hands malloc's free memory back once the engine idles.
        self.idle_trim: IdleTrim | None = None
        # Called on the event loop with each delivered step's outputs and the timestamps
        # read with them (the worker's vLLM metrics; services/worker/serving/vllm_metrics.py).
        self.on_step: Callable[[list[SequenceOutput], Mapping[str, SequenceTimes]],
                               None] | None = None
        self._added_since_step = 0
        self.failure: BaseException | None = None
        self.load = self._snapshot()

    # ----- event-loop side ------------------------------------------------------------
    def start(self) -> None:
        """Start the thread; call on the event loop that will read the streams."""
        assert self._thread is None, "EngineThread.start() called twice"
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, prompts: Sequence[Sequence[int]], params: SamplingParams,
               *, priority: int = 0, cache_salt: str | None = None,
               lora_id: int | None = None,
               on_ready: Callable[[RequestStream], None] | None = None,
               resumed: Mapping[int, Sequence[int]] | None = None,
               store_lookup: bool = True,
               images: Sequence[Sequence[PromptImage]] = ()) -> RequestStream:
        """Queue a request; prompt p's sample s is sequence p * n + s of the stream.

        `images`: each prompt's images (empty, or one entry per prompt).

        `store_lookup`: whether the KV tier may be asked for prompt blocks the engine's
        cache lacks (False when the router saw none in the kvstore).

        `resumed` (sequence index -> the output tokens it produced on a worker that was
        lost): only those sequences run, each continuing after its tokens.

        Errors the engine raises for the request (InvalidRequestError, ...) come out
        of the stream's first `next()` (or its `error`, with `on_ready`; see
        RequestStream).
        """
        self._check_usable()
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already running",
                                      param="request_id")
        if not prompts:
            raise InvalidRequestError("a request needs at least one prompt", param="prompts")
        if images and len(images) != len(prompts):
            raise InvalidRequestError(f"{len(images)} prompts' images for {len(prompts)} "
                                      "prompts", param="images")
        n = params.n
        if resumed is not None:
            if not resumed:
                raise InvalidRequestError("a resumed request needs at least one sequence",
                                          param="resumed")
            if not all(0 <= i < len(prompts) * n for i in resumed):
                raise InvalidRequestError(f"a resumed sequence index is not one of the "
                                          f"request's {len(prompts) * n}", param="resumed")
        arrival = time.monotonic()
        stream = RequestStream(request_id, [len(p) for p in prompts], n, arrival, on_ready,
                               None if resumed is None
                               else {i: len(t) for i, t in resumed.items()})
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}/{p}"
                                                      for p in range(len(prompts))]
        self._streams[request_id] = (stream, ids)
        for p, (engine_id, prompt) in enumerate(zip(ids, prompts, strict=True)):
            local = None if resumed is None else {
                i - p * n: list(t) for i, t in resumed.items() if p * n <= i < (p + 1) * n}
            if local == {}:
                continue  # every sequence of this prompt had finished
            self._routes[engine_id] = _Route(stream, p * n)
            self._commands.put(_Add(engine_id, list(prompt), params, priority, cache_salt,
                                    lora_id, arrival, local, store_lookup,
                                    images=tuple(images[p]) if images else ()))
        return stream

    def abort(self, request_id: str, indices: Sequence[int] = ()) -> int:
        """Abort some (or all, when `indices` is empty) sequences; returns how many ran."""
        entry = self._streams.get(request_id)
        if entry is None:
            return 0
        stream, ids = entry
        aborted = stream.abort(indices)
        per_prompt = stream.num_sequences // len(ids)
        for p, engine_id in enumerate(ids):
            span = range(p * per_prompt, (p + 1) * per_prompt)
            if stream.all_finished(span):
                self._commands.put(_Abort(engine_id))
                continue
            local = [i - span.start for i in indices if i in span]
            if local:  # stop only those sequences; their siblings go on
                self._commands.put(_Abort(engine_id, local))
        self._forget_if_done(stream)
        return aborted

    def cancel(self, stream: RequestStream) -> int:
        """The reader went away: abort whatever of the request still runs, at once.

        Returns how many sequences that aborted (0 when the request had finished).
        """
        entry = self._streams.get(stream.request_id)
        if entry is None or entry[0] is not stream:
            return 0
        return self.abort(stream.request_id)

    def stop(self) -> None:
        """Ask the thread to exit after its current step (running requests are dropped)."""
        self._commands.put(_STOP)

    async def wait_stopped(self) -> None:
        """Return once the thread has exited."""
        if self._thread is not None:
            await self._stopped.wait()

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def num_requests(self) -> int:
        """Requests with a stream still open."""
        return len(self._streams)

    def _check_usable(self) -> None:
        if self.failure is not None:
            raise InternalError(f"the engine failed: {self.failure!r}")
        if self._thread is None or not self._thread.is_alive():
            raise InternalError("the engine thread is not running")

    def _forget_if_done(self, stream: RequestStream) -> None:
        if stream.finished and stream.request_id in self._streams:
            _, ids = self._streams.pop(stream.request_id)
            for engine_id in ids:
                self._routes.pop(engine_id, None)

    def _deliver(self, batch: _StepBatch) -> None:
        """Route one step's results to the streams (on the event loop)."""
        touched: dict[int, RequestStream] = {}
        for engine_id, error in batch.errors:
            route = self._routes.get(engine_id)
            if route is not None:
                self.abort(route.stream.request_id)  # its other prompts, if any
                route.stream.fail(error)
        tokens = 0
        for out in batch.outputs:
            tokens += len(out.new_token_ids)
            route = self._routes.get(out.request_id)
            if route is None:
                continue  # a request whose reader went away (its abort is on its way)
            route.stream.push(out, route.offset, batch.times.get(out.request_id))
            touched[id(route.stream)] = route.stream
        self.tokens_delivered += tokens
        if batch.timing is not None:
            self.steps_delivered += 1
            self.step_ns_total += batch.timing.forward_ns
            self.last_timing = batch.timing
        for stream in touched.values():
            stream.end_step(batch.timing)
            self._forget_if_done(stream)
        if batch.kv is not None and self.on_kv_events is not None:
            self.on_kv_events(batch.kv)
        if batch.outputs and self.on_step is not None:
            self.on_step(batch.outputs, batch.times)

    def _fail_all(self, error: BaseException) -> None:
        """The engine died: end every stream with an internal error, then tell the owner."""
        failure = InternalError(f"the engine failed: {type(error).__name__}: {error}")
        for stream, _ in list(self._streams.values()):
            stream.fail(failure)
        self._streams.clear()
        self._routes.clear()
        if self.on_fatal is not None:
            self.on_fatal(error)

    def _to_loop(self, callback: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            log.debug("event loop closed; dropping engine results")

    # ----- engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        make_current(self.engine.device)
        try:
            while self._apply_commands(block=not self.engine.has_unfinished_requests()):
                batch = _StepBatch()
                if self.engine.has_unfinished_requests():
                    self._step(batch)
                self._take_errors(batch)
                self._take_kv_events(batch)
                self.load = self._snapshot()
                if self.step_trace is not None and batch.timing is not None:
                    self._trace(batch)
                if batch.outputs or batch.errors or batch.kv is not None:
                    self._to_loop(self._deliver, batch)
        except Exception as exc:  # a device or engine error is fatal for the worker
            log.exception("engine loop failed; the worker cannot serve any more")
            self.failure = exc
            self._to_loop(self._fail_all, exc)
        finally:
            self._to_loop(self._stopped.set)

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command (waiting for one if `block`); False on stop."""
        while True:
            wait_s = self.idle_trim.wait_s() if block and self.idle_trim is not None else None
            try:
                command = self._commands.get(block=block, timeout=wait_s)
            except queue.Empty:
                if not block:
                    return True
                assert self.idle_trim is not None, "a blocking wait timed out"
                self.idle_trim.idle()  # idle that long: trim if due, then wait on
                continue
            block = False
            if command is _STOP:
                return False
            if isinstance(command, _Add):
                self._add(command)
                self._added_since_step += 1
            elif isinstance(command, _Compiled):
                self._compiled(command)
            elif isinstance(command, _Abort):
                if command.indices is None and self._compiling.pop(command.engine_id, None) is not None:
                    continue  # its grammar was still compiling: it never reaches the engine
                self.engine.abort_request(command.engine_id, command.indices)
                if not self.engine.sequences(command.engine_id):
                    self._sequences.pop(command.engine_id, None)
                    self._first_timed.discard(command.engine_id)

    def _add(self, command: _Add) -> None:
        params, grammars = command.params, self._grammars
        # Grammars compile and bad words tokenize off this thread; the request joins the
        # engine when they are ready (a cached grammar is ready at once), and the others
        # run meanwhile.
        try:
            if params.bad_words and command.bad_words_ids is None:
                self._prepare(command, "bad_words_ids", grammars.submit_bad_words(
                    params.bad_words))
                return
            if params.structured is not None and command.grammar is None:
                self._prepare(command, "grammar", grammars.submit(params.structured))
                return
            embedder = self.engine.images
            if command.images and command.images_fetched is None and embedder is not None:
                fetching = embedder.prefetch(command.images)
                if fetching is not None:  # encoder services encode while others run
                    self._prepare(command, "images_fetched", fetching)
                    return
        except MeshError as exc:
            self._pending_errors.append((command.engine_id, exc))
            return
        try:
            self.engine.add_request(command.engine_id, command.prompt, command.params,
                                    priority=command.priority, cache_salt=command.cache_salt,
                                    lora_id=command.lora_id, arrival_time=command.arrival,
                                    resumed=command.resumed,
                                    store_lookup=command.store_lookup,
                                    grammar=command.grammar,
                                    bad_words_ids=command.bad_words_ids,
                                    images=command.images)
        except MeshError as exc:
            self._pending_errors.append((command.engine_id, exc))
            return
        # Kept to read their scheduling timestamps later.
        self._sequences[command.engine_id] = self.engine.sequences(command.engine_id)

    def _prepare(self, command: _Add, field: str, future: Future[Any]) -> None:
        self._compiling[command.engine_id] = command
        if future.done():
            self._compiled(_Compiled(command, field, future))
        else:
            future.add_done_callback(
                lambda done: self._commands.put(_Compiled(command, field, done)))

    def _compiled(self, command: _Compiled) -> None:
        add = command.add
        if self._compiling.get(add.engine_id) is not add:
            return  # aborted meanwhile
        del self._compiling[add.engine_id]
        error = command.future.exception()
        if error is None:
            self._add(replace(add, **{command.field: command.future.result()}))
            return
        if not isinstance(error, MeshError):
            error = InternalError(f"compiling the request's grammar failed: {error!r}")
        self._pending_errors.append((add.engine_id, error))

    def _take_errors(self, batch: _StepBatch) -> None:
        batch.errors, self._pending_errors = self._pending_errors, []

    def _step(self, batch: _StepBatch) -> None:
        started = time.perf_counter_ns()
        batch.outputs = self.engine.step()
        batch.timing = StepTiming(time.perf_counter_ns() - started)
        if self.idle_trim is not None:
            self.idle_trim.busy()
        # Timestamps are read when they can have changed: until the first token is seen,
        # and when a sequence finishes (preemption counts are final then). Reading them
        # every step would cost the engine thread a pass over every sequence.
        for out in batch.outputs:
            engine_id = out.request_id
            if out.finish_reason is None and engine_id in self._first_timed:
                continue
            sequences = self._sequences.get(engine_id)
            if not sequences:
                continue
            times = batch.times[engine_id] = SequenceTimes.of(sequences)
            if times.first_token is not None:
                self._first_timed.add(engine_id)
            if all(seq.is_finished for seq in sequences):
                del self._sequences[engine_id]
                self._first_timed.discard(engine_id)

    def _trace(self, batch: _StepBatch) -> None:
        assert self.step_trace is not None and batch.timing is not None
        self.step_trace.append(StepRecord(
            time.perf_counter(), batch.timing.forward_ns / 1e9, self.load.num_running,
            self.load.num_waiting, self._added_since_step, len(batch.outputs),
            sum(len(out.new_token_ids) for out in batch.outputs),
            self.load.num_pending_prefill_tokens, **device_fields(self.engine)))
        self._added_since_step = 0

    def _take_kv_events(self, batch: _StepBatch) -> None:
        events = self.engine.take_kv_events()
        if events:
            self._kv_seq += 1
            batch.kv = KVEventBatch(self.epoch, self._kv_seq, tuple(events))

    def _snapshot(self) -> WorkerLoad:
        load = self.engine.load()
        return WorkerLoad(
            num_running=load.num_running, num_waiting=load.num_waiting,
            num_pending_prefill_tokens=load.num_pending_prefill_tokens,
            num_used_blocks=load.num_total_blocks - load.num_free_blocks,
            num_free_blocks=load.num_free_blocks, num_total_blocks=load.num_total_blocks,
            max_running=self.engine.max_num_seqs,
            snapshot_unix_ns=time.time_ns(), num_active_tokens=load.num_active_tokens)
