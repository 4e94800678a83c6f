"""Chat answers -> `response` objects and their event streams, on canned chat answers in
OpenAI's chat shape (content, tool_calls, reasoning_content), each checked against the
`openai` package's own types."""

from __future__ import annotations

from typing import Any

import orjson
import pydantic
import pytest
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent

from meshserve.services.gateway.responses.events import ResponseEvents
from meshserve.services.gateway.responses.objects import (
    assistant_message,
    input_items,
    pending_response,
    response_object,
)
from meshserve.shared.errors import DeadlineExceededError
from meshserve.shared.sampling_params import SamplingParams

EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
PARAMS = SamplingParams(temperature=0.3, top_p=0.8)
BODY: dict[str, Any] = {"model": "m", "input": "hi", "instructions": "be brief",
                        "metadata": {"k": "v"}, "max_output_tokens": 50,
                        "tools": [{"type": "function", "name": "add",
                                   "parameters": {"type": "object"}}]}
CALLS = [{"id": "call_1", "type": "function",
          "function": {"name": "add", "arguments": '{"a": 1}'}},
         {"id": "call_2", "type": "function",
          "function": {"name": "add", "arguments": '{"a": 2}'}}]


def chat_answer(message: dict[str, Any], finish_reason: str = "stop") -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", **message},
                         "finish_reason": finish_reason}],
            "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18,
                      "prompt_tokens_details": {"cached_tokens": 4}}}


def build(message: dict[str, Any], finish_reason: str = "stop",
          message_id: str | None = None) -> dict[str, Any]:
    result = response_object("resp_1", BODY, chat_answer(message, finish_reason),
                             created=123, params=PARAMS, message_id=message_id)
    Response.model_validate(result)  # the openai package's own type accepts it
    return result


