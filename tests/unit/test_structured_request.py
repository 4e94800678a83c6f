"""Reading output constraints from request bodies: response_format, structured_outputs and
the guided_* fields, each wrong shape a 400 naming its field."""

from __future__ import annotations

import pytest

from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.openai_protocol import parse_chat_request, parse_completion_request
from meshserve.shared.structured_outputs import StructuredKind, StructuredOutputs

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def constraint(body: dict[str, object], chat: bool = True) -> StructuredOutputs | None:
    if chat:
        return parse_chat_request({**CHAT, **body}).params.structured
    return parse_completion_request({**COMPLETION, **body}).params.structured


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_schema",
                         "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
    {"structured_outputs": {"json": SCHEMA}},
    {"structured_outputs": {"json": '{"type": "object", "properties": {"a": '
                                    '{"type": "integer"}}, "required": ["a"]}'}},
    {"guided_json": SCHEMA},
    {"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"},
])
def test_every_spelling_of_a_json_schema_gives_the_same_constraint(body: dict) -> None:
    for chat in (True, False):
        assert constraint(body, chat) == StructuredOutputs.json_schema(SCHEMA)


@pytest.mark.parametrize(("body", "kind", "spec"), [
    ({"response_format": {"type": "json_object"}}, StructuredKind.JSON_OBJECT, ""),
    ({"structured_outputs": {"json_object": True}}, StructuredKind.JSON_OBJECT, ""),
    ({"structured_outputs": {"regex": r"\d+"}}, StructuredKind.REGEX, r"\d+"),
    ({"guided_regex": "a|b"}, StructuredKind.REGEX, "a|b"),
    ({"structured_outputs": {"choice": ["x", "y"]}}, StructuredKind.CHOICE, '["x","y"]'),
    ({"guided_choice": ["x"]}, StructuredKind.CHOICE, '["x"]'),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredKind.GRAMMAR,
     'root ::= "a"'),
    ({"guided_grammar": 'root ::= "b"'}, StructuredKind.GRAMMAR, 'root ::= "b"'),
])
def test_each_kind_is_read(body: dict, kind: StructuredKind, spec: str) -> None:
    found = constraint(body)
    assert found is not None and (found.kind, found.spec) == (kind, spec)


def test_text_and_absent_mean_free_text() -> None:
    assert constraint({}) is None
    assert constraint({"response_format": {"type": "text"}}) is None
    assert constraint({"structured_outputs": {"json": None}}) is None


def test_disable_any_whitespace_is_carried() -> None:
    found = constraint({"structured_outputs": {"json": SCHEMA,
                                               "disable_any_whitespace": True}})
    assert found is not None and not found.any_whitespace


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "'yaml'"),
    ({"response_format": "json"}, "response_format", "object"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"json": [1]}}, "structured_outputs.json", "JSON schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "regexp"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"structured_outputs": {"choice": ["a", 3]}}, "structured_outputs.choice", "strings"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex", "non-empty"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs",
     "whitespace_pattern"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": "yes"}},
     "structured_outputs", "boolean"),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "outlines"},
     "guided_decoding_backend", "xgrammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "exactly one"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_*",
     "set only one"),
])
def test_a_wrong_constraint_is_refused_by_name(body: dict, param: str, words: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        constraint(body)
    assert refused.value.param == param and words in refused.value.message
