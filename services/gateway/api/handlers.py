"""The generation endpoints: POST /v1/completions and POST /v1/chat/completions (and the
chat jobs that /v1/responses runs: responses/endpoint.py).

A request is parsed (shared/openai_protocol.py), its model resolved, admitted (or 429),
run by the orchestrator under the per-request deadline, and answered as SSE chunks or
one JSON object. Errors before the first output token get their own HTTP status (the
stream's headers go out only with the first chunk); errors after it end the stream
with an error event and `data: [DONE]`, as vLLM does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import orjson
from aiohttp import web
from opentelemetry import trace

from meshserve.services.gateway.api.render import Renderer, renderer_for
from meshserve.services.gateway.config import GatewayConfig
from meshserve.services.gateway.flow.admission import Admission
from meshserve.services.gateway.flow.drain import Drain
from meshserve.services.gateway.flow.generation import Generation
from meshserve.services.gateway.flow.job import GenerationJob
from meshserve.services.gateway.flow.orchestrator import Orchestrator
from meshserve.services.gateway.parsers.chat_output import ChatOutputSettings
from meshserve.shared import openai_bodies as bodies
from meshserve.shared import openai_protocol as oai
from meshserve.shared.errors import (
    DeadlineExceededError,
    InternalError,
    InvalidRequestError,
    MeshError,
    UnavailableError,
)
from meshserve.shared.generation_config import apply_defaults
from meshserve.shared.prompt_embeds import DISABLED_MESSAGE, PromptEmbeds, load_request_embeds
from meshserve.shared.status import http_error

# Tool parsers whose markers are special tokens ([TOOL_CALLS]): vLLM keeps them in the text.
_SPECIAL_MARKER_PARSERS = frozenset({"mistral"})
_log = logging.getLogger(__name__)
# No OpenAI request nests anywhere near this deep; deeper bodies would only reach recursive
# code (validation, repr, serialization) and its recursion limit.
MAX_JSON_DEPTH = 64
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request's JSON object body (413 past the app's client_max_size)."""
    raw = await request.read()
    if not raw:
        raise InvalidRequestError("the request body is empty; expected a JSON object",
                                  param="body")
    try:
        body = orjson.loads(raw)
    except (orjson.JSONDecodeError, RecursionError) as exc:
        raise InvalidRequestError(f"malformed JSON body: {exc}", param="body") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object", param="body")
    if _depth(body) > MAX_JSON_DEPTH:
        raise InvalidRequestError(f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels",
                                  param="body")
    return body


