"""Anthropic's Messages API on top of the chat path: the answer side.

The chat answer becomes a `message` (`message_object`): a thinking block when a reasoning
parser split reasoning off, a text block when there is text, one tool_use block per tool
call (its arguments parsed into `input`). The chat's finish reason becomes the stop reason:
length -> max_tokens, a stop string -> stop_sequence (with the string), a tool call ->
tool_use, anything else -> end_turn. Errors take Anthropic's body (`error_body`) with the
status the status table gives them.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import orjson

from meshserve.shared.errors import InternalError, MeshError
from meshserve.shared.status import http_error

# OpenAI error type (the status table's) -> Anthropic's error type.
_ERROR_TYPES = {
    "invalid_request_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "permission_error": "permission_error",
    "not_found_error": "not_found_error",
    "rate_limit_error": "rate_limit_error",
    "timeout_error": "timeout_error",
    "service_unavailable_error": "overloaded_error",
    "request_too_large": "request_too_large",
}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def message_object(mid: str, chat: Mapping[str, Any]) -> dict[str, Any]:
    """The `message` of a finished chat answer (its first choice)."""
    choice = chat["choices"][0]
    message = choice["message"]
    stop_reason, stop_sequence = stop_of(choice)
    return {**pending_message(mid, chat["model"], 0), "content": content_blocks(message),
            "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": usage(chat.get("usage") or {})}


def pending_message(mid: str, model: str, input_tokens: int) -> dict[str, Any]:
    """The message a stream announces first: nothing said yet."""
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0}}


def content_blocks(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A chat message's reasoning, text and tool calls as content blocks."""
    blocks: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        function = call["function"]
        blocks.append({"type": "tool_use", "id": call["id"], "name": function["name"],
                       "input": _input(function["arguments"])})
    return blocks


def _input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as tool_use input (always a JSON object)."""
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise InternalError(f"the model's tool call arguments are not a JSON object: "
                            f"{arguments!r:.80}")
    return value


def stop_of(choice: Mapping[str, Any]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat choice."""
    reason = choice.get("finish_reason")
    if reason == "length":
        return "max_tokens", None
    if reason == "tool_calls" or choice["message"].get("tool_calls"):
        return "tool_use", None
    matched = choice.get("stop_reason")
    if isinstance(matched, str):  # a stop string, not a stop token's id
        return "stop_sequence", matched
    return "end_turn", None


def usage(chat_usage: Mapping[str, Any]) -> dict[str, int]:
    return {"input_tokens": chat_usage.get("prompt_tokens", 0),
            "output_tokens": chat_usage.get("completion_tokens", 0)}


def error_body(error: MeshError) -> tuple[int, dict[str, Any]]:
    """(HTTP status, Anthropic error body) of a domain error."""
    status, body = http_error(error)
    kind = _ERROR_TYPES.get(str(body["error"]["type"]), "api_error")
    return status, error_object(kind, error.message)


def error_object(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}
