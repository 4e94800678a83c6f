"""vLLM's scoring and pooling endpoints at the edge: request bodies in, response bodies out.

- `/v1/score`, `/score`: two sides of texts, named `text_1`/`text_2`, `queries`/`documents`,
  `queries`/`items` or `data_1`/`data_2` (vLLM accepts each pair); each a string or an
  array of strings, paired 1:1, 1:N or N:N. Answer: `{"id", "object": "list", "created",
  "model", "data": [{"index", "object": "score", "score"}], "usage"}`.
- `/rerank`, `/v1/rerank`, `/v2/rerank` (Jina/Cohere style): `query`, `documents`, `top_n`
  (0: all). Answer: `{"id", "model", "usage", "results": [{"index", "document": {"text",
  "multi_modal"}, "relevance_score"}]}`, best first, cut to `top_n`.
- `/pooling`: `input` as /v1/embeddings takes it, `task` ("embed", the pooling task of the
  models meshserve pools), `use_activation` (L2 normalisation). Answer: `{"id", "object":
  "list", "created", "model", "data": [{"index", "object": "pooling", "data"}], "usage"}`.
- `/classify` (sequence-classification models): `input` as /v1/embeddings takes it,
  `use_activation` (default true: softmax over the classes, sigmoid for one class). Answer:
  `{"id", "object": "list", "created", "model", "data": [{"index", "label", "probs",
  "num_classes"}], "usage"}`, the label the config's id2label gives the best class.

A one-label classifier (a cross-encoder) scores a pair by its logit through a sigmoid
(`use_activation: false`: the logit itself); an embedding model by cosine similarity.

Wrong types and values are 400s naming the parameter, in vLLM's words where it has them;
schema fields meshserve does not implement are refused by name. Torch-free (gateway side).
"""

from __future__ import annotations

import base64
import math
import sys
import time
import uuid
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from meshserve.shared.openai_embeddings import EmbeddingRequest, parse_embedding_request
from meshserve.shared.openai_protocol import _bad, _Fields, _refuse_unsupported

SCORE_URLS = ("/score", "/v1/score")
RERANK_URLS = ("/rerank", "/v1/rerank", "/v2/rerank")
POOLING_URL = "/pooling"
CLASSIFY_URL = "/classify"
_COSINE_EPS = 1e-8  # torch.nn.CosineSimilarity's default, as vLLM scores with it
# The names vLLM's score request types give the two sides, in the order it tries them.
_SIDE_NAMES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
               ("text_1", "text_2"))

# Fields of vLLM's pooling request schemas that meshserve does not implement.
_UNSUPPORTED: dict[str, tuple[tuple[object, ...], str]] = {
    "mm_processor_kwargs": ((), "multimodal inputs are not supported"),
    "request_id": ((), "a request id in the body is not supported"),
    "padding": (("do_not_pad",), "prompts are not padded"),
    "truncation_side": (("left",), "truncation keeps the last tokens ('left')"),
    "cache_salt": ((), "cache salts are not supported for pooling requests"),
    "messages": ((), "chat-style pooling inputs are not supported; send 'input'"),
    "embed_dtype": (("float32",), "pooled outputs are float32"),
    "endianness": (("native", "little"), "base64 outputs are little-endian"),
}


@dataclass(frozen=True)
class PairRequest:
    """A validated /score or /rerank body: `left` paired with `right` (1:1, 1:N or N:N)."""

    left: tuple[str, ...]
    right: tuple[str, ...]
    model: str | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    top_n: int = 0
    """Rerank only: how many results to keep (0: all)."""
    use_activation: bool | None = None
    """A cross-encoder's sigmoid over its logit (None: on)."""

    def embedding_request(self) -> EmbeddingRequest:
        """Both sides as one embedding request: `left`'s texts, then `right`'s."""
        return EmbeddingRequest(inputs=self.left + self.right, model=self.model,
                                truncate_prompt_tokens=self.truncate_prompt_tokens,
                                priority=self.priority)


def _texts(value: object, name: str, what: str) -> tuple[str, ...]:
    """One side of a score request: a string or an array of strings."""
    items = value if isinstance(value, list) else [value]
    if any(isinstance(item, dict) for item in items):
        raise _bad("MultiModalParam is not supported for this model: only text is scored",
                   name)
    if not all(isinstance(item, str) for item in items):
        raise _bad(f"'{name}' must be a string or an array of strings", name)
    if not items:
        raise _bad(f"At least one {what} element must be given", name)
    if not all(items):
        raise _bad(f"'{name}' must not hold an empty string (nothing to score)", name)
    return tuple(items)


