"""OpenAI's Responses API on top of the chat path: the request side.

A /v1/responses body becomes a chat body (`chat_body`): input items, instructions and the
stored conversation of `previous_response_id` become messages (a message's input_image
parts become image_url parts, loaded as a chat's images are), function tools become chat
tools, `text.format` becomes `response_format` (structured outputs), included logprobs
become chat logprobs; `parse_chat` validates it as any chat request, naming the Responses
field when something is wrong. The answer side is objects.py, the stream of
events events.py, stored answers store.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshserve.shared import openai_protocol as oai
from meshserve.shared.errors import InvalidRequestError

RESPONSES_URL = "/v1/responses"
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
_FORMATS = ("text", "json_object", "json_schema")
# The one `include` meshserve has to give: the output text's token logprobs.
INCLUDE_LOGPROBS = "message.output_text.logprobs"
# OpenAI's limits on `metadata`.
_METADATA_PAIRS, _METADATA_KEY_CHARS, _METADATA_VALUE_CHARS = 16, 64, 512

# Fields of the Responses request meshserve does not implement: each is refused with a 400
# naming it unless it asks for nothing (absent, null, an object of nulls, or one of the
# values listed). Nothing is silently ignored.
UNSUPPORTED_RESPONSE_FIELDS: dict[str, tuple[tuple[object, ...], str]] = {
    "reasoning": (({},), "reasoning settings are not supported"),
    "background": ((False,), "background responses are not supported"),
    "background_options": ((), "background responses are not supported"),
    "conversation": ((), "conversations are not supported; continue with previous_response_id"),
    "prompt": ((), "prompt templates are not supported"),
    "max_tool_calls": ((), "max_tool_calls is not supported"),
    "truncation": (("disabled",), ("only 'disabled' is supported: a conversation past the "
                                   "context is a 400, never cut")),
    "service_tier": (("auto", "default"), "service tiers are not supported"),
    "stream_options": (({"include_obfuscation": False},),
                       "stream obfuscation is not implemented"),
    "prompt_cache_key": ((), ("prompt cache keys are not supported (prefix caching is "
                              "automatic)")),
    "prompt_cache_retention": ((), "prompt cache retention is not supported"),
    "prompt_cache_options": ((), "prompt cache options are not supported"),
    "context_management": ((), "context management is not supported"),
    "moderation": ((), "moderation is not supported"),
    "image": ((), "image generation is not supported"),
    "access_programs": ((), "programmatic tool calling is not supported"),
}
# Keys of a function tool besides type, name, description, parameters and strict: refused
# unless they ask for nothing.
_UNSUPPORTED_TOOL_KEYS: dict[str, tuple[object, ...]] = {
    "defer_loading": (False,), "async": (False,), "allowed_callers": (["direct"],),
    "output_schema": ()}
# vLLM's sampling extras of its Responses request, handed to the chat parser as they are.
_PASSED_THROUGH = ("top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed", "stop", "stop_token_ids", "min_tokens",
                   "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                   "priority", "cache_salt", "chat_template_kwargs", "request_id",
                   "mm_processor_kwargs")
# What the chat parser's errors name -> the Responses field the client wrote.
_CHAT_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
                "response_format": "text"}


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def _asks_for_nothing(value: object, harmless: tuple[object, ...]) -> bool:
    if value is None or any(value == ok and type(value) is type(ok) for ok in harmless):
        return True
    return isinstance(value, Mapping) and all(v is None for v in value.values())


def refuse_unsupported(body: Mapping[str, Any]) -> None:
    """InvalidRequestError naming the first unsupported field that asks for something."""
    for name, (harmless, reason) in UNSUPPORTED_RESPONSE_FIELDS.items():
        if not _asks_for_nothing(body.get(name), harmless):
            raise _bad(f"'{name}' is not supported on /v1/responses: {reason}", name)


def _typed(body: Mapping[str, Any], key: str, kind: type, what: str) -> Any:
    """`body[key]` when it is a `kind` (None when absent or null), else a 400 naming it."""
    value = body.get(key)
    if value is not None and not isinstance(value, kind):
        raise _bad(f"'{key}' must be {what}, got {value!r:.60}", key)
    return value


def chat_body(body: Mapping[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat body that runs a Responses body after the stored `history` messages."""
    refuse_unsupported(body)
    instructions = _typed(body, "instructions", str, "a string")
    for key in ("store", "stream", "parallel_tool_calls"):
        _typed(body, key, bool, "a boolean")
    _typed(body, "previous_response_id", str, "a string")
    read_metadata(body)
    # Instructions lead the conversation and are not carried into its continuations.
    messages = [{"role": "system", "content": instructions}] if instructions else []
    messages += [*history, *input_messages(body.get("input"))]
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                     ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls"),
                     ("user", "user"), ("safety_identifier", "safety_identifier"),
                     *((k, k) for k in _PASSED_THROUGH)):
        if body.get(src) is not None:
            chat[dst] = body[src]
    tools = _typed(body, "tools", list, "an array of tools")
    if tools:
        chat["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(tools)]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    if wants_logprobs(body):
        chat["logprobs"] = True
        chat["top_logprobs"] = body.get("top_logprobs") or 0
    text = _typed(body, "text", Mapping, "an object")
    if text:
        if text.get("verbosity") not in (None, "medium"):
            raise _bad("'text.verbosity' is not supported", "text")
        if text.get("format") is not None:
            chat["response_format"] = _response_format(text["format"])
    return chat


def wants_logprobs(body: Mapping[str, Any]) -> bool:
    """Whether the output text carries token logprobs: `include` asks for them, or
    `top_logprobs` is set. Anything else `include` asks for is refused."""
    include = _typed(body, "include", list, "an array of strings")
    for value in include or ():
        if value != INCLUDE_LOGPROBS:
            raise _bad(f"'include' value {value!r:.60} is not supported; only "
                       f"{INCLUDE_LOGPROBS!r} is", "include")
    return bool(include) or body.get("top_logprobs") is not None


def parse_chat(chat: dict[str, Any]) -> oai.ChatCompletionRequest:
    """`chat` validated as a chat request; errors name the Responses field."""
    try:
        return oai.parse_chat_request(chat)
    except InvalidRequestError as exc:
        param = _CHAT_PARAMS.get(exc.param or "", exc.param)
        if param == exc.param:
            raise
        message = exc.message.replace(exc.param or "", param or "", 1)
        raise InvalidRequestError(message, param=param) from exc


def read_metadata(body: Mapping[str, Any]) -> dict[str, str]:
    """The request's `metadata`, checked against OpenAI's limits ({} when absent)."""
    value = _typed(body, "metadata", Mapping, "an object of strings")
    metadata = dict(value or {})
    if len(metadata) > _METADATA_PAIRS:
        raise _bad(f"'metadata' holds at most {_METADATA_PAIRS} pairs", "metadata")
    for key, text in metadata.items():
        if len(key) > _METADATA_KEY_CHARS or not isinstance(text, str) \
                or len(text) > _METADATA_VALUE_CHARS:
            raise _bad(f"'metadata' maps keys of up to {_METADATA_KEY_CHARS} characters to "
                       f"strings of up to {_METADATA_VALUE_CHARS}; {key!r:.70} does not",
                       "metadata")
    return metadata


# -- input items -> chat messages -----------------------------------------------------------

def input_messages(value: object) -> list[dict[str, Any]]:
    """Chat messages of a Responses `input` (a string or a list of items).

    Function calls that follow each other (or follow an assistant message) become one
    assistant message with several tool_calls, as a chat template expects parallel calls.
    Reasoning items are left out: chat templates drop earlier turns' reasoning.
    """
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
            messages.append(_message(item, i))
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", i), "type": "function",
                    "function": {"name": _field(item, "name", i),
                                 "arguments": _field(item, "arguments", i)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", i),
                             "content": _text(item.get("output"), f"input[{i}].output")})
        elif kind != "reasoning":
            raise _bad(f"input[{i}] has type {kind!r}; meshserve reads message, "
                       "function_call, function_call_output and reasoning items", "input")
    return messages


