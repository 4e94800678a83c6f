"""One chat choice's text -> the assistant message: reasoning split off, tool calls parsed.

    output = ChoiceOutput(settings)
    pieces = output.feed(delta_text)       # streamed: delta dicts (content, reasoning_content,
    pieces += output.finish()              #   tool_calls), merged per chunk by `merge_pieces`
    fields, called = output.message(text)  # whole: the message's fields

A required or named tool choice was enforced with structured outputs (shared/tool_choice.py),
so its JSON always parses here (services/gateway/parsers/forced_calls.py); `auto` runs the parser
chosen by --tool-call-parser over the content, after the reasoning parser (--reasoning-parser)
has taken the reasoning out. parallel_tool_calls false keeps the first call only (as vLLM).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from meshserve.services.gateway.parsers.forced_calls import NamedCall, RequiredCalls
from meshserve.shared.tool_choice import ToolChoice


class Call(Protocol):
    name: str
    arguments: str
    id: str


class Parser(Protocol):
    """A tool-call or reasoning parser (parsers/tool_parsers.py, reasoning_parsers.py)."""

    def feed(self, delta: str) -> list[dict[str, Any]]: ...

    def finish(self) -> list[dict[str, Any]]: ...


@dataclass(frozen=True)
class ChatOutputSettings:
    """How a chat request's choices are read back: its tool choice and tools, and the
    gateway's parsers (None: none configured)."""

    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    tools: tuple[dict[str, Any], ...] = ()
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    include_reasoning: bool = True
    parallel_tool_calls: bool = True  # False: only the first call is returned (as vLLM)

    @property
    def parses_tools(self) -> bool:
        return self.tool_choice.mode in ("required", "named") or (
            self.tool_choice.mode == "auto" and self.tool_parser is not None and bool(self.tools))

    @property
    def active(self) -> bool:
        """Whether the output needs any reading back at all."""
        return self.parses_tools or self.reasoning_parser is not None


def _tool_parser(settings: ChatOutputSettings) -> Any:
    choice = settings.tool_choice
    if choice.mode == "named":
        assert choice.name is not None
        return NamedCall(choice.name)
    if choice.mode == "required":
        return RequiredCalls()
    from meshserve.services.gateway.parsers.tool_parsers import TOOL_PARSERS

    assert settings.tool_parser is not None
    return TOOL_PARSERS[settings.tool_parser](list(settings.tools))


def _reasoning_parser(settings: ChatOutputSettings) -> Any:
    from meshserve.services.gateway.parsers.reasoning_parsers import REASONING_PARSERS

    assert settings.reasoning_parser is not None
    return REASONING_PARSERS[settings.reasoning_parser](field="reasoning_content")


class ChoiceOutput:
    """Reads one choice's text back into message fields, whole or streamed."""

    def __init__(self, settings: ChatOutputSettings) -> None:
        self.settings = settings
        self._tools = _tool_parser(settings) if settings.parses_tools else None
        self._reasoning = (_reasoning_parser(settings) if settings.reasoning_parser
                           else None)
        self.called = False  # a tool call was sent (streaming)

    def message(self, text: str, finish_reason: str | None = None
                ) -> tuple[dict[str, Any], bool]:
        """The message's fields for the whole text, and whether it holds tool calls. A
        forced call answers `content: ""` beside its calls; one cut by max_tokens
        (`finish_reason` "length") is no call, its text the content (as vLLM and OpenAI)."""
        fields: dict[str, Any] = {"content": text or None}
        content = text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.extract(text)
            content = content or ""
            fields["content"] = content or None
            if self.settings.include_reasoning:
                # vLLM's newer name too: clients of either generation find it.
                fields["reasoning_content"] = fields["reasoning"] = reasoning
        if self._tools is None:
            return fields, False
        forced = self.settings.tool_choice.mode in ("required", "named")
        if forced and finish_reason == "length":
            fields["content"] = content
            return fields, False
        leftover, calls = self._tools.extract(content)
        fields["content"] = "" if forced and calls else leftover
        if not self.settings.parallel_tool_calls:
            calls = calls[:1]
        if calls:
            fields["tool_calls"] = [{"id": c.id, "type": "function",
                                     "function": {"name": c.name, "arguments": c.arguments}}
                                    for c in calls]
        return fields, bool(calls)

    def feed(self, text: str) -> list[dict[str, Any]]:
        pieces = self._reasoning.feed(text) if self._reasoning else [{"content": text}]
        return self._after_reasoning(pieces)

    def finish(self) -> list[dict[str, Any]]:
        pieces = self._reasoning.finish() if self._reasoning else []
        out = self._after_reasoning(pieces)
        if self._tools is not None:
            out += self._note(self._tools.finish())
        return out

    def _after_reasoning(self, pieces: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for piece in pieces:
            if "reasoning_content" in piece:
                if self.settings.include_reasoning:
                    out.append(dict(piece))
            elif self._tools is not None:
                out += self._note(self._tools.feed(piece.get("content") or ""))
            elif piece.get("content"):
                out.append(dict(piece))
        return out

    def _note(self, pieces: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not self.settings.parallel_tool_calls:
            pieces = [p for p in map(_first_call_only, pieces) if p]
        self.called = self.called or any(p.get("tool_calls") for p in pieces)
        return pieces


def _first_call_only(piece: dict[str, Any]) -> dict[str, Any]:
    """`piece` without the deltas of calls after the first (parallel_tool_calls false)."""
    if "tool_calls" not in piece:
        return piece
    calls = [c for c in piece["tool_calls"] if c["index"] == 0]
    rest = {k: v for k, v in piece.items() if k != "tool_calls"}
    return {**rest, "tool_calls": calls} if calls else rest


def merge_pieces(pieces: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One chunk delta from parser pieces: texts joined, a call's pieces joined by index."""
    delta: dict[str, Any] = {}
    calls: dict[int, dict[str, Any]] = {}
    for piece in pieces:
        for key in ("reasoning_content", "content"):
            if piece.get(key):
                delta[key] = delta.get(key, "") + piece[key]
        for call in piece.get("tool_calls") or ():
            known = calls.get(call["index"])
            if known is None:
                calls[call["index"]] = {**call, "function": dict(call.get("function", {}))}
                continue
            function = call.get("function", {})
            for key in ("name", "arguments"):
                if key in function:
                    known["function"][key] = known["function"].get(key, "") + function[key]
    if calls:
        delta["tool_calls"] = [calls[i] for i in sorted(calls)]
    if "reasoning_content" in delta:
        delta["reasoning"] = delta["reasoning_content"]  # vLLM's newer name
    return delta
