"""The gRPC Worker service: a thin edge over the engine thread.

Generate converts the request to domain types, submits it, and writes one
GenerateResponse per stream update, each carrying every token a sequence produced
since the previous message (the stream merges while the client reads slowly). If
the call ends early (client gone, deadline), the request is aborted at once. Each
request's worker-side phases become spans (queue, prefill, decode) under the RPC's
server span, from the engine's own timestamps.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import grpc
import orjson
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter

from meshserve.proto.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from meshserve.services.worker.engine_thread import EngineThread
from meshserve.services.worker.request_stream import RequestTimes, SequenceDelta, StreamUpdate
from meshserve.shared.errors import (
    DeadlineExceededError,
    InternalError,
    InvalidRequestError,
    NotFoundError,
)
from meshserve.shared.logprobs import TokenLogprobs
from meshserve.shared.sampling_params import SamplingParams
from meshserve.shared.worker_registry import WorkerInfo, WorkerLoad

_FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
           "abort": common_pb2.FINISH_REASON_ABORT}


def sampling_params_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """The domain SamplingParams a proto carries (unset optionals take their defaults)."""
    has = p.HasField
    return SamplingParams(
        n=p.n if has("n") else 1,
        temperature=p.temperature if has("temperature") else 1.0,
        top_p=p.top_p if has("top_p") else 1.0,
        top_k=p.top_k, min_p=p.min_p, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if has("repetition_penalty") else 1.0,
        logit_bias=dict(p.logit_bias) or None,
        seed=p.seed if has("seed") else None,
        min_tokens=p.min_tokens,
        max_tokens=p.max_tokens if has("max_tokens") else None,
        stop=tuple(p.stop), stop_token_ids=tuple(p.stop_token_ids),
        include_stop_str_in_output=p.include_stop_str_in_output, ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if has("logprobs") else None,
        prompt_logprobs=p.prompt_logprobs if has("prompt_logprobs") else None,
        skip_special_tokens=p.skip_special_tokens if has("skip_special_tokens") else True,
        spaces_between_special_tokens=(p.spaces_between_special_tokens
                                       if has("spaces_between_special_tokens") else True),
        extra=_extra(p.extra_json))


def _extra(extra_json: str) -> dict[str, object]:
    if not extra_json:
        return {}
    try:
        extra = orjson.loads(extra_json)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"extra_json is not valid JSON: {exc}",
                                  param="extra_json") from None
    if not isinstance(extra, dict):
        raise InvalidRequestError("extra_json must be a JSON object", param="extra_json")
    return extra


def _logprobs_pb(lp: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(
        token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
        top_token_ids=[t for t, _ in lp.top], top_logprobs=[v for _, v in lp.top])


def _sequence_pb(delta: SequenceDelta) -> worker_pb2.SequenceOutput:
    out = worker_pb2.SequenceOutput(
        index=delta.index, token_ids=delta.token_ids,
        finish_reason=_FINISH.get(delta.finish_reason or "",
                                  common_pb2.FINISH_REASON_UNSPECIFIED),
        usage=common_pb2.Usage(prompt_tokens=delta.num_prompt_tokens,
                               completion_tokens=delta.num_output_tokens,
                               cached_tokens=delta.num_cached_tokens))
    if delta.logprobs:
        out.logprobs.extend(_logprobs_pb(lp) for lp in delta.logprobs)
    if delta.prompt_logprobs:
        # Position 0 has no logprob (nothing precedes it); the proto starts at position 1.
        for position, lp in enumerate(delta.prompt_logprobs[1:], start=1):
            if lp is None:
                raise InternalError(f"the engine gave no logprob for prompt position "
                                    f"{position}")
            out.prompt_logprobs.append(_logprobs_pb(lp))
    if delta.finish_reason == "stop" and isinstance(delta.stop_reason, int):
        out.stop_token_id = delta.stop_reason
    return out


def generate_response(update: StreamUpdate, now: float) -> worker_pb2.GenerateResponse:
    """One Generate message from a stream update (`now`: time.monotonic())."""
    times = update.times
    queued, prefill, decode = times.durations_ns(now)
    return worker_pb2.GenerateResponse(
        outputs=[_sequence_pb(d) for d in update.deltas],
        timings=common_pb2.Timings(
            queued_ns=queued, prefill_ns=prefill, decode_ns=decode,
            step_forward_ns=times.step_forward_ns, num_steps=times.num_steps,
            num_preemptions=times.num_preemptions, sent_unix_ns=time.time_ns()))


def worker_load_pb(load: WorkerLoad, worker_id: str, epoch: int,
                   draining: bool) -> common_pb2.WorkerLoad:
    """The proto WorkerLoad of an engine load snapshot."""
    return common_pb2.WorkerLoad(
        worker_id=worker_id, epoch=epoch, num_running=load.num_running,
        num_waiting=load.num_waiting, num_pending_prefill_tokens=load.num_pending_prefill_tokens,
        num_used_blocks=load.num_used_blocks, num_free_blocks=load.num_free_blocks,
        num_total_blocks=load.num_total_blocks, max_running=load.max_running,
        draining=draining, snapshot_unix_ns=load.snapshot_unix_ns)


def worker_info_pb(info: WorkerInfo) -> common_pb2.WorkerInfo:
    """The proto WorkerInfo of the registry's WorkerInfo."""
    return common_pb2.WorkerInfo(
        worker_id=info.worker_id, epoch=info.epoch, address=info.address,
        model_names=list(info.model_names), block_size=info.block_size,
        max_model_len=info.max_model_len, num_total_blocks=info.num_total_blocks,
        lora_ids=list(info.lora_ids), tensor_parallel_size=info.tensor_parallel_size,
        kv_namespace=info.namespace)


