"""Tool calls forced with structured outputs (shared/tool_choice.py), read back whole or
as they stream.

    calls = RequiredCalls()            # tool_choice "required": [{"name", "parameters"}, ...]
    pieces = calls.feed(delta_text)    # tool_calls delta pieces, as OpenAI streams them
    pieces += calls.finish()
    content, found = calls.extract(text)

Both stream a call's arguments as the model writes them: the first piece of a call carries
its index, id, type and name, later pieces its index and an arguments piece. The arguments
are the JSON text as generated (not re-serialized), whole and streamed alike, so that the
streamed pieces always add up to the whole answer however the text is cut.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

_WHITESPACE = " \t\r\n"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ForcedCall:
    """One call read from the output: the function's name and its arguments (JSON text)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)


def _first_piece(index: int, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "id": call_id, "type": "function",
                            "function": {"name": name, "arguments": arguments}}]}


def _arguments_piece(index: int, arguments: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}


class NamedCall:
    """tool_choice naming a function: the output is that function's arguments object."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._id = new_call_id()
        self._started = False

    def extract(self, text: str) -> tuple[str | None, list[ForcedCall]]:
        return None, [ForcedCall(self.name, text, self._id)]

    def feed(self, delta: str) -> list[dict[str, Any]]:
        if not self._started:
            self._started = True
            return [_first_piece(0, self._id, self.name, delta)]
        return [_arguments_piece(0, delta)] if delta else []

    def finish(self) -> list[dict[str, Any]]:
        return [] if self._started else self.feed("")


@dataclass
class _Pending:
    """A call of the array as far as it has been read."""

    name: str | None = None
    arguments: list[str] = field(default_factory=list)
    id: str = field(default_factory=new_call_id)
    sent: int = -1  # characters of arguments streamed (-1: the first piece not sent yet)


@dataclass
class _Value:
    """The raw "parameters" value being read: nesting depth and string state."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    started: bool = False


class CallArrayScanner:
    """Follows a JSON array of {"name", "parameters"} objects one character at a time,
    keeping each call's name and the raw text of its parameters. It needs no complete
    JSON: it reads what has arrived (keys in either order, any whitespace)."""

    def __init__(self) -> None:
        self.calls: list[_Pending] = []
        self._depth = 0  # 1: inside the array, 2: inside a call object
        self._string: list[str] | None = None  # an open string at depth 2 (raw text)
        self._escaped = False
        self._key: str | None = None  # the key whose value comes at depth 2
        self._expect_key = False
        self._value: _Value | None = None  # reading "parameters" (raw)
        self._value_next = False  # "parameters" has its ':'; its value comes next

    def feed(self, text: str) -> None:
        for char in text:
            self._char(char)

    def _char(self, char: str) -> None:
        if self._value is not None:
            self._value_char(char, self._value)
        elif self._string is not None:
            self._string_char(char, self._string)
        elif self._value_next and char not in _WHITESPACE:
            self._value_next = False
            self._value = _Value()
            self._value_char(char, self._value)
        elif char == '"':
            self._string = []
        elif char in "[{":
            self._depth += 1
            if char == "{" and self._depth == 2:
                self.calls.append(_Pending())
                self._expect_key = True
        elif char in "]}":
            self._depth -= 1
        elif self._depth == 2 and char == ",":
            self._expect_key, self._key = True, None
        elif self._depth == 2 and char == ":":
            self._expect_key = False
            self._value_next = self._key == "parameters"

    def _string_char(self, char: str, raw: list[str]) -> None:
        if self._escaped:
            self._escaped = False
        elif char == "\\":
            self._escaped = True
        elif char == '"':
            self._string = None
            self._string_done("".join(raw))
            return
        raw.append(char)

    def _string_done(self, raw: str) -> None:
        if self._depth != 2:
            return  # a string inside some other value
        try:
            text = json.loads(f'"{raw}"')
        except ValueError:
            return
        if self._expect_key:
            self._key = text
        elif self._key == "name" and self.calls:
            self.calls[-1].name = text

    def _value_char(self, char: str, value: _Value) -> None:
        arguments = self.calls[-1].arguments
        if value.in_string:
            arguments.append(char)
            if value.escaped:
                value.escaped = False
            elif char == "\\":
                value.escaped = True
            elif char == '"':
                value.in_string = False
                if value.depth == 0:
                    self._value = None
            return
        if value.started and value.depth == 0 and char in ",}]" + _WHITESPACE:
            self._value = None  # a bare number, true, false or null ended
            self._char(char)
            return
        value.started = True
        arguments.append(char)
        if char == '"':
            value.in_string = True
        elif char in "[{":
            value.depth += 1
        elif char in "]}":
            value.depth -= 1
            if value.depth == 0:
                self._value = None


class RequiredCalls:
    """tool_choice "required": the output is a JSON array of {"name", "parameters"}."""

    def __init__(self) -> None:
        self._scanner = CallArrayScanner()
        self._text: list[str] = []

    def extract(self, text: str) -> tuple[str | None, list[ForcedCall]]:
        """(content, calls) of a whole output; an output that is not such an array (cut
        short by max_tokens) is content."""
        try:
            parsed = json.loads(text)
        except ValueError:
            return text or None, []
        if not isinstance(parsed, list) or not all(
                isinstance(c, dict) and isinstance(c.get("name"), str) and "parameters" in c
                for c in parsed):
            return text or None, []
        scanner = CallArrayScanner()
        scanner.feed(text)
        return None, [ForcedCall(c.name or "", "".join(c.arguments))
                      for c in scanner.calls]

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self._text.append(delta)
        self._scanner.feed(delta)
        out: list[dict[str, Any]] = []
        for index, call in enumerate(self._scanner.calls):
            if call.name is None:
                continue
            new = "".join(call.arguments[max(call.sent, 0):])
            if call.sent < 0:
                out.append(_first_piece(index, call.id, call.name, new))
            elif new:
                out.append(_arguments_piece(index, new))
            call.sent = len(call.arguments)
        return out

    def finish(self) -> list[dict[str, Any]]:
        """Nothing more unless no call could be read at all: then the text is content."""
        if any(c.sent >= 0 for c in self._scanner.calls):
            return []
        text = "".join(self._text)
        return [{"content": text}] if text else []