def _common(fields: _Fields) -> dict[str, Any]:
    """The fields every pooling request shares, checked as /v1/embeddings checks them."""
    _refuse_unsupported(fields.body, _UNSUPPORTED)
    truncate = fields.int_("truncate_prompt_tokens")
    if truncate is not None and truncate < 1 and truncate != -1:
        raise _bad("'truncate_prompt_tokens' must be a positive number of tokens, or -1 for "
                   f"the model's context length; got {truncate}", "truncate_prompt_tokens")
    return {"model": fields.str_("model"), "truncate_prompt_tokens": truncate,
            "priority": fields.int_("priority") or 0}


def _use_activation(fields: _Fields) -> bool | None:
    """vLLM's `use_activation`, or its deprecated spellings `activation` and `softmax`."""
    values = [fields.lax_bool(name) for name in ("use_activation", "activation", "softmax")]
    return next((v for v in values if v is not None), None)


def parse_score_request(body: object) -> PairRequest:
    """Validate a /score body (InvalidRequestError naming the parameter)."""
    fields = _Fields(body)
    names = next((pair for pair in _SIDE_NAMES if all(n in fields.body for n in pair)), None)
    if names is None:
        raise _bad("'text_1' and 'text_2' are required (or 'queries' with 'documents' or "
                   "'items', or 'data_1' with 'data_2')", "text_1")
    left = _texts(fields.raw(names[0]), names[0], "text")
    right = _texts(fields.raw(names[1]), names[1], "text_pair")
    if len(left) > 1 and len(left) != len(right):
        raise _bad("Input lengths must be either 1:1, 1:N or N:N", names[0])
    return PairRequest(left=left, right=right, use_activation=_use_activation(fields),
                       **_common(fields))


def parse_rerank_request(body: object) -> PairRequest:
    """Validate a /rerank body (InvalidRequestError naming the parameter)."""
    fields = _Fields(body)
    for name in ("query", "documents"):
        if name not in fields.body:
            raise _bad(f"'{name}' is required", name)
    query = fields.raw("query")
    if not isinstance(query, (str, dict)):
        raise _bad("'query' must be a string", "query")
    return PairRequest(left=_texts(query, "query", "text"),
                       right=_texts(fields.raw("documents"), "documents", "text_pair"),
                       top_n=fields.int_("top_n") or 0, use_activation=_use_activation(fields),
                       **_common(fields))


@dataclass(frozen=True)
class PoolingRequest:
    """A validated /pooling body: its inputs as an embedding request's, the task asked for
    (None: the model's own) and vLLM's `use_activation` (None: the task's default)."""

    inputs: EmbeddingRequest
    task: str | None = None
    use_activation: bool | None = None


def parse_pooling_request(body: object) -> PoolingRequest:
    """Validate a /pooling body (its `input` as /v1/embeddings reads it)."""
    fields = _Fields(body)
    common = _common(fields)
    if fields.raw("dimensions") is not None:
        raise _bad("dimensions is currently not supported", "dimensions")
    inner = {key: fields.raw(key) for key in ("input", "encoding_format", "add_special_tokens")}
    return PoolingRequest(parse_embedding_request({**inner, **common}), fields.str_("task"),
                          _use_activation(fields))


def check_task(task: str | None, supported: tuple[str, ...]) -> str:
    """The pooling task to run: `task`, or the model's one (InvalidRequestError, vLLM's
    words, for a task the model does not run)."""
    if task is not None and task not in supported:
        raise _bad(f"Unsupported task: {task!r} Supported tasks: {supported}", "task")
    return task or supported[0]


@dataclass(frozen=True)
class ClassifyRequest:
    """A validated /classify body: its inputs as an embedding request's, and whether the
    class logits go through the activation (softmax, or sigmoid for one class)."""

    inputs: EmbeddingRequest
    use_activation: bool = True


def parse_classify_request(body: object) -> ClassifyRequest:
    """Validate a /classify body (InvalidRequestError naming the parameter)."""
    fields = _Fields(body)
    common = _common(fields)
    inner = {key: fields.raw(key) for key in ("input", "add_special_tokens")}
    return ClassifyRequest(parse_embedding_request({**inner, **common}),
                           use_activation=_use_activation(fields) is not False)


# -- scores ----------------------------------------------------------------------------------

def float_rows(vectors: bytes, dimensions: int) -> list[list[float]]:
    """Row-major [N, dimensions] little-endian float32 bytes -> N rows of floats."""
    values = array("f")
    values.frombytes(vectors)
    if sys.byteorder != "little":
        values.byteswap()
    assert len(values) % dimensions == 0, f"{len(values)} floats are not rows of {dimensions}"
    flat = values.tolist()
    return [flat[i : i + dimensions] for i in range(0, len(flat), dimensions)]


