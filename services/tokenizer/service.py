"""The Tokenizer gRPC servicer: protobuf at the edge, the text-side domain behind it.

`TokenizerServicer` only converts: a `TokenizeRequest` becomes a `PromptInput`
that `ServedModel.tokenize` turns into token ids; a Detokenize stream opens one
`DetokenizeSession` (per-sequence `TextStream`s) from its options message and
answers every delta with exactly one response. Domain errors (InvalidRequestError,
NotFoundError) are raised; the shared server interceptor maps them to statuses.

Tokenization runs on the event loop thread on purpose: a Hugging Face fast
tokenizer is not safe to use from several threads at once (the Rust side raises
"Already borrowed"), and one prompt takes well under a millisecond to encode.
Scale by running more replicas.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
import orjson
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Histogram

from meshserve.proto.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from meshserve.services.tokenizer.detokenizer import TextDelta, TextStream
from meshserve.services.tokenizer.loader import Tokenizer
from meshserve.shared.errors import InvalidRequestError, NotFoundError, UnavailableError
from meshserve.shared.sampling_params import MAX_N, SamplingParams
from meshserve.shared.telemetry import Telemetry

SERVICE_NAME = "meshserve.v1.Tokenizer"
_log = logging.getLogger(__name__)
# Per-call CPU work: tens of microseconds for a delta, milliseconds for a long chat prompt.
_LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                    0.05, 0.1, 0.25, 1.0)
# Chat-only TokenizeRequest fields: setting one with plain text is a client mistake.
_CHAT_ONLY_FIELDS = ("tools_json", "chat_template", "chat_template_kwargs_json",
                     "continue_final_message", "add_generation_prompt")


# -- domain -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptInput:
    """A prompt to tokenize: `text`, or chat `messages` rendered through a chat template."""

    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    truncate_prompt_tokens: int = 0


@dataclass(frozen=True)
class TokenizedPrompt:
    """Token ids of a prompt and the text they were made from."""

    token_ids: list[int]
    text: str


@dataclass(frozen=True)
class ServedModel:
    """The one model a tokenizer replica serves: its tokenizer, names and context length."""

    tokenizer: Tokenizer
    names: tuple[str, ...]  # names a request's `model` may use ("" always means this one)
    max_model_len: int
    chat_template: str | None = None  # the server's replacement for the model's template

    @property
    def name(self) -> str:
        """The served model name."""
        return self.names[0]

    def check_name(self, model: str) -> None:
        """Raise NotFoundError unless `model` is empty or one of this model's names."""
        if model and model not in self.names:
            raise NotFoundError(f"model {model!r} is not served here (serving {self.name!r})",
                                param="model")

    def tokenize(self, prompt: PromptInput) -> TokenizedPrompt:
        """Render (chat) and encode a prompt, keeping the last `truncate_prompt_tokens`."""
        if prompt.messages is not None:
            text = self.tokenizer.render_chat(
                prompt.messages, prompt.tools, prompt.add_generation_prompt,
                prompt.continue_final_message, prompt.chat_template_kwargs,
                chat_template=prompt.chat_template or self.chat_template)
        else:
            assert prompt.text is not None, "a prompt needs text or messages"
            text = prompt.text
        ids = self.tokenizer.encode(text, add_special_tokens=prompt.add_special_tokens)
        if prompt.truncate_prompt_tokens:
            ids = ids[-prompt.truncate_prompt_tokens:]
        return TokenizedPrompt(ids, text)


@dataclass(frozen=True)
class SequenceUpdate:
    """What one sequence's new tokens turned into."""

    index: int
    text: str
    stopped: bool
    stop_string: str
    finished: bool
    num_output_tokens: int
    token_bytes: list[bytes]


@dataclass
class _Sequence:
    stream: TextStream
    num_tokens: int = 0  # output tokens that count (up to the stop string's token)
    finished: bool = False
    stop_string: str | None = None


