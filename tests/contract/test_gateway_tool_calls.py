"""Tool calls and reasoning through the gateway, against the fakes: the fake worker writes
canned model outputs, the gateway's parsers read them back (a parser per choice), and the
streamed deltas put back together equal the whole answer, in OpenAI's streaming shape."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import orjson
from openai import AsyncOpenAI
from test_gateway_fakes import MODEL, Mesh, start_mesh

from meshserve.shared.tool_choice import required_calls_schema

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},
]
AUTO_SCRIPTS = [
    ('<think>Weather needs a city: Köln.</think>Checking. '
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Köln"}}</tool_call>\n'
     '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'),
    "<think>No tool.</think>Just text, ünïcode.",
    'Broken <tool_call>{"name": oops}</tool_call>',
]
AUTO = {"tool_call_parser": "hermes", "enable_auto_tool_choice": True,
        "reasoning_parser": "qwen3"}


def body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
            **extra}


async def whole(mesh: Mesh, request: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.post(
            f"{mesh.base_url}/v1/chat/completions", json=request) as resp:
        assert resp.status == 200, await resp.text()
        return dict(await resp.json())


async def chunks(mesh: Mesh, request: dict[str, Any]) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.post(
            f"{mesh.base_url}/v1/chat/completions", json={**request, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        text = (await resp.read()).decode()
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]"
    return [orjson.loads(e) for e in events[:-1]]


def reassemble(streamed: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Each choice's message and finish reason from its deltas, checking their shape."""
    out: dict[int, dict[str, Any]] = {}
    for chunk in streamed:
        for choice in chunk["choices"]:
            message = out.setdefault(choice["index"], {"content": "", "reasoning": "",
                                                       "calls": []})
            delta = choice["delta"]
            message["content"] += delta.get("content") or ""
            message["reasoning"] += delta.get("reasoning_content") or ""
            assert delta.get("reasoning") == delta.get("reasoning_content")
            for call in delta.get("tool_calls") or ():
                if call["index"] == len(message["calls"]):  # a call's first delta
                    assert call["type"] == "function" and call["id"].startswith("call_")
                    assert set(call["function"]) == {"name", "arguments"}
                    message["calls"].append([call["function"]["name"],
                                             call["function"]["arguments"]])
                else:  # later deltas: the index and an arguments piece only
                    assert set(call) == {"index", "function"}, call
                    assert set(call["function"]) == {"arguments"}, call
                    message["calls"][call["index"]][1] += call["function"]["arguments"]
            if choice["finish_reason"] is not None:
                message["finish"] = choice["finish_reason"]
    return out


def same_message(answer: dict[str, Any], streamed: dict[int, dict[str, Any]]) -> None:
    """The streamed messages equal the whole answer's, choice by choice."""
    assert sorted(streamed) == [c["index"] for c in answer["choices"]]
    for choice in answer["choices"]:
        message, again = choice["message"], streamed[choice["index"]]
        assert again["finish"] == choice["finish_reason"]
        assert again["content"] == (message["content"] or "")
        assert again["reasoning"] == (message.get("reasoning_content") or "")
        assert again["calls"] == [[c["function"]["name"], c["function"]["arguments"]]
                                  for c in message.get("tool_calls") or ()]


async def test_auto_calls_and_reasoning_per_choice_whole_and_streamed() -> None:
    async with start_mesh(**AUTO) as mesh:
        mesh.worker.script = lambda i: AUTO_SCRIPTS[i]
        request = body(n=3)
        answer = await whole(mesh, request)
        same_message(answer, reassemble(await chunks(mesh, request)))
        assert not mesh.worker.requests[0].params.HasField("structured")
        calls, plain, broken = answer["choices"]
    assert [c["finish_reason"] for c in answer["choices"]] == ["tool_calls", "stop", "stop"]
    message = calls["message"]
    assert message["reasoning_content"] == message["reasoning"] == "Weather needs a city: Köln."
    assert message["content"].strip() == "Checking."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("function", "get_weather", {"city": "Köln"}),
                                                ("function", "add", {"a": 1, "b": 2})]
    assert plain["message"]["content"] == "Just text, ünïcode." and (
        "tool_calls" not in plain["message"])
    # Malformed JSON stays content, marker and all; no reasoning without <think> (qwen3).
    assert broken["message"]["content"] == AUTO_SCRIPTS[2]
    assert broken["message"]["reasoning_content"] is None


