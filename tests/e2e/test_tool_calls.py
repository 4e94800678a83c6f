"""Tool calling through the whole mesh started with the parser flags (as `meshserve up
--tool-call-parser hermes --enable-auto-tool-choice --reasoning-parser qwen3`), driven by
the real `openai` client with random weights: forced calls always parse and validate, with
the parsers on, streamed or not, n > 1; an explicit "auto" is served (the flags arrived)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from tiny_models import build_tiny_model

from meshserve.local.launcher import LauncherConfig, start_stack

MODEL = "tiny-tools"
TOOLS = [
    {"type": "function", "function": {
        "name": "lookup", "parameters": {"type": "object", "properties": {
            "word": {"type": "string", "pattern": "^[a-z]{1,8}$"},
            "limit": {"type": "integer", "minimum": 1, "maximum": 20}},
            "required": ["word", "limit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "toggle", "parameters": {"type": "object", "properties": {
            "on": {"type": "boolean"}, "tags": {"type": "array", "maxItems": 2,
                                                "items": {"enum": ["x", "y"]}}},
            "required": ["on"], "additionalProperties": False}}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):
    model = build_tiny_model(tmp_path_factory.mktemp("tools-model"), "llama", seed=31,
                             max_position_embeddings=2048)
    config = LauncherConfig(model=str(model), served_model_name=MODEL, workers=1, port=0,
                            num_kv_blocks=512, dtype="float32", device="cpu",
                            run_dir=str(tmp_path_factory.mktemp("run")),
                            startup_timeout_s=300, stop_grace_s=10,
                            tool_call_parser="hermes", enable_auto_tool_choice=True,
                            reasoning_parser="qwen3")
    with start_stack(config) as stack:
        yield openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0,
                            timeout=120)


def streamed_calls(client: openai.OpenAI, **kwargs: Any) -> dict[int, list[tuple[str, str]]]:
    """Each choice's streamed calls put back together as (name, arguments)."""
    calls: dict[int, list[list[str]]] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            known = calls.setdefault(choice.index, [])
            for call in choice.delta.tool_calls or ():
                if call.id:
                    known.append([call.function.name, ""])
                known[call.index][1] += call.function.arguments or ""
    return {i: [(n, a) for n, a in c] for i, c in calls.items()}


def assert_valid(calls: list[Any]) -> None:
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_parse_and_stream_the_same(client: openai.OpenAI,
                                                  parallel: bool) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": "look it up"}],
        "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": parallel,
        "n": 2, "temperature": 1.0, "seed": 11, "max_tokens": 1200}
    answer = client.chat.completions.create(**kwargs)
    streamed = streamed_calls(client, **kwargs)
    for choice in answer.choices:
        calls = choice.message.tool_calls or []
        assert choice.finish_reason == "tool_calls" and choice.message.content == ""  # vLLM
        assert calls and (parallel or len(calls) == 1)
        assert_valid(calls)
        assert streamed[choice.index] == [(c.function.name, c.function.arguments)
                                          for c in calls]


def test_a_named_call_parses_with_the_parsers_on(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": "switch"}], "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "toggle"}},
        "n": 2, "temperature": 1.0, "seed": 5, "max_tokens": 400}
    answer = client.chat.completions.create(**kwargs)
    streamed = streamed_calls(client, **kwargs)
    for choice in answer.choices:
        [call] = choice.message.tool_calls or []
        assert choice.finish_reason == "stop" and call.function.name == "toggle"
        assert choice.message.content == ""  # as vLLM, not null
        assert_valid([call])
        assert streamed[choice.index] == [("toggle", call.function.arguments)]


POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                "maximum": 9}},
         "required": ["x"], "additionalProperties": False}
MOVE = {"type": "function", "function": {"name": "move", "parameters": {
    "type": "object", "$defs": {"Point": POINT},
    "properties": {"to": {"$ref": "#/$defs/Point"}}, "required": ["to"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "move"}}])
def test_a_function_with_defs_is_called(client: openai.OpenAI, choice: Any) -> None:
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "go"}], tools=[MOVE],
        tool_choice=choice, temperature=0, max_tokens=200)
    calls = answer.choices[0].message.tool_calls or []
    assert calls and answer.choices[0].finish_reason in ("stop", "tool_calls")
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments),
                            MOVE["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_by_max_tokens_ends_with_length(client: openai.OpenAI,
                                                          stream: bool) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": "switch"}], "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "toggle"}},
        "temperature": 0, "max_tokens": 2}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "length" and not choice.message.tool_calls
        return
    finishes = [c.finish_reason for chunk in client.chat.completions.create(
        stream=True, **kwargs) for c in chunk.choices if c.finish_reason]
    assert finishes == ["length"]


def test_required_wins_over_response_format(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "look"}], tools=TOOLS,
        tool_choice="required", response_format={"type": "json_object"},
        parallel_tool_calls=False, temperature=0, max_tokens=400)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert_valid(choice.message.tool_calls or [])


def test_auto_is_served_when_the_flags_are_on(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], tools=TOOLS,
        tool_choice="auto", max_tokens=8, temperature=0)  # type: ignore[arg-type]
    choice = answer.choices[0]
    # Random weights write no <tool_call> block: the text comes back as content.
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    assert answer.usage is not None and answer.usage.completion_tokens > 0