def cosine_similarity(a: Sequence[float], b: Sequence[float]) -> float:
    """a·b / max(|a||b|, eps), as torch.nn.CosineSimilarity computes it."""
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(math.fsum(x * x for x in a) * math.fsum(y * y for y in b))
    return dot / max(norms, _COSINE_EPS)


def pair_scores(rows: list[list[float]], num_left: int) -> list[float]:
    """The cosine score of each pair: `rows` holds the left side's vectors, then the
    right side's; one left vector is paired with every right one."""
    left, right = rows[:num_left], rows[num_left:]
    if len(left) == 1:
        left = left * len(right)
    return [cosine_similarity(a, b) for a, b in zip(left, right, strict=True)]


def activate(logits: list[float]) -> list[float]:
    """vLLM's classification activation: sigmoid for one class, else softmax."""
    if len(logits) < 2:
        return [_sigmoid(x) for x in logits]
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = math.fsum(exps)
    return [e / total for e in exps]


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def cross_encoder_scores(rows: list[list[float]], use_activation: bool | None) -> list[float]:
    """A one-label classifier's score of each pair: its logit, through a sigmoid unless
    `use_activation` is False."""
    assert all(len(row) == 1 for row in rows), "a cross-encoder has one label"
    return [row[0] if use_activation is False else _sigmoid(row[0]) for row in rows]


def pair_inputs(ids: list[list[int]], num_left: int) -> list[tuple[int, ...]]:
    """A cross-encoder's inputs: each pair's two token id lists, end to end (`ids` holds
    the left side's, then the right side's; one left text goes with every right one)."""
    left, right = ids[:num_left], ids[num_left:]
    if len(left) == 1:
        left = left * len(right)
    return [tuple(a + b) for a, b in zip(left, right, strict=True)]


def pair_tokens(lengths: list[int], num_left: int, separator: int) -> int:
    """Prompt tokens of a score request as vLLM counts them: each pair's two inputs, plus
    `separator` (1 when the tokenizer has a pad token, else 0) between them."""
    left, right = lengths[:num_left], lengths[num_left:]
    if len(left) == 1:
        left = left * len(right)
    return sum(a + separator + b for a, b in zip(left, right, strict=True))


# -- bodies ----------------------------------------------------------------------------------

def _usage(prompt_tokens: int) -> dict[str, Any]:
    """vLLM's UsageInfo of a pooling answer: prompt tokens only."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
            "completion_tokens": 0, "prompt_tokens_details": None}


def score_response(model: str, scores: list[float], prompt_tokens: int) -> dict[str, Any]:
    """The /score answer: one score per pair, in pair order."""
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": model, "usage": _usage(prompt_tokens),
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]}


def rerank_response(model: str, request: PairRequest, scores: list[float],
                    prompt_tokens: int) -> dict[str, Any]:
    """The /rerank answer: the documents best first (ties in document order), cut to
    `top_n` when it is positive."""
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    if 0 < request.top_n < len(order):
        order = order[:request.top_n]
    results = [{"index": i, "document": {"text": request.right[i], "multi_modal": None},
                "relevance_score": scores[i]} for i in order]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def classify_response(model: str, labels: Sequence[str], rows: list[list[float]],
                      prompt_tokens: int, use_activation: bool) -> dict[str, Any]:
    """The /classify answer: each input's class probabilities (logits when
    `use_activation` is off) and the label of the best class."""
    data: list[dict[str, Any]] = []
    for index, row in enumerate(rows):
        probs = activate(row) if use_activation else row
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": index, "label": labels[best], "probs": probs,
                     "num_classes": len(probs)})
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list",
            "created": int(time.time()), "model": model, "data": data,
            "usage": _usage(prompt_tokens)}


def pooling_response(model: str, rows: list[list[float]], prompt_tokens: int,
                     encoding_format: str) -> dict[str, Any]:
    """The /pooling answer: each input's pooled vector, floats or base64 float32 bytes."""
    data: list[dict[str, Any]] = []
    for index, row in enumerate(rows):
        value: list[float] | str = row
        if encoding_format == "base64":
            packed = array("f", row)
            if sys.byteorder != "little":
                packed.byteswap()
            value = base64.b64encode(packed.tobytes()).decode("ascii")
        data.append({"index": index, "object": "pooling", "data": value})
    return {"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": model, "data": data, "usage": _usage(prompt_tokens)}
