"""POST /v1/chat/completions/batch: vLLM's batch chat endpoint.

The body is a chat request whose `messages` is a list of conversations. Each conversation
runs as its own chat job (the /v1/chat/completions path), all of them concurrently; the
answer is one `chat.completion` whose choice `i` is conversation `i`'s answer and whose
usage is the sum of theirs. As in vLLM: `n` must be 1, beam search and tool choices other
than "none" are refused, `stream` is ignored (always one JSON body), and the first failing
conversation's error is the whole request's.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from aiohttp import web

from meshserve.services.gateway.api.handlers import Handlers, json_response, read_json
from meshserve.shared.errors import InvalidRequestError

# Fields a batch request takes but a single conversation's job must not see: vLLM's batch
# request has no streaming and no tools (unknown fields it ignores).
_IGNORED = ("stream", "stream_options", "tools", "parallel_tool_calls")


def conversations(body: dict[str, Any]) -> list[list[Any]]:
    """The request's conversations, validated as vLLM's BatchChatCompletionRequest is."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("`messages` must be a non-empty list of conversations",
                                  param="messages")
    for index, conversation in enumerate(messages):
        if not isinstance(conversation, list) or not conversation:
            raise InvalidRequestError(f"conversation {index} of `messages` must be a "
                                      "non-empty list of messages", param="messages")
    if body.get("use_beam_search"):
        raise InvalidRequestError("Batch chat completions do not support beam search. "
                                  "Please set `use_beam_search` to False.",
                                  param="use_beam_search")
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise InvalidRequestError("Batch chat completions do not support `n > 1`. "
                                  "Please set `n` to 1.", param="n")
    if body.get("tool_choice", "none") not in ("none", None):
        raise InvalidRequestError("Batch chat completions do not support tools: "
                                  '`tool_choice` must be "none"', param="tool_choice")
    return messages


def merge(answers: list[dict[str, Any]], request_id: str) -> dict[str, Any]:
    """One `chat.completion` of the conversations' answers: choice `i` is answer `i`'s
    choice, the usage their sum."""
    choices = [{**answer["choices"][0], "index": i} for i, answer in enumerate(answers)]
    prompt = sum(answer["usage"]["prompt_tokens"] for answer in answers)
    completion = sum(answer["usage"]["completion_tokens"] for answer in answers)
    merged = {**answers[0], "id": request_id, "created": int(time.time()), "choices": choices,
              "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                        "total_tokens": prompt + completion}}
    for field in ("prompt_logprobs", "prompt_token_ids"):  # per conversation: not batched
        if field in merged:
            merged[field] = None
    return merged


class BatchChat:
    """The batch endpoint over the chat handlers' jobs."""

    def __init__(self, generation: Handlers) -> None:
        self._generation = generation

    async def handle(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        shared = {k: v for k, v in body.items() if k != "messages" and k not in _IGNORED}
        shared.pop("tool_choice", None)
        batch = conversations(body)
        tasks = [asyncio.create_task(self._answer({**shared, "messages": conversation}))
                 for conversation in batch]
        try:
            answers = await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # one failed: the others' work is not wanted
                if not task.done():
                    task.cancel()
        return json_response(merge(list(answers), f"chatcmpl-{uuid.uuid4().hex}"))

    async def _answer(self, body: dict[str, Any]) -> dict[str, Any]:
        generation = self._generation
        job = await generation.chat_job(body)
        with generation.admitted(job):
            return await generation.answer(job)