def test_text_becomes_one_message_item_and_usage_is_renamed() -> None:
    result = build({"content": "Paris.", "tool_calls": []})
    [item] = result["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["id"].startswith("msg_") and item["status"] == "completed"
    assert item["content"] == [{"type": "output_text", "text": "Paris.", "annotations": [],
                                "logprobs": []}]
    assert result["status"] == "completed" and result["incomplete_details"] is None
    assert result["usage"] == {"input_tokens": 11, "output_tokens": 7, "total_tokens": 18,
                               "input_tokens_details": {"cached_tokens": 4,
                                                        "cache_write_tokens": 0},
                               "output_tokens_details": {"reasoning_tokens": 0}}
    assert Response.model_validate(result).output_text == "Paris."
    # The request is echoed as the sampling ran it.
    assert (result["temperature"], result["top_p"]) == (0.3, 0.8)
    assert (result["instructions"], result["metadata"]) == ("be brief", {"k": "v"})
    assert result["tools"] == [{"type": "function", "name": "add", "description": None,
                                "parameters": {"type": "object"}, "strict": None}]
    assert result["store"] is True and result["tool_choice"] == "auto"


def test_tool_calls_become_function_call_items_after_the_text() -> None:
    result = build({"content": "Adding.", "tool_calls": CALLS}, "tool_calls")
    kinds = [item["type"] for item in result["output"]]
    assert kinds == ["message", "function_call", "function_call"]
    assert result["output"][1:] == [
        {"type": "function_call", "id": "fc_call_1", "status": "completed",
         "call_id": "call_1", "name": "add", "arguments": '{"a": 1}'},
        {"type": "function_call", "id": "fc_call_2", "status": "completed",
         "call_id": "call_2", "name": "add", "arguments": '{"a": 2}'}]
    assert result["status"] == "completed"


def test_only_tool_calls_make_no_message_item() -> None:
    result = build({"content": None, "tool_calls": CALLS[:1]}, "tool_calls")
    assert [item["type"] for item in result["output"]] == ["function_call"]
    # A streamed message item was announced already: it stays, even empty.
    streamed = build({"content": None, "tool_calls": CALLS[:1]}, "tool_calls", "msg_x")
    assert [item["id"] for item in streamed["output"]] == ["msg_x", "fc_call_1"]


def test_reasoning_comes_first_as_a_reasoning_item() -> None:
    result = build({"content": "4", "reasoning_content": "2+2 is 4"})
    reasoning, message = result["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "2+2 is 4"}]
    assert message["content"][0]["text"] == "4"


def test_a_length_cut_is_incomplete_for_max_output_tokens() -> None:
    result = build({"content": "Once upon"}, "length")
    assert result["status"] == "incomplete"
    assert result["incomplete_details"] == {"reason": "max_output_tokens"}


def test_the_stored_assistant_turn_keeps_text_and_calls() -> None:
    said = assistant_message(chat_answer({"content": "Adding.", "tool_calls": CALLS,
                                          "reasoning_content": "hmm"}))
    assert said == {"role": "assistant", "content": "Adding.", "tool_calls": CALLS}
    assert assistant_message(chat_answer({"content": "hi"})) == {"role": "assistant",
                                                                 "content": "hi"}


def parse(stream: bytes) -> list[Any]:
    """The events of SSE bytes, each checked: `event:` names its data's type."""
    events = []
    for block in stream.decode().split("\n\n"):
        if not block:
            continue
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: ")
        event = EVENT.validate_python(orjson.loads(data_line[len("data: "):]))
        assert event.type == name_line[len("event: "):]
        events.append(event)
    return events


def test_streamed_text_events_in_openais_order() -> None:
    events = ResponseEvents()
    pending = pending_response("resp_1", BODY, "m", 123, PARAMS)
    Response.model_validate(pending)
    data = events.start(pending, "msg_1") + events.text("msg_1", "Pa") \
        + events.text("msg_1", "ris.")
    final = build({"content": "Paris."}, message_id="msg_1")
    sent = parse(data + events.finish(final, streamed_message=True))
    assert [e.type for e in sent] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in sent] == list(range(len(sent)))
    assert sent[0].response.status == "in_progress" and sent[0].response.id == "resp_1"
    assert sent[6].text == "Paris." and sent[8].item.id == "msg_1"
    assert sent[-1].response.output_text == "Paris."


def test_function_calls_and_reasoning_are_sent_whole_at_the_end() -> None:
    events = ResponseEvents()
    start = events.start(pending_response("resp_1", BODY, "m", 123, PARAMS), None)
    final = build({"content": "ok", "reasoning_content": "think", "tool_calls": CALLS[:1]},
                  "length")
    sent = parse(start + events.finish(final, streamed_message=False))
    assert [e.type for e in sent] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.incomplete"]
    assert [e.output_index for e in sent if e.type == "response.output_item.added"] == [0, 1, 2]
    call_added = sent[12]
    assert call_added.item.arguments == "" and call_added.item.status == "in_progress"
    assert sent[13].delta == '{"a": 1}' and sent[15].item.call_id == "call_1"
    assert [e.sequence_number for e in sent] == list(range(len(sent)))


@pytest.mark.parametrize("streamed", [True, False])
def test_an_error_is_the_last_event(streamed: bool) -> None:
    events = ResponseEvents()
    start = events.start(pending_response("resp_1", BODY, "m", 1, PARAMS),
                         "msg_1" if streamed else None)
    sent = parse(start + events.error(DeadlineExceededError("too slow")))
    assert sent[-1].type == "error" and sent[-1].code == "deadline_exceeded"
    assert sent[-1].message == "too slow" and sent[-1].sequence_number == len(sent) - 1


def test_input_items_are_listed_with_ids_in_openais_item_shapes() -> None:
    item = pydantic.TypeAdapter(ResponseItem)
    items = input_items([
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "id": "msg_a",
         "content": [{"type": "output_text", "text": "yo"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "3"},
        {"type": "reasoning", "id": "rs_a", "summary": []}])
    listed = [item.validate_python(i) for i in items]
    assert [i.type for i in listed] == ["message", "message", "function_call",
                                        "function_call_output", "reasoning"]
    assert listed[0].content[0].text == "hi" and listed[0].id.startswith("msg_")
    assert listed[1].id == "msg_a" and listed[1].content[0].type == "output_text"
    assert listed[2].id.startswith("fc_") and listed[3].id.startswith("fco_")
    assert len({i.id for i in listed}) == 5
    assert input_items("hello")[0]["content"] == [{"type": "input_text", "text": "hello"}]


def test_logprobs_of_the_chat_answer_ride_in_the_text_part_and_its_events() -> None:
    entry = {"token": "4", "logprob": -0.5, "bytes": [52],
             "top_logprobs": [{"token": "4", "logprob": -0.5, "bytes": [52]}]}
    answer = chat_answer({"content": "4"})
    answer["choices"][0]["logprobs"] = {"content": [entry], "refusal": None}
    result = response_object("resp_1", BODY, answer, created=1, params=PARAMS,
                             message_id="msg_1")
    assert Response.model_validate(result).output[0].content[0].logprobs[0].logprob == -0.5
    events = ResponseEvents()
    sent = parse(events.start(pending_response("resp_1", BODY, "m", 1, PARAMS), "msg_1")
                 + events.text("msg_1", "4", [entry]) + events.finish(result, True))
    delta, done = (e for e in sent if e.type in ("response.output_text.delta",
                                                 "response.output_text.done"))
    assert delta.logprobs[0].token == "4" and done.logprobs[0].top_logprobs[0].logprob == -0.5
