"""Anthropic Messages bodies -> chat bodies, and chat answers -> `message` objects, their
event streams and error bodies, on canned inputs; answers are checked against the
`anthropic` package's own types."""

from __future__ import annotations

from typing import Any

import orjson
import pydantic
import pytest
from anthropic.types import ErrorResponse, Message, RawMessageStreamEvent

from meshserve.services.gateway.anthropic import convert
from meshserve.services.gateway.anthropic.events import MessageEvents, error_event
from meshserve.services.gateway.anthropic.objects import (
    error_body,
    message_object,
    pending_message,
    stop_of,
)
from meshserve.shared.errors import (
    DeadlineExceededError,
    InternalError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
)

EVENT = pydantic.TypeAdapter(RawMessageStreamEvent)
USER = [{"role": "user", "content": "hi"}]
TOOL = {"name": "add", "description": "Adds.", "input_schema": {"type": "object"}}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 5, "messages": USER, **fields}


def chat_answer(message: dict[str, Any], finish_reason: str = "stop",
                stop_reason: int | str | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", **message},
                         "finish_reason": finish_reason, "stop_reason": stop_reason}],
            "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}}


# -- request ----------------------------------------------------------------------------------

def test_plain_fields_map_onto_the_chat() -> None:
    chat = convert.chat_body(body(system="be brief", stop_sequences=["\n\n"], temperature=0.5,
                                  top_p=0.9, top_k=4, stream=True, metadata={"user_id": "u"},
                                  thinking={"type": "enabled", "budget_tokens": 1024}))
    assert chat == {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": "hi"}],
                    "max_tokens": 5, "stop": ["\n\n"], "temperature": 0.5, "top_p": 0.9,
                    "top_k": 4, "stream": True}
    assert convert.parse_chat(chat).params.top_k == 4


def test_system_blocks_join_and_empty_system_is_dropped() -> None:
    blocks = [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "b"}]
    assert convert.system_messages(blocks) == [{"role": "system", "content": "ab"}]
    assert convert.system_messages("") == []
    with pytest.raises(InvalidRequestError) as bad:
        convert.system_messages([{"type": "image"}])
    assert bad.value.param == "system"


def test_tool_use_and_tool_result_blocks() -> None:
    messages = convert.chat_messages([
        {"role": "user", "content": [{"type": "text", "text": "add 1"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "s"},
            {"type": "text", "text": "calling"},
            {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "2"}, {"type": "text", "text": "ok"}]},
            {"type": "text", "text": "thanks"}]}])
    assert messages == [
        {"role": "user", "content": "add 1"},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "add", "arguments": '{"a":1}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "2\nok"},
        {"role": "user", "content": "thanks"}]


def test_a_turn_of_only_tool_results_is_only_tool_messages() -> None:
    messages = convert.chat_messages([{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "a"},
        {"type": "tool_result", "tool_use_id": "t2"}]}])
    assert messages == [{"role": "tool", "tool_call_id": "t1", "content": "a"},
                        {"role": "tool", "tool_call_id": "t2", "content": ""}]


def test_images_become_image_url_parts() -> None:
    messages = convert.chat_messages([{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}},
        {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
        {"type": "text", "text": "what?"}]}])
    assert messages == [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
        {"type": "text", "text": "what?"}]}]
    with pytest.raises(InvalidRequestError, match="image source"):
        convert.chat_messages([{"role": "user", "content": [
            {"type": "image", "source": {"type": "file", "file_id": "f"}}]}])


@pytest.mark.parametrize(("choice", "chat"), [
    ({"type": "auto"}, {"tool_choice": "auto"}),
    ({"type": "any"}, {"tool_choice": "required"}),
    ({"type": "none"}, {"tool_choice": "none"}),
    ({"type": "tool", "name": "add", "disable_parallel_tool_use": True},
     {"tool_choice": {"type": "function", "function": {"name": "add"}},
      "parallel_tool_calls": False}),
])
def test_tools_and_tool_choice(choice: dict[str, Any], chat: dict[str, Any]) -> None:
    converted = convert.chat_body(body(tools=[TOOL], tool_choice=choice))
    assert converted["tools"] == [{"type": "function", "function": {
        "name": "add", "parameters": {"type": "object"}, "description": "Adds."}}]
    assert {k: converted[k] for k in chat} == chat


def test_output_format_becomes_a_json_schema() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = convert.chat_body(body(output_config={"format": {"type": "json_schema",
                                                            "schema": schema},
                                                 "effort": "low"}))
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": schema}}


@pytest.mark.parametrize(("fields", "param", "text"), [
    ({"max_tokens": None}, "max_tokens", "max_tokens: Field required"),
    ({"model": None}, "model", "model: Field required"),
    ({"messages": []}, "messages", "non-empty"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages", "role"),
    ({"messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t"}]}]}, "messages", "tool_result"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools", "web_search"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice", "tool_choice"),
    ({"stop_sequences": "x"}, "stop_sequences", "array"),
    ({"mcp_servers": [{"url": "u"}]}, "mcp_servers", "MCP"),
])
def test_refusals_name_the_field(fields: dict[str, Any], param: str, text: str) -> None:
    with pytest.raises(InvalidRequestError) as bad:
        convert.chat_body({k: v for k, v in body(**fields).items() if v is not None})
    assert bad.value.param == param and text in bad.value.message


