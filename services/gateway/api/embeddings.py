"""POST /v1/embeddings: tokenize -> route to a pooling worker -> Embed -> OpenAI's body.

String inputs are tokenized on a tokenizer replica (one Tokenize each, concurrently, with
`truncate_prompt_tokens` applied there); token-id inputs go through as they are (cut to
their last N tokens when asked). An input longer than the model's context is a 400 here,
before any worker is asked. The request is routed as one unit (all its inputs) to a
pooling worker (`Runner` POOLING: a model served only by generating workers is a 400, as
in vLLM), which batches its inputs with other requests' into shared forwards. A worker
lost before it answered is excluded and the request routed again, up to
`max_generate_attempts` workers in all: an embedding has no partial output to carry.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from typing import TypedDict

from aiohttp import web
from opentelemetry.trace import Tracer

from meshserve.proto.v1 import common_pb2, scheduler_pb2, worker_pb2
from meshserve.services.gateway import wire
from meshserve.services.gateway.api.handlers import json_response, read_json
from meshserve.services.gateway.config import GatewayConfig
from meshserve.services.gateway.flow.admission import Admission
from meshserve.services.gateway.flow.drain import Drain
from meshserve.services.gateway.flow.orchestrator import Orchestrator
from meshserve.services.gateway.links.clients import MeshClients
from meshserve.shared.errors import (
    ContextLengthError,
    DeadlineExceededError,
    InvalidRequestError,
    UnavailableError,
)
from meshserve.shared.grpc_client import mesh_errors
from meshserve.shared.openai_embeddings import (
    EmbeddingInput,
    EmbeddingRequest,
    embedding_response,
    parse_embedding_request,
)
from meshserve.shared.telemetry import inject_headers


class _PoolerOptions(TypedDict, total=False):
    """EmbedRequest's pooler fields the client set (as keyword arguments)."""

    dimensions: int
    normalize: bool


