"""Every field of OpenAI's Responses request (as the `openai` package types it) is read by
meshserve or refused with a 400 naming it; a Responses body becomes the chat body that
runs it, and what is wrong in it is named as the client wrote it."""

from __future__ import annotations

import typing
from typing import Any

import pytest
from openai.types.responses import response_create_params

from meshserve.services.gateway.responses.convert import (
    UNSUPPORTED_RESPONSE_FIELDS,
    chat_body,
    input_messages,
    parse_chat,
)
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.structured_outputs import StructuredKind

READ = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
        "stream", "tools", "tool_choice", "parallel_tool_calls", "previous_response_id",
        "store", "text", "metadata", "user", "safety_identifier", "include", "top_logprobs"}
BASE = {"model": "m", "input": "hi"}


def test_every_field_is_read_or_refused() -> None:
    fields = set(typing.get_type_hints(response_create_params.ResponseCreateParamsBase))
    unknown = fields - READ - set(UNSUPPORTED_RESPONSE_FIELDS)
    assert not unknown, f"classify these /v1/responses fields: {sorted(unknown)}"
    assert not READ & set(UNSUPPORTED_RESPONSE_FIELDS)


def asking(harmless: tuple[object, ...]) -> object:
    """A value that asks for something: not null, not of nulls, not a harmless one."""
    for candidate in ("x", 7, True, ["x"], {"x": 1}):
        if not any(candidate == ok and type(candidate) is type(ok) for ok in harmless):
            return candidate
    raise AssertionError(harmless)


@pytest.mark.parametrize("field", sorted(UNSUPPORTED_RESPONSE_FIELDS))
def test_a_refused_field_is_named_and_a_harmless_value_passes(field: str) -> None:
    harmless, reason = UNSUPPORTED_RESPONSE_FIELDS[field]
    with pytest.raises(InvalidRequestError) as refused:
        chat_body({**BASE, field: asking(harmless)}, [])
    assert refused.value.param == field
    assert refused.value.message == f"'{field}' is not supported on /v1/responses: {reason}"
    for fine in (None, {"effort": None}, *harmless):
        chat_body({**BASE, field: fine}, [])


def test_items_become_chat_messages_after_the_instructions_and_history() -> None:
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    chat = chat_body({
        "model": "m", "instructions": "be kind", "max_output_tokens": 5, "user": "u1",
        "text": {"format": {"type": "json_object"}}, "parallel_tool_calls": False,
        "tools": [{"type": "function", "name": "f", "parameters": {}, "strict": True,
                   "description": None}],
        "tool_choice": {"type": "function", "name": "f"},
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "h"},
                                               {"type": "input_text", "text": "i"}]},
                  {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                   "content": [{"type": "output_text", "text": "let me", "annotations": []}]},
                  {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                  {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "[]"},
                  {"type": "function_call_output", "call_id": "c1", "output": "ok"},
                  {"type": "function_call_output", "call_id": "c2",
                   "output": [{"type": "input_text", "text": "fine"}]},
                  {"type": "reasoning", "id": "rs_1", "summary": []},
                  {"role": "developer", "content": "go on"}]}, history)
    call = {"type": "function", "function": {"name": "f"}}
    assert chat["messages"] == [
        {"role": "system", "content": "be kind"}, *history,
        {"role": "user", "content": "hi"},
        # An assistant message and the calls after it are one turn, as chat templates expect.
        {"role": "assistant", "content": "let me", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "[]"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "tool", "tool_call_id": "c2", "content": "fine"},
        {"role": "developer", "content": "go on"}]
    assert chat["max_tokens"] == 5 and chat["user"] == "u1"
    assert chat["response_format"] == {"type": "json_object"}
    assert chat["parallel_tool_calls"] is False
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {},
                                                               "strict": True}}]
    assert chat["tool_choice"] == call
    assert "stream" not in chat and "store" not in chat


def test_a_function_call_without_an_assistant_message_before_it_opens_one() -> None:
    assert input_messages([{"role": "user", "content": "q"},
                           {"type": "function_call", "call_id": "c", "name": "f",
                            "arguments": "{}"}])[1] == {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "c", "type": "function",
                        "function": {"name": "f", "arguments": "{}"}}]}


