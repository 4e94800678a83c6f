"""Offline batch inference over OpenAI batch files (`meshserve run-batch`).

Input: one JSON object a line, `{"custom_id", "method": "POST", "url", "body"}`
with url `/v1/completions` or `/v1/chat/completions`. Output: one line per
input line, in input order, shaped as OpenAI's batch output:
`{"id": "batch_req_…", "custom_id", "response": {"status_code", "request_id",
"body"}, "error": null}`. A request the API would reject (bad parameters,
prompt too long, unknown model) gets its HTTP status and OpenAI error body in
`response`; a line that is not a request at all (invalid JSON, unknown url,
no body) gets `"response": null` and `"error": {"code", "message"}`. Either
way every other line still completes.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from tqdm import tqdm

from meshserve.offline.images import BatchImages, refuse_images
from meshserve.offline.llm import GenerationItem, GenerationResult, OfflineLLM
from meshserve.services.gateway.media.parts import split_images
from meshserve.services.tokenizer.loader import Tokenizer
from meshserve.services.tokenizer.model import PromptInput
from meshserve.shared import openai_bodies as bodies
from meshserve.shared import openai_protocol as oai
from meshserve.shared.errors import InvalidRequestError, MeshError, NotFoundError
from meshserve.shared.logprobs import TokenLogprobs
from meshserve.shared.status import http_error

_SUPPORTED_URLS = (oai.COMPLETIONS_URL, oai.CHAT_COMPLETIONS_URL)


@dataclass(frozen=True)
class BatchSummary:
    """Counts of one run-batch: lines, outcomes, tokens and wall time."""

    total: int
    succeeded: int
    failed: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    elapsed_s: float


class _LineError(Exception):
    """A line that is not a request at all (OpenAI's line-level error)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class _Line:
    """One input line on its way to an output line."""

    number: int
    custom_id: str | None = None
    url: str = ""
    request: oai.CompletionRequest | oai.ChatCompletionRequest | None = None
    items: list[GenerationItem] = field(default_factory=list)
    echo_texts: list[str] = field(default_factory=list)
    output: dict[str, Any] | None = None  # set once the line has its output record
    model: str = ""  # the model the request named: the base model's or an adapter's name


@dataclass(frozen=True)
class BatchModels:
    """The models a batch's requests may name: the engine's, and its LoRA adapters by name."""

    base: str
    adapters: Mapping[str, int] = field(default_factory=dict)  # name -> LoRA id

    def resolve(self, name: str | None) -> tuple[str, int | None]:
        """(the name answered with, the LoRA id to run with); NotFoundError for others."""
        if name is None or name == self.base:
            return self.base, None
        if name in self.adapters:
            return name, self.adapters[name]
        served = ", ".join([self.base, *self.adapters])
        raise NotFoundError(f"The model `{name}` does not exist; this batch runs {served}",
                            param="model")


def _record(custom_id: str | None, response: dict[str, Any] | None,
            error: dict[str, str] | None = None) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": response, "error": error}


def _http_record(custom_id: str | None, status: int, body: dict[str, Any]) -> dict[str, Any]:
    return _record(custom_id, {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}",
                               "body": body})


def _envelope(raw: bytes, line: _Line) -> dict[str, Any]:
    """Check a line's request envelope; set its custom_id and url; return its body."""
    number = line.number
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _LineError("invalid_json_line", f"line {number} is not valid JSON: {exc}") from None
    if not isinstance(record, dict):
        raise _LineError("invalid_json_line", f"line {number} is not a JSON object")
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _LineError("missing_custom_id", f"line {number} has no string 'custom_id'")
    line.custom_id = custom_id
    if record.get("method") != "POST":
        raise _LineError("invalid_method", f"line {number}: 'method' must be POST")
    url = record.get("url")
    if url not in _SUPPORTED_URLS:
        raise _LineError("invalid_url", f"line {number}: url {url!r} is not supported; use "
                         f"{' or '.join(_SUPPORTED_URLS)}")
    line.url = str(url)
    body = record.get("body")
    if not isinstance(body, dict):
        raise _LineError("missing_body", f"line {number} has no JSON object 'body'")
    return body


def _check_options(line: _Line, options: oai.RequestOptions, models: BatchModels
                   ) -> int | None:
    """The LoRA id of the line's model (None: the base model); sets `line.model`."""
    line.model, lora_id = models.resolve(options.model)
    if options.stream:
        raise InvalidRequestError("streaming is not supported in batch requests", param="stream")
    return lora_id


