"""The gRPC Worker service: a thin edge over the engine thread.

Session (the gateway's data plane) hands one bidirectional stream to a `WorkerSession`
(session.py): commands in, one columnar message per engine step out, for every request
the gateway runs here. A request whose caller went away is aborted at once, and each
request's worker-side phases become spans (queue, prefill, decode) from the engine's own
timestamps, under the trace context the request carries.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.util.types import AttributeValue
from prometheus_client import CollectorRegistry, Counter

from meshserve.proto.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from meshserve.services.worker.lora.control import LoraControl
from meshserve.services.worker.serving.engine_thread import EngineThread
from meshserve.services.worker.serving.request_stream import RequestTimes
from meshserve.services.worker.serving.session import SessionEntry, WorkerSession
from meshserve.services.worker.serving.wire import sampling_params_from_proto
from meshserve.services.worker.tier.handoff import KvHandoff, RoomReservations
from meshserve.shared.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    NotFoundError,
)
from meshserve.shared.sampling_params import SamplingParams
from meshserve.shared.worker_registry import (
    ROLE_DECODE,
    ROLE_MIXED,
    ROLE_PREFILL,
    RUNNER_POOLING,
    WorkerInfo,
    WorkerLoad,
)


def worker_load_pb(load: WorkerLoad, worker_id: str, epoch: int,
                   draining: bool) -> common_pb2.WorkerLoad:
    """The proto WorkerLoad of an engine load snapshot."""
    return common_pb2.WorkerLoad(
        worker_id=worker_id, epoch=epoch, num_running=load.num_running,
        num_waiting=load.num_waiting, num_pending_prefill_tokens=load.num_pending_prefill_tokens,
        num_used_blocks=load.num_used_blocks, num_free_blocks=load.num_free_blocks,
        num_total_blocks=load.num_total_blocks, max_running=load.max_running,
        draining=draining, snapshot_unix_ns=load.snapshot_unix_ns,
        num_active_tokens=load.num_active_tokens)


def worker_info_pb(info: WorkerInfo) -> common_pb2.WorkerInfo:
    """The proto WorkerInfo of the registry's WorkerInfo."""
    return common_pb2.WorkerInfo(
        worker_id=info.worker_id, epoch=info.epoch, address=info.address,
        model_names=list(info.model_names), block_size=info.block_size,
        max_model_len=info.max_model_len, num_total_blocks=info.num_total_blocks,
        lora_ids=list(info.lora_ids), tensor_parallel_size=info.tensor_parallel_size,
        loras=[common_pb2.LoraAdapter(name=name, id=lora_id, base_model_name=info.model_names[0])
               for name, lora_id in zip(info.lora_names, info.lora_ids, strict=True)],
        kv_namespace=info.namespace, sampling_defaults_json=info.sampling_defaults_json,
        runner=(common_pb2.RUNNER_POOLING if info.runner == RUNNER_POOLING
                else common_pb2.RUNNER_GENERATE),
        embedding_size=info.embedding_size, class_labels=list(info.class_labels),
        metrics_url=info.metrics_url, role=_ROLE_ENUMS[info.role],
        kv_handoff_address=info.kv_handoff_address)


_ROLE_ENUMS = {ROLE_MIXED: common_pb2.WORKER_ROLE_MIXED,
               ROLE_PREFILL: common_pb2.WORKER_ROLE_PREFILL,
               ROLE_DECODE: common_pb2.WORKER_ROLE_DECODE}


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


