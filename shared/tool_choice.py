"""What a chat request asks of tools: `tool_choice` and `parallel_tool_calls`, read and
checked, and the JSON schema that forces a call when the request requires one.

    choice = read_tool_choice(body.get("tool_choice"), tools)   # ToolChoice
    constraint = choice.constraint(tools, parallel=True)        # StructuredOutputs | None

`required` makes the model write a JSON array of {"name", "parameters"} objects, one of
the tools each; a named function makes it write that function's arguments object.
Both are enforced with structured outputs, so the calls always parse (as vLLM does), in
compact JSON (arguments are for programs, and a model cannot spend its tokens on spaces).
A function's `$defs` move to the top of the array schema, where its `#/$defs/...`
references find them (as vLLM's `get_json_schema_from_tools`); two functions defining one
name differently are refused, as vLLM refuses them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.structured_outputs import StructuredOutputs

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _bad(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param="tool_choice")


@dataclass(frozen=True)
class ToolChoice:
    """`mode` is "none", "auto", "required" or "named" (then `name` is the function);
    `explicit` tells whether the body set it (an absent one is "auto" with tools)."""

    mode: str = "none"
    name: str | None = None
    explicit: bool = False

    def constraint(self, tools: Sequence[Mapping[str, Any]], *, parallel: bool = True
                   ) -> StructuredOutputs | None:
        """The output constraint that enforces this choice (None for none / auto)."""
        if self.mode == "named":
            function = next(t["function"] for t in tools if t["function"]["name"] == self.name)
            return StructuredOutputs.json_schema(_parameters(function), any_whitespace=False,
                                                 param="tools")
        if self.mode == "required":
            return StructuredOutputs.json_schema(required_calls_schema(tools, parallel),
                                                 any_whitespace=False, param="tools")
        return None


def read_tool_choice(value: object, tools: Sequence[Mapping[str, Any]] | None) -> ToolChoice:
    """The request's tool choice; a named function must be one of `tools`."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise _bad("tool_choice 'required' needs 'tools'")
        return ToolChoice(str(value), explicit=True)
    function = value.get("function") if isinstance(value, Mapping) else None
    if (not isinstance(value, Mapping) or value.get("type") != "function"
            or not isinstance(function, Mapping) or not isinstance(function.get("name"), str)):
        raise _bad("'tool_choice' must be 'none', 'auto', 'required' or "
                   "{'type': 'function', 'function': {'name': ...}}")
    name = function["name"]
    if not any(t["function"]["name"] == name for t in tools or ()):
        raise _bad(f"tool_choice names the function {name!r}, which is not in 'tools'")
    return ToolChoice("named", name, explicit=True)


def required_calls_schema(tools: Sequence[Mapping[str, Any]], parallel: bool
                          ) -> dict[str, Any]:
    """An array of calls, each {"name": one tool's name, "parameters": its arguments}."""
    parameters = [_parameters(t["function"]) for t in tools]
    defs = _hoisted_defs(parameters)
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": p},
              "required": ["name", "parameters"]} for t, p in zip(tools, parameters)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _hoisted_defs(parameters: list[dict[str, Any]]) -> dict[str, Any]:
    """The functions' `$defs` taken out of `parameters` (changed in place) and merged."""
    merged: dict[str, Any] = {}
    for schema in parameters:
        defs = schema.pop("$defs", None)
        for name, definition in (defs.items() if isinstance(defs, Mapping) else ()):
            if merged.get(name, definition) != definition:
                raise InvalidRequestError(f"Tool definition '{name}' has multiple schemas, "
                                          "which is not supported.", param="tools")
            merged[name] = definition
    return merged


def _parameters(function: Mapping[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    return dict(parameters) if isinstance(parameters, Mapping) and parameters else _ANY_OBJECT
