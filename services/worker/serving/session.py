"""One gateway's Session stream on this worker: many requests, one message per engine step.

    session = WorkerSession(engine, info, tracer=..., draining=...)
    reader = asyncio.ensure_future(session.read(request_iterator))   # commands in
    async for response in session.responses():                       # outputs out
        await context.write(response)

Commands (adds, aborts) are applied as they arrive. Each request's `RequestStream`
merges what the engine produces; when a stream has news it marks itself dirty here,
and the writer takes every dirty stream at once into one columnar `SessionResponse`.
While the gateway reads slowly, `context.write` waits and steps keep merging, so the
gateway gets one larger message rather than a backlog. A request's deadline, a failed
add, or an engine error ends that request alone with an error entry. When the stream
ends, whatever still runs is aborted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from meshserve.proto.v1 import common_pb2, worker_pb2
from meshserve.services.worker.serving.engine_thread import EngineThread
from meshserve.services.worker.serving.request_stream import RequestStream, SequenceDelta
from meshserve.services.worker.serving.wire import (
    FINISH_PB,
    logprobs_pb,
    prompt_logprobs_pb,
    request_images,
    resumed_sequences,
    timings_pb,
)
from meshserve.services.worker.tier.handoff import KvHandoff, RoomReservations
from meshserve.shared.errors import (
    DeadlineExceededError,
    MeshError,
    UnavailableError,
)
from meshserve.shared.proto_errors import error_pb
from meshserve.shared.sampling_params import SamplingParams

_UNSET = common_pb2.FINISH_REASON_UNSPECIFIED


@dataclass
class SessionEntry:
    """One request of the session."""

    handle: int
    request: worker_pb2.GenerateRequest
    params: SamplingParams
    stream: RequestStream
    traceparent: str
    tracestate: str
    prefill_only: bool = False
    """Disaggregated serving: this worker computes the prompt and first tokens only."""
    continues: bool = False
    """A prefill-only request with sequences that go on at the decode worker."""


class WorkerSession:
    """The requests of one Session stream and the building of its messages."""

    def __init__(self, engine: EngineThread, *, worker_id: str,
                 validate: Callable[[worker_pb2.GenerateRequest], SamplingParams],
                 on_finished: Callable[[SessionEntry, str | None], None],
                 draining: Callable[[], bool] = lambda: False,
                 handoff: KvHandoff | None = None,
                 reservations: RoomReservations | None = None) -> None:
        """`validate` turns a request into its SamplingParams (or raises); `on_finished`
        is called once per request that ends (its entry and the error kind, if any);
        `handoff` moves prefilled prompts' KV (disaggregated serving; None: not served);
        `reservations`: the worker's blocks promised to handed-off requests (shared by its
        sessions; default: this session's own)."""
        self._engine = engine
        self._handoff = handoff
        self._reservations = reservations if reservations is not None else RoomReservations()
        self._handed: list[worker_pb2.RequestDone] = []  # handoffs sent, not yet reported
        self._sending: set[asyncio.Task[None]] = set()  # handoffs under way (held: the loop
        # keeps only weak references to tasks)
        self._worker_id = worker_id
        self._validate = validate
        self._on_finished = on_finished
        self._draining = draining
        self._entries: dict[int, SessionEntry] = {}
        self._by_stream: dict[int, int] = {}  # id(stream) -> handle
        self._dirty: dict[int, SessionEntry] = {}
        self._errors: list[worker_pb2.RequestError] = []
        self._deadlines: list[tuple[int, int]] = []  # heap of (deadline_unix_ns, handle)
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._ready = asyncio.Event()
        self._closed = False
        self._input_closed = False
        self._steps_seen = engine.steps_delivered

    @property
    def num_requests(self) -> int:
        """Requests of this session still running or with output not yet sent."""
        return len(self._entries)

    # -- commands in ------------------------------------------------------------------------

    async def read(self, requests: AsyncIterator[worker_pb2.SessionRequest]) -> None:
        """Apply every command the gateway sends until it stops sending.

        Once it has stopped (a half-close), the session ends after its last request.
        """
        try:
            async for message in requests:
                for add in message.adds:
                    self.add(add)
                for abort in message.aborts:
                    self.abort(abort.handle, list(abort.indices))
        finally:
            self._input_closed = True
            self._ready.set()

    def add(self, add: worker_pb2.SessionAdd) -> None:
        """Start one request (or answer its handle with an error entry)."""
        handle = add.handle
        if handle in self._entries:
            self._fail_handle(handle, UnavailableError(
                f"handle {handle} is already in use on this session", param="handle"))
            return
        try:
            if self._draining():
                raise UnavailableError(f"worker {self._worker_id} is draining; retry on "
                                       "another worker")
            params = self._validate(add.request)
            if self._refuses(add, params.n):
                return
            prefill_only = self._prefill_only(add.request, params)
            if prefill_only:  # the first token here, the rest at the decode worker
                params = dataclasses.replace(params, max_tokens=1,
                                             min_tokens=min(params.min_tokens, 1))
                if add.request.kv_target and self._handoff is not None:
                    self._handoff.target(add.request.request_id, add.request.kv_target)
            if add.request.deadline_unix_ns and add.request.deadline_unix_ns <= time.time_ns():
                raise DeadlineExceededError("the request's deadline passed before it "
                                            "reached the worker", param="deadline_unix_ns")
            request = add.request
            stream = self._engine.submit(
                request.request_id, [list(p.token_ids) for p in request.prompts], params,
                priority=request.priority, cache_salt=request.cache_salt or None,
                lora_id=request.lora_id if request.HasField("lora_id") else None,
                on_ready=self._on_ready,
                resumed=resumed_sequences(add.resumed) if add.resumed else None,
                store_lookup=not request.HasField("kvstore_blocks")
                or request.kvstore_blocks > 0,
                images=request_images(request.prompts))
        except MeshError as exc:
            if (add.request.handed_off or add.request.kv_target) and self._handoff is not None:
                # `_refuses` told the handoff where its blocks wait: nothing will pull them
                # (or nothing will push them).
                self._handoff.forget(add.request.request_id)
            self._fail_handle(handle, exc)
            return
        entry = SessionEntry(handle, add.request, params, stream, add.traceparent, add.tracestate,
                             prefill_only=prefill_only)
        self._entries[handle] = entry
        self._by_stream[id(stream)] = handle
        if add.request.handed_off and self._handoff is not None:
            self._reservations.reserve(stream, self._prompt_blocks(add, params.n))
        if add.request.deadline_unix_ns:
            heapq.heappush(self._deadlines, (add.request.deadline_unix_ns, handle))
            self._arm_deadline_timer()

    def _refuses(self, add: worker_pb2.SessionAdd, n: int) -> bool:
        """Whether this decode worker refuses a handed-off request for lack of KV room (a
        RequestDone.refused, not an error: the gateway places it elsewhere); otherwise
        tells the handoff where its blocks wait. The blocks other handed-off requests were
        promised and the engine has not allocated yet count as taken (the request reserves
        its own once it is submitted, in `add`)."""
        request, handoff = add.request, self._handoff
        if not request.handed_off or handoff is None:
            return False
        load = self._engine.load
        blocks = sum(self._prompt_blocks(add, n))
        if not self._reservations.has_room(blocks, load.num_free_blocks,
                                           load.num_total_blocks, handoff.watermark):
            handoff.stats.refused += 1
            self._handed.append(worker_pb2.RequestDone(handle=add.handle, refused=True))
            self._ready.set()
            return True
        if request.kv_source:
            handoff.expect(request.request_id, request.kv_source)
        return False

    def _prompt_blocks(self, add: worker_pb2.SessionAdd, n: int) -> list[int]:
        """The full blocks of each of the request's prompts (`n` samples each) that will
        run (a resumed request's prompts whose every sequence had finished run nothing)."""
        assert self._handoff is not None, "only a worker with a handoff counts prompt blocks"
        size = self._handoff.block_size
        runs = {resumed.index // n for resumed in add.resumed} if add.resumed else None
        return [len(p.token_ids) // size if runs is None or i in runs else 0
                for i, p in enumerate(add.request.prompts)]

    def _prefill_only(self, request: worker_pb2.GenerateRequest,
                      params: SamplingParams) -> bool:
        """Whether `request` is a prefill worker's part that leaves tokens to decode."""
        if not request.prefill_only:
            return False
        if self._handoff is None:
            raise UnavailableError(f"worker {self._worker_id} cannot hand KV off (it runs "
                                   "without a kvstore)", param="prefill_only")
        return params.max_tokens is None or params.max_tokens > 1

    def abort(self, handle: int, indices: list[int]) -> None:
        """Abort some (or all) sequences of a request; unknown handles are ignored."""
        entry = self._entries.get(handle)
        if entry is not None:
            self._engine.abort(entry.request.request_id, indices)

    def _fail_handle(self, handle: int, error: MeshError) -> None:
        self._errors.append(worker_pb2.RequestError(handle=handle, error=error_pb(error)))
        self._ready.set()

    # -- deadlines --------------------------------------------------------------------------

    def _arm_deadline_timer(self) -> None:
        if not self._deadlines:
            return
        loop = asyncio.get_running_loop()
        at_ns = self._deadlines[0][0]
        if self._deadline_timer is not None:
            if self._deadline_timer.when() <= loop.time() + (at_ns - time.time_ns()) / 1e9:
                return  # an earlier timer will re-arm for this one
            self._deadline_timer.cancel()
        delay = max((at_ns - time.time_ns()) / 1e9, 0.0)
        self._deadline_timer = loop.call_later(delay, self._expire_deadlines)

    def _expire_deadlines(self) -> None:
        self._deadline_timer = None
        now = time.time_ns()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, handle = heapq.heappop(self._deadlines)
            entry = self._entries.get(handle)
            if entry is None or entry.stream.finished:
                continue
            self._engine.cancel(entry.stream)
            entry.stream.fail(DeadlineExceededError("the request ran past its deadline",
                                                    param="deadline_unix_ns"))
        self._arm_deadline_timer()

    # -- outputs out ------------------------------------------------------------------------

    def _on_ready(self, stream: RequestStream) -> None:
        handle = self._by_stream.get(id(stream))
        if handle is None:
            return
        self._dirty[handle] = self._entries[handle]
        self._ready.set()

    def wake(self) -> None:
        """Re-check the session's state (e.g. the worker started draining)."""
        self._ready.set()

    async def responses(self) -> AsyncIterator[worker_pb2.SessionResponse]:
        """One message per wake-up with news, until the session closes (or, draining, has
        nothing left to run)."""
        while not self._closed:
            await self._ready.wait()
            self._ready.clear()
            message = self._collect()
            if message is not None:
                yield message
            idle = not (self._entries or self._errors or self._dirty or self._handed)
            if idle and (self._input_closed or self._draining()):
                return

    def _collect(self) -> worker_pb2.SessionResponse | None:
        dirty, self._dirty = self._dirty, {}
        errors, self._errors = self._errors, []
        handles: list[int] = []
        indices: list[int] = []
        num_tokens: list[int] = []
        token_ids: list[int] = []
        reasons: list[common_pb2.FinishReason] = []
        details: list[worker_pb2.EntryDetail] = []
        done, self._handed = self._handed, []
        for handle, entry in dirty.items():
            stream = entry.stream
            if stream.error is not None:
                errors.append(worker_pb2.RequestError(handle=handle,
                                                      error=error_pb(stream.error)))
                self._forget(entry, stream.error.kind)
                continue
            for delta in stream.take():
                self._add_entry(delta, len(handles), details)
                handles.append(handle)
                indices.append(delta.index)
                num_tokens.append(len(delta.token_ids))
                token_ids.extend(delta.token_ids)
                reasons.append(self._reason(entry, delta))
            if stream.drained and entry.continues:
                self._by_stream.pop(id(stream), None)
                task = asyncio.ensure_future(self._hand_off(entry))
                self._sending.add(task)
                task.add_done_callback(self._sending.discard)
            elif stream.drained:
                done.append(worker_pb2.RequestDone(
                    handle=handle, timings=timings_pb(stream.times, time.monotonic())))
                self._forget(entry, None)
        if not (handles or errors or done):
            return None
        steps = self._engine.steps_delivered - self._steps_seen
        self._steps_seen = self._engine.steps_delivered
        timing = self._engine.last_timing
        return worker_pb2.SessionResponse(
            handles=handles, indices=indices, num_tokens=num_tokens, token_ids=token_ids,
            finish_reasons=reasons, details=details, errors=errors, done=done,
            num_steps=steps, step_forward_ns=timing.forward_ns if timing else 0,
            sent_unix_ns=time.time_ns())

    def _reason(self, entry: SessionEntry, delta: SequenceDelta) -> common_pb2.FinishReason:
        """A delta's finish reason on the wire; a prefill-only sequence stopped by its
        one-token budget is not finished: it goes on at the decode worker."""
        if delta.first and entry.request.handed_off and self._handoff is not None:
            self._admitted(entry, delta)
        if not delta.finish_reason:
            return _UNSET
        if entry.prefill_only and delta.finish_reason == "length":
            entry.continues = True
            return _UNSET
        return FINISH_PB[delta.finish_reason]

    def _admitted(self, entry: SessionEntry, delta: SequenceDelta) -> None:
        """A handed-off request's sequence gave its first output: the engine allocated its
        prompt's blocks (or it ended before that), so that prompt's reservation ends."""
        assert self._handoff is not None
        self._handoff.receive(delta.num_cached_tokens // self._handoff.block_size)
        self._reservations.release(entry.stream, delta.index // entry.params.n)

    async def _hand_off(self, entry: SessionEntry) -> None:
        """Send a prefilled request's prompt KV, then report it handed off (the gateway
        moves it to its decode worker on that)."""
        assert self._handoff is not None, "only a worker with a handoff runs prefill_only"
        size = self._handoff.block_size
        request_id = entry.request.request_id
        await self._handoff.send(sum(len(p.token_ids) // size for p in entry.request.prompts),
                                 request_id)
        source = self._handoff.source_of(request_id)
        if entry.handle not in self._entries:
            return  # the session closed meanwhile
        self._handed.append(worker_pb2.RequestDone(
            handle=entry.handle, timings=timings_pb(entry.stream.times, time.monotonic()),
            handed_off=True, kv_source=source))
        self._forget(entry, None)
        self._ready.set()

    @staticmethod
    def _add_entry(delta: SequenceDelta, entry: int,
                   details: list[worker_pb2.EntryDetail]) -> None:
        """The EntryDetail of one delta, when it has more to say than its tokens."""
        stop_token = (delta.stop_reason if delta.finish_reason == "stop"
                      and isinstance(delta.stop_reason, int) else None)
        if not (delta.logprobs or delta.prompt_logprobs or delta.first
                or stop_token is not None):
            return
        detail = worker_pb2.EntryDetail(entry=entry, stop_token_id=stop_token)
        if delta.first:
            detail.cached_tokens = delta.num_cached_tokens
        if delta.logprobs:
            detail.logprobs.extend(logprobs_pb(lp) for lp in delta.logprobs)
        if delta.prompt_logprobs:
            detail.prompt_logprobs.extend(prompt_logprobs_pb(delta.prompt_logprobs))
        details.append(detail)

    def _forget(self, entry: SessionEntry, error_kind: str | None) -> None:
        self._reservations.release(entry.stream)
        if (entry.request.kv_source or entry.request.kv_target) and self._handoff is not None:
            self._handoff.forget(entry.request.request_id)
        self._entries.pop(entry.handle, None)
        self._by_stream.pop(id(entry.stream), None)
        self._on_finished(entry, error_kind)

    def close(self) -> None:
        """The stream ended: abort every request still running, stop the writer."""
        self._closed = True
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        for entry in list(self._entries.values()):
            self._engine.cancel(entry.stream)
            self._forget(entry, "cancelled")
        self._ready.set()

    @staticmethod
    def trace_parent(entry: SessionEntry) -> Context | None:
        """The trace context the gateway sent with a request (None when none)."""
        if not entry.traceparent:
            return None
        carrier = {"traceparent": entry.traceparent}
        if entry.tracestate:
            carrier["tracestate"] = entry.tracestate
        return TraceContextTextMapPropagator().extract(carrier)
