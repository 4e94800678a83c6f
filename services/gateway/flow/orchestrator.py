"""One request across the mesh: Tokenize -> Route -> the worker and detokenize sessions.

    async with orchestrator.generate(job) as generation:
        async for update in generation.updates():
            ...  # SSE chunks, or aggregate

Token-id prompts skip Tokenize. Batched prompts and n > 1 travel as one worker request
with several prompts, each sampled n times. The request is routed on this gateway's
RouteSession stream to the scheduler, then joins its Session stream to the routed worker
and its DetokenizeSession stream to one tokenizer replica (all three shared by every
request of the gateway: decision 5). The block is entered once
the first output arrived, so that an error before it gets its own HTTP status.

A lost worker (its session broke) is excluded and the request routed again. Before the
request had any output token, that is a plain retry (`max_generate_attempts` workers in
all); after, a failover (`max_failovers` per request): the new worker gets the prompt and,
for each unfinished sequence, every output token received so far, and continues from
there, so the client's stream goes on as if nothing happened. Each failover is logged,
counted (meshserve:gateway_failovers_total by outcome) and an event on the request's span.
A lost tokenizer replica (the request's detokenize stream broke) is no failure either: the
request waits, at most `detokenize_failover_wait_s`, for a replica to take its text over
(`MeshClients.recover_detokenize_stream`) and goes on there (the Generation's doc says how).
On leaving the block: normally every sequence has finished; otherwise (error, deadline,
client gone) the worker is told to abort and the tokenizer to forget the request, at once.
The scheduler is told each attempt ended (a release on the route stream).

Disaggregated serving: a route that names a decode worker (RouteResponse.decode) places
the request on its prefill worker as `prefill_only`; that worker sends the first tokens
and hands the prompt's KV off, and the request then moves to the decode worker the way a
failover does (the first tokens resumed there), without counting as one. A decode worker
without room refuses it (RequestDone.refused) before running anything: the request is
routed again without that worker, to another decode worker or whole elsewhere.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, TypeVar

import orjson
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode, Tracer

from meshserve.proto.v1 import common_pb2, scheduler_pb2, tokenizer_pb2, worker_pb2
from meshserve.services.gateway import wire
from meshserve.services.gateway.config import GatewayConfig
from meshserve.services.gateway.flow.generation import Generation, Placement
from meshserve.services.gateway.flow.job import (
    ChatPrompt,
    GenerationJob,
    PreparedPrompt,
    PromptInput,
    resolve_max_tokens,
)
from meshserve.services.gateway.links.clients import LoraEntry, MeshClients
from meshserve.services.gateway.links.detokenize import DetokenizeStream, open_request
from meshserve.services.gateway.media.loader import LoadedImage, MediaLoader
from meshserve.services.gateway.metrics import GatewayMetrics
from meshserve.shared.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    MeshError,
    NotFoundError,
    UnavailableError,
)
from meshserve.shared.prompt_embeds import PromptEmbeds
from meshserve.shared.telemetry import inject_headers

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

# How long a model a worker list named stays known when a later list lacks it: a scheduler
# restarted or a Redis come back empty lists no worker for a few heartbeats.
_MODEL_MEMORY_S = 60.0


class Orchestrator:
    """Runs generation requests (and the /tokenize, /detokenize helpers) over the mesh."""

    def __init__(self, config: GatewayConfig, clients: MeshClients, metrics: GatewayMetrics,
                 tracer: Tracer) -> None:
        self._config = config
        self._clients = clients
        self._metrics = metrics
        self._tracer = tracer
        self._handles = itertools.count(1)  # session handles, unique in this gateway
        self._media = MediaLoader(config.media, metrics, tracer)

    async def close(self) -> None:
        """Release what requests used (the image fetcher's connections)."""
        await self._media.close()

    # -- models -----------------------------------------------------------------------------

    async def model_names(self) -> list[str]:
        """Names served: the configured ones, or those the registered workers announce."""
        if self._config.served_model_names:
            return list(self._config.served_model_names)
        return await self._clients.model_names()

    async def sampling_defaults(self, model: str) -> dict[str, Any]:
        """The model's defaults for request fields a body leaves out."""
        return await self._clients.sampling_defaults(model)

    async def lora_adapters(self, *, refresh: bool = False) -> dict[str, LoraEntry]:
        """The LoRA adapters served, by name (their requests name them as the model)."""
        return await self._clients.lora_adapters(refresh=refresh)

    async def base_model(self, model: str) -> str:
        """The model that serves `model`: the base of a LoRA adapter, else itself."""
        adapter = (await self.lora_adapters()).get(model)
        return model if adapter is None else adapter.base_model

    async def _bind_lora(self, job: GenerationJob) -> GenerationJob:
        """`job` with its adapter's base model and id when it names a LoRA adapter."""
        if job.lora_id is not None:
            return job
        try:
            adapter = (await self.lora_adapters()).get(job.model)
        except MeshError:  # the registry is out of reach: routing reports it for the request
            return job
        if adapter is None:
            return job
        return replace(job, base_model=adapter.base_model, lora_id=adapter.lora_id)

    async def resolve_model(self, requested: str | None) -> str:
        """The model a request names (the first served one when it names none), or a LoRA
        adapter's name."""
        names = await self.model_names()
        if requested is None:
            if not names:
                raise UnavailableError("no model is being served yet (no worker registered)")
            return names[0]
        if requested in names or requested in await self.lora_adapters():
            return requested
        if requested in await self.lora_adapters(refresh=True):  # loaded since last read
            return requested
        if not self._config.served_model_names and requested in await self._clients.model_names(
                refresh=True):  # a worker may have registered since the cache was filled
            return requested
        if self._clients.listed_within(requested, _MODEL_MEMORY_S):
            # Served moments ago: its workers are registering again, and routing holds the
            # request for them (or answers 503), where a 404 would say it never existed.
            return requested
        raise NotFoundError(f"The model `{requested}` does not exist.", param="model")

    # -- tokenization -----------------------------------------------------------------------

    def remaining_s(self, deadline: float) -> float:
        """Seconds left until `deadline` (event-loop clock); DeadlineExceededError if none."""
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise DeadlineExceededError("the request ran past its deadline "
                                        f"({self._config.request_timeout_s}s)")
        return left

    async def load_images(self, prompt: PromptInput) -> list[LoadedImage]:
        """The images of a chat prompt, fetched and checked ([] for any other prompt)."""
        if not isinstance(prompt, ChatPrompt):
            return []
        return await self._media.load(prompt.images)

    async def tokenize(self, model: str, prompt: str | ChatPrompt, *, add_special_tokens: bool,
                       deadline: float, truncate_prompt_tokens: int | None = None,
                       return_token_strs: bool = False, suffix: str | None = None,
                       images: Sequence[LoadedImage] = ()) -> tokenizer_pb2.TokenizeResponse:
        """Tokenize one text or chat prompt on a tokenizer replica (keeping only its last
        `truncate_prompt_tokens` tokens when set; -1: the model's context length). A chat
        prompt's `images` (load_images) are sent as their sizes; the answer places each."""
        request = tokenizer_pb2.TokenizeRequest(model=model,
                                                add_special_tokens=add_special_tokens,
                                                return_token_strs=return_token_strs)
        keep = await self._keep_tokens(model, truncate_prompt_tokens)
        if keep is not None:
            request.truncate_prompt_tokens = keep
        if isinstance(prompt, str):
            request.text = prompt
            if suffix is not None:
                request.suffix = suffix
        else:
            request.chat.CopyFrom(wire.chat_messages(prompt.messages))
            request.tools_json = orjson.dumps(prompt.tools).decode() if prompt.tools else ""
            request.add_generation_prompt = prompt.add_generation_prompt
            request.continue_final_message = prompt.continue_final_message
            if prompt.chat_template_kwargs:
                request.chat_template_kwargs_json = orjson.dumps(
                    prompt.chat_template_kwargs).decode()
            if prompt.chat_template:
                request.chat_template = prompt.chat_template
            assert len(images) == len(prompt.images), "a chat prompt's images are loaded first"
            request.images.extend(wire.image_sizes(images))
        timeout = self.remaining_s(deadline)
        response = await self._clients.call_tokenizer(
            lambda stub: stub.Tokenize(request, timeout=timeout))
        wire.check_image_ranges(response, len(images))
        return response

    async def detokenize(self, model: str, token_ids: Sequence[int], deadline: float) -> str:
        """Text of `token_ids` (special tokens kept), from a tokenizer replica."""
        ids = wire.check_token_ids(token_ids, "tokens")
        with self._tracer.start_as_current_span("detokenize", attributes={
                "gen_ai.request.model": model, "meshserve.num_tokens": len(ids)}):
            return await self._clients.detokenize_stream().detokenize(
                ids, model=model, request_id=f"detok-{uuid.uuid4().hex}",
                timeout_s=self.remaining_s(deadline))

    async def _keep_tokens(self, model: str, truncate: int | None) -> int | None:
        """Prompt tokens to keep for a `truncate_prompt_tokens` value (None: all)."""
        if truncate != -1:
            return truncate
        return await self._clients.max_model_len(model)  # -1: the context length

    async def _prepare_one(self, job: GenerationJob, prompt: PromptInput,
                           images: list[LoadedImage]) -> PreparedPrompt:
        truncate = job.options.truncate_prompt_tokens
        if isinstance(prompt, PromptEmbeds):  # rows in place of tokens: one placeholder each
            keep = await self._keep_tokens(job.target_model, truncate)
            embeds = prompt if keep is None else prompt.last_rows(keep)
            return PreparedPrompt([0] * embeds.rows, None,
                                  await self._clients.max_model_len(job.target_model),
                                  embeds=embeds)
        if isinstance(prompt, tuple):  # token ids go straight through
            ids = wire.check_token_ids(prompt, "prompt")
            keep = await self._keep_tokens(job.target_model, truncate)
            if keep is not None:
                ids = ids[-keep:]
            text = (await self.detokenize(job.target_model, ids, job.deadline) if job.echo
                    else None)
            return PreparedPrompt(ids, text, await self._clients.max_model_len(job.target_model))
        response = await self.tokenize(job.target_model, prompt, deadline=job.deadline,
                                       add_special_tokens=job.add_special_tokens,
                                       truncate_prompt_tokens=truncate, suffix=job.suffix,
                                       images=images)
        if not response.token_ids:
            raise InvalidRequestError("The decoder prompt cannot be empty",  # vLLM's text
                                      param=job.prompt_param)
        text = prompt if isinstance(prompt, str) else response.prompt_text
        if truncate is not None and job.echo:  # echo what was kept, not what was sent
            text = await self.detokenize(job.target_model, list(response.token_ids),
                                        job.deadline)
        return PreparedPrompt(list(response.token_ids), text, response.max_model_len or None,
                              wire.prompt_images(images, response))

    async def _prepare(self, job: GenerationJob) -> list[PreparedPrompt]:
        # Images first, under their own span: fetching is not tokenizing.
        images = [await self.load_images(p) for p in job.prompts]
        with self._tracer.start_as_current_span("tokenize", attributes={
                "gen_ai.request.model": job.model,
                "meshserve.num_prompts": len(job.prompts)}) as span:
            prompts = await _gather_all([self._prepare_one(job, p, i)
                                         for p, i in zip(job.prompts, images, strict=True)])
            span.set_attribute("gen_ai.usage.input_tokens",
                               sum(len(p.token_ids) for p in prompts))
        return prompts

    # -- generation -------------------------------------------------------------------------

    @asynccontextmanager
    async def generate(self, job: GenerationJob) -> AsyncIterator[Generation]:
        """Run `job`; the block reads the Generation (see the module doc)."""
        job = await self._bind_lora(job)
        prompts = await self._prepare(job)
        max_tokens = resolve_max_tokens(job, prompts)
        span = self._tracer.start_span("generate", attributes={
            "gen_ai.request.model": job.model, "meshserve.request_id": job.request_id})
        request = self._generate_request(job, prompts, max_tokens)
        generation = Generation(job, prompts, detok=self._clients.detokenize_stream(),
                                metrics=self._metrics, span=span,
                                failover=lambda g, lost: self._place(g, request, lost, span),
                                detok_failover=lambda g, lost: self._move_detokenization(
                                    g, lost, span))
        try:
            await self._place(generation, request, None, span)
            with trace.use_span(span, end_on_exit=False):
                await generation.wait_started()
            yield generation
        except BaseException as exc:
            generation.cancel()
            _record_failure(span, exc)
            raise
        else:
            generation.finish()
        finally:
            if generation.placement is not None:
                self._release(job, generation.route)
            span.end()

    def _generate_request(self, job: GenerationJob, prompts: Sequence[PreparedPrompt],
                          max_tokens: int | None) -> worker_pb2.GenerateRequest:
        return wire.guarded(lambda: worker_pb2.GenerateRequest(
            request_id=job.request_id,
            prompts=[wire.prompt(p) for p in prompts],
            params=wire.sampling_params(job.params, max_tokens),
            priority=job.options.priority, cache_salt=job.options.cache_salt or "",
            lora_id=job.lora_id), "priority")

    async def _place(self, generation: Generation, request: worker_pb2.GenerateRequest,
                     lost: UnavailableError | None, span: Span) -> None:
        """Route the request (excluding workers lost by earlier attempts) and start it there;
        after a loss, the unfinished sequences continue from their output tokens."""
        job = generation.job
        resumed: list[worker_pb2.ResumedSequence] = []
        handed_off = False
        if generation.placement is None:
            route = await self._route(job, generation.prompts, request.params, [])
        else:
            if lost is not None:
                route = await self._move(generation, request, lost, span)
            elif generation.refused:
                route, handed_off = await self._after_refusal(generation, request, span)
            else:
                route, handed_off = self._handed_over(generation, span), True
            if generation.num_received:  # else it simply starts again
                resumed = [worker_pb2.ResumedSequence(index=i, token_ids=ids)
                           for i, ids in generation.unfinished()]
        with trace.use_span(span, end_on_exit=False):  # the worker's spans go under generate
            carrier = inject_headers({})
        request.deadline_unix_ns = self._deadline_unix_ns(job)
        # What the router saw in the kvstore: with none, the worker skips asking it.
        request.kvstore_blocks = route.num_kvstore_blocks
        request.prefill_only = route.HasField("decode")
        request.kv_target = route.decode.kv_address if request.prefill_only else ""
        request.handed_off = handed_off
        request.kv_source = generation.kv_source if handed_off else ""
        if handed_off:  # the prompt's blocks are in the kvstore now: the worker asks for them
            request.ClearField("kvstore_blocks")
        add = worker_pb2.SessionAdd(handle=next(self._handles), request=request,
                                    traceparent=carrier.get("traceparent", ""),
                                    tracestate=carrier.get("tracestate", ""),
                                    resumed=resumed)
        placement = Placement(route, self._clients.worker_link(route.address), add.handle)
        prompts = [p.context_ids for p in generation.prompts]
        generation.place(placement, lambda handle: open_request(
            handle, job.params, model=job.target_model, request_id=job.request_id, prompts=prompts,
            samples_per_prompt=job.params.n, traceparent=carrier.get("traceparent", "")), add)

    def _handed_over(self, generation: Generation, span: Span) -> scheduler_pb2.RouteResponse:
        """The decode worker's route of a request that its prefill worker handed off."""
        prefill = generation.route
        assert prefill.HasField("decode"), "only a route with a decode worker hands off"
        self._clients.route_stream().release(generation.job.request_id, prefill.worker_id)
        span.add_event("kv handoff", {"meshserve.from_worker_id": prefill.worker_id,
                                      "meshserve.to_worker_id": prefill.decode.worker_id,
                                      "meshserve.tokens_carried": generation.num_received})
        return _decode_route(prefill)

    async def _after_refusal(self, generation: Generation, request: worker_pb2.GenerateRequest,
                             span: Span) -> tuple[scheduler_pb2.RouteResponse, bool]:
        """Where a request goes that its decode worker refused (no room for its prompt's
        KV; nothing ran there), and whether it is still a handoff: another decode worker
        the router picks, the blocks pulled from the same source; with none, the whole
        request where the router places it. Not a failover: nothing was lost."""
        generation.refused = False
        refused = generation.route
        generation.excluded.append(refused.worker_id)
        self._release(generation.job, refused)
        span.add_event("kv handoff refused", {"meshserve.worker_id": refused.worker_id})
        route = await self._route(generation.job, generation.prompts, request.params,
                                  generation.excluded)
        if not route.HasField("decode"):
            return route, False
        self._clients.route_stream().release(generation.job.request_id, route.worker_id)
        return _decode_route(route), True

    async def _move(self, generation: Generation, request: worker_pb2.GenerateRequest,
                    lost: UnavailableError, span: Span) -> scheduler_pb2.RouteResponse:
        """The route of a request whose worker was lost, excluding it (and every worker lost
        before), or the error the request ends with."""
        job = generation.job
        worker = generation.route.worker_id
        generation.excluded.append(worker)
        self._release(job, generation.route)
        carried = generation.num_received
        if not carried:  # nothing generated yet: simply try another worker
            if generation.attempts >= self._config.max_generate_attempts:
                raise lost
            span.add_event("worker lost before any output, retrying", {
                "meshserve.worker_id": worker, "exception.message": lost.message})
            return await self._route(job, generation.prompts, request.params,
                                     generation.excluded)
        failovers = self._metrics.failovers
        if generation.failovers >= self._config.max_failovers:
            failovers.labels("exhausted").inc()
            raise UnavailableError(
                f"worker {worker} failed while generating this response ({lost.message}); "
                f"the request was not moved to another worker (moved {generation.failovers} "
                f"time(s) already, max_failovers {self._config.max_failovers})")
        try:
            route = await self._route(job, generation.prompts, request.params,
                                      generation.excluded)
        except DeadlineExceededError:
            raise
        except MeshError as exc:
            failovers.labels("unplaced").inc()
            raise UnavailableError(
                f"worker {worker} failed while generating this response ({lost.message}) and "
                f"no other worker could take it over: {exc.message}") from exc
        generation.failovers += 1
        failovers.labels("resumed").inc()
        _log.warning("request %s failed over from worker %s to %s carrying %d output tokens "
                     "(%s)", job.request_id, worker, route.worker_id, carried, lost.message)
        span.add_event("failover", {
            "meshserve.from_worker_id": worker, "meshserve.to_worker_id": route.worker_id,
            "meshserve.tokens_carried": carried, "exception.message": lost.message})
        return route

    async def _move_detokenization(self, generation: Generation, lost: MeshError,
                                   span: Span) -> DetokenizeStream:
        """A detokenize stream to carry on a request whose stream broke, found within the
        configured wait and the request's deadline, or the error the request ends with."""
        job = generation.job
        # The search is shared by every request that lost its stream, so it runs for the
        # configured wait; this request waits no longer than its deadline allows.
        configured = self._config.detokenize_failover_wait_s
        wait_s = min(configured, self.remaining_s(job.deadline))
        try:
            async with asyncio.timeout(wait_s):
                stream = await self._clients.recover_detokenize_stream(configured)
        except (TimeoutError, MeshError) as exc:
            self._metrics.detokenize_failovers.labels("unplaced").inc()
            reason = exc.message if isinstance(exc, MeshError) else f"none within {wait_s:g}s"
            raise UnavailableError(
                f"the tokenizer detokenizing this response was lost ({lost.message}) and no "
                f"replica took it over: {reason}") from exc
        self._metrics.detokenize_failovers.labels("moved").inc()
        _log.warning("request %s moved its detokenization to tokenizer %s (%s)",
                     job.request_id, stream.address, lost.message)
        span.add_event("detokenizer failover", {"meshserve.tokenizer_address": stream.address,
                                                "exception.message": lost.message})
        return stream

    async def _route(self, job: GenerationJob, prompts: list[PreparedPrompt],
                     params: common_pb2.SamplingParams, excluded: list[str]
                     ) -> scheduler_pb2.RouteResponse:
        first = prompts[0]
        max_tokens = params.max_tokens if params.HasField("max_tokens") else None
        expected = max_tokens or self._config.route_output_estimate
        if first.max_model_len is not None:
            expected = min(expected, first.max_model_len - len(first.token_ids))
        request = wire.guarded(lambda: scheduler_pb2.RouteRequest(
            request_id=job.request_id, model=job.target_model, prompt_token_ids=first.token_ids,
            lora_id=job.lora_id,
            num_prompt_tokens=len(first.token_ids), cache_salt=job.options.cache_salt or "",
            priority=job.options.priority, deadline_unix_ns=self._deadline_unix_ns(job),
            expected_output_tokens=expected, num_sequences=job.num_choices,
            exclude_worker_ids=excluded, images=wire.route_images(first),
            # Refused by the estimate only as it first arrives: a request moving to another
            # worker after a failure was admitted already.
            max_queue_delay_s=0.0 if excluded else self._config.max_queue_delay_s),
            "priority")
        with self._tracer.start_as_current_span("route", attributes={
                "gen_ai.request.model": job.model,
                "meshserve.num_excluded": len(excluded)}) as span:
            carrier = inject_headers({})
            response = await self._clients.route(
                request, traceparent=carrier.get("traceparent", ""),
                timeout_s=self.remaining_s(job.deadline),
                wait_s=self._config.scheduler_failover_wait_s)
            span.set_attributes({
                "meshserve.worker_id": response.worker_id,
                "meshserve.matched_blocks": response.num_matched_blocks,
                "meshserve.kvstore_blocks": response.num_kvstore_blocks,
                "meshserve.prompt_blocks": response.num_prompt_blocks,
                "meshserve.queued_ns": response.queued_ns,
                "meshserve.routing.policy": response.policy,
                "meshserve.routing.score": response.score,
                "meshserve.worker.num_running": response.num_running,
                "meshserve.worker.num_waiting": response.num_waiting,
                "meshserve.worker.num_used_blocks": response.num_used_blocks})
        return response

    def _deadline_unix_ns(self, job: GenerationJob) -> int:
        return time.time_ns() + int(self.remaining_s(job.deadline) * 1e9)

    # -- best-effort cleanup ----------------------------------------------------------------

    def _release(self, job: GenerationJob, route: scheduler_pb2.RouteResponse) -> None:
        """Tell the scheduler an attempt ended (best effort, batched on the route stream);
        a decode worker chosen for a handoff that never came is released too."""
        self._clients.route_stream().release(job.request_id, route.worker_id)
        if route.HasField("decode"):
            self._clients.route_stream().release(job.request_id, route.decode.worker_id)


def _decode_route(route: scheduler_pb2.RouteResponse) -> scheduler_pb2.RouteResponse:
    """The route of a disaggregated `route`'s decode worker (the request moves there)."""
    target = route.decode
    return scheduler_pb2.RouteResponse(
        worker_id=target.worker_id, address=target.address, epoch=target.epoch,
        block_size=route.block_size, policy=route.policy,
        num_prompt_blocks=route.num_prompt_blocks)


async def _gather_all(coros: Sequence[Awaitable[_T]]) -> list[_T]:
    """Await all; on the first failure cancel the rest and raise it."""
    if len(coros) == 1:
        return [await coros[0]]
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


def _record_failure(span: Span, exc: BaseException) -> None:
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        span.set_attribute("meshserve.cancelled", True)
        return
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
