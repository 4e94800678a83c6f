"""Tool-call parsers: exact parses, and streamed parses equal to whole-text parses."""

from __future__ import annotations

import json
import random
import re

import pytest

from meshserve.services.gateway.parsers.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    Qwen3CoderToolParser,
    ToolCall,
    ToolParser,
)

Parsed = tuple[str | None, list[tuple[str, str]]]
CALL_ID = r"call_[0-9a-f]{24}|[A-Za-z0-9]{9}"  # mistral's ids: 9 letters or digits


def _whole(parser: ToolParser, text: str) -> Parsed:
    content, calls = parser.extract(text)
    for c in calls:
        assert re.fullmatch(CALL_ID, c.id)
    assert len({c.id for c in calls}) == len(calls)
    return content, [(c.name, c.arguments) for c in calls]


def _stream(parser: ToolParser, text: str, seed: int) -> Parsed:
    rng = random.Random(seed)
    pieces: list[dict] = []
    pos = 0
    while pos < len(text):
        n = rng.randint(1, 7)
        pieces += parser.feed(text[pos : pos + n])
        pos += n
    pieces += parser.finish()
    content = ""
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for p in pieces:
        assert len(p) == 1, p
        if "content" in p:
            assert p["content"]
            content += p["content"]
            continue
        (tc,) = p["tool_calls"]
        i = tc["index"]
        if "id" in tc:
            assert i == len(names) and tc["type"] == "function"
            assert re.fullmatch(CALL_ID, tc["id"])
            names[i] = tc["function"]["name"]
            args[i] = tc["function"]["arguments"]
        else:
            args[i] += tc["function"]["arguments"]
    return content or None, [(names[i], args[i]) for i in sorted(names)]


def _args(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False)


W = {"city": "Paris", "unit": "c"}
T = {"tz": "Europe/Paris"}
U = {"q": "café ☕ 東京"}

HERMES_CASES: list[tuple[str, Parsed]] = [
    (
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
        (None, [("weather", _args(W))]),
    ),
    (
        (
            'Let me check.\n<tool_call>{"name": "weather", "arguments": {"city": "Paris", "unit": "c"}}'
            '</tool_call>\n<tool_call>{"name": "time", "arguments": {"tz": "Europe/Paris"}}</tool_call>'
        ),
        ("Let me check.\n", [("weather", _args(W)), ("time", _args(T))]),
    ),
    (
        'Hi <tool_call>{"name": "weather", "arguments": {"city": </tool_call>',
        ('Hi <tool_call>{"name": "weather", "arguments": {"city": </tool_call>', []),
    ),
    (
        '<tool_call>{"name": "search", "arguments": {"q": "café ☕ 東京"}}</tool_call>',
        (None, [("search", _args(U))]),
    ),
    (
        '<tool_call>{"name": "time", "arguments": {"tz": "Europe/Paris"}}',  # unclosed at the end
        (None, [("time", _args(T))]),
    ),
    (
        "plain answer with < and <tool_ but no call",
        ("plain answer with < and <tool_ but no call", []),
    ),
    ("ends with a partial marker <tool_", ("ends with a partial marker <tool_", [])),
    ("", (None, [])),
]

LLAMA_CASES: list[tuple[str, Parsed]] = [
    (
        '<|python_tag|>{"name": "weather", "parameters": {"city": "Paris", "unit": "c"}}',
        (None, [("weather", _args(W))]),
    ),
    (
        (
            '{"name": "weather", "parameters": {"city": "Paris", "unit": "c"}}; '
            '{"name": "time", "parameters": {"tz": "Europe/Paris"}}'
        ),
        (None, [("weather", _args(W)), ("time", _args(T))]),
    ),
    (
        '  {"name": "search", "parameters": {"q": "café ☕ 東京"}}',
        (None, [("search", _args(U))]),
    ),
    (
        '{"name": "weather", "parameters": {"city": "Paris"',
        ('{"name": "weather", "parameters": {"city": "Paris"', []),
    ),
    (
        '{"name": "a", "parameters": {}} {"name": "b", "parameters": {}}',  # no `;` between
        ('{"name": "a", "parameters": {}} {"name": "b", "parameters": {}}', []),
    ),
    (
        'The weather tool needs {"name": "weather"}',
        ('The weather tool needs {"name": "weather"}', []),
    ),
    ("<|python", ("<|python", [])),
]

MISTRAL_CASES: list[tuple[str, Parsed]] = [
    (
        '[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Paris", "unit": "c"}}]',
        (None, [("weather", _args(W))]),
    ),
    (
        (
            'Sure. [TOOL_CALLS][{"name": "weather", "arguments": {"city": "Paris", "unit": "c"}}, '
            '{"name": "time", "arguments": {"tz": "Europe/Paris"}}]'
        ),
        ("Sure. ", [("weather", _args(W)), ("time", _args(T))]),
    ),
    (
        (
            '[TOOL_CALLS]weather[ARGS]{"city": "Paris", "unit": "c"}'
            '[TOOL_CALLS]time[ARGS]{"tz": "Europe/Paris"}'
        ),
        (None, [("weather", _args(W)), ("time", _args(T))]),
    ),
    (
        '[TOOL_CALLS]search[ARGS]{"q": "café ☕ 東京"}',
        (None, [("search", _args(U))]),
    ),
    (
        '[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Pa',
        ('[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Pa', []),
    ),
    (
        '[TOOL_CALLS]weather[ARGS]{"city": }',
        ('[TOOL_CALLS]weather[ARGS]{"city": }', []),
    ),
    ("[TOOL", ("[TOOL", [])),
]

