"""Reading a chat choice back: reasoning split off, tool calls parsed with the configured
parser; streamed pieces merged per chunk add up to the whole message."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from meshserve.services.gateway.parsers.chat_output import (
    ChatOutputSettings,
    ChoiceOutput,
    merge_pieces,
)
from meshserve.shared.tool_choice import ToolChoice

TOOLS = ({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}},)
TEXT = ('<think>The user wants weather.</think>Let me check. '
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')


def streamed(settings: ChatOutputSettings, text: str, seed: int) -> dict[str, Any]:
    """The whole message rebuilt from chunk deltas of random sizes."""
    output, rng, at = ChoiceOutput(settings), random.Random(seed), 0
    message: dict[str, Any] = {"content": "", "reasoning_content": "", "calls": {}}
    while at <= len(text):
        size = rng.randint(1, 7)
        pieces = output.feed(text[at:at + size])
        at += size
        if at > len(text):
            pieces += output.finish()
        delta = merge_pieces(pieces)
        message["content"] += delta.get("content", "")
        message["reasoning_content"] += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", ()):
            known = message["calls"].setdefault(call["index"], {"arguments": ""})
            known.setdefault("name", call["function"].get("name"))
            known["arguments"] += call["function"].get("arguments", "")
    message["called"] = output.called
    return message


@pytest.mark.parametrize("seed", range(8))
def test_auto_with_hermes_and_deepseek_reasoning(seed: int) -> None:
    settings = ChatOutputSettings(ToolChoice("auto"), TOOLS, "hermes", "deepseek_r1")
    fields, called = ChoiceOutput(settings).message(TEXT)
    assert called and fields["reasoning_content"] == "The user wants weather."
    assert fields["content"].strip() == "Let me check."
    [call] = fields["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    again = streamed(settings, TEXT, seed)
    assert again["called"] and again["reasoning_content"] == fields["reasoning_content"]
    assert again["content"] == fields["content"]
    assert again["calls"] == {0: {"name": "get_weather",
                                  "arguments": call["function"]["arguments"]}}


def test_include_reasoning_false_drops_it_and_no_parser_leaves_text() -> None:
    settings = ChatOutputSettings(ToolChoice("auto"), TOOLS, None, "deepseek_r1",
                                  include_reasoning=False)
    fields, called = ChoiceOutput(settings).message(TEXT)
    assert not called and "reasoning_content" not in fields
    assert fields["content"].startswith("Let me check. <tool_call>")
    assert streamed(settings, TEXT, 1)["reasoning_content"] == ""


def test_a_named_call_streams_its_arguments_as_generated() -> None:
    settings = ChatOutputSettings(ToolChoice("named", "get_weather", True), TOOLS)
    text = '{"city": "Oslo"}'
    fields, _ = ChoiceOutput(settings).message(text)
    assert fields["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": text}
    assert streamed(settings, text, 3)["calls"] == {0: {"name": "get_weather",
                                                        "arguments": text}}
