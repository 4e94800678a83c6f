"""Anthropic's Messages API on top of the chat path: the request side.

A /v1/messages body becomes a chat body (`chat_body`): `system` leads as a system message,
each message's content blocks become chat content (text; images as image_url parts, a
base64 source as a data: URL), an assistant's tool_use blocks its tool_calls and a user's
tool_result blocks tool messages (ahead of the rest of that user turn); tools become
function tools, `tool_choice` the chat's (any -> required, tool -> the named function),
`stop_sequences` the chat's `stop`, `output_config.format` (a JSON schema) the chat's
`response_format` (structured outputs). What only advises (`metadata`, `thinking` and
`output_config.effort`: reasoning follows the server's --reasoning-parser; `cache_control`:
prefix caching is automatic; `service_tier`, `speed`, ...) asks nothing of it. `parse_chat` validates the result as any chat
request, naming the Anthropic field when something is wrong. The answer side is objects.py,
the stream of events events.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from meshserve.shared import openai_protocol as oai
from meshserve.shared.errors import InvalidRequestError

MESSAGES_URL = "/v1/messages"
COUNT_TOKENS_URL = "/v1/messages/count_tokens"
_ROLES = ("user", "assistant")
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# Request fields that ask for what meshserve does not have: refused (400) unless absent.
_UNSUPPORTED = {
    "mcp_servers": "MCP servers are not supported",
    "container": "containers are not supported",
    "context_management": "context management is not supported",
}
# What the chat parser's errors name -> the Anthropic field the client wrote.
_CHAT_PARAMS = {"stop": "stop_sequences", "response_format": "output_config"}


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def _typed(body: Mapping[str, Any], key: str, kind: type | tuple[type, ...],
           what: str) -> Any:
    """`body[key]` when it is a `kind` (None when absent or null), else a 400 naming it."""
    value = body.get(key)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)
                              and kind is not bool):
        raise _bad(f"{key}: must be {what}, got {value!r:.60}", key)
    return value


def chat_body(body: Mapping[str, Any], *, count_only: bool = False) -> dict[str, Any]:
    """The chat body that runs a Messages body; `count_only` (count_tokens): the prompt
    alone, no max_tokens needed."""
    for name, reason in _UNSUPPORTED.items():
        if body.get(name) is not None:
            raise _bad(f"{name}: {reason}", name)
    model = _typed(body, "model", str, "a string")
    if model is None:
        raise _bad("model: Field required", "model")
    chat: dict[str, Any] = {"model": model, "messages": [
        *system_messages(body.get("system")), *chat_messages(body.get("messages"))]}
    tools = _typed(body, "tools", list, "an array of tools")
    if tools:
        chat["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(tools)]
    if body.get("tool_choice") is not None:
        chat.update(_chat_tool_choice(body["tool_choice"]))
    if count_only:
        return chat
    output = _typed(body, "output_config", Mapping, "an object")
    if output and output.get("format") is not None:
        chat["response_format"] = _response_format(output["format"])
    if body.get("max_tokens") is None:
        raise _bad("max_tokens: Field required", "max_tokens")
    stops = _typed(body, "stop_sequences", list, "an array of strings")
    if stops is not None:
        chat["stop"] = stops
    _typed(body, "stream", bool, "a boolean")
    for key in ("max_tokens", "temperature", "top_p", "top_k", "stream"):
        if body.get(key) is not None:
            chat[key] = body[key]
    return chat


def parse_chat(chat: dict[str, Any]) -> oai.ChatCompletionRequest:
    """`chat` validated as a chat request; errors name the Anthropic field."""
    try:
        return oai.parse_chat_request(chat)
    except InvalidRequestError as exc:
        param = _CHAT_PARAMS.get(exc.param or "")
        if param is None:
            raise
        message = exc.message.replace(exc.param or "", param, 1)
        raise InvalidRequestError(message, param=param) from exc


def system_messages(system: object) -> list[dict[str, Any]]:
    """The chat system message of `system` (a string or text blocks); none when empty."""
    if system is None:
        return []
    if isinstance(system, str):
        text = system
    elif isinstance(system, list):
        text = "".join(_block_text(block, f"system[{i}]", "system")
                       for i, block in enumerate(system))
    else:
        raise _bad("system: must be a string or an array of text blocks", "system")
    return [{"role": "system", "content": text}] if text else []


def chat_messages(messages: object) -> list[dict[str, Any]]:
    """Chat messages of the Messages API's `messages`."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages: must be a non-empty array of messages", "messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("role") not in _ROLES:
            raise _bad(f"messages.{i}.role: must be one of {', '.join(_ROLES)}", "messages")
        content = message.get("content")
        where = f"messages.{i}.content"
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
        elif isinstance(content, list):
            out += _turn(message["role"], content, where)
        else:
            raise _bad(f"{where}: must be a string or an array of content blocks", "messages")
    return out