def test_input_images_become_image_url_parts_in_their_place() -> None:
    url = "data:image/png;base64,iVBORw0KGgo="
    [message] = input_messages([{"role": "user", "content": [
        {"type": "input_text", "text": "what is"}, {"type": "input_image", "image_url": url,
                                                     "detail": "low"},
        {"type": "input_text", "text": "this?"}]}])
    assert message == {"role": "user", "content": [
        {"type": "text", "text": "what is"}, {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "this?"}]}
    with pytest.raises(InvalidRequestError, match=r"input\[0\]\.content\[1\]\.detail"):
        input_messages([{"role": "user", "content": [
            {"type": "input_text", "text": "x"},
            {"type": "input_image", "image_url": url, "detail": "max"}]}])


def test_text_formats_become_structured_outputs() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    parsed = parse_chat(chat_body({**BASE, "text": {"format": {
        "type": "json_schema", "name": "answer", "schema": schema, "strict": True}}}, []))
    assert parsed.params.structured is not None
    assert parsed.params.structured.kind is StructuredKind.JSON
    assert '"integer"' in parsed.params.structured.spec
    plain = parse_chat(chat_body({**BASE, "text": {"format": {"type": "text"}}}, []))
    assert plain.params.structured is None
    anything = parse_chat(chat_body({**BASE, "text": {"format": {"type": "json_object"}}}, []))
    assert anything.params.structured is not None
    assert anything.params.structured.kind is StructuredKind.JSON_OBJECT


def test_logprobs_are_asked_by_include_or_top_logprobs() -> None:
    assert parse_chat(chat_body(BASE, [])).params.logprobs is None
    assert parse_chat(chat_body({**BASE, "include": []}, [])).params.logprobs is None
    included = parse_chat(chat_body({**BASE, "include": ["message.output_text.logprobs"]}, []))
    assert included.params.logprobs == 0  # the chosen token's only
    top = parse_chat(chat_body({**BASE, "top_logprobs": 3}, []))
    assert top.params.logprobs == 3
    with pytest.raises(InvalidRequestError) as refused:
        parse_chat(chat_body({**BASE, "top_logprobs": -2}, []))
    assert refused.value.param == "top_logprobs"


def test_sampling_fields_and_vllm_extras_reach_the_chat_request() -> None:
    parsed = parse_chat(chat_body({**BASE, "temperature": 0.5, "top_p": 0.9, "top_k": 3,
                                   "max_output_tokens": 9, "seed": 4}, []))
    params = parsed.params
    assert (params.temperature, params.top_p, params.top_k) == (0.5, 0.9, 3)
    assert (params.max_tokens, params.seed) == (9, 4)


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"input": None}, "input", "string or a non-empty array"),
    ({"input": []}, "input", "string or a non-empty array"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "role must be one of"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "input", "file_id is not supported"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [
        {"type": "input_image", "image_url": "u"}]}]}, "input", "images only in a message"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input",
     "call_id must be a string"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "'item_reference'"),
    ({"instructions": 3}, "instructions", "must be a string"),
    ({"store": "yes"}, "store", "must be a boolean"),
    ({"stream": 1}, "stream", "must be a boolean"),
    ({"metadata": {"k": 1}}, "metadata", "strings"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16"),
    ({"metadata": {"k" * 65: "v"}}, "metadata", "64 characters"),
    ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"tools": [{"type": "function", "name": "f", "defer_loading": True}]}, "tools",
     "defer_loading"),
    ({"tools": {"type": "function"}}, "tools", "an array"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice", "'required'"),
    ({"text": {"format": {"type": "grammar"}}}, "text", "must be one of"),
    ({"text": {"format": {"type": "json_schema", "name": "n"}}}, "text", "schema object"),
    ({"text": {"verbosity": "high"}}, "text", "verbosity"),
    ({"request_id": "r1"}, "request_id", "not supported"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "only 'message.output_text"),
    ({"include": "message.output_text.logprobs"}, "include", "an array"),
])
def test_what_is_wrong_is_named(extra: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        chat_body({**BASE, **extra}, [])
        if param == "request_id":  # vLLM's extras are checked by the chat parser
            parse_chat(chat_body({**BASE, **extra}, []))
    assert refused.value.param == param
    assert words in refused.value.message


@pytest.mark.parametrize(("extra", "param"), [
    ({"max_output_tokens": 0}, "max_output_tokens"), ({"max_output_tokens": "9"},
                                                      "max_output_tokens"),
    ({"temperature": -1}, "temperature"), ({"model": 5}, "model")])
def test_chat_errors_are_named_as_the_responses_field(extra: dict[str, Any], param: str
                                                      ) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        parse_chat(chat_body({**BASE, **extra}, []))
    assert refused.value.param == param
    assert f"'{param}'" in refused.value.message or param in refused.value.message
