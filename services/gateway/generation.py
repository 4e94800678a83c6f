"""One running request: the worker's Generate stream piped through the Detokenize streams.

Each worker stream message (every token since the previous one, for every sequence
that progressed) becomes one DetokenizeDelta and then one `GenerationUpdate` with a
`ChoiceDelta` per sequence: never one call or one update per token. When the
detokenizer reports that a stop string ended a sequence, the sequence ends with
finish_reason "stop", its later tokens are ignored, and the worker is told to abort it
(the whole request once every sequence is done).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.trace import Span

from meshserve.proto.v1 import common_pb2, scheduler_pb2, tokenizer_pb2, worker_pb2
from meshserve.services.gateway import wire
from meshserve.services.gateway.detokenize import DetokenizeSession, TokenLookup
from meshserve.services.gateway.job import (
    ChoiceDelta,
    GenerationJob,
    GenerationUpdate,
    PreparedPrompt,
)
from meshserve.services.gateway.metrics import GatewayMetrics
from meshserve.shared.errors import InternalError, UnavailableError
from meshserve.shared.grpc_client import mesh_errors
from meshserve.shared.openai_protocol import usage as usage_body

_UNFINISHED = common_pb2.FINISH_REASON_UNSPECIFIED


@dataclass
class _Sequence:
    """What the gateway tracks of one sequence (choice)."""

    num_tokens: int = 0  # output tokens that count (none past a stop string)
    cached_tokens: int = 0
    finish_reason: str | None = None
    seen: bool = False  # its first message (the one with prompt logprobs) arrived


class Generation:
    """Reads one request's Generate stream and yields its updates (see the module doc)."""

    def __init__(self, job: GenerationJob, prompts: Sequence[PreparedPrompt],
                 call: grpc.aio.UnaryStreamCall, first: Any, detok: DetokenizeSession, *,
                 route: scheduler_pb2.RouteResponse, abort: Callable[[list[int]], None], metrics: GatewayMetrics,
                 span: Span) -> None:
        """`first`: the stream's first message (already read) or grpc.aio.EOF;
        `abort(indices)`: tells the worker to abort sequences ([] for all of them)."""
        self.job = job
        self.prompts = list(prompts)
        self.route = route
        self._call = call
        self._first = first
        self._detok = detok
        self._abort = abort
        self._metrics = metrics
        self._span = span
        self._seqs = [_Sequence() for _ in range(job.num_choices)]
        self._stopped_all = False  # every sequence ended on a stop string or was aborted
        self._last_token_time: float | None = None
        self._timings: common_pb2.Timings | None = None

    @property
    def done(self) -> bool:
        """Whether every sequence has finished."""
        return all(s.finish_reason is not None for s in self._seqs)

    @property
    def lookup(self) -> TokenLookup:
        """Token texts for logprobs (a TokenRenderer)."""
        return self._detok.lookup

    @property
    def finish_reasons(self) -> list[str | None]:
        return [s.finish_reason for s in self._seqs]

    def usage(self) -> dict[str, Any]:
        """The OpenAI usage object so far (cached tokens of each prompt's first sample)."""
        n = self.job.params.n
        cached = sum(self._seqs[p * n].cached_tokens for p in range(len(self.prompts)))
        return usage_body(sum(len(p.token_ids) for p in self.prompts),
                          sum(s.num_tokens for s in self._seqs), cached)

    async def updates(self) -> AsyncIterator[GenerationUpdate]:
        """One update per worker message that brought news, until every sequence ends."""
        message, self._first = self._first, None
        while message is not grpc.aio.EOF:
            update = await self._process(message)
            if update.choices:
                yield update
            if self._stopped_all:
                return
            message = await self._read()
        if not self.done:
            raise UnavailableError("the worker ended the Generate stream before every "
                                   "sequence finished")

    async def _read(self) -> Any:
        with mesh_errors():
            return await self._call.read()

    async def _process(self, message: worker_pb2.GenerateResponse) -> GenerationUpdate:
        self._observe_timing(message)
        outputs = [o for o in message.outputs if self._live(o.index)]
        if not outputs:
            return GenerationUpdate([])
        texts = await self._detok.exchange([self._tokens_of(o) for o in outputs])
        deltas = [self._delta(o, t) for o, t in zip(outputs, texts, strict=True)]
        stopped = [t.index for t in texts if t.stopped]
        if stopped:
            self._stopped_all = self.done
            self._abort([] if self._stopped_all else stopped)
        return GenerationUpdate(deltas)

    def _live(self, index: int) -> bool:
        if index >= len(self._seqs):
            raise InternalError(f"the worker sent sequence {index} of a request with "
                                f"{len(self._seqs)} sequences")
        return self._seqs[index].finish_reason is None

    def _tokens_of(self, output: worker_pb2.SequenceOutput) -> tokenizer_pb2.SequenceTokens:
        lookups = wire.lookup_ids(output.logprobs) if self.job.wants_logprobs else []
        if self.job.echo and output.prompt_logprobs and not self._seqs[output.index].seen:
            prompt = self.prompts[output.index // self.job.params.n]
            lookups = [*prompt.token_ids, *wire.lookup_ids(output.prompt_logprobs), *lookups]
        # A worker's STOP is EOS or a stop token id (stop strings are the detokenizer's).
        return tokenizer_pb2.SequenceTokens(
            index=output.index, token_ids=output.token_ids,
            final=output.finish_reason != _UNFINISHED, lookup_token_ids=lookups,
            stopped_on_token=output.finish_reason == common_pb2.FINISH_REASON_STOP)

    def _delta(self, output: worker_pb2.SequenceOutput,
               text: tokenizer_pb2.SequenceText) -> ChoiceDelta:
        seq = self._seqs[output.index]
        counted = len(output.token_ids)
        reason: str | None = None
        stop_reason: int | str | None = None
        if text.stopped:  # only tokens up to the one completing the stop string count
            counted = min(counted, max(0, text.num_output_tokens - seq.num_tokens))
            reason, stop_reason = "stop", text.stop_string
        elif output.finish_reason != _UNFINISHED:
            reason = wire.FINISH_REASONS.get(output.finish_reason, "abort")
            stop_reason = wire.stop_token_id(output)
        logprobs = None
        if self.job.wants_logprobs:
            logprobs = [wire.token_logprobs(e) for e in output.logprobs[:counted]]
        prompt_logprobs = None
        if not seq.seen and output.prompt_logprobs:
            prompt_logprobs = [None, *map(wire.token_logprobs, output.prompt_logprobs)]
        seq.seen = True
        seq.num_tokens += counted
        if output.HasField("usage"):
            seq.cached_tokens = output.usage.cached_tokens
        seq.finish_reason = reason
        return ChoiceDelta(output.index, text.text, list(output.token_ids[:counted]), logprobs,
                           prompt_logprobs, reason, stop_reason)

    def _observe_timing(self, message: worker_pb2.GenerateResponse) -> None:
        if message.HasField("timings"):
            self._timings = message.timings
        tokens = max((len(o.token_ids) for o in message.outputs), default=0)
        if not tokens:
            return
        now = asyncio.get_running_loop().time()
        model = self.job.model
        if self._last_token_time is None:
            self._metrics.ttft.labels(model).observe(now - self.job.arrival)
        else:
            self._metrics.itl.labels(model).observe((now - self._last_token_time) / tokens)
        self._last_token_time = now

    # -- ending -----------------------------------------------------------------------------

    async def finish(self) -> None:
        """The caller is done reading: close the streams; abort what still runs."""
        if not self._call.done():
            self._call.cancel()  # only when stop strings ended it early (worker was told)
        if not self.done:
            self.cancel()
            return
        await self._detok.finish()
        loop_time = asyncio.get_running_loop().time()
        model = self.job.model
        self._metrics.e2e.labels(model).observe(loop_time - self.job.arrival)
        usage = self.usage()
        self._metrics.prompt_tokens.labels(model).inc(usage["prompt_tokens"])
        self._metrics.generation_tokens.labels(model).inc(usage["completion_tokens"])
        self._record_span()

    def cancel(self) -> None:
        """Tear everything down at once (error, deadline, client gone)."""
        self._call.cancel()
        self._detok.cancel()
        if not self.done:
            self._abort([])
        self._record_span()

    def _record_span(self) -> None:
        reasons = [r or "abort" for r in self.finish_reasons]
        self._span.set_attribute("gen_ai.response.finish_reasons", reasons)
        timings = self._timings
        if timings is not None:
            self._span.set_attributes({
                "meshserve.worker.queued_ns": timings.queued_ns,
                "meshserve.worker.prefill_ns": timings.prefill_ns,
                "meshserve.worker.decode_ns": timings.decode_ns,
                "meshserve.worker.kv_fetch_ns": timings.kv_fetch_ns,
                "meshserve.worker.num_steps": timings.num_steps,
                "meshserve.worker.num_preemptions": timings.num_preemptions})