def _completion_items(line: _Line, body: dict[str, Any], tokenizer: Tokenizer,
                      models: BatchModels) -> None:
    request = oai.parse_completion_request(body)
    lora_id = _check_options(line, request.options, models)
    line.request = request
    for k, prompt in enumerate(request.prompts):
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt, add_special_tokens=request.add_special_tokens)
            text = prompt
        else:
            ids = list(prompt)
            if max(ids) >= tokenizer.vocab_size:
                raise InvalidRequestError(f"prompt token id {max(ids)} is outside the "
                                          f"vocabulary ({tokenizer.vocab_size})", param="prompt")
            text = tokenizer.decode(ids, skip_special_tokens=False)
        if not ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        line.items.append(GenerationItem(f"{line.custom_id}#{line.number}-{k}", ids,
                                         request.params, request.options.priority,
                                         request.options.cache_salt, lora_id))
        line.echo_texts.append(text)


def _chat_items(line: _Line, body: dict[str, Any], tokenizer: Tokenizer,
                models: BatchModels, images: BatchImages | None) -> None:
    request = oai.parse_chat_request(body)
    lora_id = _check_options(line, request.options, models)
    line.request = request
    messages, refs = split_images(list(request.messages))
    if refs:  # a vision-language chat: images loaded, placeholders placed
        if images is None:
            refuse_images(refs)
        assert images is not None
        ids, placed = images.tokenize(messages, refs, PromptInput(
            tools=list(request.tools or ()) or None,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=request.chat_template_kwargs))
        line.items.append(GenerationItem(f"{line.custom_id}#{line.number}", ids,
                                         request.params, request.options.priority,
                                         request.options.cache_salt, lora_id, tuple(placed)))
        return
    text = tokenizer.render_chat(list(request.messages), list(request.tools or ()) or None,
                                 request.add_generation_prompt, request.continue_final_message,
                                 request.chat_template_kwargs)
    ids = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
    line.items.append(GenerationItem(f"{line.custom_id}#{line.number}", ids, request.params,
                                     request.options.priority, request.options.cache_salt,
                                     lora_id))


def _prepare(raw: bytes, number: int, tokenizer: Tokenizer, models: BatchModels,
             images: BatchImages | None) -> _Line:
    line = _Line(number)
    try:
        body = _envelope(raw, line)
        if line.url == oai.COMPLETIONS_URL:
            _completion_items(line, body, tokenizer, models)
        else:
            _chat_items(line, body, tokenizer, models, images)
    except _LineError as exc:
        line.output = _record(line.custom_id, None, {"code": exc.code, "message": exc.message})
    except MeshError as exc:
        line.items = []
        line.output = _http_record(line.custom_id, *http_error(exc))
    return line


def _usage(results: list[GenerationResult]) -> dict[str, Any]:
    return bodies.usage(sum(r.num_prompt_tokens for r in results),
                     sum(r.num_output_tokens for r in results),
                     sum(r.num_cached_tokens for r in results))


def _completion_body(line: _Line, results: list[GenerationResult],
                     tokenizer: Tokenizer, model_name: str) -> dict[str, Any]:
    request = line.request
    assert isinstance(request, oai.CompletionRequest), "completion line without its request"
    n, choices = request.params.n, []
    for k, result in enumerate(results):
        prefix = line.echo_texts[k] if request.echo else ""
        for seq in result.sequences:
            logprobs = None
            if seq.logprobs is not None:
                ids = list(seq.token_ids)
                entries: list[TokenLogprobs | None] = list(seq.logprobs)
                if request.echo:
                    prompt_lp = result.prompt_logprobs
                    if prompt_lp is None or len(prompt_lp) != len(result.prompt_token_ids):
                        prompt_lp = [None] * len(result.prompt_token_ids)
                    ids, entries = result.prompt_token_ids + ids, list(prompt_lp) + entries
                logprobs = bodies.completion_logprobs(ids, entries, tokenizer)
            choices.append(bodies.completion_choice(k * n + seq.index, prefix + seq.text,
                                                 seq.finish_reason, seq.stop_reason, logprobs))
    return bodies.completion_response(bodies.completion_id(), bodies.created_timestamp(), model_name,
                                   choices, _usage(results))


