"""Protobuf -> domain conversions of the tokenizer's edge."""

from __future__ import annotations

from typing import Any

import orjson

from meshserve.proto.v1 import common_pb2, tokenizer_pb2
from meshserve.services.tokenizer.images import ImageSize, PlaceholderRange
from meshserve.services.tokenizer.model import PromptInput
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.sampling_params import MAX_N, SamplingParams

# Chat-only TokenizeRequest fields: setting one with plain text is a client mistake.
_CHAT_ONLY_FIELDS = ("tools_json", "chat_template", "chat_template_kwargs_json",
                     "continue_final_message", "add_generation_prompt", "images")


def _json(text: str, param: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"{param} is not valid JSON: {exc}", param=param) from None


def _message(message: tokenizer_pb2.ChatMessage, index: int) -> dict[str, Any]:
    """One ChatMessage as the dict chat templates take (checked by the loader)."""
    where = f"messages[{index}]"
    out: dict[str, Any] = {"role": message.role}
    if message.content_parts_json:
        out["content"] = _json(message.content_parts_json, f"{where}.content")
    else:
        out["content"] = message.content if message.HasField("content") else None
    if message.name:
        out["name"] = message.name
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls_json:
        out["tool_calls"] = _json(message.tool_calls_json, f"{where}.tool_calls")
    if message.reasoning_content:
        out["reasoning_content"] = message.reasoning_content
    return out


def prompt_input(request: tokenizer_pb2.TokenizeRequest) -> PromptInput:
    """The domain prompt of a TokenizeRequest (InvalidRequestError on a malformed one)."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidRequestError("the prompt needs `text` or `chat`", param="input")
    add_special = request.add_special_tokens if request.HasField("add_special_tokens") else None
    if kind == "text":
        for name in _CHAT_ONLY_FIELDS:
            if _is_set(request, name):
                raise InvalidRequestError(f"{name} applies to chat prompts only", param=name)
        return PromptInput(text=request.text,
                           add_special_tokens=True if add_special is None else add_special,
                           truncate_prompt_tokens=request.truncate_prompt_tokens,
                           suffix=request.suffix if request.HasField("suffix") else None)
    if request.HasField("suffix"):
        raise InvalidRequestError("suffix applies to text prompts only", param="suffix")
    tools = _json(request.tools_json, "tools") if request.tools_json else None
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise InvalidRequestError("tools must be a JSON array of objects", param="tools")
    kwargs = (_json(request.chat_template_kwargs_json, "chat_template_kwargs")
              if request.chat_template_kwargs_json else None)
    if kwargs is not None and not isinstance(kwargs, dict):
        raise InvalidRequestError("chat_template_kwargs must be a JSON object",
                                  param="chat_template_kwargs")
    # Unset add_generation_prompt is true, except when continuing the final message
    # (the two exclude each other).
    add_generation = (request.add_generation_prompt if request.HasField("add_generation_prompt")
                      else not request.continue_final_message)
    return PromptInput(
        messages=[_message(m, i) for i, m in enumerate(request.chat.messages)], tools=tools,
        add_generation_prompt=add_generation,
        add_special_tokens=False if add_special is None else add_special,
        continue_final_message=request.continue_final_message,
        chat_template=request.chat_template or None, chat_template_kwargs=kwargs,
        truncate_prompt_tokens=request.truncate_prompt_tokens,
        images=tuple(ImageSize(image.width, image.height) for image in request.images))


def placeholder_ranges(ranges: tuple[PlaceholderRange, ...]) -> list[common_pb2.PlaceholderRange]:
    """The image ranges of a tokenized prompt as TokenizeResponse.image_ranges."""
    return [common_pb2.PlaceholderRange(offset=r.offset, length=r.length) for r in ranges]


def _is_set(request: tokenizer_pb2.TokenizeRequest, name: str) -> bool:
    if name == "add_generation_prompt":
        return request.HasField(name)
    return bool(getattr(request, name))


def sampling_params(options: tokenizer_pb2.DetokenizeOptions) -> SamplingParams:
    """The text-side parameters a DetokenizeOptions message carries."""
    if not 1 <= options.num_sequences <= MAX_N:
        raise InvalidRequestError(f"num_sequences must be between 1 and {MAX_N}, got "
                                  f"{options.num_sequences}", param="num_sequences")
    return SamplingParams(
        n=options.num_sequences, max_tokens=None, stop=tuple(options.stop),
        include_stop_str_in_output=options.include_stop_str_in_output,
        min_tokens=options.min_tokens,
        skip_special_tokens=(options.skip_special_tokens
                             if options.HasField("skip_special_tokens") else True),
        spaces_between_special_tokens=(options.spaces_between_special_tokens
                                       if options.HasField("spaces_between_special_tokens")
                                       else True))
