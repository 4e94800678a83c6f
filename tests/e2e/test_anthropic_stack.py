"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the whole mesh,
driven by the real `anthropic` client: greedy answers equal what /v1/chat/completions says
for the same conversation (the `openai` client, same stack), stop reasons, the stream's
events, forced tool calls, tool results, and errors in Anthropic's shape.

One stack for the module (tiny random Llama on the CPU); every test is a few short requests.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from tiny_models import build_tiny_model

from meshserve.local.launcher import LauncherConfig, start_stack

MODEL = "tiny-messages"
USER = [{"role": "user", "content": "Say something."}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["paris", "rome", "oslo"]},
               "days": {"type": "integer", "minimum": 1, "maximum": 3}},
               "required": ["city", "days"], "additionalProperties": False}}
CALL_ID = "toolu_0123456789"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    model = build_tiny_model(tmp_path_factory.mktemp("model"), "llama", seed=17,
                             max_position_embeddings=2048)
    config = LauncherConfig(model=str(model), served_model_name=MODEL, workers=1, port=0,
                            num_kv_blocks=256, dtype="float32", device="cpu", kvstore=False,
                            max_model_len=1024, run_dir=str(tmp_path_factory.mktemp("run")),
                            startup_timeout_s=300, stop_grace_s=10)
    with start_stack(config) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.gateway_url, api_key="none", max_retries=0,
                               timeout=120)


@pytest.fixture(scope="module")
def chat(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=120)


# This client version sends no sampling fields itself: temperature rides in extra_body.
GREEDY = {"temperature": 0}


def greedy(client: anthropic.Anthropic, **kwargs: Any) -> anthropic.types.Message:
    return client.messages.create(model=MODEL, extra_body=GREEDY, **kwargs)


def chat_greedy(chat: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int,
                **kwargs: Any) -> Any:
    return chat.chat.completions.create(model=MODEL, messages=messages,  # type: ignore
                                        max_tokens=max_tokens, temperature=0, **kwargs)