def _chat_body(results: list[GenerationResult], tokenizer: Tokenizer,
               model_name: str) -> dict[str, Any]:
    choices = [bodies.chat_choice(seq.index, seq.text, seq.finish_reason, seq.stop_reason,
                               None if seq.logprobs is None
                               else bodies.chat_logprobs(seq.logprobs, tokenizer))
               for result in results for seq in result.sequences]
    return bodies.chat_response(bodies.chat_completion_id(), bodies.created_timestamp(), model_name,
                             choices, _usage(results))


def _finish_line(line: _Line, results: list[GenerationResult], tokenizer: Tokenizer) -> None:
    model_name = line.model
    errors = [r.error for r in results if r.error is not None]
    if errors:
        line.output = _http_record(line.custom_id, *http_error(errors[0]))
    elif line.url == oai.COMPLETIONS_URL:
        body = _completion_body(line, results, tokenizer, model_name)
        line.output = _http_record(line.custom_id, 200, body)
    else:
        line.output = _http_record(line.custom_id, 200, _chat_body(results, tokenizer,
                                                                   model_name))


def _read_lines(input_path: str | os.PathLike[str]) -> list[tuple[int, bytes]]:
    try:
        data = Path(input_path).read_bytes()
    except OSError as exc:
        raise InvalidRequestError(f"cannot read batch input file {input_path}: {exc}",
                                  param="input_file") from exc
    return [(i, raw) for i, raw in enumerate(data.splitlines(), start=1) if raw.strip()]


def run_batch(input_path: str | os.PathLike[str], output_path: str | os.PathLike[str],
              llm: OfflineLLM, model_name: str, *, show_progress: bool = True,
              adapters: Mapping[str, int] | None = None,
              images: BatchImages | None = None) -> BatchSummary:
    """Run every request of an OpenAI batch input file; write the output file.

    A request names `model_name` (or no model) for the base model, or one of `adapters`
    (LoRA adapter name -> id, as the engine serves them) to run with that adapter, as
    vLLM's run-batch takes them. All requests go to the engine together so it batches
    them. A tqdm bar on stderr counts finished lines. `images`: a vision-language
    model's image handling (chats with image parts; None: a text model refuses them).
    """
    start = time.monotonic()
    tokenizer = llm.tokenizer
    models = BatchModels(model_name, dict(adapters or {}))
    lines = [_prepare(raw, number, tokenizer, models, images)
             for number, raw in _read_lines(input_path)]
    items = [item for line in lines for item in line.items]
    owners = [i for i, line in enumerate(lines) for _ in line.items]
    remaining = [len(line.items) for line in lines]
    with tqdm(total=len(lines), file=sys.stderr, desc="run-batch", unit="req",
              disable=not show_progress) as bar:
        bar.update(sum(1 for count in remaining if count == 0))

        def on_item(position: int) -> None:
            owner = owners[position]
            remaining[owner] -= 1
            if remaining[owner] == 0:
                bar.update(1)

        results = llm.generate(items, on_item)
    cursor = 0
    for line in lines:
        line_results = results[cursor:cursor + len(line.items)]
        cursor += len(line.items)
        if line.output is None:
            _finish_line(line, line_results, tokenizer)
    _write(output_path, lines)
    return _summary(lines, time.monotonic() - start)


def _write(output_path: str | os.PathLike[str], lines: list[_Line]) -> None:
    path = Path(output_path)
    try:
        with path.open("wb") as out:
            for line in lines:
                out.write(orjson.dumps(line.output) + b"\n")
    except OSError as exc:
        raise InvalidRequestError(f"cannot write batch output file {path}: {exc}",
                                  param="output_file") from exc


def _summary(lines: list[_Line], elapsed_s: float) -> BatchSummary:
    ok = [line for line in lines
          if line.output is not None and (line.output["response"] or {}).get("status_code") == 200]
    usages = [line.output["response"]["body"]["usage"] for line in ok if line.output]
    return BatchSummary(
        total=len(lines), succeeded=len(ok), failed=len(lines) - len(ok),
        prompt_tokens=sum(u["prompt_tokens"] for u in usages),
        completion_tokens=sum(u["completion_tokens"] for u in usages),
        cached_tokens=sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages),
        elapsed_s=elapsed_s)
