"""The Tokenizer gRPC servicer: protobuf at the edge, the text-side domain behind it.

`TokenizerServicer` only converts: a `TokenizeRequest` becomes a `PromptInput` that
`ServedModel.tokenize` turns into token ids (model.py); a DetokenizeSession stream (the
gateway's data plane) is a `SessionTexts` (session.py) that answers each message, one
step of many requests, with one columnar message. Domain errors (InvalidRequestError,
NotFoundError) are raised; the shared server interceptor maps them to statuses.

Ordinary prompts are tokenized on the event loop thread (one takes well under a
millisecond); large ones on a bounded pool of threads with a tokenizer copy each, so that
rendering and encoding megabytes never stall the small requests and detokenization behind
them; prompts past a character limit fail at once (encode_pool.py). Scale by running more
replicas.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Histogram

from meshserve.proto.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from meshserve.services.tokenizer.encode_pool import EncodePool, PromptLimits
from meshserve.services.tokenizer.model import ServedModel, TokenizedPrompt
from meshserve.services.tokenizer.session import SessionTexts
from meshserve.services.tokenizer.wire import placeholder_ranges, prompt_input
from meshserve.shared.errors import UnavailableError
from meshserve.shared.telemetry import Telemetry

SERVICE_NAME = "meshserve.v1.Tokenizer"
# Per-call CPU work: tens of microseconds for a delta, milliseconds for a long chat prompt.
_LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                    0.05, 0.1, 0.25, 1.0)


# -- metrics and the servicer ---------------------------------------------------------------


@dataclass
class TokenizerMetrics:
    """Prometheus metrics of the tokenizer service."""

    registry: CollectorRegistry
    requests: Counter = field(init=False)
    tokens: Counter = field(init=False)
    latency: Histogram = field(init=False)

    def __post_init__(self) -> None:
        self.requests = Counter("meshserve:tokenizer_requests", "Tokenizer calls received",
                                ["method"], registry=self.registry)
        self.tokens = Counter("meshserve:tokenizer_tokens", "Tokens produced (tokenize) or "
                              "turned into text (detokenize)", ["direction"],
                              registry=self.registry)
        self.latency = Histogram("meshserve:tokenizer_latency_seconds", "Time to tokenize one "
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
                 telemetry: Telemetry | None = None,
                 limits: PromptLimits | None = None) -> None:
        self._model: ServedModel | None = None
        self._pool = EncodePool(limits or PromptLimits())
        if model is not None:
            self.set_model(model)
        self._tracer = (telemetry.tracer if telemetry is not None
                        else trace.get_tracer("meshserve.tokenizer"))
        self.metrics = TokenizerMetrics(telemetry.registry if telemetry is not None
                                        else CollectorRegistry())

    def set_model(self, model: ServedModel) -> None:
        """Start serving `model` (once it is loaded)."""
        self._pool.set_model(model)
        self._model = model

    @property
    def model(self) -> ServedModel:
        """The served model; UnavailableError while it is still loading."""
        if self._model is None:
            raise UnavailableError("the tokenizer is still loading")
        return self._model

    async def _tokenize(self, request: tokenizer_pb2.TokenizeRequest,
                        method: str) -> TokenizedPrompt:
        self.metrics.requests.labels(method).inc()
        model = self.model
        model.check_name(request.model)
        prompt = prompt_input(request)
        with self._tracer.start_as_current_span("tokenize") as span, self.metrics.timed(method):
            span.set_attribute("gen_ai.request.model", model.name)
            span.set_attribute("meshserve.prompt.kind", "text" if prompt.text is not None
                               else "chat")
            span.set_attribute("meshserve.prompt.images", len(prompt.images))
            result = await self._pool.tokenize(model, prompt)
            span.set_attribute("gen_ai.usage.input_tokens", len(result.token_ids))
        self.metrics.tokens.labels("tokenize").inc(len(result.token_ids))
        return result

    async def Tokenize(self, request: tokenizer_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> tokenizer_pb2.TokenizeResponse:
        result = await self._tokenize(request, "tokenize")
        strs = (self.model.tokenizer.convert_ids_to_tokens(result.token_ids)
                if request.return_token_strs else [])
        return tokenizer_pb2.TokenizeResponse(token_ids=result.token_ids, prompt_text=result.text,
                                              max_model_len=self.model.max_model_len,
                                              token_strs=strs,
                                              image_ranges=placeholder_ranges(result.image_ranges))

    async def CountTokens(self, request: tokenizer_pb2.CountTokensRequest,
                          context: grpc.aio.ServicerContext
                          ) -> tokenizer_pb2.CountTokensResponse:
        result = await self._tokenize(request.prompt, "count_tokens")
        return tokenizer_pb2.CountTokensResponse(count=len(result.token_ids),
                                                 max_model_len=self.model.max_model_len)

    async def GetTokenizerInfo(self, request: tokenizer_pb2.TokenizerInfoRequest,
                               context: grpc.aio.ServicerContext
                               ) -> tokenizer_pb2.TokenizerInfoResponse:
        self.metrics.requests.labels("tokenizer_info").inc()
        self.model.check_name(request.model)
        info = json.dumps(self.model.tokenizer_info())
        return tokenizer_pb2.TokenizerInfoResponse(info_json=info)

    async def DetokenizeSession(
            self, request_iterator: AsyncIterator[tokenizer_pb2.DetokenizeSessionRequest],
            context: grpc.aio.ServicerContext
    ) -> AsyncIterator[tokenizer_pb2.DetokenizeSessionResponse]:
        texts = SessionTexts(self.model, self._tracer)
        try:
            async for message in request_iterator:
                received, opened = texts.num_tokens_received, texts.num_requests_opened
                with self.metrics.timed("detokenize_step"):
                    answer = texts.apply(message)
                self.metrics.requests.labels("detokenize").inc(
                    texts.num_requests_opened - opened)
                self.metrics.tokens.labels("detokenize").inc(
                    texts.num_tokens_received - received)
                yield answer
        finally:  # also when the gateway went away mid-stream
            texts.close()