def test_chat_parser_errors_name_the_anthropic_field() -> None:
    with pytest.raises(InvalidRequestError) as bad:
        convert.parse_chat(convert.chat_body(body(stop_sequences=[1])))
    assert bad.value.param == "stop_sequences"


def test_count_tokens_needs_no_max_tokens() -> None:
    chat = convert.chat_body({"model": "m", "messages": USER, "tools": [TOOL]},
                             count_only=True)
    assert "max_tokens" not in chat and chat["tools"][0]["function"]["name"] == "add"


# -- answer -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("finish", "matched", "calls", "expected"), [
    ("stop", None, False, ("end_turn", None)),
    ("stop", 2, False, ("end_turn", None)),  # a stop token's id
    ("stop", "END", False, ("stop_sequence", "END")),
    ("length", None, False, ("max_tokens", None)),
    ("tool_calls", None, True, ("tool_use", None)),
    ("stop", None, True, ("tool_use", None)),  # a named function's call
])
def test_stop_reasons(finish: str, matched: Any, calls: bool,
                      expected: tuple[str, str | None]) -> None:
    message: dict[str, Any] = {"content": "x"}
    if calls:
        message["tool_calls"] = [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]
    assert stop_of({"finish_reason": finish, "stop_reason": matched,
                    "message": message}) == expected


def test_message_object_holds_thinking_text_and_tool_use() -> None:
    chat = chat_answer({"content": "calling", "reasoning_content": "think", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "add", "arguments": '{"a": 1}'}}]}, "tool_calls")
    message = message_object("msg_1", chat)
    Message.model_validate(message)
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use"]
    assert message["content"][2] == {"type": "tool_use", "id": "call_1", "name": "add",
                                     "input": {"a": 1}}
    assert message["stop_reason"] == "tool_use"
    assert message["usage"] == {"input_tokens": 11, "output_tokens": 7}


def test_empty_answer_has_no_blocks_and_bad_arguments_are_an_error() -> None:
    assert message_object("msg_1", chat_answer({"content": ""}))["content"] == []
    with pytest.raises(InternalError):
        message_object("msg_1", chat_answer({"content": "", "tool_calls": [
            {"id": "c", "function": {"name": "f", "arguments": "[1]"}}]}))


def parse_events(data: bytes) -> list[dict[str, Any]]:
    events = []
    for frame in data.decode().strip().split("\n\n"):
        name, payload = frame.split("\n")
        event = orjson.loads(payload.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        if event["type"] not in ("ping", "error"):  # outside the package's event union
            EVENT.validate_python(event)
        events.append(event)
    return events


def test_streamed_text_events() -> None:
    events = MessageEvents()
    data = events.start(pending_message("msg_1", "m", 11)) + events.text("") \
        + events.text("Hel") + events.text("lo")
    message = message_object("msg_1", chat_answer({"content": "Hello"}, "length"))
    parsed = parse_events(data + events.finish(message, streamed_text=True))
    assert [e["type"] for e in parsed] == [
        "message_start", "ping", "content_block_start", "content_block_delta",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert parsed[0]["message"]["usage"] == {"input_tokens": 11, "output_tokens": 0}
    assert [e["delta"]["text"] for e in parsed[3:5]] == ["Hel", "lo"]
    assert parsed[6]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert parsed[6]["usage"]["output_tokens"] == 7


def test_parsed_output_is_sent_whole_at_the_end() -> None:
    events = MessageEvents()
    message = message_object("msg_1", chat_answer({"content": "", "tool_calls": [
        {"id": "c1", "function": {"name": "add", "arguments": '{"a": 1}'}},
        {"id": "c2", "function": {"name": "add", "arguments": '{"a": 2}'}}]}, "tool_calls"))
    parsed = parse_events(events.start(pending_message("msg_1", "m", 3))
                          + events.finish(message, streamed_text=False))
    blocks = [e for e in parsed if e["type"].startswith("content_block")]
    assert [(e["type"], e["index"]) for e in blocks] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1)]
    assert blocks[0]["content_block"] == {"type": "tool_use", "id": "c1", "name": "add",
                                          "input": {}}
    assert orjson.loads(blocks[4]["delta"]["partial_json"]) == {"a": 2}


@pytest.mark.parametrize(("error", "status", "kind"), [
    (InvalidRequestError("bad"), 400, "invalid_request_error"),
    (NotFoundError("no model"), 404, "not_found_error"),
    (OverloadedError("full"), 429, "rate_limit_error"),
    (DeadlineExceededError("late"), 504, "timeout_error"),
    (InternalError("oops"), 500, "api_error"),
])
def test_error_bodies(error: Any, status: int, kind: str) -> None:
    assert error_body(error) == (status, {"type": "error", "error": {
        "type": kind, "message": error.message}})
    ErrorResponse.model_validate({**error_body(error)[1], "request_id": None})
    event = parse_events(error_event(error_body(error)[1]))[0]
    assert event == {"type": "error", "error": {"type": kind, "message": error.message}}
