"""The gRPC Worker service of a pooling worker: Embed over the embedding thread.

Thin: validate, convert protobuf to domain values, submit to the `EmbedBatcher`, convert
back. The generation call (Session) fails with INVALID_ARGUMENT naming the model
as an embedding model; GetLoad and GetInfo answer as on a generating worker. The call's
`worker.embed` span (queue and forward times) joins the caller's trace through the
server's trace-context interceptor.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter

from meshserve.proto.v1 import worker_pb2, worker_pb2_grpc
from meshserve.services.worker.pooling.batcher import EmbedBatcher, EmbedResult
from meshserve.services.worker.serving.service import _deadline, worker_info_pb, worker_load_pb
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.worker_registry import WorkerInfo


class PoolingServicer(worker_pb2_grpc.WorkerServicer):
    """meshserve.v1.Worker of a pooling worker (`--runner pooling`)."""

    def __init__(self, batcher: EmbedBatcher, info: WorkerInfo, *,
                 registry: CollectorRegistry | None = None,
                 draining: Callable[[], bool] = lambda: False) -> None:
        self._batcher = batcher
        self._embedder = batcher.embedder
        self.info = info
        self._draining = draining
        self._inputs = Counter("meshserve:worker_embedded_inputs", "Inputs embedded",
                               registry=registry)
        self._tokens = Counter("meshserve:worker_embedded_tokens",
                               "Prompt tokens of the inputs embedded", registry=registry)

    async def Embed(self, request: worker_pb2.EmbedRequest,
                    context: grpc.aio.ServicerContext) -> worker_pb2.EmbedResponse:
        if not request.inputs:
            raise InvalidRequestError("at least one input is needed", param="input")
        inputs = [list(p.token_ids) for p in request.inputs]
        for i, ids in enumerate(inputs):
            self._embedder.check_input(ids, i)
        pooler = self._embedder.pooler
        dimensions = pooler.resolve_dimensions(
            request.dimensions if request.HasField("dimensions") else None,
            self.info.model_names[0] if self.info.model_names else "")
        normalize = request.normalize if request.HasField("normalize") else pooler.normalize
        future = self._batcher.submit(inputs, dimensions=dimensions, normalize=normalize)
        try:
            async with _deadline(request.deadline_unix_ns):
                result = await future
        finally:
            future.cancel()  # caller gone or deadline: its inputs not yet run are skipped
        self._record(request, result)
        return worker_pb2.EmbedResponse(
            dimensions=result.dimensions, embeddings=result.vectors,
            num_prompt_tokens=result.num_tokens, queued_ns=result.queued_ns,
            forward_ns=result.forward_ns)

    def _record(self, request: worker_pb2.EmbedRequest, result: EmbedResult) -> None:
        self._inputs.inc(len(request.inputs))
        self._tokens.inc(result.num_tokens)
        trace.get_current_span().set_attributes({
            "gen_ai.request.id": request.request_id,
            "gen_ai.usage.input_tokens": result.num_tokens,
            "meshserve.worker.id": self.info.worker_id,
            "meshserve.embed.num_inputs": len(request.inputs),
            "meshserve.embed.queued_ns": result.queued_ns,
            "meshserve.embed.forward_ns": result.forward_ns})

    def _not_generating(self) -> InvalidRequestError:
        return InvalidRequestError(
            f"worker {self.info.worker_id} runs an embedding model (--runner pooling): it "
            "serves /v1/embeddings, not text generation", param="model")

    async def Session(self, request_iterator: AsyncIterator[worker_pb2.SessionRequest],
                      context: grpc.aio.ServicerContext) -> None:
        raise self._not_generating()

    async def Abort(self, request: worker_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> worker_pb2.AbortResponse:
        return worker_pb2.AbortResponse(num_aborted=0)  # nothing here runs by request id

    async def GetLoad(self, request: worker_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.GetLoadResponse:
        return worker_pb2.GetLoadResponse(load=worker_load_pb(
            self._batcher.load, self.info.worker_id, self.info.epoch, self._draining()))

    async def GetInfo(self, request: worker_pb2.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.GetInfoResponse:
        return worker_pb2.GetInfoResponse(info=worker_info_pb(self.info))