def _turn(role: str, blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """The chat messages of one turn of content blocks: a user's tool results first (as
    tool messages), then the turn's own message when it says anything."""
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text":
            parts.append({"type": "text", "text": _block_text(block, at, "messages")})
        elif kind == "image":
            parts.append(image_part(block, at))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block, at))
        elif kind == "tool_result" and role == "user":
            results += _tool_result(block, at)
        elif kind not in ("thinking", "redacted_thinking"):  # templates drop past reasoning
            raise _bad(f"{at}: a {role} message cannot hold a block of type {kind!r:.40}",
                       "messages")
    turn: list[dict[str, Any]] = results
    if parts or calls:
        message: dict[str, Any] = {"role": role, "content": _content(parts)}
        if calls:
            message["tool_calls"] = calls
        turn.append(message)
    return turn


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]] | None:
    """Chat content: plain text unless images are among the parts; None when empty."""
    if not parts:
        return None
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _block_text(block: object, where: str, param: str) -> str:
    if not isinstance(block, Mapping) or block.get("type") != "text" \
            or not isinstance(block.get("text"), str):
        raise _bad(f"{where}: must be a text block with a string 'text'", param)
    return str(block["text"])


def image_part(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An image block as the chat's image_url part (base64 data -> a data: URL)."""
    source = block.get("source")
    source = source if isinstance(source, Mapping) else {}
    kind = source.get("type")
    if kind == "url" and isinstance(source.get("url"), str):
        url = str(source["url"])
    elif kind == "base64" and isinstance(source.get("data"), str) \
            and isinstance(source.get("media_type"), str):
        url = f"data:{source['media_type']};base64,{source['data']}"
    else:
        raise _bad(f"{where}.source: an image source must be {{type: base64, media_type, "
                   "data}} or {type: url, url}", "messages")
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_call(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A tool_use block as the chat's tool call (its input as JSON arguments)."""
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
            or not isinstance(block.get("input"), Mapping):
        raise _bad(f"{where}: a tool_use block needs a string id and name and an object "
                   "input", "messages")
    arguments = orjson.dumps(block["input"]).decode()
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": arguments}}


def _tool_result(block: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    """A tool_result block as a tool message; images in it follow as a user message."""
    if not isinstance(block.get("tool_use_id"), str):
        raise _bad(f"{where}.tool_use_id: must be a string", "messages")
    content = block.get("content")
    texts: list[str] = []
    images: list[dict[str, Any]] = []
    if isinstance(content, str):
        texts.append(content)
    elif isinstance(content, list):
        for k, item in enumerate(content):
            kind = item.get("type") if isinstance(item, Mapping) else None
            if kind == "image":
                images.append(image_part(item, f"{where}.content.{k}"))
            else:
                texts.append(_block_text(item, f"{where}.content.{k}", "messages"))
    elif content is not None:
        raise _bad(f"{where}.content: must be a string or an array of blocks", "messages")
    messages = [{"role": "tool", "tool_call_id": block["tool_use_id"],
                 "content": "\n".join(texts)}]
    if images:
        messages.append({"role": "user", "content": images})
    return messages


def _chat_tool(tool: object, index: int) -> dict[str, Any]:
    """A client tool (name, description, input_schema) as a chat function tool."""
    if not isinstance(tool, Mapping) or tool.get("type") not in (None, "custom"):
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        raise _bad(f"tools.{index}: tools of type {kind!r:.40} are not supported; only "
                   "client tools (name, description, input_schema) are", "tools")
    if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"),
                                                                   Mapping):
        raise _bad(f"tools.{index}: a tool needs a string name and an object input_schema",
                   "tools")
    function = {"name": tool["name"], "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: object) -> dict[str, Any]:
    """The chat's tool_choice (and parallel_tool_calls) of an Anthropic tool_choice."""
    choice = choice if isinstance(choice, Mapping) else {}
    kind = choice.get("type")
    chat: dict[str, Any]
    if kind in _TOOL_CHOICES:
        chat = {"tool_choice": _TOOL_CHOICES[kind]}
    elif kind == "tool" and isinstance(choice.get("name"), str):
        chat = {"tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    else:
        raise _bad("tool_choice: must be {type: auto|any|none} or {type: tool, name}",
                   "tool_choice")
    if choice.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False
    return chat


def _response_format(fmt: object) -> dict[str, Any]:
    """The chat's json_schema response_format of `output_config.format`."""
    if not isinstance(fmt, Mapping) or fmt.get("type") != "json_schema" \
            or not isinstance(fmt.get("schema"), Mapping):
        raise _bad("output_config.format: must be {type: json_schema, schema}", "output_config")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