CODER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "nights": {"type": "integer"},
                    "budget": {"type": "number"},
                    "breakfast": {"type": "boolean"},
                    "guests": {"type": "array"},
                    "prefs": {"type": "object"},
                    "note": {"type": ["string", "null"]},
                    "zip": {"type": "string"},
                },
            },
        },
    }
]

BOOK = (
    "<tool_call>\n<function=book>\n"
    "<parameter=city>\nSão Paulo\n</parameter>\n"
    "<parameter=nights>\n3\n</parameter>\n"
    "<parameter=budget>\n120.5\n</parameter>\n"
    "<parameter=breakfast>\nTrue\n</parameter>\n"
    '<parameter=guests>\n["ana", "bo"]\n</parameter>\n'
    '<parameter=prefs>\n{"floor": 2}\n</parameter>\n'
    "<parameter=note>\nline one\nline two\n</parameter>\n"
    "<parameter=zip>\n01310\n</parameter>\n"
    "</function>\n</tool_call>"
)
BOOK_ARGS = _args(
    {
        "city": "São Paulo",
        "nights": 3,
        "budget": 120.5,
        "breakfast": True,
        "guests": ["ana", "bo"],
        "prefs": {"floor": 2},
        "note": "line one\nline two",
        "zip": "01310",
    }
)
CODER_CASES: list[tuple[str, Parsed]] = [
    (BOOK, (None, [("book", BOOK_ARGS)])),
    (
        "I'll book it.\n" + BOOK + "\n<tool_call>\n<function=lookup>\n<parameter=n>\n7\n"
        "</parameter>\n</function>\n</tool_call>",
        ("I'll book it.\n", [("book", BOOK_ARGS), ("lookup", _args({"n": "7"}))]),
    ),
    (
        "<tool_call>\n<parameter=nights>\n3\n</parameter>\n</tool_call>",  # no function
        ("<tool_call>\n<parameter=nights>\n3\n</parameter>\n</tool_call>", []),
    ),
    (
        (
            "<tool_call>\n<function=book>\n<parameter=nights>\nthree\n</parameter>\n</function>\n"
            "</tool_call>"
        ),  # a value that does not fit its type stays text
        (None, [("book", _args({"nights": "three"}))]),
    ),
]

ALL_CASES = (
    [(HermesToolParser, c) for c in HERMES_CASES]
    + [(Llama3JsonToolParser, c) for c in LLAMA_CASES]
    + [(MistralToolParser, c) for c in MISTRAL_CASES]
    + [(Qwen3CoderToolParser, c) for c in CODER_CASES]
)


@pytest.mark.parametrize(("cls", "case"), ALL_CASES)
def test_extract(cls: type[ToolParser], case: tuple[str, Parsed]) -> None:
    text, expected = case
    assert _whole(cls(CODER_TOOLS), text) == expected


@pytest.mark.parametrize("seed", range(15))
@pytest.mark.parametrize(("cls", "case"), ALL_CASES)
def test_streamed_equals_whole(cls: type[ToolParser], case: tuple[str, Parsed], seed: int) -> None:
    text, expected = case
    assert _stream(cls(CODER_TOOLS), text, seed) == expected


def test_stream_holds_back_marker_prefix_and_emits_call_pieces() -> None:
    p = HermesToolParser()
    assert p.feed("Hi <tool_") == [{"content": "Hi "}]
    assert p.feed('call>{"name": "f", "arguments": {"a": 1}}') == []
    out = p.feed("</tool_call>")
    call_id = out[0]["tool_calls"][0]["id"]
    assert out == [
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "f", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]},
    ]
    assert p.finish() == []


def test_text_after_calls_is_content_and_separating_whitespace_dropped() -> None:
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n\nDone.'
    assert _whole(HermesToolParser(), text) == ("Done.", [("f", "{}")])
    assert _stream(HermesToolParser(), text, 3) == ("Done.", [("f", "{}")])


def test_arguments_given_as_json_string() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert _whole(HermesToolParser(), text) == (None, [("f", '{"a": 1}')])


def test_coder_without_tools_keeps_strings() -> None:
    text = "<tool_call>\n<function=f>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>"
    assert _whole(Qwen3CoderToolParser(), text) == (None, [("f", '{"n": "3"}')])


def test_tool_call_ids() -> None:
    a, b = ToolCall("f", "{}"), ToolCall("f", "{}")
    assert re.fullmatch(r"call_[0-9a-f]{24}", a.id) and a.id != b.id


def test_mistral_call_ids_are_nine_letters_or_digits() -> None:
    _, calls = MistralToolParser().extract('[TOOL_CALLS][{"name": "f", "arguments": {}}, '
                                           '{"name": "g", "arguments": {}}]')
    assert len(calls) == 2 and calls[0].id != calls[1].id
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in calls)
    _, [call] = HermesToolParser().extract('<tool_call>{"name": "f", "arguments": {}}'
                                           '</tool_call>')
    assert call.id.startswith("call_")


def test_registry() -> None:
    assert TOOL_PARSERS == {
        "hermes": HermesToolParser,
        "qwen3": HermesToolParser,
        "llama3_json": Llama3JsonToolParser,
        "mistral": MistralToolParser,
        "qwen3_coder": Qwen3CoderToolParser,
    }