async def test_the_openai_client_reads_calls_and_reasoning() -> None:
    async with start_mesh(**AUTO) as mesh, AsyncOpenAI(
            base_url=f"{mesh.base_url}/v1", api_key="x", max_retries=0) as api:
        mesh.worker.script = lambda i: AUTO_SCRIPTS[0]
        answer = await api.chat.completions.create(**body())  # type: ignore[call-overload]
        message = answer.choices[0].message
        assert [c.function.name for c in message.tool_calls or ()] == ["get_weather", "add"]
        assert (message.model_extra or {})["reasoning_content"].startswith("Weather")
        names = []
        async for chunk in await api.chat.completions.create(
                **body(stream=True)):  # type: ignore[call-overload]
            names += [c.function.name for c in chunk.choices[0].delta.tool_calls or ()
                      if c.function and c.function.name]
        assert names == ["get_weather", "add"]


async def test_parallel_false_and_include_reasoning_false() -> None:
    async with start_mesh(**AUTO) as mesh:
        mesh.worker.script = lambda i: AUTO_SCRIPTS[0]
        request = body(parallel_tool_calls=False, include_reasoning=False)
        answer = await whole(mesh, request)
        streamed = reassemble(await chunks(mesh, request))
    same_message(answer, streamed)
    message = answer["choices"][0]["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert "reasoning_content" not in message and "reasoning" not in message
    assert streamed[0]["reasoning"] == ""


async def test_tool_choice_none_leaves_the_text_alone() -> None:
    async with start_mesh(**AUTO) as mesh:
        mesh.worker.script = lambda i: AUTO_SCRIPTS[0]
        answer = await whole(mesh, body(tool_choice="none"))
    message = answer["choices"][0]["message"]
    assert "tool_calls" not in message and "<tool_call>" in message["content"]
    assert answer["choices"][0]["finish_reason"] == "stop"


async def test_required_is_constrained_and_streams_arguments_as_written() -> None:
    script = ('[{"name": "add", "parameters": {"a": 10, "b": 20}}, '
              '{"name": "get_weather", "parameters": {"city": "Zürich"}}]')
    async with start_mesh() as mesh:  # no parser needed: the output is constrained
        mesh.worker.script = lambda i: script
        request = body(tool_choice="required", n=2)
        answer = await whole(mesh, request)
        streamed = await chunks(mesh, request)
        structured = mesh.worker.requests[0].params.structured
    assert json.loads(structured.spec) == required_calls_schema(TOOLS, True)
    assert structured.disable_any_whitespace
    same_message(answer, reassemble(streamed))
    for choice in answer["choices"]:
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == ""
        assert [(c["function"]["name"], c["function"]["arguments"])
                for c in choice["message"]["tool_calls"]] == [
            ("add", '{"a": 10, "b": 20}'), ("get_weather", '{"city": "Zürich"}')]
    pieces = [c for chunk in streamed for ch in chunk["choices"]
              for c in ch["delta"].get("tool_calls") or () if ch["index"] == 0]
    assert len(pieces) > 4  # the arguments came in pieces, as the worker sent the tokens


async def test_required_without_parallel_asks_for_one_call() -> None:
    async with start_mesh() as mesh:
        mesh.worker.script = lambda i: '[{"name": "add", "parameters": {"a": 1, "b": 2}}]'
        answer = await whole(mesh, body(tool_choice="required", parallel_tool_calls=False))
        schema = json.loads(mesh.worker.requests[0].params.structured.spec)
    assert schema["maxItems"] == 1 and len(answer["choices"][0]["message"]["tool_calls"]) == 1


async def test_a_named_function_is_called_and_ends_with_stop() -> None:
    async with start_mesh() as mesh:
        mesh.worker.script = lambda i: '{"a": 4, "b": 5}'
        request = body(tool_choice={"type": "function", "function": {"name": "add"}})
        answer = await whole(mesh, request)
        same_message(answer, reassemble(await chunks(mesh, request)))
        structured = mesh.worker.requests[0].params.structured
    assert json.loads(structured.spec) == TOOLS[1]["function"]["parameters"]
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop"  # as OpenAI and vLLM for a forced function
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": '{"a": 4, "b": 5}'}
    assert choice["message"]["content"] == ""  # as vLLM (not null)


async def test_a_forced_call_cut_by_max_tokens_is_no_call() -> None:
    named = {"type": "function", "function": {"name": "add"}}
    for choice, script in ((named, '{"a": 4, "b": 5}'),
                           ("required", '[{"name": "add", "parameters": {"a": 4}}]')):
        async with start_mesh() as mesh:
            mesh.worker.script = lambda i, script=script: script
            request = body(tool_choice=choice, max_tokens=8)
            answer = await whole(mesh, request)
            streamed = reassemble(await chunks(mesh, request))
        [first] = answer["choices"]
        assert first["finish_reason"] == "length" and streamed[0]["finish"] == "length"
        assert "tool_calls" not in first["message"]
        assert first["message"]["content"] == script[:8]


async def test_required_wins_over_response_format_as_in_vllm() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "string"}}}
    formats = ({"type": "json_object"},
               {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    async with start_mesh() as mesh, aiohttp.ClientSession() as http:
        mesh.worker.script = lambda i: '[{"name": "add", "parameters": {"a": 1}}]'
        for response_format in formats:
            answer = await whole(mesh, body(tool_choice="required",
                                            response_format=response_format))
            assert answer["choices"][0]["finish_reason"] == "tool_calls"
        specs = [json.loads(r.params.structured.spec) for r in mesh.worker.requests]
        assert specs == [required_calls_schema(TOOLS, True)] * 2
        async with http.post(f"{mesh.base_url}/v1/chat/completions", json=body(
                tool_choice="required", structured_outputs={"json": schema})) as resp:
            assert resp.status == 400  # vLLM: structured outputs or tools, not both


async def test_defs_of_the_functions_move_to_the_top_of_the_required_schema() -> None:
    point = {"type": "object", "properties": {"x": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "$defs": {"Point": point},
        "properties": {"at": {"$ref": "#/$defs/Point"}}}}} for name in ("a", "b")]
    schema = required_calls_schema(tools, True)
    assert schema["$defs"] == {"Point": point} and "$defs" in tools[0]["function"]["parameters"]
    assert all("$defs" not in c["properties"]["parameters"] for c in schema["items"]["anyOf"])
    tools[1]["function"]["parameters"]["$defs"] = {"Point": {"type": "string"}}
    async with start_mesh() as mesh, aiohttp.ClientSession() as http, http.post(
            f"{mesh.base_url}/v1/chat/completions",
            json={**body(tool_choice="required"), "tools": tools}) as resp:
        assert resp.status == 400
        assert "multiple schemas" in (await resp.json())["error"]["message"]


async def test_mistral_markers_survive_detokenization() -> None:
    settings = {"tool_call_parser": "mistral", "enable_auto_tool_choice": True}
    async with start_mesh(**settings) as mesh:
        mesh.worker.script = lambda i: '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]'
        answer = await whole(mesh, body())
        options = mesh.tokenizer.detokenize_options[-1]
    assert options.HasField("skip_special_tokens") and not options.skip_special_tokens
    [call] = answer["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {
        "a": 1}


async def test_auto_needs_the_flags_and_a_named_tool_must_exist() -> None:
    async with start_mesh() as mesh, aiohttp.ClientSession() as http:
        for choice, says in (("auto", "--enable-auto-tool-choice"),
                             ({"type": "function", "function": {"name": "nope"}}, "'nope'")):
            async with http.post(f"{mesh.base_url}/v1/chat/completions",
                                 json=body(tool_choice=choice)) as resp:
                assert resp.status == 400
                error = (await resp.json())["error"]
            assert error["param"] == "tool_choice" and says in error["message"]
        assert mesh.worker.requests == []  # refused before anything ran
