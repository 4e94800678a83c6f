"""One running request at the gateway: fed by the worker and detokenize sessions, read by
its HTTP handler.

    await generation.wait_started()           # first output, or the error (HTTP status)
    async for update in generation.updates():  # one GenerationUpdate per worker step
        ...

A `Generation` is its request's `SessionRunner` on a worker session and its `TextSink`
on a detokenize stream. Each worker entry (a sequence's new tokens) goes to the
detokenize stream; each answer becomes a `ChoiceDelta`; all deltas of one answer become
one `GenerationUpdate` in the mailbox, and the handler is woken once. When the
detokenizer reports that a stop string ended a sequence, the sequence ends with
finish_reason "stop", its later tokens are ignored, and the worker is told to abort it.

If the worker is lost (its session breaks), the request moves to another worker
(`failover`, the orchestrator's, which bounds it or raises): the sequences still running
continue there after every output token this worker had sent for them. The detokenizer
state is kept (the detokenize handle outlives worker handles), so the text goes on
from where it was: nothing already sent is sent again, and stop strings span the seam.

If the detokenize stream breaks (its tokenizer replica is gone), the request waits for
another stream (`DetokenizeFailover`, the orchestrator's: another replica, or the same one
restarted, within a bounded wait) and opens there with where each sequence stood: the
tokens already answered and the text they made (`resumed`), from which the tokenizer
rebuilds the text state; then every entry still unanswered is sent again, in order. The
worker keeps generating meanwhile; its entries wait for the new stream.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import Span

from meshserve.proto.v1 import common_pb2, scheduler_pb2, tokenizer_pb2, worker_pb2
from meshserve.services.gateway import wire
from meshserve.services.gateway.flow.job import (
    ChoiceDelta,
    GenerationJob,
    GenerationUpdate,
    PreparedPrompt,
)
from meshserve.services.gateway.links.detokenize import DetokenizeStream, SequenceText, TokenLookup
from meshserve.services.gateway.links.worker_link import WorkerLink
from meshserve.services.gateway.metrics import GatewayMetrics
from meshserve.shared.errors import InternalError, MeshError, UnavailableError
from meshserve.shared.openai_bodies import usage as usage_body

_UNFINISHED = common_pb2.FINISH_REASON_UNSPECIFIED
_STOP = common_pb2.FINISH_REASON_STOP


@dataclass(slots=True)
class _Sequence:
    """What the gateway tracks of one sequence (choice)."""

    num_tokens: int = 0  # output tokens that count (none past a stop string)
    cached_tokens: int = 0
    finish_reason: str | None = None
    seen: bool = False  # its first entry (the one with prompt logprobs) was rendered
    # Every output token the workers sent for it, in order: what it resumes from elsewhere.
    received: list[int] = field(default_factory=list)
    # Of those, how many the detokenizer answered (in entries of these sizes), and the texts
    # it answered for them: what a new detokenize stream resumes from.
    num_answered: int = 0
    entry_sizes: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Entry:
    """One worker entry on its way through the detokenizer."""

    index: int
    token_ids: list[int]
    finish_reason: int
    detail: worker_pb2.EntryDetail | None
    lookups: list[int]  # token ids whose bytes the answer brings (logprob tokens)


@dataclass(frozen=True)
class Placement:
    """Where one attempt of a request runs: its route, worker session and handle."""

    route: scheduler_pb2.RouteResponse
    session: WorkerLink
    handle: int


Failover = Callable[["Generation", UnavailableError | None], Awaitable[None]]
"""Moves a request whose worker was lost to another worker (the orchestrator's), or
raises the error it ends with; with None, a prefilled request to its decode worker."""
DetokenizeFailover = Callable[["Generation", MeshError], Awaitable[DetokenizeStream]]
"""A detokenize stream for a request whose stream broke (the orchestrator's), or raises
the error it ends with."""


class Generation:
    """One request's state between the sessions and its HTTP handler (see the module doc)."""

    def __init__(self, job: GenerationJob, prompts: Sequence[PreparedPrompt], *,
                 detok: DetokenizeStream, metrics: GatewayMetrics, span: Span,
                 failover: Failover, detok_failover: DetokenizeFailover) -> None:
        self.job = job
        self.prompts = list(prompts)
        self.placement: Placement | None = None
        self._detok: DetokenizeStream | None = detok  # None while its stream is lost
        self._lookup = detok.lookup  # shared by every stream (one tokenizer)
        self._detok_failover = detok_failover
        self._detok_open: Callable[[int], tokenizer_pb2.DetokenizeOpen] | None = None
        self._detok_lost: MeshError | None = None
        self._metrics = metrics
        self._span = span
        self._failover = failover
        self._detok_handle = 0  # the first placement's handle, kept for the request's life
        self._seqs = [_Sequence() for _ in range(job.num_choices)]
        self._num_live = job.num_choices  # sequences without a finish reason
        self._wants_logprobs = job.wants_logprobs
        # Whether the response shows prompt tokens' logprobs: echoed with logprobs, or
        # asked for as `prompt_logprobs`.
        self._prompt_logprobs_shown = (job.echo and job.wants_logprobs) \
            or job.options.return_prompt_logprobs
        # Labelled metric children, resolved once (a labels() lookup costs microseconds).
        self._ttft = metrics.ttft.labels(*metrics.model(job.model))
        self._itl = metrics.itl.labels(*metrics.model(job.model))
        self._mailbox: list[GenerationUpdate] = []
        self._deltas: list[ChoiceDelta] = []  # of the detokenizer answer being applied
        self._stopped: list[int] = []
        self._waiter: asyncio.Future[None] | None = None  # the handler's, while it waits
        self._error: MeshError | None = None
        self._lost: MeshError | None = None
        self._handed_off = False  # the prefill worker handed the request off: move it
        self.kv_source = ""  # where its prompt's KV waits (a TCP handoff; "": the kvstore)
        self.refused = False  # the decode worker it moved to had no room: move it again
        # Entries sent to the detokenizer (or waiting for a new stream), answer pending, in
        # order; a worker's error or loss waits for them, so that what was generated before
        # it still reaches the client first.
        self._pending: deque[_Entry] = deque()
        self._deferred: Callable[[], None] | None = None
        self._first: list[GenerationUpdate] | None = None
        self._closed = False
        self._last_token_time: float | None = None
        self._timings: common_pb2.Timings | None = None
        self.attempts = 0  # placements, failovers included
        self.failovers = 0  # placements that continued a request after its worker was lost
        self.detok_failovers = 0  # detokenize streams taken over after one broke
        self.excluded: list[str] = []  # workers lost by earlier attempts

    # -- placement --------------------------------------------------------------------------

    @property
    def route(self) -> scheduler_pb2.RouteResponse:
        assert self.placement is not None, "the generation was never placed"
        return self.placement.route

    def place(self, placement: Placement,
              detok_open: Callable[[int], tokenizer_pb2.DetokenizeOpen],
              add: worker_pb2.SessionAdd) -> None:
        """Run under `placement`: first, or after the previous worker was lost (`add` then
        resumes the unfinished sequences; the detokenizer state goes on)."""
        if self.placement is None:
            self._detok_handle = placement.handle
            self._detok_open = detok_open
            assert self._detok is not None, "a stream is lost only once the request opened"
            self._detok.open(self, detok_open(placement.handle))
        else:
            assert not self._pending, "a failover waits for the lost worker's entries"
        self.placement = placement
        self.attempts += 1
        placement.session.submit(self, add)

    @property
    def num_received(self) -> int:
        """Output tokens the workers sent, all sequences together."""
        return sum(len(s.received) for s in self._seqs)

    def unfinished(self) -> list[tuple[int, list[int]]]:
        """(index, every output token received) of each sequence still running."""
        return [(i, s.received) for i, s in enumerate(self._seqs) if s.finish_reason is None]

    # -- the handler's side -----------------------------------------------------------------

    @property
    def done(self) -> bool:
        """Whether every sequence has finished."""
        return self._num_live == 0

    @property
    def lookup(self) -> TokenLookup:
        """Token texts for logprobs (a TokenRenderer)."""
        return self._lookup

    @property
    def finish_reasons(self) -> list[str | None]:
        return [s.finish_reason for s in self._seqs]

    def usage(self) -> dict[str, Any]:
        """The OpenAI usage object so far (cached tokens of each prompt's first sample)."""
        n = self.job.params.n
        cached = sum(self._seqs[p * n].cached_tokens for p in range(len(self.prompts)))
        return usage_body(sum(len(p.token_ids) for p in self.prompts),
                          sum(s.num_tokens for s in self._seqs), cached)

    async def wait_started(self) -> None:
        """Wait for the first output (or the end); raise the request's error if it failed."""
        if self._first is None:
            self._first = await self._next() or []

    async def updates(self) -> AsyncIterator[GenerationUpdate]:
        """One update per worker step that brought news, until every sequence ends."""
        await self.wait_started()
        batch, self._first = self._first, []
        while batch:
            for update in batch:
                yield update
            batch = await self._next() or []

    async def _next(self) -> list[GenerationUpdate] | None:
        """The updates gathered since the previous call; None once every sequence ended."""
        while True:
            if self._mailbox:
                batch, self._mailbox = self._mailbox, []
                return batch
            if self._error is not None:
                raise self._error
            if self._detok_lost is not None:
                detok_lost, self._detok_lost = self._detok_lost, None
                await self._move_detokenization(detok_lost)
                continue
            if self._lost is not None:
                lost, self._lost = self._lost, None
                await self._handle_lost(lost)
                continue
            if self._handed_off:
                self._handed_off = False
                await self._failover(self, None)
                continue
            if self.done:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def _handle_lost(self, lost: MeshError) -> None:
        await self._failover(self, UnavailableError(lost.message, param=lost.param))

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the worker session's side (SessionRunner) ------------------------------------------

    def on_entry(self, index: int, token_ids: list[int], finish_reason: int,
                 detail: worker_pb2.EntryDetail | None) -> DetokenizeStream | None:
        if index >= len(self._seqs):
            self.on_worker_error(InternalError(
                f"the worker sent sequence {index} of a request with {len(self._seqs)}"))
            return None
        seq = self._seqs[index]
        if seq.finish_reason is not None or self._closed:
            return None
        seq.received.extend(token_ids)
        lookups: list[int] = []
        if detail is not None:
            if self._wants_logprobs:
                lookups = wire.lookup_ids(detail.logprobs)
            # A one-token prompt has no prompt logprobs, but its token is echoed all the same.
            if self._prompt_logprobs_shown and not seq.seen:
                prompt = self.prompts[index // self.job.params.n]
                lookups = [*prompt.token_ids, *wire.lookup_ids(detail.prompt_logprobs),
                           *lookups]
        entry = _Entry(index, token_ids, finish_reason, detail, lookups)
        self._pending.append(entry)
        if self._detok is None:
            return None  # sent once another stream takes the request over
        self._send(self._detok, entry)
        return self._detok

    def _send(self, stream: DetokenizeStream, entry: _Entry) -> None:
        stream.add(self, entry, self._detok_handle, entry.index, entry.token_ids,
                   entry.finish_reason != _UNFINISHED, entry.finish_reason == _STOP,
                   entry.lookups)

    def on_worker_error(self, error: MeshError) -> None:
        self._after_detok(lambda: self._fail(error))

    def on_worker_done(self, done: worker_pb2.RequestDone) -> None:
        self._timings = done.timings
        if done.handed_off or done.refused:  # disaggregated serving: the request moves on
            self.kv_source = done.kv_source if done.handed_off else self.kv_source
            self.refused = done.refused
            self._after_detok(self._set_handed_off)

    def _set_handed_off(self) -> None:
        if not self._closed and not self.done:
            self._handed_off = True
            self._wake()

    def worker_lost(self, error: MeshError) -> None:
        self._after_detok(lambda: self._set_lost(error))

    def _set_lost(self, error: MeshError) -> None:
        if not self._closed and not self.done:
            self._lost = error
            self._wake()

    def _after_detok(self, action: Callable[[], None]) -> None:
        """Run `action` once the entries already at the detokenizer have been answered."""
        if self._pending:
            self._deferred = action
        else:
            action()

    # -- the detokenize stream's side (TextSink) --------------------------------------------

    def on_text(self, ref: object, text: SequenceText) -> None:
        assert isinstance(ref, _Entry), "a generation's entries carry _Entry refs"
        assert self._pending and self._pending[0] is ref, "answers come in entry order"
        self._pending.popleft()
        if self._closed:
            return  # a cancelled request
        seq = self._seqs[ref.index]
        if seq.finish_reason is not None:
            return
        if ref.token_ids:
            seq.num_answered += len(ref.token_ids)
            seq.entry_sizes.append(len(ref.token_ids))
        seq.texts.append(text.text)
        self._deltas.append(self._delta(seq, ref, text))
        if text.stopped:
            self._stopped.append(ref.index)

    def publish(self, now: float) -> None:
        self._run_deferred()
        if not self._deltas:
            return
        update, self._deltas = GenerationUpdate(self._deltas), []
        self._observe_timing(update, now)
        self._mailbox.append(update)
        stopped, self._stopped = self._stopped, []
        placement = self.placement
        assert placement is not None
        if self.done:
            placement.session.forget(placement.handle)
            if self._detok is not None:
                self._detok.release(self._detok_handle)
        if stopped:  # the worker would go on: stop what a stop string ended
            placement.session.abort(placement.handle, [] if self.done else stopped)
        self._wake()

    def _run_deferred(self) -> None:
        if not self._pending and self._deferred is not None:
            deferred, self._deferred = self._deferred, None
            deferred()

    def on_detokenize_error(self, error: MeshError) -> None:
        self._fail(error)

    def on_detokenize_lost(self, error: MeshError) -> None:
        if self._closed or self._detok is None:
            return
        self._detok = None
        self._detok_lost = error
        self._wake()

    async def _move_detokenization(self, lost: MeshError) -> None:
        """Open the request on another stream where its text stood, and send again every
        entry the lost stream had not answered (see the module doc)."""
        stream = await self._detok_failover(self, lost)
        if self._closed:
            return
        assert stream.lookup is self._lookup, "detokenize streams share one TokenLookup"
        assert self._detok_open is not None, "only an opened request loses its stream"
        self._detok = stream
        self.detok_failovers += 1
        # A sequence that ended (a stop string) while entries were on their way gets no
        # more tokens: its entries would be ignored anyway.
        self._pending = deque(e for e in self._pending
                              if self._seqs[e.index].finish_reason is None)
        request = self._detok_open(self._detok_handle)
        request.resumed.extend(self._resumed())
        stream.open(self, request)
        if self._detok is not stream:
            return  # lost again at once: the next turn of _next moves it again
        indices: set[int] = set()
        for entry in self._pending:
            if entry.index in indices:  # a step has one entry per sequence: a new step
                stream.cut()  # its own message, so its text is one update, as at first
                indices.clear()
            indices.add(entry.index)
            self._send(stream, entry)
        await stream.flush()
        self._run_deferred()

    def _resumed(self) -> list[tokenizer_pb2.DetokenizeResume]:
        """Where each sequence stood: what the answered tokens made, or that it ended."""
        resumed: list[tokenizer_pb2.DetokenizeResume] = []
        for i, seq in enumerate(self._seqs):
            if seq.finish_reason is not None:
                resumed.append(tokenizer_pb2.DetokenizeResume(index=i, finished=True))
            elif seq.num_answered:
                resumed.append(tokenizer_pb2.DetokenizeResume(
                    index=i, token_ids=seq.received[:seq.num_answered],
                    text="".join(seq.texts), entry_sizes=seq.entry_sizes))
        return resumed

    def _fail(self, error: MeshError) -> None:
        if self._error is None and not self._closed:
            self._error = error
            self._wake()

    def _delta(self, seq: _Sequence, entry: _Entry, text: SequenceText) -> ChoiceDelta:
        counted = len(entry.token_ids)
        reason: str | None = None
        stop_reason: int | str | None = None
        detail = entry.detail
        if text.stopped:  # only tokens up to the one completing the stop string count
            counted = min(counted, max(0, text.num_output_tokens - seq.num_tokens))
            reason, stop_reason = "stop", text.stop_string
        elif entry.finish_reason != _UNFINISHED:
            reason = wire.FINISH_REASONS.get(entry.finish_reason, "abort")
            if detail is not None and detail.HasField("stop_token_id"):
                stop_reason = detail.stop_token_id
        logprobs = None
        prompt_logprobs = None
        if detail is not None:
            if self._wants_logprobs:
                logprobs = [wire.token_logprobs(e) for e in detail.logprobs[:counted]]
            if not seq.seen and (detail.prompt_logprobs or self._prompt_logprobs_shown):
                prompt_logprobs = [None, *map(wire.token_logprobs, detail.prompt_logprobs)]
            if detail.HasField("cached_tokens") and not seq.seen:
                # The first worker's figure: a later one also counts its prefix hits on
                # the resumed output tokens.
                seq.cached_tokens = detail.cached_tokens
        elif self._wants_logprobs:
            logprobs = []
        seq.seen = True
        seq.num_tokens += counted
        if reason is not None:
            seq.finish_reason = reason
            self._num_live -= 1
        return ChoiceDelta(entry.index, text.text, entry.token_ids[:counted], logprobs,
                           prompt_logprobs, reason, stop_reason)

    def _observe_timing(self, update: GenerationUpdate, now: float) -> None:
        """TTFT, or the inter-token latency of the update's tokens (`now`: the step's time,
        read once for every request of the step)."""
        tokens = max(len(choice.token_ids) for choice in update.choices)
        if not tokens:
            return
        if self._last_token_time is None:
            self._ttft.observe(now - self.job.arrival)
        else:
            self._itl.observe((now - self._last_token_time) / tokens)
        self._last_token_time = now

    # -- ending -----------------------------------------------------------------------------

    def finish(self) -> None:
        """The handler read everything: metrics and the span (or cancel if it stopped early)."""
        if not self.done:
            self.cancel()
            return
        self._closed = True
        loop_time = asyncio.get_running_loop().time()
        metrics, labels = self._metrics, self._metrics.model(self.job.model)
        metrics.e2e.labels(*labels).observe(loop_time - self.job.arrival)
        usage = self.usage()
        metrics.prompt_tokens.labels(*labels).inc(usage["prompt_tokens"])
        metrics.generation_tokens.labels(*labels).inc(usage["completion_tokens"])
        for reason in self.finish_reasons:
            metrics.request_success.labels(*labels, reason or "abort").inc()
        self._record_span()

    def cancel(self) -> None:
        """Tear everything down at once (error, deadline, client gone)."""
        if self._closed:
            return
        self._closed = True
        placement = self.placement
        if placement is not None:
            if not self.done:
                placement.session.abort(placement.handle)
            placement.session.forget(placement.handle)
            if self._detok is not None:
                self._detok.close(self._detok_handle)
        self._record_span()

    def _record_span(self) -> None:
        reasons = [r or "abort" for r in self.finish_reasons]
        self._span.set_attribute("gen_ai.response.finish_reasons", reasons)
        if self.placement is not None:
            self._span.set_attributes({"meshserve.worker_id": self.placement.route.worker_id,
                                       "meshserve.attempts": self.attempts,
                                       "meshserve.failovers": self.failovers})
        timings = self._timings
        if timings is not None:
            self._span.set_attributes({
                "meshserve.worker.queued_ns": timings.queued_ns,
                "meshserve.worker.prefill_ns": timings.prefill_ns,
                "meshserve.worker.decode_ns": timings.decode_ns,
                "meshserve.worker.kv_fetch_ns": timings.kv_fetch_ns,
                "meshserve.worker.num_steps": timings.num_steps,
                "meshserve.worker.num_preemptions": timings.num_preemptions})