def _message(item: Mapping[str, Any], index: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise _bad(f"input[{index}].role must be one of {', '.join(_ROLES)}, got {role!r:.40}",
                   "input")
    return {"role": role, "content": _content(item.get("content"), f"input[{index}].content")}


def _field(item: Mapping[str, Any], key: str, index: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _bad(f"input[{index}].{key} must be a string", "input")
    return value


def _text(content: object, where: str) -> str:
    """The text of a string or of a list of input_text / output_text parts."""
    if isinstance(content, list) and any(_is_image(part) for part in content):
        raise _bad(f"{where} may hold images only in a message's content", "input")
    text = _content(content, where)
    assert isinstance(text, str), "content without images is text"
    return text


def _content(content: object, where: str) -> str | list[dict[str, Any]]:
    """A message's content: its text, or chat parts (text and image_url) when it holds
    input_image parts (whose URL, http(s) or data:, the chat path fetches)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or an array of input_text parts", "input")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if _is_image(part):
            parts.append({"type": "image_url",
                          "image_url": {"url": _image_url(part, f"{where}[{j}]")}})
        elif kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise _bad(f"{where} parts must be input_text, output_text or input_image, got "
                       f"{kind!r:.40}", "input")
    if any(part["type"] == "image_url" for part in parts):
        return parts
    return "".join(part["text"] for part in parts)


def _is_image(part: object) -> bool:
    return isinstance(part, Mapping) and part.get("type") == "input_image"


def _image_url(part: Mapping[str, Any], where: str) -> str:
    url = part.get("image_url")
    if part.get("file_id") is not None or not isinstance(url, str) or not url:
        raise _bad(f"{where}: an input_image needs an image_url (an http(s) or data: URL); "
                   "file_id is not supported (there is no file store)", "input")
    if part.get("detail") not in (None, "auto", "low", "high"):
        raise _bad(f"{where}.detail must be auto, low or high", "input")
    return url


def _chat_tool(tool: object, index: int) -> dict[str, Any]:
    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        raise _bad(f"tools[{index}] has type {kind!r:.40}; only function tools are supported",
                   "tools")
    if not isinstance(tool.get("name"), str):
        raise _bad(f"tools[{index}] must have a name", "tools")
    for key, harmless in _UNSUPPORTED_TOOL_KEYS.items():
        if not _asks_for_nothing(tool.get(key), harmless):
            raise _bad(f"tools[{index}].{key} is not supported", "tools")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: object) -> object:
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise _bad("'tool_choice' must be 'none', 'auto', 'required' or "
               "{'type': 'function', 'name': ...}", "tool_choice")


def _response_format(fmt: object) -> dict[str, Any]:
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if not isinstance(fmt, Mapping) or kind not in _FORMATS:
        raise _bad(f"'text.format' type must be one of {', '.join(_FORMATS)}, got {kind!r:.40}",
                   "text")
    if kind != "json_schema":
        return {"type": kind}
    if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), Mapping):
        raise _bad("'text.format' of type json_schema needs a name and a schema object",
                   "text")
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}
