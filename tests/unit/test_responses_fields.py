"""Every field of OpenAI's Responses request (as the `openai` package types it) is read by
meshserve or refused with a 400 naming it."""

from __future__ import annotations

import typing

import pytest
from openai.types.responses import response_create_params

from meshserve.services.gateway.responses import UNSUPPORTED_RESPONSE_FIELDS, chat_body
from meshserve.shared.errors import InvalidRequestError

READ = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
        "stream", "tools", "tool_choice", "parallel_tool_calls", "previous_response_id",
        "store", "text", "metadata", "user"}


def test_every_field_is_read_or_refused() -> None:
    fields = set(typing.get_type_hints(response_create_params.ResponseCreateParamsBase))
    assert not fields - READ - set(UNSUPPORTED_RESPONSE_FIELDS), "classify these fields"
    assert not READ & set(UNSUPPORTED_RESPONSE_FIELDS)


@pytest.mark.parametrize("field", sorted(UNSUPPORTED_RESPONSE_FIELDS))
def test_a_refused_field_is_named(field: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        chat_body({"model": "m", "input": "hi", field: {"x": 1}}, [])
    assert refused.value.param == field


def test_items_become_chat_messages_after_the_history() -> None:
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    chat = chat_body({"model": "m", "instructions": "be kind", "max_output_tokens": 5,
                      "text": {"format": {"type": "json_object"}},
                      "tools": [{"type": "function", "name": "f", "parameters": {}}],
                      "tool_choice": {"type": "function", "name": "f"},
                      "input": [{"role": "user", "content": [{"type": "input_text",
                                                              "text": "hi"}]},
                                {"type": "function_call", "call_id": "c1", "name": "f",
                                 "arguments": "{}"},
                                {"type": "function_call_output", "call_id": "c1",
                                 "output": "ok"}]}, history)
    assert chat["messages"] == [
        {"role": "system", "content": "be kind"}, *history,
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    assert chat["max_tokens"] == 5 and chat["response_format"] == {"type": "json_object"}
    assert chat["tools"] == [{"type": "function", "function": {"name": "f",
                                                               "parameters": {}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
