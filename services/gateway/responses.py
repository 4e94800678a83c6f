"""OpenAI's Responses API on top of the chat path: a /v1/responses body becomes a chat body
(input items, instructions and the stored conversation of `previous_response_id` become
messages; function tools become chat tools; `text.format` becomes `response_format`), and
the chat answer becomes a `response` object or its stream of events.

Stored responses (`store`, default true) keep the conversation needed to continue them, in
Redis when the gateway has one (so every gateway replica finds them), else in this
process, for `--responses-ttl-s`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

import orjson

from meshserve.shared.errors import InvalidRequestError, NotFoundError

# Fields of the Responses API meshserve does not implement (refused unless harmless).
UNSUPPORTED_RESPONSE_FIELDS: dict[str, tuple[object, ...]] = {
    "reasoning": (), "include": ([],), "background": (False,), "conversation": (),
    "prompt": (), "top_logprobs": (0,), "max_tool_calls": (), "truncation": ("disabled",),
    "service_tier": ("auto", "default"), "stream_options": (), "prompt_cache_key": (),
    "safety_identifier": (), "prompt_cache_retention": (), "context_management": (),
    "moderation": (), "image": (), "background_options": (), "access_programs": (),
    "prompt_cache_options": (),
}


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def chat_body(body: Mapping[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat body that runs a Responses body after the stored `history` messages."""
    for name, harmless in UNSUPPORTED_RESPONSE_FIELDS.items():
        value = body.get(name)
        if value is not None and value not in harmless:
            raise _bad(f"'{name}' is not supported on /v1/responses", name)
    messages = list(history)
    if isinstance(body.get("instructions"), str):
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    messages += input_messages(body.get("input"))
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages,
                            "stream": False}
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                     ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls"),
                     ("user", "user")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    if body.get("tools"):
        chat["tools"] = [_chat_tool(t, i) for i, t in enumerate(body["tools"])]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    text = body.get("text")
    if isinstance(text, Mapping) and isinstance(text.get("format"), Mapping):
        chat["response_format"] = _response_format(text["format"])
    return chat