@asynccontextmanager
async def _deadline(deadline_unix_ns: int) -> AsyncIterator[None]:
    """Raise DeadlineExceededError when the request's wall-clock deadline passes."""
    if not deadline_unix_ns:
        yield
        return
    remaining = (deadline_unix_ns - time.time_ns()) / 1e9
    if remaining <= 0:
        raise DeadlineExceededError("the request's deadline passed before it reached the "
                                    "worker", param="deadline_unix_ns")
    try:
        async with asyncio.timeout(remaining):
            yield
    except TimeoutError:
        raise DeadlineExceededError("the request ran past its deadline",
                                    param="deadline_unix_ns") from None


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """meshserve.v1.Worker over an EngineThread."""

    def __init__(self, engine: EngineThread, info: WorkerInfo, *,
                 tracer: trace.Tracer | None = None,
                 registry: CollectorRegistry | None = None,
                 draining: Callable[[], bool] = lambda: False) -> None:
        self._engine = engine
        self.info = info
        self._tracer = tracer or trace.get_tracer("meshserve.worker")
        self._draining = draining
        # time.monotonic() + offset = wall clock, for spans made from engine timestamps.
        self._wall_offset_ns = time.time_ns() - time.monotonic_ns()
        self._tokens = Counter("meshserve_worker_generated_tokens", "Tokens generated",
                               registry=registry)
        self._finished = Counter("meshserve_worker_sequences_finished",
                                 "Sequences finished, by reason", ["finish_reason"],
                                 registry=registry)

    async def Generate(self, request: worker_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> None:
        params = self._validate(request)
        stream = self._engine.submit(
            request.request_id, [list(p.token_ids) for p in request.prompts], params,
            priority=request.priority, cache_salt=request.cache_salt or None,
            lora_id=request.lora_id if request.HasField("lora_id") else None)
        try:
            async with _deadline(request.deadline_unix_ns):
                while (update := await stream.next()) is not None:
                    self._count(update)
                    await context.write(generate_response(update, time.monotonic()))
        finally:
            # Client gone (CancelledError), deadline, error or done: abort what still runs.
            aborted = self._engine.cancel(stream)
            if aborted:
                self._finished.labels("abort").inc(aborted)
            self._record_spans(request, params, stream.times)

    def _validate(self, request: worker_pb2.GenerateRequest) -> SamplingParams:
        if not request.request_id:
            raise InvalidRequestError("request_id must not be empty", param="request_id")
        if not request.prompts:
            raise InvalidRequestError("a request needs at least one prompt", param="prompts")
        if request.HasField("lora_id") and request.lora_id not in self.info.lora_ids:
            raise NotFoundError(f"LoRA adapter {request.lora_id} is not loaded on worker "
                                f"{self.info.worker_id}", param="lora_id")
        return sampling_params_from_proto(request.params)

    def _count(self, update: StreamUpdate) -> None:
        for delta in update.deltas:
            self._tokens.inc(len(delta.token_ids))
            if delta.finish_reason is not None:
                self._finished.labels(delta.finish_reason).inc()

    def _record_spans(self, request: worker_pb2.GenerateRequest, params: SamplingParams,
                      times: RequestTimes) -> None:
        """worker.queue / worker.prefill / worker.decode spans under the current span."""
        end = times.finished if times.finished is not None else time.monotonic()
        attributes = {
            "gen_ai.request.id": request.request_id, "gen_ai.request.n": params.n,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.max_tokens": params.max_tokens or 0,
            "meshserve.worker.id": self.info.worker_id,
            "meshserve.worker.num_steps": times.num_steps,
            "meshserve.worker.num_preemptions": times.num_preemptions,
        }
        phases = [("worker.queue", times.arrival, times.first_scheduled or end),
                  ("worker.prefill", times.first_scheduled, times.first_token or end),
                  ("worker.decode", times.first_token, end)]
        for name, start, stop in phases:
            if start is None:
                continue
            span = self._tracer.start_span(name, start_time=self._wall_ns(start),
                                           attributes=attributes)
            span.end(end_time=self._wall_ns(max(stop, start)))

    def _wall_ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._wall_offset_ns

    async def Abort(self, request: worker_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> worker_pb2.AbortResponse:
        aborted = self._engine.abort(request.request_id, list(request.indices))
        return worker_pb2.AbortResponse(num_aborted=aborted)

    async def GetLoad(self, request: worker_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.GetLoadResponse:
        return worker_pb2.GetLoadResponse(load=worker_load_pb(
            self._engine.load, self.info.worker_id, self.info.epoch, self._draining()))

    async def GetInfo(self, request: worker_pb2.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.GetInfoResponse:
        return worker_pb2.GetInfoResponse(info=worker_info_pb(self.info))
