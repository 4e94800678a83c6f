"""The Anthropic Messages endpoints: POST /v1/messages (whole or streamed) and
POST /v1/messages/count_tokens, as vLLM's server answers them.

A request runs as the chat job of its converted body (convert.py) through the chat
handlers' admission, orchestration and rendering, and is answered as a `message`
(objects.py) or as Anthropic's stream of events (events.py). Every error is answered in
Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, with the status the
status table gives it; an error after the first event ends the stream with an `error`
event.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from meshserve.services.gateway.anthropic import convert, objects
from meshserve.services.gateway.anthropic.events import MessageEvents, error_event
from meshserve.services.gateway.api.handlers import (
    SSE_HEADERS,
    Handlers,
    json_response,
    read_json,
)
from meshserve.services.gateway.api.middleware import error_response, retry_after_of
from meshserve.services.gateway.api.render import renderer_for
from meshserve.services.gateway.config import GatewayConfig
from meshserve.services.gateway.flow.drain import Drain
from meshserve.services.gateway.flow.job import ChatPrompt, GenerationJob, GenerationUpdate
from meshserve.services.gateway.flow.orchestrator import Orchestrator
from meshserve.shared.errors import MeshError, UnavailableError

_log = logging.getLogger(__name__)
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class MessagesEndpoint:
    """Handlers of /v1/messages and /v1/messages/count_tokens."""

    def __init__(self, config: GatewayConfig, chat: Handlers, orchestrator: Orchestrator,
                 drain: Drain) -> None:
        self._config = config
        self._chat = chat
        self._orch = orchestrator
        self._drain = drain

    async def create(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/messages."""
        return await self._answered(self._create, request)

    async def count_tokens(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/messages/count_tokens: {"input_tokens"} of the prompt the request's
        messages, system and tools make (images counted as their placeholder tokens)."""
        return await self._answered(self._count_tokens, request)

    async def _answered(self, handler: _Handler, request: web.Request) -> web.StreamResponse:
        """`handler`'s answer, its errors in Anthropic's shape."""
        retry_after_s = self._config.retry_after_s
        try:
            return await handler(request)
        except MeshError as exc:
            status, body = objects.error_body(exc)
            retry_after_s = retry_after_of(exc, retry_after_s)
        except web.HTTPRequestEntityTooLarge as exc:
            status = exc.status
            body = objects.error_object("request_too_large",
                                        f"request body too large: {exc.text or exc.reason}")
        except ConnectionResetError:
            raise  # the client went away: the error middleware counts it
        except Exception as exc:  # noqa: BLE001 (logged with traceback, answered as 500)
            _log.exception("unexpected error in %s %s", request.method, request.path)
            status = 500
            body = objects.error_object("api_error",
                                        f"internal error: {type(exc).__name__}: {exc}")
        return error_response(status, body, retry_after_s)

    async def _create(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        job = await self._chat.chat_job(convert.chat_body(body), parse=convert.parse_chat)
        with self._chat.admitted(job):
            if job.options.stream:
                return await self._stream(request, job)
            answer = await self._chat.answer(job)
        return json_response(objects.message_object(objects.message_id(), answer))

    async def _count_tokens(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        parsed = convert.parse_chat(convert.chat_body(body, count_only=True))
        model = await self._orch.resolve_model(parsed.options.model)
        prompt = ChatPrompt.of(parsed)
        images = await self._orch.load_images(prompt)
        deadline = asyncio.get_running_loop().time() + self._config.request_timeout_s
        response = await self._orch.tokenize(
            await self._orch.base_model(model), prompt,
            add_special_tokens=parsed.add_special_tokens, deadline=deadline, images=images)
        return json_response({"input_tokens": len(response.token_ids)})

    async def _stream(self, request: web.Request, job: GenerationJob) -> web.StreamResponse:
        """Events: the message announced once the prompt is placed, text as it is generated,
        the rest when the answer is complete."""
        mid, events = objects.message_id(), MessageEvents()
        # Output read back by parsers (tool calls, reasoning) is only known at the end.
        streamed = job.chat_output is None
        stream: web.StreamResponse | None = None
        try:
            async with asyncio.timeout_at(job.deadline):
                async with self._orch.generate(job) as generation:
                    renderer = renderer_for(job, generation.prompts, generation.lookup)
                    stream = web.StreamResponse(headers=SSE_HEADERS)
                    await stream.prepare(request)
                    prompt_tokens = generation.usage()["prompt_tokens"]
                    await stream.write(events.start(
                        objects.pending_message(mid, job.model, prompt_tokens)))
                    async for update in generation.updates():
                        renderer.add(update)
                        data = events.text(_text(update)) if streamed else b""
                        if data:
                            await stream.write(data)
                    answer = renderer.response(generation.usage())
            message = objects.message_object(mid, answer)
        except asyncio.CancelledError as exc:
            if stream is None or not self._drain.ended_by_drain(exc):
                raise  # the client went away (or the request never started)
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            await _end(stream, UnavailableError(
                "the gateway shut down before this message was complete; retry the request"))
            return stream
        except ConnectionResetError:
            raise  # the client went away: nobody to tell
        except Exception as exc:  # after the first event, every error is an event
            error = self._chat.stream_error(exc)
            if stream is None:
                raise error from exc
            await _end(stream, error)
            return stream
        await stream.write(events.finish(message, streamed))
        await stream.write_eof()
        return stream


def _text(update: GenerationUpdate) -> str:
    """What the update says of the (only) choice."""
    return "".join(d.text for d in update.choices if d.index == 0)


async def _end(stream: web.StreamResponse, error: MeshError) -> None:
    """An open stream's last event: the error."""
    _log.warning("message stream ended by an error: %s", error,
                 extra={"error_kind": error.kind})
    body: dict[str, Any] = objects.error_body(error)[1]
    try:
        await stream.write(error_event(body))
        await stream.write_eof()
    except (ConnectionError, RuntimeError):  # the client is gone as well
        _log.info("client went away before the error event")