def input_messages(value: object) -> list[dict[str, Any]]:
    """Chat messages of a Responses `input` (a string or a list of items)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _bad("'input' must be a string or a non-empty array of items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        if not isinstance(item, Mapping):
            raise _bad(f"input[{i}] must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": item.get("output")})
        else:
            raise _bad(f"input[{i}] has type {kind!r}; meshserve reads message, function_call "
                       "and function_call_output items", "input")
    return messages


def _text(content: object, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") in (
            "input_text", "output_text") for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise _bad(f"input[{index}].content must be a string or input_text/output_text parts",
               "input")


def _chat_tool(tool: object, index: int) -> dict[str, Any]:
    if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(
            tool.get("name"), str):
        raise _bad(f"tools[{index}] must be a function tool with a name (other tool types "
                   "are not supported)", "tools")
    function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: object) -> object:
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(fmt: Mapping[str, Any]) -> dict[str, Any]:
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "output"), "schema": fmt.get("schema"),
            "strict": fmt.get("strict")}}
    return {"type": fmt.get("type")}


def response_object(rid: str, body: Mapping[str, Any], chat: Mapping[str, Any],
                    created: int, message_id: str | None = None) -> dict[str, Any]:
    """The `response` of a finished chat answer (its first choice); `message_id`: the id of
    its message item, already announced to a stream (the item is there even if empty)."""
    choice = chat["choices"][0]
    message = choice["message"]
    output: list[dict[str, Any]] = []
    if message.get("content") or message_id is not None:
        output.append(_message_item(message.get("content") or "", message_id))
    for call in message.get("tool_calls") or ():
        output.append({"type": "function_call", "id": f"fc_{call['id']}", "status": "completed",
                       "call_id": call["id"], "name": call["function"]["name"],
                       "arguments": call["function"]["arguments"]})
    usage = chat.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    incomplete = choice.get("finish_reason") == "length"
    return {
        "id": rid, "object": "response", "created_at": created, "model": chat["model"],
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None, "instructions": body.get("instructions"), "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools", []),
        "metadata": body.get("metadata") or {}, "store": body.get("store", True),
        "text": body.get("text") or {"format": {"type": "text"}}, "truncation": "disabled",
        "user": body.get("user"),
        "usage": {"input_tokens": usage.get("prompt_tokens", 0),
                  "input_tokens_details": {"cached_tokens": cached},
                  "output_tokens": usage.get("completion_tokens", 0),
                  "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage.get("total_tokens", 0)},
    }


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def _message_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or message_id(), "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


class ResponseEvents:
    """A response's SSE events in OpenAI's order, numbered as they are made.

    Plain text streams as it is generated: `start` announces the response, its message
    item and text part; `text` sends each delta; `finish` closes them and sends the other
    items (function calls) and the final response. Without `message_id` (tool calls or
    reasoning being parsed) everything after `start` comes with `finish`."""

    def __init__(self) -> None:
        self._number = 0

    def event(self, name: str, data: dict[str, Any]) -> bytes:
        body = orjson.dumps({"type": name, "sequence_number": self._number, **data})
        self._number += 1
        return b"event: " + name.encode() + b"\ndata: " + body + b"\n\n"

    def start(self, rid: str, body: Mapping[str, Any], model: str, created: int,
              message_id: str | None) -> bytes:
        pending = {"id": rid, "object": "response", "created_at": created, "model": model,
                   "status": "in_progress", "output": [], "usage": None,
                   "previous_response_id": body.get("previous_response_id")}
        out = [self.event("response.created", {"response": pending}),
               self.event("response.in_progress", {"response": pending})]
        if message_id is not None:
            item = {"type": "message", "id": message_id, "status": "in_progress",
                    "role": "assistant", "content": []}
            out += [self.event("response.output_item.added", {"output_index": 0, "item": item}),
                    self.event("response.content_part.added", {
                        "output_index": 0, "item_id": message_id, "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": []}})]
        return b"".join(out)

    def text(self, message_id: str, delta: str) -> bytes:
        return self.event("response.output_text.delta", {
            "output_index": 0, "item_id": message_id, "content_index": 0, "delta": delta,
            "logprobs": []})

    def finish(self, response: dict[str, Any], streamed_message: bool) -> bytes:
        out = []
        for index, item in enumerate(response["output"]):
            events = _item_events(index, item)
            if streamed_message and index == 0:
                events = [e for e in events if e[0] in _CLOSING]
            out += [self.event(name, data) for name, data in events]
        done = ("response.completed" if response["status"] == "completed"
                else "response.incomplete")
        out.append(self.event(done, {"response": response}))
        return b"".join(out)


# What closes a message item that was streamed as it was generated.
_CLOSING = ("response.output_text.done", "response.content_part.done",
            "response.output_item.done")


def _item_events(index: int, item: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    common = {"output_index": index, "item_id": item["id"]}
    if item["type"] == "function_call":
        return [("response.output_item.added", {"output_index": index,
                                                "item": {**item, "arguments": "",
                                                         "status": "in_progress"}}),
                ("response.function_call_arguments.delta", {**common,
                                                            "delta": item["arguments"]}),
                ("response.function_call_arguments.done", {**common,
                                                           "arguments": item["arguments"]}),
                ("response.output_item.done", {"output_index": index, "item": item})]
    part = item["content"][0]
    empty = {**part, "text": ""}
    at = {**common, "content_index": 0}
    return [("response.output_item.added", {"output_index": index, "item": {
                **item, "status": "in_progress", "content": []}}),
            ("response.content_part.added", {**at, "part": empty}),
            ("response.output_text.delta", {**at, "delta": part["text"], "logprobs": []}),
            ("response.output_text.done", {**at, "text": part["text"], "logprobs": []}),
            ("response.content_part.done", {**at, "part": part}),
            ("response.output_item.done", {"output_index": index, "item": item})]


class ResponseStore:
    """Stored responses and the conversations that continue them, in Redis when given (any
    gateway replica finds them), else in this process; each kept for `ttl_s`."""

    def __init__(self, redis_url: str | None, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._local: dict[str, tuple[float, bytes]] = {}
        self._redis: Any = None
        if redis_url:
            import redis.asyncio as aioredis

            self._redis = aioredis.Redis.from_url(redis_url)

    async def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        value = orjson.dumps({"response": response, "messages": messages})
        key = f"meshserve:response:{response['id']}"
        if self._redis is not None:
            await self._redis.set(key, value, px=int(self.ttl_s * 1000))
            return
        now = time.monotonic()
        self._local = {k: v for k, v in self._local.items() if v[0] > now}
        self._local[key] = (now + self.ttl_s, value)

    async def get(self, rid: str, param: str = "previous_response_id") -> dict[str, Any]:
        key = f"meshserve:response:{rid}"
        if self._redis is not None:
            value = await self._redis.get(key)
        else:
            entry = self._local.get(key)
            value = entry[1] if entry and entry[0] > time.monotonic() else None
        if value is None:
            raise NotFoundError(f"Previous response with id '{rid}' not found.", param=param)
        stored: dict[str, Any] = orjson.loads(value)
        return stored

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