class EmbeddingHandlers:
    """The /v1/embeddings endpoint over the mesh."""

    def __init__(self, config: GatewayConfig, orchestrator: Orchestrator, clients: MeshClients,
                 admission: Admission, drain: Drain, tracer: Tracer) -> None:
        self._config = config
        self._orch = orchestrator
        self._clients = clients
        self._admission = admission
        self._drain = drain
        self._tracer = tracer

    async def embeddings(self, request: web.Request) -> web.Response:
        """POST /v1/embeddings."""
        parsed = parse_embedding_request(await read_json(request))
        deadline = asyncio.get_running_loop().time() + self._config.request_timeout_s
        model = await self._orch.resolve_model(parsed.model)
        await self._refuse_classifier(model)
        self._drain.refuse_if_draining()
        with self._admission.slot(), self._drain.track():
            try:
                async with asyncio.timeout_at(deadline):
                    body = await self._embed(parsed, model, deadline)
            except TimeoutError as exc:
                raise DeadlineExceededError(
                    f"the request did not finish within {self._config.request_timeout_s}s "
                    "(request_timeout_s)") from exc
        return json_response(body)

    async def _refuse_classifier(self, model: str) -> None:
        """A sequence classifier's workers pool class logits, not embeddings: a 400 in
        vLLM's words."""
        workers = await self._clients.list_workers()
        if any(w.class_labels for w in workers if w.serves(model)):
            raise InvalidRequestError("The model does not support Embeddings API",
                                      param="model")

    async def _embed(self, parsed: EmbeddingRequest, model: str, deadline: float) -> dict:
        _, response = await self.pool(parsed, model, deadline)
        return embedding_response(model, response.embeddings, response.dimensions,
                                  response.num_prompt_tokens, parsed.encoding_format)

    async def pool(self, parsed: EmbeddingRequest, model: str, deadline: float, *,
                   operation: str = "embedding generation",
                   ) -> tuple[list[list[int]], worker_pb2.EmbedResponse]:
        """Tokenize `parsed.inputs` and embed them on a pooling worker: each input's token
        ids and the worker's answer. `operation` names the request in a too-long error
        (vLLM's words: "score", "embedding generation")."""
        request_id = f"embd-{uuid.uuid4().hex}"
        with self._tracer.start_as_current_span("embed", attributes={
                "gen_ai.operation.name": "embeddings", "gen_ai.request.model": model,
                "gen_ai.request.id": request_id,
                "meshserve.embed.num_inputs": len(parsed.inputs)}) as span:
            inputs = await self.token_ids(parsed, model, deadline, operation)
            response = await self._run(request_id, model, inputs, parsed, deadline)
            span.set_attributes({"gen_ai.usage.input_tokens": response.num_prompt_tokens,
                                 "meshserve.embed.dimensions": response.dimensions,
                                 "meshserve.embed.queued_ns": response.queued_ns,
                                 "meshserve.embed.forward_ns": response.forward_ns})
        return inputs, response

    # -- tokens -----------------------------------------------------------------------------

    async def token_ids(self, parsed: EmbeddingRequest, model: str, deadline: float,
                        operation: str = "embedding generation") -> list[list[int]]:
        """Each input's token ids (strings tokenized on replicas, concurrently); a
        ContextLengthError for one longer than the model's context."""
        with self._tracer.start_as_current_span("tokenize", attributes={
                "gen_ai.request.model": model,
                "meshserve.num_prompts": len(parsed.inputs)}) as span:
            tasks = [asyncio.ensure_future(self._one(parsed, model, item, deadline))
                     for item in parsed.inputs]
            try:
                results = await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:
                    task.cancel()
                raise
            span.set_attribute("gen_ai.usage.input_tokens", sum(len(ids) for ids, _ in results))
        # The tokenizer's limit and the workers' (--max-model-len), whichever is smaller.
        known = [limit for _, limit in results if limit]
        announced = await self._clients.max_model_len(model)
        limit = min(known + [announced] if announced else known, default=None)
        for ids, _ in results:
            _check_length(ids, limit, operation)
        return [ids for ids, _ in results]

    async def _one(self, parsed: EmbeddingRequest, model: str, item: EmbeddingInput,
                   deadline: float) -> tuple[list[int], int | None]:
        """One input's token ids, with the context length its tokenizer reported."""
        truncate = parsed.truncate_prompt_tokens
        if isinstance(item, tuple):
            ids = wire.check_token_ids(item, "input")
            keep = await self._clients.max_model_len(model) if truncate == -1 else truncate
            return (ids[-keep:] if keep else ids), None
        response = await self._orch.tokenize(model, item, deadline=deadline,
                                             add_special_tokens=parsed.add_special_tokens,
                                             truncate_prompt_tokens=truncate)
        return list(response.token_ids), response.max_model_len or None

    # -- the worker -------------------------------------------------------------------------

    async def _run(self, request_id: str, model: str, inputs: list[list[int]],
                   parsed: EmbeddingRequest, deadline: float) -> worker_pb2.EmbedResponse:
        """Embed on a routed pooling worker, routing again past workers that were lost."""
        excluded: list[str] = []
        while True:
            route = await self._route(request_id, model, inputs, parsed, excluded, deadline)
            try:
                return await self._call(route, request_id, inputs, parsed, deadline)
            except UnavailableError:
                excluded.append(route.worker_id)
                if len(excluded) >= self._config.max_generate_attempts:
                    raise
            finally:
                self._clients.route_stream().release(request_id, route.worker_id)

    async def _route(self, request_id: str, model: str, inputs: Sequence[Sequence[int]],
                     parsed: EmbeddingRequest, excluded: list[str],
                     deadline: float) -> scheduler_pb2.RouteResponse:
        request = wire.guarded(lambda: scheduler_pb2.RouteRequest(
            request_id=request_id, model=model, num_prompt_tokens=sum(map(len, inputs)),
            num_sequences=len(inputs), expected_output_tokens=0, priority=parsed.priority,
            deadline_unix_ns=self._deadline_unix_ns(deadline),
            exclude_worker_ids=excluded, runner=common_pb2.RUNNER_POOLING,
            # Refused by the wait estimate only as it first arrives, as generation is.
            max_queue_delay_s=0.0 if excluded else self._config.max_queue_delay_s), "priority")
        with self._tracer.start_as_current_span("route", attributes={
                "gen_ai.request.model": model, "meshserve.num_excluded": len(excluded)}) as span:
            carrier = inject_headers({})
            response = await self._clients.route(
                request, traceparent=carrier.get("traceparent", ""),
                timeout_s=self._orch.remaining_s(deadline),
                wait_s=self._config.scheduler_failover_wait_s)
            span.set_attributes({"meshserve.worker_id": response.worker_id,
                                 "meshserve.queued_ns": response.queued_ns})
        return response

    async def _call(self, route: scheduler_pb2.RouteResponse, request_id: str,
                    inputs: list[list[int]], parsed: EmbeddingRequest,
                    deadline: float) -> worker_pb2.EmbedResponse:
        options: _PoolerOptions = {}  # unset fields: the worker's pooler config
        if parsed.dimensions is not None:
            options["dimensions"] = parsed.dimensions
        if parsed.normalize is not None:
            options["normalize"] = parsed.normalize
        request = wire.guarded(lambda: worker_pb2.EmbedRequest(
            request_id=request_id, inputs=[worker_pb2.Prompt(token_ids=ids) for ids in inputs],
            deadline_unix_ns=self._deadline_unix_ns(deadline), **options), "dimensions")
        stub = self._clients.worker(route.address)
        with mesh_errors():
            response: worker_pb2.EmbedResponse = await stub.Embed(
                request, timeout=self._orch.remaining_s(deadline))
        return response

    def _deadline_unix_ns(self, deadline: float) -> int:
        return time.time_ns() + int(self._orch.remaining_s(deadline) * 1e9)


def _check_length(ids: list[int], limit: int | None, operation: str) -> None:
    """ContextLengthError (400, vLLM's message) for an input longer than the context."""
    if limit is not None and len(ids) > limit:
        raise ContextLengthError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(ids)} tokens in the input for {operation}. Please reduce the length of "
            "the input.", param="input")
