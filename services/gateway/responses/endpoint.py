"""The /v1/responses endpoints: POST (create, whole or streamed), GET and DELETE by id.

A request runs as the chat job of its converted body (convert.py) through the chat
handlers' admission, orchestration and rendering, and is answered as a `response`
(objects.py); its answer is stored (store.py)
unless `store` is false, with the conversation a `previous_response_id` continues from.
A stream sends plain text as it is generated and everything else (reasoning, function
calls) whole at the end (events.py); an error after the first event ends it
with an `error` event, as the chat stream ends with its error chunk.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from meshserve.services.gateway.api.handlers import (
    SSE_HEADERS,
    Handlers,
    json_response,
    read_json,
)
from meshserve.services.gateway.api.render import Renderer, renderer_for
from meshserve.services.gateway.flow.drain import Drain
from meshserve.services.gateway.flow.job import GenerationJob, GenerationUpdate
from meshserve.services.gateway.flow.orchestrator import Orchestrator
from meshserve.services.gateway.responses import convert, objects
from meshserve.services.gateway.responses.events import ResponseEvents
from meshserve.services.gateway.responses.store import ResponseStore
from meshserve.shared.errors import InvalidRequestError, MeshError, UnavailableError
from meshserve.shared.openai_bodies import chat_logprobs, created_timestamp

_log = logging.getLogger(__name__)
_MAX_PAGE = 100  # most input items one page lists, as OpenAI


class ResponsesEndpoint:
    """Handlers of /v1/responses and /v1/responses/{response_id}."""

    def __init__(self, chat: Handlers, orchestrator: Orchestrator, store: ResponseStore,
                 drain: Drain) -> None:
        self._chat = chat
        self._orch = orchestrator
        self.store = store
        self._drain = drain

    async def create(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/responses."""
        body = await read_json(request)
        previous = body.get("previous_response_id")
        if previous is not None and not isinstance(previous, str):
            raise InvalidRequestError("'previous_response_id' must be a string",
                                      param="previous_response_id")
        convert.refuse_unsupported(body)  # before the store is asked anything
        history: list[dict[str, Any]] = []
        if previous:
            history = (await self.store.get(previous, "previous_response_id"))["messages"]
        job = await self._chat.chat_job(convert.chat_body(body, history),
                                        parse=convert.parse_chat)
        with self._chat.admitted(job):
            if body.get("stream"):
                return await self._stream(request, job, body, history)
            answer = await self._chat.answer(job)
        result = objects.response_object(objects.response_id(), body, answer,
                                           created=created_timestamp(), params=job.params)
        await self._keep(body, history, answer, result)
        return json_response(result)

    async def retrieve(self, request: web.Request) -> web.Response:
        """GET /v1/responses/{response_id}: a stored response (404 when unknown or expired)."""
        if request.query.get("stream", "false").lower() not in ("false", "0"):
            raise InvalidRequestError("streaming a stored response is not supported (there are "
                                      "no background responses to follow)", param="stream")
        if request.query.getall("include[]", []) or request.query.getall("include", []):
            raise InvalidRequestError("'include' is not supported: no extra output can be "
                                      "included", param="include")
        stored = await self.store.get(request.match_info["response_id"])
        return json_response(stored["response"])

    async def input_items(self, request: web.Request) -> web.Response:
        """GET /v1/responses/{response_id}/input_items: the items of its request's input, a
        page (`limit`, 1 to 100, default 20) after the item `after`, newest first unless
        `order` is asc."""
        query = request.query
        if query.getall("include[]", []) or query.getall("include", []):
            raise InvalidRequestError("'include' is not supported: no extra output can be "
                                      "included", param="include")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidRequestError(f"'order' must be asc or desc, got {order!r:.20}",
                                      param="order")
        limit = query.get("limit", "20")
        if not limit.isdigit() or not 1 <= int(limit) <= _MAX_PAGE:
            raise InvalidRequestError(f"'limit' must be between 1 and {_MAX_PAGE}, got "
                                      f"{limit!r:.20}", param="limit")
        items = (await self.store.get(request.match_info["response_id"]))["input_items"]
        items = items[::-1] if order == "desc" else items
        after = query.get("after")
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise InvalidRequestError(f"no input item {after!r:.60} in this response",
                                          param="after")
            items = items[ids.index(after) + 1:]
        page = items[:int(limit)]
        return json_response({"object": "list", "data": page,
                              "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None,
                              "has_more": len(items) > len(page)})

    async def delete(self, request: web.Request) -> web.Response:
        """DELETE /v1/responses/{response_id}: forget a stored response (404 when none)."""
        response_id = request.match_info["response_id"]
        await self.store.delete(response_id)
        return json_response({"id": response_id, "object": "response", "deleted": True})

    async def _keep(self, body: dict[str, Any], history: list[dict[str, Any]],
                    answer: dict[str, Any], result: dict[str, Any]) -> None:
        """Store the answer with its conversation, unless the request said store: false."""
        if body.get("store") is False:
            return
        conversation = [*history, *convert.input_messages(body["input"]),
                        objects.assistant_message(answer)]
        await self.store.put(result, conversation, objects.input_items(body["input"]))

    async def _stream(self, request: web.Request, job: GenerationJob, body: dict[str, Any],
                      history: list[dict[str, Any]]) -> web.StreamResponse:
        """Events: announced once the first output arrived, text as it is generated, the
        rest when the answer is complete."""
        rid, created, events = objects.response_id(), created_timestamp(), ResponseEvents()
        # Output read back by parsers (tool calls, reasoning) is only known at the end.
        item = objects.message_id() if job.chat_output is None else None
        stream: web.StreamResponse | None = None
        try:
            async with asyncio.timeout_at(job.deadline):
                async with self._orch.generate(job) as generation:
                    renderer = renderer_for(job, generation.prompts, generation.lookup)
                    stream = web.StreamResponse(headers=SSE_HEADERS)
                    await stream.prepare(request)
                    pending = objects.pending_response(rid, body, job.model, created,
                                                         job.params)
                    await stream.write(events.start(pending, item))
                    async for update in generation.updates():
                        renderer.add(update)
                        data = _text_event(events, item, update, renderer,
                                           job.wants_logprobs) if item is not None else b""
                        if data:
                            await stream.write(data)
                    answer = renderer.response(generation.usage())
            result = objects.response_object(rid, body, answer, created=created,
                                               params=job.params, message_id=item)
            await self._keep(body, history, answer, result)
        except asyncio.CancelledError as exc:
            if stream is None or not self._drain.ended_by_drain(exc):
                raise  # the client went away (or the request never started)
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            await _end(stream, events, UnavailableError(
                "the gateway shut down before this response was complete; retry the request"))
            return stream
        except ConnectionResetError:
            raise  # the client went away: nobody to tell
        except Exception as exc:  # after the first event, every error is an event
            error = self._chat.stream_error(exc)
            if stream is None:
                raise error from exc
            await _end(stream, events, error)
            return stream
        await stream.write(events.finish(result, item is not None))
        await stream.write_eof()
        return stream


def _text_event(events: ResponseEvents, item: str, update: GenerationUpdate,
                renderer: Renderer, logprobs: bool) -> bytes:
    """The delta event of what the update's first choice says (nothing when it says
    nothing: tokens held back for a possible stop string come with the next)."""
    deltas = [d for d in update.choices if d.index == 0]
    text = "".join(d.text for d in deltas)
    entries = [e for d in deltas for e in d.logprobs or ()] if logprobs else []
    if not text and not entries:
        return b""
    shown = chat_logprobs(entries, renderer.lookup)["content"] if entries else None
    return events.text(item, text, shown)


async def _end(stream: web.StreamResponse, events: ResponseEvents, error: MeshError) -> None:
    """An open stream's last event: the error."""
    _log.warning("response stream ended by an error: %s", error,
                 extra={"error_kind": error.kind})
    try:
        await stream.write(events.error(error))
        await stream.write_eof()
    except (ConnectionError, RuntimeError):  # the client is gone as well
        _log.info("client went away before the error event")