class DetokenizeSession:
    """Text state of one request's sequences for the life of one Detokenize stream.

    With stop strings, a chunk is fed one token at a time so that the token that
    completes a stop string is known (it bounds `num_output_tokens`); without
    them the whole chunk is decoded at once. After a stop string, later tokens
    are ignored and the sequence answers empty, stopped and finished.
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, num_sequences: int,
                 prompt_token_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._per_token = bool(params.stop)
        self._sequences = [_Sequence(TextStream(tokenizer, params, prompt_token_ids))
                           for _ in range(num_sequences)]
        self.num_tokens_received = 0

    def update(self, index: int, token_ids: Sequence[int], final: bool,
               lookup_token_ids: Sequence[int] = (),
               stopped_on_token: bool = False) -> SequenceUpdate:
        """Feed one sequence's new tokens (and its end, when `final`); return its new text."""
        if not 0 <= index < len(self._sequences):
            raise InvalidRequestError(f"sequence index {index} is out of range: the options "
                                      f"declared {len(self._sequences)} sequences",
                                      param="sequences.index")
        seq = self._sequences[index]
        self.num_tokens_received += len(token_ids)
        text = ""
        if not seq.finished:
            delta = self._feed(seq, token_ids, final, final and stopped_on_token)
            text = delta.text
            seq.finished = delta.stopped or final
            seq.stop_string = delta.stop_reason if delta.stopped else None
        elif token_ids and seq.stop_string is None:
            raise InvalidRequestError(f"sequence {index} got tokens after its final delta",
                                      param="sequences.token_ids")
        return SequenceUpdate(
            index=index, text=text, stopped=seq.stop_string is not None,
            stop_string=seq.stop_string or "", finished=seq.finished,
            num_output_tokens=seq.num_tokens,
            token_bytes=[self._tokenizer.token_bytes(t) for t in lookup_token_ids])

    def _feed(self, seq: _Sequence, token_ids: Sequence[int], final: bool,
              stopped_on_token: bool) -> TextDelta:
        if not self._per_token or not token_ids:
            seq.num_tokens += len(token_ids)
            return seq.stream.feed(token_ids, finished=final, stopped_on_token=stopped_on_token)
        parts: list[str] = []
        last = len(token_ids) - 1
        for i, token_id in enumerate(token_ids):
            delta = seq.stream.feed((token_id,), finished=final and i == last,
                                    stopped_on_token=stopped_on_token and i == last)
            seq.num_tokens += 1
            parts.append(delta.text)
            if delta.stopped:
                return TextDelta("".join(parts), True, delta.stop_reason)
        return TextDelta("".join(parts))


# -- protobuf -> domain ---------------------------------------------------------------------


def _json(text: str, param: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"{param} is not valid JSON: {exc}", param=param) from None


def _message(message: tokenizer_pb2.ChatMessage, index: int) -> dict[str, Any]:
    """One ChatMessage as the dict chat templates take (checked by the loader)."""
    where = f"messages[{index}]"
    out: dict[str, Any] = {"role": message.role}
    if message.content_parts_json:
        out["content"] = _json(message.content_parts_json, f"{where}.content")
    else:
        out["content"] = message.content if message.HasField("content") else None
    if message.name:
        out["name"] = message.name
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls_json:
        out["tool_calls"] = _json(message.tool_calls_json, f"{where}.tool_calls")
    if message.reasoning_content:
        out["reasoning_content"] = message.reasoning_content
    return out