def _depth(value: object) -> int:
    """How deeply lists and objects nest in `value` (without recursion)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_JSON_DEPTH:
            break
        stack.extend((child, depth + 1) for child in item)
    return deepest


def json_response(body: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=bodies.dumps(body), content_type="application/json")


class Handlers:
    """Handlers of the two generation endpoints."""

    def __init__(self, config: GatewayConfig, orchestrator: Orchestrator,
                 admission: Admission, drain: Drain) -> None:
        self._config = config
        self._orch = orchestrator
        self._admission = admission
        self._drain = drain

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        body, defaults = await self._with_defaults(await read_json(request))
        parsed = oai.parse_completion_request(body)
        embeds = self._prompt_embeds(parsed.prompt_embeds)
        arrival, deadline = self._clock()
        model = await self._orch.resolve_model(parsed.options.model)
        job = GenerationJob.for_completion(
            parsed, body, model=model, arrival=arrival, deadline=deadline,
            default_max_tokens=self._default_max_tokens(False, defaults), embeds=embeds)
        return await self._run(request, job)

    def _prompt_embeds(self, encoded: tuple[str, ...]) -> tuple[PromptEmbeds, ...]:
        """The body's prompt_embeds read (vLLM's 400 without --enable-prompt-embeds)."""
        if encoded and not self._config.enable_prompt_embeds:
            raise InvalidRequestError(DISABLED_MESSAGE, param="prompt_embeds")
        return load_request_embeds(encoded)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        return await self._run(request, await self.chat_job(await read_json(request)))

    async def chat_job(self, body: dict[str, Any],
                       parse: Callable[[dict[str, Any]], oai.ChatCompletionRequest]
                       = oai.parse_chat_request) -> GenerationJob:
        """The job of a chat body: the model's sampling defaults filled in, validated by
        `parse`, its model resolved, and how its output is read back (tools, reasoning)."""
        body, defaults = await self._with_defaults(body)
        parsed = parse(body)
        arrival, deadline = self._clock()
        model = await self._orch.resolve_model(parsed.options.model)
        chat_output = self._chat_output(parsed)
        if chat_output.tool_parser in _SPECIAL_MARKER_PARSERS:
            # Their call markers are special tokens, which the text would otherwise lose.
            parsed = replace(parsed, params=replace(parsed.params, skip_special_tokens=False))
        return GenerationJob.for_chat(
            parsed, model=model, arrival=arrival, deadline=deadline,
            default_max_tokens=self._default_max_tokens(True, defaults),
            chat_output=chat_output)

    async def _with_defaults(self, body: dict[str, Any]
                             ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The body with the model's sampling defaults (its generation config, announced by
        its workers) for the fields it leaves out, and those defaults."""
        requested = body.get("model")
        try:
            model = await self._orch.resolve_model(requested if isinstance(requested, str)
                                                   else None)
        except MeshError:
            return body, {}  # the request's own checks report the model
        defaults = await self._orch.sampling_defaults(model)
        return apply_defaults(body, defaults), defaults

    def _default_max_tokens(self, chat: bool, defaults: dict[str, Any]) -> int | None:
        """The configured default, capped by the model's max_new_tokens when it has one."""
        configured = self._config.default_max_tokens(chat=chat)
        cap = defaults.get("max_tokens")
        if not isinstance(cap, int) or cap <= 0:
            return configured
        return cap if configured is None else min(configured, cap)

    def _chat_output(self, parsed: oai.ChatCompletionRequest) -> ChatOutputSettings:
        """How the request's choices are read back (tool calls, reasoning), as vLLM: an
        explicit tool_choice 'auto' needs --enable-auto-tool-choice and a parser."""
        config, choice = self._config, parsed.tool_choice
        auto = config.enable_auto_tool_choice and config.tool_call_parser is not None
        if choice.mode == "auto" and choice.explicit and parsed.tools and not auto:
            raise InvalidRequestError('"auto" tool choice requires --enable-auto-tool-choice '
                                      "and --tool-call-parser to be set", param="tool_choice")
        return ChatOutputSettings(choice, parsed.tools or (),
                                  config.tool_call_parser if auto else None,
                                  config.reasoning_parser, parsed.include_reasoning,
                                  parsed.parallel_tool_calls)

    def _clock(self) -> tuple[float, float]:
        now = asyncio.get_running_loop().time()
        return now, now + self._config.request_timeout_s

    @contextmanager
    def admitted(self, job: GenerationJob) -> Iterator[None]:
        """Runs `job` as an admitted request: traced, refused while the gateway drains (503)
        or is full (429), counted until the block ends."""
        _annotate_request(job)
        self._drain.refuse_if_draining()
        with self._admission.slot(), self._drain.track():
            yield

    async def _run(self, request: web.Request, job: GenerationJob) -> web.StreamResponse:
        with self.admitted(job):
            if job.options.stream:
                return await self._stream(request, job)
            return await self._aggregate(job)

    def _deadline_error(self) -> DeadlineExceededError:
        return DeadlineExceededError(
            f"the request did not finish within {self._config.request_timeout_s}s "
            "(request_timeout_s)")

    async def _aggregate(self, job: GenerationJob) -> web.Response:
        return json_response(await self.answer(job))

    async def answer(self, job: GenerationJob) -> dict[str, Any]:
        """The whole response body of a job."""
        try:
            async with asyncio.timeout_at(job.deadline):
                async with self._orch.generate(job) as generation:
                    renderer = renderer_for(job, generation.prompts, generation.lookup)
                    async for update in generation.updates():
                        renderer.add(update)
                    usage = generation.usage()
                    body = renderer.response(usage)
                    _annotate_result(generation, renderer, usage)
        except TimeoutError as exc:
            raise self._deadline_error() from exc
        return body

    async def _stream(self, request: web.Request, job: GenerationJob) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        try:
            async with asyncio.timeout_at(job.deadline):
                async with self._orch.generate(job) as generation:
                    renderer = renderer_for(job, generation.prompts, generation.lookup)
                    response = web.StreamResponse(headers=SSE_HEADERS)
                    await response.prepare(request)
                    tail = await self._write_stream(response, generation, renderer)
        except asyncio.CancelledError as exc:
            if response is None or not self._drain.ended_by_drain(exc):
                raise  # the client went away (or the request never started)
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            await self._end_stream(response, job, UnavailableError(
                "the gateway shut down before this response was complete; retry the request"))
            return response
        except ConnectionResetError:
            raise  # the client went away: nobody to tell
        except Exception as exc:  # after the first byte, every error is an event
            error = self.stream_error(exc)
            if response is None:
                raise error from exc
            await self._end_stream(response, job, error)
            return response
        assert response is not None
        await response.write_eof(tail + bodies.SSE_DONE)
        return response

    def stream_error(self, exc: Exception) -> MeshError:
        """The MeshError a failed stream reports (an unexpected exception as internal)."""
        if isinstance(exc, MeshError):
            return exc
        if isinstance(exc, TimeoutError):
            return self._deadline_error()
        _log.exception("unexpected error in a stream")
        return InternalError(f"internal error: {type(exc).__name__}: {exc}")

    @staticmethod
    async def _end_stream(response: web.StreamResponse, job: GenerationJob,
                          error: MeshError) -> None:
        """An open stream's last words: the error as an event, then `[DONE]`."""
        _log.warning("stream of %s ended by an error: %s", job.request_id, error,
                     extra={"error_kind": error.kind})
        trace.get_current_span().set_attribute("meshserve.stream_error", error.kind)
        try:
            await response.write(bodies.sse(http_error(error)[1]))
            await response.write(bodies.SSE_DONE)
            await response.write_eof()
        except (ConnectionError, RuntimeError):  # the client is gone as well
            _log.info("client of %s went away before the error event", job.request_id)

    async def _write_stream(self, response: web.StreamResponse, generation: Generation,
                            renderer: Renderer) -> bytes:
        """Write the chunks of every worker step but the last, each step's in one write (the
        role chunks go with the first); returns the last step's chunks and the usage chunk,
        which go out in one write with `[DONE]` and the end of the stream."""
        options = generation.job.options
        # As vLLM: continuous usage stats only where usage is asked for at all, on every
        # chunk from the first (role) chunk on.
        continuous = options.include_usage and options.continuous_usage_stats
        held = renderer.start(_before_output(generation.usage()) if continuous else None)
        try:
            async for update in generation.updates():
                held += renderer.chunks(update, generation.usage() if continuous else None)
                if held and not generation.done:
                    await response.write(held)
                    held = b""
        except Exception:
            if held:  # what came before the error reaches the client first
                await response.write(held)
            raise
        usage = generation.usage()
        if options.include_usage:
            held += renderer.usage_chunk(usage)
        _annotate_result(generation, renderer, usage)
        return held