_REASON_NAMES = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
                 common_pb2.FINISH_REASON_ABORT: "abort"}


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
        self._tokens = Counter("meshserve:worker_generated_tokens", "Tokens generated",
                               registry=registry)
        self._finished = Counter("meshserve:worker_sequences_finished",
                                 "Sequences finished, by reason", ["finish_reason"],
                                 registry=registry)
        self._sessions: set[WorkerSession] = set()
        # Each accepted request's sampling parameters (the vLLM request-parameter metrics).
        self.on_params: Callable[[SamplingParams], None] = lambda params: None
        self.lora: LoraControl | None = None  # runtime LoRA loading (set by the worker)
        # Moves prefilled prompts' KV (disaggregated serving; set by a worker with a kvstore).
        self.handoff: KvHandoff | None = None
        # Decode side: blocks promised to handed-off requests, over all sessions.
        self.reservations = RoomReservations()

    def wake_sessions(self) -> None:
        """Let every session re-check its state (the worker started draining)."""
        for session in self._sessions:
            session.wake()

    async def Session(self, request_iterator: AsyncIterator[worker_pb2.SessionRequest],
                      context: grpc.aio.ServicerContext) -> None:
        session = WorkerSession(self._engine, worker_id=self.info.worker_id,
                                validate=self._validate, on_finished=self._session_finished,
                                draining=self._draining, handoff=self.handoff,
                                reservations=self.reservations)
        self._sessions.add(session)
        reader = asyncio.ensure_future(session.read(request_iterator))
        try:
            async for response in session.responses():
                self._count_session(response)
                await context.write(response)
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                raise reader.exception()  # type: ignore[misc]
        finally:
            reader.cancel()
            session.close()
            self._sessions.discard(session)

    def _count_session(self, response: worker_pb2.SessionResponse) -> None:
        self._tokens.inc(len(response.token_ids))
        for reason in response.finish_reasons:
            if reason:
                self._finished.labels(_REASON_NAMES[reason]).inc()

    def _session_finished(self, entry: SessionEntry, error_kind: str | None) -> None:
        """A session request ended: its worker-side spans, under the gateway's trace."""
        self._record_spans(entry.request, entry.params, entry.stream.times,
                           context=WorkerSession.trace_parent(entry), error_kind=error_kind)

    def _validate(self, request: worker_pb2.GenerateRequest) -> SamplingParams:
        if not request.request_id:
            raise InvalidRequestError("request_id must not be empty", param="request_id")
        if not request.prompts:
            raise InvalidRequestError("a request needs at least one prompt", param="prompts")
        if request.HasField("lora_id") and request.lora_id not in self.info.lora_ids:
            raise NotFoundError(f"LoRA adapter {request.lora_id} is not loaded on worker "
                                f"{self.info.worker_id}", param="lora_id")
        params = sampling_params_from_proto(request.params)
        self.on_params(params)
        return params

    def _record_spans(self, request: worker_pb2.GenerateRequest, params: SamplingParams,
                      times: RequestTimes, *, context: Context | None = None,
                      error_kind: str | None = None) -> None:
        """worker.queue / worker.prefill / worker.decode spans under `context` (default:
        the current span)."""
        end = times.finished if times.finished is not None else time.monotonic()
        attributes: dict[str, AttributeValue] = {
            "gen_ai.request.id": request.request_id, "gen_ai.request.n": params.n,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.max_tokens": params.max_tokens or 0,
            "meshserve.worker.id": self.info.worker_id,
            "meshserve.worker.num_steps": times.num_steps,
            "meshserve.worker.num_preemptions": times.num_preemptions,
            "meshserve.worker.images": sum(len(p.images) for p in request.prompts),
        }
        if error_kind is not None:
            attributes["meshserve.error_kind"] = error_kind
        phases = [("worker.queue", times.arrival, times.first_scheduled or end),
                  ("worker.prefill", times.first_scheduled, times.first_token or end),
                  ("worker.decode", times.first_token, end)]
        for name, start, stop in phases:
            if start is None:
                continue
            span = self._tracer.start_span(name, context=context,
                                           start_time=self._wall_ns(start),
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

    async def LoadLoraAdapter(self, request: worker_pb2.LoadLoraAdapterRequest,
                              context: grpc.aio.ServicerContext
                              ) -> worker_pb2.LoadLoraAdapterResponse:
        lora_id = await self._lora().load(request.lora_name, request.lora_path)
        return worker_pb2.LoadLoraAdapterResponse(lora_id=lora_id)

    async def UnloadLoraAdapter(self, request: worker_pb2.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext
                                ) -> worker_pb2.UnloadLoraAdapterResponse:
        lora_id = await self._lora().unload(request.lora_name)
        return worker_pb2.UnloadLoraAdapterResponse(lora_id=lora_id)

    def _lora(self) -> LoraControl:
        if self.lora is None:
            raise InvalidRequestError("LoRA adapters are not enabled on this worker (start it "
                                      "with --enable-lora)", param="lora_name")
        return self.lora

    async def Embed(self, request: worker_pb2.EmbedRequest,
                    context: grpc.aio.ServicerContext) -> worker_pb2.EmbedResponse:
        raise InvalidRequestError(
            f"worker {self.info.worker_id} runs a generation model: it does not embed (start "
            "a worker with --runner pooling for /v1/embeddings)", param="model")
