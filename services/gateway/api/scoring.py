"""vLLM's scoring, pooling and classification endpoints over the embedding path: POST
/score (/v1/score), /rerank (/v1/rerank, /v2/rerank), /pooling and /classify.

Every request is one Embed on a pooling worker (`EmbeddingHandlers.pool`: tokenized on a
tokenizer replica, routed as one unit). What the worker pools depends on its model, which
its registration says (`class_labels`):
- an embedding model pools embeddings: a pair scores the cosine similarity of its two
  embeddings, both sides embedded in one request (one left text once, for 1:N); usage
  counts each pair's tokens plus the tokenizer's pad token between them, as vLLM does;
- a sequence classifier pools class logits: /classify activates them (softmax, or sigmoid
  for one class); a one-label classifier is a cross-encoder, scoring each pair's two
  token id lists laid end to end by its logit through a sigmoid.
A model served only by generating workers, or of the other kind, is a 400 in vLLM's words
("The model does not support Score API").
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from aiohttp import web

from meshserve.services.gateway.api import scoring_protocol as protocol
from meshserve.services.gateway.api.embeddings import EmbeddingHandlers
from meshserve.services.gateway.api.handlers import json_response, read_json
from meshserve.services.gateway.config import GatewayConfig
from meshserve.services.gateway.flow.admission import Admission
from meshserve.services.gateway.flow.drain import Drain
from meshserve.services.gateway.flow.orchestrator import Orchestrator
from meshserve.services.gateway.links.clients import MeshClients
from meshserve.shared.errors import DeadlineExceededError, InvalidRequestError
from meshserve.shared.openai_embeddings import EmbeddingRequest

if TYPE_CHECKING:
    from aiohttp.typedefs import Handler


@dataclass(frozen=True)
class _Served:
    """The model a request runs on, and its class labels (empty: an embedding model)."""

    name: str
    labels: tuple[str, ...] = ()


class ScoringHandlers:
    """The /score, /rerank, /pooling and /classify endpoints over a gateway's embedding
    path."""

    def __init__(self, config: GatewayConfig, orchestrator: Orchestrator, clients: MeshClients,
                 admission: Admission, drain: Drain, embeddings: EmbeddingHandlers) -> None:
        self._config = config
        self._orch = orchestrator
        self._clients = clients
        self._admission = admission
        self._drain = drain
        self._embeddings = embeddings
        self._separator: int | None = None  # 1 when the tokenizer has a pad token

    def routes(self) -> list[tuple[str, Handler]]:
        """Each POST path served here, with its handler."""
        return [*((path, self.score) for path in protocol.SCORE_URLS),
                *((path, self.rerank) for path in protocol.RERANK_URLS),
                (protocol.POOLING_URL, self.pooling), (protocol.CLASSIFY_URL, self.classify)]

    async def score(self, request: web.Request) -> web.Response:
        """POST /score and /v1/score."""
        parsed = protocol.parse_score_request(await read_json(request))
        served = await self._scoring_model(parsed.model, "Score API")

        async def answer(deadline: float) -> dict[str, Any]:
            scores, tokens = await self._pair_scores(parsed, served, deadline, "score")
            return protocol.score_response(served.name, scores, tokens)

        return json_response(await self._serve(answer))

    async def rerank(self, request: web.Request) -> web.Response:
        """POST /rerank, /v1/rerank and /v2/rerank."""
        parsed = protocol.parse_rerank_request(await read_json(request))
        served = await self._scoring_model(parsed.model, "Rerank (Score) API")

        async def answer(deadline: float) -> dict[str, Any]:
            scores, tokens = await self._pair_scores(parsed, served, deadline,
                                                     "embedding generation")
            return protocol.rerank_response(served.name, parsed, scores, tokens)

        return json_response(await self._serve(answer))

    async def pooling(self, request: web.Request) -> web.Response:
        """POST /pooling: embeddings, or a classifier's class probabilities."""
        parsed = protocol.parse_pooling_request(await read_json(request))
        served = await self._pooling_model(parsed.inputs.model, "Pooling API")
        task = protocol.check_task(parsed.task, ("classify",) if served.labels else ("embed",))

        async def answer(deadline: float) -> dict[str, Any]:
            inputs = parsed.inputs if task == "classify" else replace(
                parsed.inputs, normalize=parsed.use_activation)
            rows, tokens = await self._rows(inputs, served, deadline)
            if task == "classify" and parsed.use_activation is not False:
                rows = [protocol.activate(row) for row in rows]
            return protocol.pooling_response(served.name, rows, tokens,
                                             parsed.inputs.encoding_format)

        return json_response(await self._serve(answer))

    async def classify(self, request: web.Request) -> web.Response:
        """POST /classify (sequence-classification models)."""
        parsed = protocol.parse_classify_request(await read_json(request))
        served = await self._pooling_model(parsed.inputs.model, "Classification API")
        if not served.labels:
            raise _unsupported("Classification API")

        async def answer(deadline: float) -> dict[str, Any]:
            rows, tokens = await self._rows(parsed.inputs, served, deadline, "classification")
            return protocol.classify_response(served.name, served.labels, rows, tokens,
                                              parsed.use_activation)

        return json_response(await self._serve(answer))

    async def pooled_input(self, request: web.Request) -> web.StreamResponse:
        """A body of `input` as /invocations answers it: /classify on a sequence
        classifier, /v1/embeddings otherwise (vLLM tries the tasks the model serves)."""
        model = (await read_json(request)).get("model")
        resolved = await self._orch.resolve_model(model if isinstance(model, str) else None)
        workers = await self._clients.list_workers()
        if any(w.class_labels for w in workers if w.serves(resolved)):
            return await self.classify(request)
        return await self._embeddings.embeddings(request)

    # -- the model --------------------------------------------------------------------------

    async def _pooling_model(self, requested: str | None, api: str) -> _Served:
        """The model asked for and its kind; a 400 in vLLM's words when only generating
        workers serve it."""
        model = await self._orch.resolve_model(requested)
        serving = [w for w in await self._clients.list_workers() if w.serves(model)]
        if serving and all(w.generates for w in serving):
            raise _unsupported(api)
        labels = next((w.class_labels for w in serving if not w.generates), ())
        return _Served(model, tuple(labels))

    async def _scoring_model(self, requested: str | None, api: str) -> _Served:
        """A model that scores pairs: an embedding model or a one-label classifier."""
        served = await self._pooling_model(requested, api)
        if len(served.labels) > 1:
            raise _unsupported(api)
        return served

    # -- running ----------------------------------------------------------------------------

    async def _serve(self, answer: Callable[[float], Awaitable[dict[str, Any]]],
                     ) -> dict[str, Any]:
        """`answer(deadline)` under admission, drain tracking and the request timeout."""
        deadline = asyncio.get_running_loop().time() + self._config.request_timeout_s
        self._drain.refuse_if_draining()
        with self._admission.slot(), self._drain.track():
            try:
                async with asyncio.timeout_at(deadline):
                    return await answer(deadline)
            except TimeoutError as exc:
                raise DeadlineExceededError(
                    f"the request did not finish within {self._config.request_timeout_s}s "
                    "(request_timeout_s)") from exc

    async def _rows(self, inputs: EmbeddingRequest, served: _Served, deadline: float,
                    operation: str = "embedding generation") -> tuple[list[list[float]], int]:
        """Each input's pooled vector (embedding or class logits) and the prompt tokens."""
        _, response = await self._embeddings.pool(inputs, served.name, deadline,
                                                  operation=operation)
        return (protocol.float_rows(response.embeddings, response.dimensions),
                response.num_prompt_tokens)

    async def _pair_scores(self, parsed: protocol.PairRequest, served: _Served,
                           deadline: float, operation: str) -> tuple[list[float], int]:
        """Each pair's score and the request's prompt tokens (vLLM's count)."""
        both = parsed.embedding_request()
        if served.labels:  # a cross-encoder: each pair is one input
            ids = await self._embeddings.token_ids(both, served.name, deadline, operation)
            pairs = protocol.pair_inputs(ids, len(parsed.left))
            rows, tokens = await self._rows(
                EmbeddingRequest(inputs=tuple(pairs), priority=parsed.priority), served,
                deadline, operation)
            return protocol.cross_encoder_scores(rows, parsed.use_activation), tokens
        inputs, response = await self._embeddings.pool(both, served.name, deadline,
                                                       operation=operation)
        rows = protocol.float_rows(response.embeddings, response.dimensions)
        scores = protocol.pair_scores(rows, len(parsed.left))
        separator = await self._pad_separator()
        return scores, protocol.pair_tokens(list(map(len, inputs)), len(parsed.left), separator)

    async def _pad_separator(self) -> int:
        """1 when the served tokenizer has a pad token (vLLM counts one between the two
        inputs of a scored pair), else 0; asked of a tokenizer replica once."""
        if self._separator is None:
            info = json.loads(await self._clients.tokenizer_info(self._config.request_timeout_s))
            self._separator = 1 if info.get("pad_token") is not None else 0
        return self._separator


def _unsupported(api: str) -> InvalidRequestError:
    return InvalidRequestError(f"The model does not support {api}", param="model")
