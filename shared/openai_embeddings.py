"""POST /v1/embeddings at the edge: the request body in, OpenAI's response body out.

Request: `input` (a string, an array of strings, an array of token ids, or an array of
arrays of token ids; none empty), `model`, `encoding_format` ("float" or "base64"),
`dimensions`, `user`, and vLLM's `truncate_prompt_tokens`, `add_special_tokens` and
`normalize`. As for the other endpoints, a schema field meshserve does not implement is
refused with a 400 naming it; keys outside the schemas are ignored.

Response: `{"object": "list", "data": [{"object": "embedding", "index": i,
"embedding": [...] | "<base64>"}], "model", "usage": {"prompt_tokens", "total_tokens"}}`;
base64 is OpenAI's: the vector's little-endian float32 bytes. Torch-free (gateway side).
"""

from __future__ import annotations

import base64
import sys
from array import array
from dataclasses import dataclass
from typing import Any, Literal

from meshserve.shared.openai_protocol import _bad, _Fields, _is_token_id, _refuse_unsupported

EMBEDDINGS_URL = "/v1/embeddings"
EncodingFormat = Literal["float", "base64"]
_FLOAT32_BYTES = 4

# vLLM embedding request fields meshserve does not implement (harmless values pass).
UNSUPPORTED_EMBEDDING_FIELDS: dict[str, tuple[tuple[object, ...], str]] = {
    "messages": ((), "chat-style embedding inputs are not supported; send 'input'"),
    "chat_template": ((), "chat-style embedding inputs are not supported"),
    "mm_processor_kwargs": ((), "multimodal inputs are not supported"),
    "embed_dtype": (("float32",), "embeddings are float32"),
    "endianness": (("native", "little"), "base64 embeddings are little-endian"),
    "request_id": ((), "a request id in the body is not supported"),
    "use_activation": ((), "use_activation is not supported; see 'normalize'"),
}

EmbeddingInput = str | tuple[int, ...]


@dataclass(frozen=True)
class EmbeddingRequest:
    """A validated /v1/embeddings body; `inputs` has one entry per vector asked for."""

    inputs: tuple[EmbeddingInput, ...]
    model: str | None = None
    encoding_format: EncodingFormat = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    """Keep only each input's last N tokens (vLLM's field); -1: the model's context length."""
    add_special_tokens: bool = True
    normalize: bool | None = None
    """L2-normalise the vectors (vLLM's field); None: as the model's pooler config says."""
    priority: int = 0


def _inputs(value: object) -> tuple[EmbeddingInput, ...]:
    if isinstance(value, str) and value:
        return (value,)
    if isinstance(value, list) and value:
        if all(isinstance(p, str) and p for p in value):
            return tuple(value)
        if all(_is_token_id(t) for t in value):
            return (tuple(value),)
        if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in value):
            return tuple(tuple(p) for p in value)
    raise _bad("'input' must be a non-empty string, an array of non-empty strings, an array "
               "of token ids or an array of arrays of token ids (none empty)", "input")


def parse_embedding_request(body: object) -> EmbeddingRequest:
    """Validate a /v1/embeddings body (InvalidRequestError naming the parameter)."""
    fields = _Fields(body)
    _refuse_unsupported(fields.body, UNSUPPORTED_EMBEDDING_FIELDS)
    if "input" not in fields.body:
        raise _bad("'input' is required", "input")
    encoding = fields.str_("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise _bad(f"'encoding_format' must be 'float' or 'base64', got {encoding!r}",
                   "encoding_format")
    dimensions = fields.int_("dimensions")
    if dimensions is not None and dimensions < 1:
        raise _bad(f"'dimensions' must be at least 1, got {dimensions}", "dimensions")
    truncate = fields.int_("truncate_prompt_tokens")
    if truncate is not None and truncate < 1 and truncate != -1:
        raise _bad("'truncate_prompt_tokens' must be a positive number of tokens, or -1 for "
                   f"the model's context length; got {truncate}", "truncate_prompt_tokens")
    add_special = fields.bool_("add_special_tokens")
    return EmbeddingRequest(
        inputs=_inputs(fields.raw("input")), model=fields.str_("model"),
        encoding_format="base64" if encoding == "base64" else "float",
        dimensions=dimensions, user=fields.str_("user"), truncate_prompt_tokens=truncate,
        add_special_tokens=True if add_special is None else add_special,
        normalize=fields.bool_("normalize"), priority=fields.int_("priority") or 0)


def embedding_response(model: str, vectors: bytes, dimensions: int, prompt_tokens: int,
                       encoding_format: EncodingFormat) -> dict[str, Any]:
    """OpenAI's response body for `vectors`: row-major [N, dimensions] little-endian
    float32 bytes, one row per input in input order."""
    row_bytes = dimensions * _FLOAT32_BYTES
    assert dimensions > 0 and len(vectors) % row_bytes == 0, (
        f"{len(vectors)} bytes are not rows of {dimensions} float32 values")
    view = memoryview(vectors)
    rows = [view[i : i + row_bytes] for i in range(0, len(vectors), row_bytes)]
    data: list[dict[str, Any]] = []
    for index, row in enumerate(rows):
        embedding: list[float] | str
        if encoding_format == "base64":
            embedding = base64.b64encode(row).decode("ascii")
        else:
            embedding = _floats(row)
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def _floats(row: memoryview) -> list[float]:
    """Little-endian float32 bytes -> Python floats (exactly the float32 values)."""
    values = array("f")
    values.frombytes(row)
    if sys.byteorder != "little":
        values.byteswap()
    return values.tolist()
