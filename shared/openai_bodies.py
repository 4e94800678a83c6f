"""The OpenAI HTTP API's response bodies: ids, usage, logprobs, choices, complete objects
and streaming chunks, as OpenAI shapes them; `dumps`/`sse` serialise them with orjson.
(Request bodies are parsed by `meshserve.shared.openai_protocol`.)"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

import orjson

from meshserve.shared.logprobs import TokenLogprobs

SSE_DONE = b"data: [DONE]\n\n"
# OpenAI reports -inf logprobs as this floor (JSON has no infinity).
_MIN_LOGPROB = -9999.0


class TokenRenderer(Protocol):
    """How logprobs show a token (the `Tokenizer` implements this)."""

    def token_text(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


# -- ids, serialisation -------------------------------------------------------------------

def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def created_timestamp() -> int:
    return int(time.time())


def dumps(obj: object) -> bytes:
    """JSON bytes of a response body."""
    return orjson.dumps(obj)


def sse(obj: object) -> bytes:
    """One server-sent event carrying `obj`; end a stream with `SSE_DONE`."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


# -- responses ------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _clamp(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None],
                        renderer: TokenRenderer, text_offset: int = 0) -> dict[str, Any]:
    """Legacy completions logprobs; an entry of None (first prompt token) has no logprob."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = renderer.token_text(token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        token_logprobs.append(None if entry is None else _clamp(entry.logprob))
        # As vLLM: the token itself first, then its top alternatives (so `logprobs=0`
        # still shows the sampled token, and an echoed prompt token shows itself).
        top_logprobs.append(None if entry is None else {
            renderer.token_text(t): _clamp(lp)
            for t, lp in [(entry.token_id, entry.logprob), *entry.top]})
    return {"tokens": tokens, "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs, "text_offset": offsets}


def prompt_logprobs_field(entries: Sequence[TokenLogprobs | None], renderer: TokenRenderer
                          ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` of a choice: None for the first prompt token, then for each
    token {token id: {logprob, rank, decoded_token}} of the token itself and its top
    alternatives."""
    def one(token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": _clamp(logprob), "rank": rank,
                "decoded_token": renderer.token_text(token_id)}

    return [None if e is None else {
        **{str(t): one(t, lp, rank) for rank, (t, lp) in enumerate(e.top, start=1)},
        str(e.token_id): one(e.token_id, e.logprob, e.rank)} for e in entries]


def _chat_token(token_id: int, logprob: float, renderer: TokenRenderer) -> dict[str, Any]:
    return {"token": renderer.token_text(token_id), "logprob": _clamp(logprob),
            "bytes": list(renderer.token_bytes(token_id))}


def _sampled_first(entry: TokenLogprobs) -> list[tuple[int, float]]:
    """The k entries of a chat token's `top_logprobs` as vLLM lists them: the sampled token
    first, then the top alternatives in rank order without it, k in all (so a sampled token
    outside the top k pushes out the k-th)."""
    if not entry.top:
        return []
    rest = [(t, lp) for t, lp in entry.top if t != entry.token_id]
    return [(entry.token_id, entry.logprob), *rest][:len(entry.top)]


def chat_logprobs(entries: Sequence[TokenLogprobs], renderer: TokenRenderer) -> dict[str, Any]:
    """Chat logprobs: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}."""
    content = [{**_chat_token(e.token_id, e.logprob, renderer),
                "top_logprobs": [_chat_token(t, lp, renderer) for t, lp in _sampled_first(e)]}
               for e in entries]
    return {"content": content, "refusal": None}


def completion_choice(index: int, text: str, finish_reason: str | None,
                      stop_reason: int | str | None = None,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One choice of a completion or of a `text_completion` chunk."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def chat_choice(index: int, content: str, finish_reason: str | None,
                stop_reason: int | str | None = None,
                logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One choice of a chat.completion."""
    return {"index": index, "message": {"role": "assistant", "content": content,
                                        "refusal": None},
            "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}


def chat_delta_choice(index: int, content: str | None, *, role: bool | str = False,
                      finish_reason: str | None = None, stop_reason: int | str | None = None,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One choice of a chat.completion.chunk; the first chunk of a choice sets `role`
    (True: "assistant")."""
    delta: dict[str, Any] = {"role": "assistant" if role is True else role} if role else {}
    if content is not None:
        delta["content"] = content
    return {"index": index, "delta": delta, "logprobs": logprobs,
            "finish_reason": finish_reason, "stop_reason": stop_reason}


def _envelope(id_: str, object_: str, created: int, model: str,
              choices: list[dict[str, Any]], usage_: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": id_, "object": object_, "created": created, "model": model,
                            "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def completion_response(id_: str, created: int, model: str, choices: list[dict[str, Any]],
                        usage_: dict[str, Any]) -> dict[str, Any]:
    return _envelope(id_, "text_completion", created, model, choices, usage_)


def chat_response(id_: str, created: int, model: str, choices: list[dict[str, Any]],
                  usage_: dict[str, Any]) -> dict[str, Any]:
    return _envelope(id_, "chat.completion", created, model, choices, usage_)


def completion_chunk(id_: str, created: int, model: str, choices: list[dict[str, Any]],
                     usage_: dict[str, Any] | None = None) -> dict[str, Any]:
    """A streamed `text_completion` chunk; the final usage chunk has no choices."""
    return _envelope(id_, "text_completion", created, model, choices, usage_)


def chat_chunk(id_: str, created: int, model: str, choices: list[dict[str, Any]],
               usage_: dict[str, Any] | None = None) -> dict[str, Any]:
    """A `chat.completion.chunk`; the final usage chunk has no choices."""
    return _envelope(id_, "chat.completion.chunk", created, model, choices, usage_)
