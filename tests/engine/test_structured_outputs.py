"""Structured outputs in the engine: every output of a random-weight model follows its
constraint (JSON schemas, regex, choice, grammar), sampled and greedy, n > 1, in the
overlapped loop too; constrained rows never change unconstrained ones; the engine thread
keeps serving while a grammar compiles."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from engine_features import grammars_of
from tiny_models import build_tiny_model
from transformers import AutoTokenizer

from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.serving.engine_thread import EngineThread
from meshserve.services.worker.structured.grammars import (
    choice_grammar,
    new_matcher,
    strict_json_strings,
)
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.sampling_params import SamplingParams
from meshserve.shared.structured_outputs import StructuredKind, StructuredOutputs

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object",
     "properties": {"name": {"type": "string", "pattern": "^[A-Za-z0-9 _-]{1,12}$"},
                    "age": {"type": "integer", "minimum": 0, "maximum": 130},
                    "score": {"type": "number", "minimum": -1.5, "maximum": 2.5}},
     "required": ["name", "age", "score"], "additionalProperties": False},
    {"type": "object",
     "properties": {"user": {"type": "object",
                             "properties": {"id": {"type": "integer", "minimum": 1,
                                                   "maximum": 999},
                                            "role": {"enum": ["admin", "guest", "owner"]}},
                             "required": ["id", "role"]},
                    "tags": {"type": "array",
                             "items": {"type": "string", "pattern": "^[A-Za-z0-9 _-]{1,6}$"},
                             "minItems": 1, "maxItems": 3}},
     "required": ["user", "tags"]},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4},
    {"type": "object",
     "properties": {"kind": {"const": "point"},
                    "xy": {"type": "array", "items": {"type": "integer", "minimum": -9,
                                                      "maximum": 9},
                           "minItems": 2, "maxItems": 2},
                    "label": {"anyOf": [{"type": "null"}, {"enum": ["a", "b"]}]}},
     "required": ["kind", "xy", "label"]},
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("so-llama"), "llama", seed=11,
                            max_position_embeddings=2048)


@pytest.fixture(scope="module")
def tokenizer(folder: Path) -> Any:
    return AutoTokenizer.from_pretrained(folder)


def make_engine(folder: Path, **overrides: object) -> LLMEngine:
    config = {"model": str(folder), "device": "cpu", "dtype": "float32",
              "num_kv_blocks": 1024, "max_model_len": 2048, **overrides}
    return build_engine(EngineConfig(**config))  # type: ignore[arg-type]


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
        ) -> dict[tuple[str, int], tuple[list[int], str]]:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    tokens: dict[tuple[str, int], list[int]] = {}
    reasons: dict[tuple[str, int], str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            key = (out.request_id, out.index)
            tokens.setdefault(key, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                reasons[key] = out.finish_reason
    return {key: (tokens[key], reasons[key]) for key in tokens}


def text(tokenizer: Any, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_every_sampled_output_follows_its_json_schema(folder: Path, tokenizer: Any,
                                                      async_scheduling: str) -> None:
    engine = make_engine(folder, async_scheduling=async_scheduling)
    requests = {f"s{i}-{seed}": ([1 + i, 7, 9, 30 + seed], SamplingParams(
        n=2, temperature=1.0, seed=seed, max_tokens=400,
        structured=StructuredOutputs.json_schema(schema)))
        for i, schema in enumerate(SCHEMAS) for seed in range(3)}
    results = run(engine, requests)
    assert len(results) == 2 * len(requests)
    for (request_id, index), (tokens, reason) in results.items():
        schema = SCHEMAS[int(request_id[1:].split("-")[0])]
        assert reason == "stop", (request_id, index, text(tokenizer, tokens))
        jsonschema.validate(json.loads(text(tokenizer, tokens)), schema)


def test_regex_choice_and_grammar_outputs_match(folder: Path, tokenizer: Any) -> None:
    grammar = ('root ::= "(" num " " op " " num ")"\n'
               'num ::= [1-9] [0-9]?\nop ::= "+" | "-" | "*"')
    specs = {
        "regex": (StructuredOutputs(StructuredKind.REGEX, r"[A-Z][a-z]{2,5}-\d{3}"),
                  re.compile(r"[A-Z][a-z]{2,5}-\d{3}")),
        "choice": (StructuredOutputs.choices(["red", "green", 'say "hi"\n']),
                   re.compile(r'red|green|say "hi"\n')),
        "grammar": (StructuredOutputs(StructuredKind.GRAMMAR, grammar),
                    re.compile(r"\([1-9][0-9]? [+*-] [1-9][0-9]?\)")),
    }
    requests = {f"{name}-{seed}": ([5, 6, 7 + seed], SamplingParams(
        n=3, temperature=1.0, seed=seed, max_tokens=64, structured=spec))
        for name, (spec, _) in specs.items() for seed in range(4)}
    requests["greedy-regex"] = ([3, 4], SamplingParams(
        temperature=0.0, max_tokens=64, structured=specs["regex"][0]))
    results = run(make_engine(folder), requests)
    seen_choices = set()
    for (request_id, _), (tokens, reason) in results.items():
        name = request_id.split("-")[0]
        pattern = specs["regex" if name == "greedy" else name][1]
        output = text(tokenizer, tokens)
        assert reason == "stop" and pattern.fullmatch(output), (request_id, output)
        if name == "choice":
            seen_choices.add(output)
    assert len(seen_choices) >= 2  # sampling really picks among the options


def test_constrained_rows_leave_the_others_untouched(folder: Path) -> None:
    free = {f"free{i}": ([2 + i, 8, 4], SamplingParams(temperature=0.0, max_tokens=24,
                                                      ignore_eos=True)) for i in range(3)}
    alone = run(make_engine(folder), free)
    mixed = run(make_engine(folder), {**free, **{
        f"json{i}": ([9, i + 1], SamplingParams(
            temperature=1.0, seed=i, max_tokens=200,
            structured=StructuredOutputs.json_schema(SCHEMAS[i]))) for i in range(3)}})
    for key, value in alone.items():
        assert mixed[key] == value


def test_a_resumed_sequence_continues_inside_its_grammar(folder: Path, tokenizer: Any) -> None:
    spec = StructuredOutputs.json_schema(SCHEMAS[0])
    params = SamplingParams(temperature=0.0, max_tokens=300, structured=spec)
    whole = run(make_engine(folder), {"r": ([4, 4, 2], params)})[("r", 0)][0]
    engine = make_engine(folder)
    engine.add_request("r", [4, 4, 2], params, resumed={0: whole[:5]})
    rest = run(engine, {})[("r", 0)][0]
    assert whole[:5] + rest == whole
    with pytest.raises(InvalidRequestError, match="does not follow"):
        make_engine(folder).add_request("bad", [4, 4, 2], params,
                                        resumed={0: tokenizer.encode("nope")})


@pytest.mark.parametrize(("spec", "message"), [
    (StructuredOutputs(StructuredKind.JSON, '{"type": "object", "properties": 3}'),
     "invalid JSON schema"),
    (StructuredOutputs(StructuredKind.REGEX, "[unclosed"), "invalid regular expression"),
    (StructuredOutputs(StructuredKind.GRAMMAR, "root ::= missing_rule"), "invalid grammar"),
])
def test_an_invalid_constraint_is_a_request_error(folder: Path, spec: StructuredOutputs,
                                                  message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as caught:
        make_engine(folder).add_request("r", [1, 2], SamplingParams(structured=spec))
    assert caught.value.param == "structured_outputs"


def test_backend_none_refuses_constrained_requests(folder: Path) -> None:
    engine = make_engine(folder, structured_outputs_backend="none")
    with pytest.raises(InvalidRequestError, match="switched off"):
        engine.add_request("r", [1, 2], SamplingParams(
            structured=StructuredOutputs(StructuredKind.JSON_OBJECT)))


def test_a_length_bounded_string_admits_no_control_character_or_surrogate(
        folder: Path) -> None:
    # Outputs of random weights elsewhere use patterns: xgrammar also lets overlong UTF-8
    # through, which only such models write (recorded in docs/behaviour.md).
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}}
    assert strict_json_strings(schema)["properties"]["s"] == {
        "type": "string", "pattern": '^[^\\x00-\\x1f"\\\\\\ud800-\\udfff]{0,4}$'}
    grammar = grammars_of(make_engine(folder)).compile(StructuredOutputs.json_schema(schema))
    for text, fits in [(b'{"s": "ab\xc3\xa9"}', True), (b'{"s": "abcde"}', False),
                       (b'{"s": "a\x08"}', False), (b'{"s": "a\tb"}', False),
                       (b'{"s": "\xed\xa5\xb6"}', False)]:
        matcher = new_matcher(grammar, [])
        assert (matcher.accept_string(text) and matcher.is_completed()) == fits, text


def test_a_structural_tag_constrains_only_what_follows_its_trigger(folder: Path,
                                                                  tokenizer: Any) -> None:
    tag = {"type": "structural_tag", "triggers": ["<f>"], "structures": [
        {"begin": "<f>", "end": "</f>", "schema": {
            "type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                   "maximum": 9}},
            "required": ["n"], "additionalProperties": False}}]}
    spec = StructuredOutputs(StructuredKind.STRUCTURAL_TAG, json.dumps(tag))
    grammar = grammars_of(make_engine(folder)).compile(spec)
    for text, fits in [("free text <f>{\"n\": 3}</f> more", True),
                       ("<f>{\"n\": 12}</f>", False), ("no tags at all", True)]:
        matcher = new_matcher(grammar, [])
        assert matcher.accept_string(text) == fits, text


def test_choice_grammar_escapes_quotes_and_newlines() -> None:
    assert choice_grammar(['a"b', "c\\d", "e\nf"]) == r'root ::= "a\"b" | "c\\d" | "e\nf"'


def test_the_engine_serves_others_while_a_grammar_compiles(folder: Path, tokenizer: Any) -> None:
    engine = make_engine(folder)
    release = threading.Event()
    original = grammars_of(engine)._compile

    def held_compile(spec: StructuredOutputs) -> Any:
        assert release.wait(30), "the test never released the compile"
        return original(spec)

    grammars_of(engine)._compile = held_compile  # type: ignore[method-assign]

    async def scenario() -> tuple[list[int], list[int], str]:
        thread = EngineThread(engine)
        thread.start()
        constrained = thread.submit("slow", [[3, 1]], SamplingParams(
            temperature=0.0, max_tokens=64,
            structured=StructuredOutputs(StructuredKind.REGEX, r"[a-z]{4}")))
        free = thread.submit("fast", [[2, 2]], SamplingParams(temperature=0.0, max_tokens=8,
                                                              ignore_eos=True))
        free_tokens = await collect(free)
        compiled_yet = "done" if constrained.finished else "waiting"
        release.set()
        slow_tokens = await collect(constrained)
        thread.stop()
        await thread.wait_stopped()
        return free_tokens, slow_tokens, compiled_yet

    free_tokens, slow_tokens, state = asyncio.run(scenario())
    assert len(free_tokens) == 8 and state == "waiting"
    assert re.fullmatch(r"[a-z]{4}", text(tokenizer, slow_tokens))


async def collect(stream: Any) -> list[int]:
    tokens: list[int] = []
    while (update := await stream.next()) is not None:
        for delta in update.deltas:
            tokens.extend(delta.token_ids)
    return tokens
