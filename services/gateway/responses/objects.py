"""OpenAI's Responses API on top of the chat path: the answer side.

The chat answer becomes a `response` object (`response_object`): a reasoning item when a
reasoning parser split one off, a `message` item of `output_text` (with its token logprobs
when asked), then one `function_call` item per tool call of the chat message. The request's
input is kept as listed items (`input_items`) and the answer as the assistant turn a
continuation starts from (`assistant_message`).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from meshserve.shared.sampling_params import SamplingParams


def response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def response_object(rid: str, body: Mapping[str, Any], chat: Mapping[str, Any], *,
                    created: int, params: SamplingParams,
                    message_id: str | None = None) -> dict[str, Any]:
    """The `response` of a finished chat answer (its first choice). `message_id`: the id of
    its message item, already announced to a stream (the item is there even if empty)."""
    choice = chat["choices"][0]
    message = choice["message"]
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    output: list[dict[str, Any]] = []
    if reasoning:
        output.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                       "content": [{"type": "reasoning_text", "text": reasoning}],
                       "status": "completed"})
    if message.get("content") or message_id is not None:
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        output.append(_message_item(message.get("content") or "", message_id, logprobs))
    output += [function_call_item(call) for call in message.get("tool_calls") or ()]
    incomplete = choice.get("finish_reason") == "length"
    return {**_envelope(rid, body, chat["model"], created, params),
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": output, "usage": _usage(chat.get("usage") or {})}


def pending_response(rid: str, body: Mapping[str, Any], model: str, created: int,
                     params: SamplingParams) -> dict[str, Any]:
    """The response announced when a stream starts: in progress, nothing output yet."""
    return {**_envelope(rid, body, model, created, params), "status": "in_progress",
            "incomplete_details": None, "output": [], "usage": None}


def function_call_item(call: Mapping[str, Any]) -> dict[str, Any]:
    """A chat message's tool call (OpenAI's chat shape) as a `function_call` output item."""
    function = call["function"]
    return {"type": "function_call", "id": f"fc_{call['id']}", "status": "completed",
            "call_id": call["id"], "name": function["name"], "arguments": function["arguments"]}


def _message_item(text: str, item_id: str | None,
                  logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    """The message item of the output text; `logprobs` in the chat shape, which is the
    Responses shape too ({token, logprob, bytes, top_logprobs})."""
    return {"type": "message", "id": item_id or message_id(), "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": logprobs}]}


def _envelope(rid: str, body: Mapping[str, Any], model: str, created: int,
              params: SamplingParams) -> dict[str, Any]:
    """What every response object says of its request."""
    return {
        "id": rid, "object": "response", "created_at": created, "model": model,
        "error": None, "instructions": body.get("instructions"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "previous_response_id": body.get("previous_response_id"),
        "temperature": params.temperature, "top_p": params.top_p,
        "top_logprobs": params.logprobs, "max_output_tokens": body.get("max_output_tokens"),
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": [_tool_echo(t) for t in body.get("tools") or ()],
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "store": body.get("store") is not False, "background": False, "truncation": "disabled",
        "reasoning": None, "service_tier": "default", "user": body.get("user"),
        "safety_identifier": body.get("safety_identifier")}


def _tool_echo(tool: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": "function", "name": tool["name"], "description": tool.get("description"),
            "parameters": tool.get("parameters"), "strict": tool.get("strict")}


def _usage(usage: Mapping[str, Any]) -> dict[str, Any]:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage.get("prompt_tokens", 0),
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": usage.get("completion_tokens", 0),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.get("total_tokens", 0)}


def assistant_message(chat: Mapping[str, Any]) -> dict[str, Any]:
    """The assistant turn of a chat answer as the stored conversation keeps it."""
    message = chat["choices"][0]["message"]
    said: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        said["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
            "name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
            for c in message["tool_calls"]]
    return said


def input_items(value: object) -> list[dict[str, Any]]:
    """A validated `input` as the items GET /v1/responses/{id}/input_items lists: each with
    an id (the client's, else a new one) and status, in OpenAI's item shapes."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    assert isinstance(value, list), "responses.input_messages validated the input first"
    return [_listed_item(item) for item in value]


def _listed_item(item: Mapping[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    listed = {"status": "completed", **item, "type": kind}
    if kind == "message":
        content = item["content"]
        part = "output_text" if item["role"] == "assistant" else "input_text"
        if isinstance(content, str):
            content = [{"type": part, "text": content}]
        if part == "output_text":
            content = [{"annotations": [], **p} for p in content]
        return {**listed, "id": item.get("id") or message_id(), "content": content}
    prefix = {"function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}[kind]
    return {**listed, "id": item.get("id") or f"{prefix}_{uuid.uuid4().hex}"}
