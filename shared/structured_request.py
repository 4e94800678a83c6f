"""Reading a request body's output constraint: OpenAI's `response_format`, vLLM's
`structured_outputs` object and its older `guided_*` fields. At most one of them may ask
for a constraint; each wrong shape is a 400 naming the field.

    constraint = structured_outputs_of(body)   # StructuredOutputs | None
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.structured_outputs import StructuredKind, StructuredOutputs

# vLLM's `structured_outputs` keys that pick the constraint (exactly one may be set).
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# The `guided_*` fields and the `structured_outputs` key each stands for.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
# Backends a request may name: the one meshserve runs, or "let the server choose".
_BACKENDS = (None, "auto", "xgrammar")
_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
            "whitespace_pattern", *_KINDS)


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def structured_outputs_of(body: Mapping[str, Any]) -> StructuredOutputs | None:
    """The constraint `body` asks for, or None for free text."""
    found = [(name, c) for name, c in (
        ("response_format", _from_response_format(body.get("response_format"))),
        ("structured_outputs", _from_vllm(body.get("structured_outputs"), "structured_outputs")),
        ("guided_*", _from_guided(body)),
    ) if c is not None]
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise _bad(f"{names} both constrain the output; set only one", found[1][0])
    return found[0][1] if found else None


def _from_response_format(value: object) -> StructuredOutputs | None:
    param = "response_format"
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _bad("'response_format' must be an object", param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(StructuredKind.JSON_OBJECT)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping):
            raise _bad("'response_format.json_schema' must be an object with a 'schema'",
                       param)
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            raise _bad("'response_format.json_schema.schema' is required", param)
        return StructuredOutputs.json_schema(schema, param=param)
    if kind == "structural_tag":
        return StructuredOutputs(StructuredKind.STRUCTURAL_TAG,
                                 orjson.dumps(dict(value)).decode())
    raise _bad(f"'response_format.type' must be 'text', 'json_object', 'json_schema' or "
               f"'structural_tag', got {kind!r}", param)


def _from_vllm(value: object, param: str) -> StructuredOutputs | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _bad(f"'{param}' must be an object", param)
    unknown = [key for key in value if key not in _OPTIONS]
    if unknown:
        raise _bad(f"'{param}.{unknown[0]}' is not a structured outputs option "
                   f"(known: {', '.join(_OPTIONS)})", param)
    chosen = [key for key in _KINDS if value.get(key) not in (None, False)]
    if not chosen:
        return None
    if len(chosen) > 1:
        raise _bad(f"'{param}' sets {' and '.join(chosen)}; set exactly one", param)
    _check_options(value, param)
    any_whitespace = not _flag(value, "disable_any_whitespace", param)
    return _constraint(chosen[0], value[chosen[0]], any_whitespace, f"{param}.{chosen[0]}")


def _check_options(value: Mapping[str, Any], param: str) -> None:
    for key in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
        _flag(value, key, param)
    if value.get("whitespace_pattern") is not None:
        raise _bad(f"'{param}.whitespace_pattern' is not supported by the xgrammar backend "
                   "(use disable_any_whitespace for compact JSON)", param)
    if _flag(value, "disable_additional_properties", param):
        raise _bad(f"'{param}.disable_additional_properties' is not supported by the xgrammar "
                   "backend (set additionalProperties: false in the schema)", param)


def _flag(value: Mapping[str, Any], key: str, param: str) -> bool:
    flag = value.get(key)
    if flag is not None and not isinstance(flag, bool):
        raise _bad(f"'{param}.{key}' must be a boolean", param)
    return bool(flag)


def _constraint(kind: str, value: object, any_whitespace: bool, param: str
                ) -> StructuredOutputs:
    if kind == "json":
        if isinstance(value, (str, Mapping)):
            return StructuredOutputs.json_schema(value, any_whitespace=any_whitespace,
                                                 param=param)
        raise _bad(f"'{param}' must be a JSON schema (an object or its JSON text)", param)
    if kind == "json_object":
        if value is not True:
            raise _bad(f"'{param}' must be true", param)
        return StructuredOutputs(StructuredKind.JSON_OBJECT, "", any_whitespace)
    if kind == "choice":
        if not isinstance(value, list):
            raise _bad(f"'{param}' must be an array of strings", param)
        return StructuredOutputs.choices(value, param=param)
    if not isinstance(value, str) or not value:
        raise _bad(f"'{param}' must be a non-empty string", param)
    return StructuredOutputs(StructuredKind(kind), value, any_whitespace)


def _from_guided(body: Mapping[str, Any]) -> StructuredOutputs | None:
    backend = body.get("guided_decoding_backend")
    if backend not in _BACKENDS:
        raise _bad(f"'guided_decoding_backend' {backend!r} is not available; meshserve "
                   "compiles grammars with xgrammar", "guided_decoding_backend")
    if body.get("guided_whitespace_pattern") is not None:
        raise _bad("'guided_whitespace_pattern' is not supported by the xgrammar backend",
                   "guided_whitespace_pattern")
    chosen = [(name, key) for name, key in _GUIDED.items() if body.get(name) is not None]
    if not chosen:
        return None
    if len(chosen) > 1:
        raise _bad(f"{' and '.join(n for n, _ in chosen)} are both set; set exactly one",
                   chosen[1][0])
    name, key = chosen[0]
    return _constraint(key, body[name], True, name)
