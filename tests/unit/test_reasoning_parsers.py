"""Reasoning parsers: exact splits, and streamed parses equal to whole-text parses."""

from __future__ import annotations

import random

import pytest

from meshserve.services.gateway.parsers.reasoning_parsers import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
)


def _stream(parser: ReasoningParser, text: str, seed: int) -> tuple[str | None, str | None]:
    rng = random.Random(seed)
    pieces: list[dict] = []
    pos = 0
    while pos < len(text):
        n = rng.randint(1, 6)
        pieces += parser.feed(text[pos : pos + n])
        pos += n
    pieces += parser.finish()
    for p in pieces:
        assert len(p) == 1 and next(iter(p.values())), p  # one non-empty field per piece
    reasoning = "".join(p[parser.field] for p in pieces if parser.field in p)
    content = "".join(p["content"] for p in pieces if "content" in p)
    return reasoning or None, content or None


R1_CASES = [
    (
        "<think>step 1\nstep 2</think>\n\nThe answer is 4.",
        ("step 1\nstep 2", "\n\nThe answer is 4."),
    ),
    (
        "step 1 (think opened in prompt)</think>Answer",
        ("step 1 (think opened in prompt)", "Answer"),
    ),
    ("<think>cut off while thinking", ("cut off while thinking", None)),
    ("no markers at all", ("no markers at all", None)),
    ("<think></think>only content", (None, "only content")),
    ("<think>思考：x < y</think>答案 ✓", ("思考：x < y", "答案 ✓")),
    ("<think>a</think>b</think>c", ("a", "b</think>c")),
    ("", (None, None)),
    ("<thi", ("<thi", None)),
]

QWEN3_CASES = [
    ("<think>plan</think>\n\nHello", ("plan", "\n\nHello")),
    ("Hello, no thinking", (None, "Hello, no thinking")),
    ("text then </think> later", (None, "text then </think> later")),
    ("<think>cut off", ("cut off", None)),
    ("<think>\n日本語で考える\n</think>答え", ("\n日本語で考える\n", "答え")),
    ("<thi", (None, "<thi")),
    ("", (None, None)),
]


@pytest.mark.parametrize(("text", "expected"), R1_CASES)
def test_deepseek_r1_extract(text: str, expected: tuple[str | None, str | None]) -> None:
    assert DeepSeekR1ReasoningParser().extract(text) == expected


@pytest.mark.parametrize(("text", "expected"), QWEN3_CASES)
def test_qwen3_extract(text: str, expected: tuple[str | None, str | None]) -> None:
    assert Qwen3ReasoningParser().extract(text) == expected


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize(
    ("cls", "case"),
    [(DeepSeekR1ReasoningParser, c) for c in R1_CASES]
    + [(Qwen3ReasoningParser, c) for c in QWEN3_CASES],
)
def test_streamed_equals_whole(cls: type[ReasoningParser], case: tuple, seed: int) -> None:
    text, expected = case
    assert _stream(cls(), text, seed) == expected


def test_stream_holds_back_partial_end_marker() -> None:
    p = DeepSeekR1ReasoningParser()
    assert p.feed("<think>abc</th") == [{"reasoning": "abc"}]
    assert p.feed("ink>x") == [{"content": "x"}]
    assert p.finish() == []


def test_field_name_is_configurable() -> None:
    p = Qwen3ReasoningParser(field="reasoning_content")
    assert p.feed("<think>a</think>b") == [{"reasoning_content": "a"}, {"content": "b"}]
    assert p.extract("<think>a</think>b") == ("a", "b")


def test_registry() -> None:
    assert REASONING_PARSERS == {
        "deepseek_r1": DeepSeekR1ReasoningParser,
        "qwen3": Qwen3ReasoningParser,
    }
