"""What a request constrains its output to: a JSON schema, any JSON object, a regex, one of
a list of choices, or a grammar. Torch-free: the gateway builds it from the request body,
the worker compiles it (with xgrammar) and masks each step's logits with it.

    StructuredOutputs.json_schema({"type": "object", ...})
    StructuredOutputs(StructuredKind.REGEX, r"\\d{3}-\\d{4}")
    StructuredOutputs.choices(["yes", "no"])
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from meshserve.shared.errors import InvalidRequestError


class StructuredKind(enum.Enum):
    """What `StructuredOutputs.spec` holds."""

    JSON = "json"  # a JSON schema, as JSON text
    JSON_OBJECT = "json_object"  # any JSON object; spec is empty
    REGEX = "regex"  # a regular expression the whole output matches
    CHOICE = "choice"  # a JSON array of strings; the output is exactly one of them
    GRAMMAR = "grammar"  # an EBNF grammar (xgrammar's GBNF dialect) whose root is `root`
    STRUCTURAL_TAG = "structural_tag"  # an xgrammar structural tag, as JSON text


@dataclass(frozen=True)
class StructuredOutputs:
    """One request's output constraint. `spec` is text in every kind (a JSON schema's
    key order is kept: generated objects follow its order of properties)."""

    kind: StructuredKind
    spec: str = ""
    # JSON kinds: whether whitespace between tokens is free (False: compact JSON only).
    any_whitespace: bool = True

    def __post_init__(self) -> None:
        if self.kind is StructuredKind.JSON_OBJECT:
            if self.spec:
                raise InvalidRequestError("a json_object constraint takes no spec",
                                          param="response_format")
            return
        if not self.spec:
            raise InvalidRequestError(f"the {self.kind.value} constraint is empty",
                                      param="structured_outputs")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str | bool, *,
                    any_whitespace: bool = True, param: str = "response_format"
                    ) -> StructuredOutputs:
        """A JSON-schema constraint from a parsed schema or its JSON text."""
        if isinstance(schema, str):
            try:
                schema = orjson.loads(schema)
            except orjson.JSONDecodeError as exc:
                raise InvalidRequestError(f"'{param}' is not valid JSON: {exc}",
                                          param=param) from None
        if isinstance(schema, bool) or not isinstance(schema, Mapping):
            raise InvalidRequestError(f"'{param}' must be a JSON schema object", param=param)
        text = orjson.dumps(schema).decode()  # key order kept: properties come in it
        return cls(StructuredKind.JSON, text, any_whitespace)

    @classmethod
    def choices(cls, options: Sequence[str], *, param: str = "structured_outputs"
                ) -> StructuredOutputs:
        if not options or not all(isinstance(o, str) and o for o in options):
            raise InvalidRequestError(f"'{param}' choices must be a non-empty array of "
                                      "non-empty strings", param=param)
        return cls(StructuredKind.CHOICE, orjson.dumps(list(options)).decode())

    @property
    def choice_list(self) -> list[str]:
        """The options of a CHOICE constraint."""
        assert self.kind is StructuredKind.CHOICE, f"{self.kind} has no choices"
        return list(orjson.loads(self.spec))

    @property
    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar: equal keys compile to equal grammars."""
        return (self.kind.value, self.spec, self.any_whitespace)