def text_of(message: anthropic.types.Message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_plain_message_matches_chat(client: anthropic.Anthropic, chat: openai.OpenAI) -> None:
    message = greedy(client, max_tokens=8, messages=USER, metadata={"user_id": "u1"})
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == MODEL
    assert [b.type for b in message.content] == ["text"]
    answer = chat_greedy(chat, USER, 8)
    assert text_of(message) == answer.choices[0].message.content
    assert answer.choices[0].finish_reason == "length"
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.input_tokens == answer.usage.prompt_tokens
    assert message.usage.output_tokens == answer.usage.completion_tokens == 8


def test_system_prompt(client: anthropic.Anthropic, chat: openai.OpenAI) -> None:
    system = "You are terse."
    as_string = greedy(client, max_tokens=6, system=system, messages=USER)
    as_blocks = greedy(client, max_tokens=6, messages=USER, system=[
        {"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}])
    answer = chat_greedy(chat, [{"role": "system", "content": system}, *USER], 6)
    assert text_of(as_string) == text_of(as_blocks) == answer.choices[0].message.content
    plain = greedy(client, max_tokens=1, messages=USER)
    assert as_string.usage.input_tokens == answer.usage.prompt_tokens
    assert as_string.usage.input_tokens > plain.usage.input_tokens


def test_stop_sequence_and_max_tokens(client: anthropic.Anthropic) -> None:
    long = text_of(greedy(client, max_tokens=24, messages=USER))
    stop = long[4:7]
    assert stop.strip() and len(long) > 8
    cut = greedy(client, max_tokens=24, messages=USER, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert text_of(cut) == long[:long.index(stop)]
    short = greedy(client, max_tokens=3, messages=USER)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_stream_events_and_text(client: anthropic.Anthropic) -> None:
    whole = greedy(client, max_tokens=12, messages=USER)
    events = list(client.messages.create(model=MODEL, extra_body=GREEDY, max_tokens=12,
                                         messages=USER, stream=True))
    kinds = [e.type for e in events]  # the client leaves pings out
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    start = events[0].message  # type: ignore[union-attr]
    assert start.id.startswith("msg_") and start.content == []
    assert start.usage.input_tokens == whole.usage.input_tokens
    text = "".join(e.delta.text for e in events  # type: ignore[union-attr]
                   if e.type == "content_block_delta")
    assert text == text_of(whole)
    delta = events[-2]
    assert delta.delta.stop_reason == whole.stop_reason  # type: ignore[union-attr]
    assert delta.usage.output_tokens == whole.usage.output_tokens  # type: ignore[union-attr]
    with client.messages.stream(model=MODEL, extra_body=GREEDY, max_tokens=12,
                                messages=USER) as stream:
        final = stream.get_final_message()
    assert text_of(final) == text_of(whole) and final.stop_reason == whole.stop_reason


def test_stream_wire_format(stack) -> None:
    """Each event is an `event:` line and a `data:` line whose type repeats it; a ping
    follows message_start."""
    body = {"model": MODEL, "max_tokens": 4, "messages": USER, "stream": True, **GREEDY}
    request = urllib.request.Request(f"{stack.gateway_url}/v1/messages",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        raw = response.read().decode()
    frames = [f.split("\n") for f in raw.strip().split("\n\n")]
    names = []
    for frame in frames:
        assert len(frame) == 2 and frame[0].startswith("event: ")
        assert frame[1].startswith("data: ")
        names.append(frame[0].removeprefix("event: "))
        assert json.loads(frame[1].removeprefix("data: "))["type"] == names[-1]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-1] == "message_stop"


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_forced_tool_call(client: anthropic.Anthropic, choice: dict[str, Any]) -> None:
    kwargs: dict[str, Any] = {"max_tokens": 200, "tools": [WEATHER], "tool_choice": choice,
                              "messages": [{"role": "user", "content": "Weather in Rome?"}]}
    message = greedy(client, **kwargs)
    assert message.stop_reason == "tool_use"
    calls = [b for b in message.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id
    jsonschema.validate(calls[0].input, WEATHER["input_schema"])
    with client.messages.stream(model=MODEL, extra_body=GREEDY, **kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(e.delta.partial_json for e in events  # type: ignore[union-attr]
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(partial) == calls[0].input
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert [(b.name, b.input) for b in streamed] == [("get_weather", calls[0].input)]
    assert final.stop_reason == "tool_use"


def test_tool_result_turn_matches_chat(client: anthropic.Anthropic, chat: openai.OpenAI) -> None:
    arguments = {"city": "rome", "days": 2}
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": CALL_ID, "name": "get_weather", "input": arguments}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": CALL_ID,
             "content": [{"type": "text", "text": "sunny, 24C"}]},
            {"type": "text", "text": "Summarize."}]}]
    message = greedy(client, max_tokens=8, tools=[WEATHER], messages=history)
    assert message.stop_reason in ("max_tokens", "end_turn")
    assert message.usage.output_tokens > 0
    tool = {"type": "function", "function": {"name": "get_weather",
                                             "description": WEATHER["description"],
                                             "parameters": WEATHER["input_schema"]}}
    answer = chat_greedy(chat, [
        history[0],
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": CALL_ID, "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": "sunny, 24C"},
        {"role": "user", "content": "Summarize."}], 8, tools=[tool])
    assert text_of(message) == answer.choices[0].message.content
    assert message.usage.input_tokens == answer.usage.prompt_tokens


def test_count_tokens(client: anthropic.Anthropic) -> None:
    counted = client.messages.count_tokens(model=MODEL, messages=USER, system="Be brief.")
    message = greedy(client, max_tokens=1, messages=USER, system="Be brief.")
    assert counted.input_tokens == message.usage.input_tokens > 0
    with_tools = client.messages.count_tokens(model=MODEL, messages=USER, tools=[WEATHER])
    called = greedy(client, max_tokens=1, messages=USER, tools=[WEATHER])
    assert with_tools.input_tokens == called.usage.input_tokens


def test_errors_in_anthropic_shape(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as missing:
        client.post("/v1/messages", cast_to=object, body={"model": MODEL, "messages": USER})
    assert missing.value.status_code == 400
    assert missing.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: Field required"}}
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="no-such-model", max_tokens=4, messages=USER)
    body: Any = unknown.value.body
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    assert "no-such-model" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as bad_stream:
        client.messages.create(model=MODEL, max_tokens=4, messages=USER, stream=True,
                               stop_sequences="not a list")  # type: ignore[arg-type]
    assert bad_stream.value.body["error"]["type"] == "invalid_request_error"  # type: ignore
    with pytest.raises(anthropic.BadRequestError) as too_long:  # refused before any event
        list(client.messages.create(model=MODEL, max_tokens=5000, messages=USER, stream=True))
    assert too_long.value.body["error"]["type"] == "invalid_request_error"  # type: ignore
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="no-such-model", messages=USER)
    # The bad requests lost nothing else.
    assert greedy(client, max_tokens=2, messages=USER).usage.output_tokens == 2
