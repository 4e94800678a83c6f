"""Calls forced with structured outputs, read back: a required choice's JSON array streams
each call as soon as its name is known and its arguments as they are written, and the
pieces, however the text is cut, add up to the whole-text reading."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from meshserve.services.gateway.parsers.chat_output import ChatOutputSettings, ChoiceOutput
from meshserve.services.gateway.parsers.forced_calls import NamedCall, RequiredCalls
from meshserve.shared.tool_choice import ToolChoice

ARRAYS = [
    '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}]',
    ('[{"name": "add", "parameters": {"a": 1, "b": -2.50}}, '
     '{"name": "get_weather", "parameters": {"city": "Köln \\"Dom\\" 🌧", "unit": "celsius"}}]'),
    '[{"name":"nest","parameters":{"x":[1,{"y":"}]"}],"z":{}}},{"name":"empty","parameters":{}}]',
    # Keys in the other order, free whitespace, a parameters value that is not an object.
    '[ {"parameters" : [1, 2] ,"name" : "list"} , {"name": "n", "parameters": 42} ]',
    '[{"name": "esc\\u00e9", "parameters": "a \\"quoted\\" \\\\ string"}]',
]


def whole(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = RequiredCalls().extract(text)
    return content, [(c.name, c.arguments) for c in calls]


def streamed(text: str, seed: int) -> tuple[str | None, list[tuple[str, str]], list[Any]]:
    """(content, calls, pieces) from feeding `text` in random-sized chunks."""
    parser, rng, at, pieces = RequiredCalls(), random.Random(seed), 0, []
    while at < len(text):
        size = rng.randint(1, 6)
        pieces += parser.feed(text[at:at + size])
        at += size
    pieces += parser.finish()
    content = "".join(p.get("content", "") for p in pieces) or None
    calls: dict[int, list[str]] = {}
    for piece in pieces:
        for call in piece.get("tool_calls", ()):
            if "id" in call:
                assert call["index"] not in calls and call["type"] == "function"
                assert call["id"].startswith("call_")
                calls[call["index"]] = [call["function"]["name"], call["function"]["arguments"]]
            else:  # later pieces: the index and an arguments piece, nothing else
                assert set(call) == {"index", "function"} and set(call["function"]) == {
                    "arguments"}
                calls[call["index"]][1] += call["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [(n, a) for n, a in (calls[i] for i in sorted(calls))], pieces


@pytest.mark.parametrize("text", ARRAYS)
def test_a_required_array_reads_whole_with_arguments_as_written(text: str) -> None:
    content, calls = whole(text)
    assert content is None
    assert [(n, json.loads(a)) for n, a in calls] == [
        (c["name"], c["parameters"]) for c in json.loads(text)]
    for _, arguments in calls:
        assert arguments in text  # the generated text itself, not re-serialized


@pytest.mark.parametrize("text", ARRAYS)
@pytest.mark.parametrize("seed", range(6))
def test_streamed_pieces_add_up_to_the_whole_reading(text: str, seed: int) -> None:
    content, calls, _ = streamed(text, seed)
    assert (content, calls) == whole(text)


def test_arguments_stream_as_they_are_written() -> None:
    text = '[{"name": "f", "parameters": {"long": "' + "x" * 40 + '"}}]'
    parser = RequiredCalls()
    first = parser.feed(text[:33])  # the name is complete, the arguments just began
    assert first == [{"tool_calls": [{"index": 0, "id": first[0]["tool_calls"][0]["id"],
                                      "type": "function",
                                      "function": {"name": "f", "arguments": '{"lo'}}]}]
    assert parser.feed(text[33:45]) == [
        {"tool_calls": [{"index": 0, "function": {"arguments": text[33:45]}}]}]
    assert parser.feed("") == []


@pytest.mark.parametrize("text", ["", "not json", '{"name": "f", "parameters": {}}'])
def test_text_that_is_no_call_array_is_content(text: str) -> None:
    expected = text or None
    assert whole(text) == (expected, [])
    content, calls, _ = streamed(text, 1)
    assert calls == [] and content == expected


def test_a_cut_array_is_content_whole_but_streams_what_was_written() -> None:
    text = ARRAYS[1][:90]  # max_tokens ended it inside the second call
    assert whole(text) == (text, [])
    _, calls, _ = streamed(text, 2)
    assert [name for name, _ in calls] == ["add", "get_weather"]


def test_a_named_call_is_the_text_as_its_arguments() -> None:
    call = NamedCall("add")
    pieces = call.feed('{"a"') + call.feed("") + call.feed(': 1}') + call.finish()
    [first, rest] = [p["tool_calls"][0] for p in pieces]
    assert first["function"] == {"name": "add", "arguments": '{"a"'} and first["index"] == 0
    assert rest == {"index": 0, "function": {"arguments": ": 1}"}}
    assert NamedCall("add").finish()[0]["tool_calls"][0]["function"] == {"name": "add",
                                                                        "arguments": ""}


TOOLS = ({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},)
TWO_CALLS = ('<tool_call>{"name": "f", "arguments": {"i": 1}}</tool_call>\n'
             '<tool_call>{"name": "f", "arguments": {"i": 2}}</tool_call>')


@pytest.mark.parametrize("choice", [ToolChoice("auto"), ToolChoice("required", explicit=True)])
def test_parallel_tool_calls_false_keeps_the_first_call(choice: ToolChoice) -> None:
    text = TWO_CALLS if choice.mode == "auto" else ARRAYS[1]
    for parallel, count in ((True, 2), (False, 1)):
        settings = ChatOutputSettings(choice, TOOLS, "hermes", parallel_tool_calls=parallel)
        fields, called = ChoiceOutput(settings).message(text)
        assert called and len(fields["tool_calls"]) == count
        output = ChoiceOutput(settings)
        pieces = [p for i in range(0, len(text), 5) for p in output.feed(text[i:i + 5])]
        pieces += output.finish()
        indices = {c["index"] for p in pieces for c in p.get("tool_calls", ())}
        assert indices == set(range(count)) and output.called
        arguments = "".join(c["function"]["arguments"] for p in pieces
                            for c in p.get("tool_calls", ()) if c["index"] == 0)
        assert arguments == fields["tool_calls"][0]["function"]["arguments"]