def _before_output(usage: dict[str, Any]) -> dict[str, Any]:
    """The usage of chunks sent before any output (the role chunk): no completion tokens."""
    return {**usage, "completion_tokens": 0, "total_tokens": usage["prompt_tokens"]}


def _annotate_request(job: GenerationJob) -> None:
    """gen_ai.* request attributes on the HTTP request's span."""
    params = job.params
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "chat" if job.chat else "text_completion",
        "gen_ai.request.id": job.request_id, "gen_ai.request.model": job.model,
        "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
        "gen_ai.request.n": params.n, "gen_ai.request.stream": job.options.stream}
    max_tokens = job.max_tokens if job.max_tokens is not None else job.default_max_tokens
    if max_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = max_tokens
    if params.seed is not None and params.seed < 2**63:  # span attributes are int64
        attributes["gen_ai.request.seed"] = params.seed
    if job.options.user:  # `user` (or `safety_identifier`): who the end user is, traced
        attributes["meshserve.request.user"] = job.options.user
    trace.get_current_span().set_attributes(attributes)


def _annotate_result(generation: Generation, renderer: Renderer, usage: dict[str, Any]) -> None:
    """gen_ai.* response attributes on the HTTP request's span."""
    trace.get_current_span().set_attributes({
        "gen_ai.response.id": renderer.response_id,
        "gen_ai.response.model": generation.job.model,
        "gen_ai.response.finish_reasons": [r or "abort" for r in generation.finish_reasons],
        "gen_ai.usage.input_tokens": usage["prompt_tokens"],
        "gen_ai.usage.output_tokens": usage["completion_tokens"],
        "gen_ai.usage.cache_read.input_tokens": usage["prompt_tokens_details"]["cached_tokens"]})