def prompt_input(request: tokenizer_pb2.TokenizeRequest) -> PromptInput:
    """The domain prompt of a TokenizeRequest (InvalidRequestError on a malformed one)."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidRequestError("the prompt needs `text` or `chat`", param="input")
    add_special = request.add_special_tokens if request.HasField("add_special_tokens") else None
    if kind == "text":
        for name in _CHAT_ONLY_FIELDS:
            if _is_set(request, name):
                raise InvalidRequestError(f"{name} applies to chat prompts only", param=name)
        return PromptInput(text=request.text,
                           add_special_tokens=True if add_special is None else add_special,
                           truncate_prompt_tokens=request.truncate_prompt_tokens)
    tools = _json(request.tools_json, "tools") if request.tools_json else None
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise InvalidRequestError("tools must be a JSON array of objects", param="tools")
    kwargs = (_json(request.chat_template_kwargs_json, "chat_template_kwargs")
              if request.chat_template_kwargs_json else None)
    if kwargs is not None and not isinstance(kwargs, dict):
        raise InvalidRequestError("chat_template_kwargs must be a JSON object",
                                  param="chat_template_kwargs")
    # Unset add_generation_prompt is true, except when continuing the final message
    # (the two exclude each other).
    add_generation = (request.add_generation_prompt if request.HasField("add_generation_prompt")
                      else not request.continue_final_message)
    return PromptInput(
        messages=[_message(m, i) for i, m in enumerate(request.chat.messages)], tools=tools,
        add_generation_prompt=add_generation,
        add_special_tokens=False if add_special is None else add_special,
        continue_final_message=request.continue_final_message,
        chat_template=request.chat_template or None, chat_template_kwargs=kwargs,
        truncate_prompt_tokens=request.truncate_prompt_tokens)


def _is_set(request: tokenizer_pb2.TokenizeRequest, name: str) -> bool:
    if name == "add_generation_prompt":
        return request.HasField(name)
    return bool(getattr(request, name))


def sampling_params(options: tokenizer_pb2.DetokenizeOptions) -> SamplingParams:
    """The text-side parameters a DetokenizeOptions message carries."""
    if not 1 <= options.num_sequences <= MAX_N:
        raise InvalidRequestError(f"num_sequences must be between 1 and {MAX_N}, got "
                                  f"{options.num_sequences}", param="num_sequences")
    return SamplingParams(
        n=options.num_sequences, max_tokens=None, stop=tuple(options.stop),
        include_stop_str_in_output=options.include_stop_str_in_output,
        min_tokens=options.min_tokens,
        skip_special_tokens=(options.skip_special_tokens
                             if options.HasField("skip_special_tokens") else True),
        spaces_between_special_tokens=(options.spaces_between_special_tokens
                                       if options.HasField("spaces_between_special_tokens")
                                       else True))


def _sequence_text(update: SequenceUpdate) -> tokenizer_pb2.SequenceText:
    return tokenizer_pb2.SequenceText(
        index=update.index, text=update.text, stopped=update.stopped,
        stop_string=update.stop_string, finished=update.finished,
        token_bytes=update.token_bytes, num_output_tokens=update.num_output_tokens)


# -- metrics and the servicer ---------------------------------------------------------------


@dataclass
class TokenizerMetrics:
    """Prometheus metrics of the tokenizer service."""

    registry: CollectorRegistry
    requests: Counter = field(init=False)
    tokens: Counter = field(init=False)
    latency: Histogram = field(init=False)

    def __post_init__(self) -> None:
        self.requests = Counter("meshserve_tokenizer_requests", "Tokenizer calls received",
                                ["method"], registry=self.registry)
        self.tokens = Counter("meshserve_tokenizer_tokens", "Tokens produced (tokenize) or "
                              "turned into text (detokenize)", ["direction"],
                              registry=self.registry)
        self.latency = Histogram("meshserve_tokenizer_latency_seconds", "Time to tokenize one "
                                 "prompt or detokenize one delta", ["operation"],
                                 registry=self.registry, buckets=_LATENCY_BUCKETS)

    @contextmanager
    def timed(self, operation: str) -> Iterator[None]:
        """Observe the latency of the enclosed work under `operation`."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.latency.labels(operation).observe(time.perf_counter() - started)


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    """meshserve.v1.Tokenizer over a `ServedModel` (set when loaded; UNAVAILABLE before)."""

    def __init__(self, model: ServedModel | None = None, *,
                 telemetry: Telemetry | None = None) -> None:
        self._model = model
        self._tracer = (telemetry.tracer if telemetry is not None
                        else trace.get_tracer("meshserve.tokenizer"))
        self.metrics = TokenizerMetrics(telemetry.registry if telemetry is not None
                                        else CollectorRegistry())

    def set_model(self, model: ServedModel) -> None:
        """Start serving `model` (once it is loaded)."""
        self._model = model

    @property
    def model(self) -> ServedModel:
        """The served model; UnavailableError while it is still loading."""
        if self._model is None:
            raise UnavailableError("the tokenizer is still loading")
        return self._model

    def _tokenize(self, request: tokenizer_pb2.TokenizeRequest, method: str) -> TokenizedPrompt:
        self.metrics.requests.labels(method).inc()
        model = self.model
        model.check_name(request.model)
        prompt = prompt_input(request)
        with self._tracer.start_as_current_span("tokenize") as span, self.metrics.timed(method):
            span.set_attribute("gen_ai.request.model", model.name)
            span.set_attribute("meshserve.prompt.kind", "text" if prompt.text is not None
                               else "chat")
            result = model.tokenize(prompt)
            span.set_attribute("gen_ai.usage.input_tokens", len(result.token_ids))
        self.metrics.tokens.labels("tokenize").inc(len(result.token_ids))
        return result

    async def Tokenize(self, request: tokenizer_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> tokenizer_pb2.TokenizeResponse:
        result = self._tokenize(request, "tokenize")
        return tokenizer_pb2.TokenizeResponse(token_ids=result.token_ids, prompt_text=result.text,
                                              max_model_len=self.model.max_model_len)

    async def CountTokens(self, request: tokenizer_pb2.CountTokensRequest,
                          context: grpc.aio.ServicerContext
                          ) -> tokenizer_pb2.CountTokensResponse:
        result = self._tokenize(request.prompt, "count_tokens")
        return tokenizer_pb2.CountTokensResponse(count=len(result.token_ids),
                                                 max_model_len=self.model.max_model_len)

    async def Detokenize(self, request_iterator: AsyncIterator[tokenizer_pb2.DetokenizeRequest],
                         context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[tokenizer_pb2.DetokenizeResponse]:
        session: DetokenizeSession | None = None
        with self._tracer.start_as_current_span("detokenize") as span:
            try:
                async for request in request_iterator:
                    kind = request.WhichOneof("kind")
                    if session is None:
                        if kind != "options":
                            raise InvalidRequestError("the first Detokenize message must "
                                                      "carry options", param="options")
                        session = self._open(request.options, span)
                        continue
                    if kind != "delta":
                        raise InvalidRequestError("Detokenize options may be sent only once, "
                                                  "first", param="options")
                    yield self._answer(session, request.delta)
            finally:  # also when the caller went away mid-stream
                if session is not None:
                    span.set_attribute("gen_ai.usage.output_tokens",
                                       session.num_tokens_received)

    def _open(self, options: tokenizer_pb2.DetokenizeOptions,
              span: trace.Span) -> DetokenizeSession:
        self.metrics.requests.labels("detokenize").inc()
        model = self.model
        model.check_name(options.model)
        params = sampling_params(options)
        span.set_attribute("gen_ai.request.id", options.request_id)
        span.set_attribute("gen_ai.request.model", model.name)
        span.set_attribute("meshserve.num_sequences", options.num_sequences)
        _log.debug("detokenize stream opened", extra={"request_id": options.request_id,
                                                      "num_sequences": options.num_sequences})
        return DetokenizeSession(model.tokenizer, params, options.num_sequences,
                                 list(options.prompt_token_ids))

    def _answer(self, session: DetokenizeSession,
                delta: tokenizer_pb2.DetokenizeDelta) -> tokenizer_pb2.DetokenizeResponse:
        received = session.num_tokens_received
        with self.metrics.timed("detokenize"):
            texts = [_sequence_text(session.update(s.index, s.token_ids, s.final,
                                                   s.lookup_token_ids, s.stopped_on_token))
                     for s in delta.sequences]
        self.metrics.tokens.labels("detokenize").inc(session.num_tokens_received - received)
        return tokenizer_pb2.DetokenizeResponse(sequences=texts)
