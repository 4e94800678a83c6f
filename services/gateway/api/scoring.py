"""vLLM's scoring and pooling endpoints over the embedding path: POST /score (/v1/score),
/rerank (/v1/rerank, /v2/rerank) and /pooling.

Both sides of a score or rerank request are embedded in one request to a pooling worker
(`EmbeddingHandlers.pool`: tokenized on a tokenizer replica, routed as one unit), then each
pair is scored by the cosine similarity of its two embeddings, as vLLM scores with an
embedding model; one left text is embedded once and paired with every right one. Usage
counts each pair's tokens plus the tokenizer's pad token between them, as vLLM does.
/pooling answers each input's pooled vector (the embedding). A model served only by
generating workers is a 400 in vLLM's words ("The model does not support Score API").
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
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

if TYPE_CHECKING:
    from aiohttp.typedefs import Handler


class ScoringHandlers:
    """The /score, /rerank and /pooling endpoints over a gateway's embedding path."""

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
                (protocol.POOLING_URL, self.pooling)]

    async def score(self, request: web.Request) -> web.Response:
        """POST /score and /v1/score."""
        parsed = protocol.parse_score_request(await read_json(request))
        model = await self._pooling_model(parsed.model, "Score API")

        async def answer(deadline: float) -> dict[str, Any]:
            scores, tokens = await self._pair_scores(parsed, model, deadline, "score")
            return protocol.score_response(model, scores, tokens)

        return json_response(await self._serve(answer))

    async def rerank(self, request: web.Request) -> web.Response:
        """POST /rerank, /v1/rerank and /v2/rerank."""
        parsed = protocol.parse_rerank_request(await read_json(request))
        model = await self._pooling_model(parsed.model, "Rerank (Score) API")

        async def answer(deadline: float) -> dict[str, Any]:
            scores, tokens = await self._pair_scores(parsed, model, deadline,
                                                     "embedding generation")
            return protocol.rerank_response(model, parsed, scores, tokens)

        return json_response(await self._serve(answer))

    async def pooling(self, request: web.Request) -> web.Response:
        """POST /pooling."""
        parsed = protocol.parse_pooling_request(await read_json(request))
        model = await self._pooling_model(parsed.model, "Pooling API")

        async def answer(deadline: float) -> dict[str, Any]:
            _, response = await self._embeddings.pool(parsed, model, deadline)
            return protocol.pooling_response(model, response.embeddings, response.dimensions,
                                             response.num_prompt_tokens,
                                             parsed.encoding_format)

        return json_response(await self._serve(answer))

    # -- parts ------------------------------------------------------------------------------

    async def _pooling_model(self, requested: str | None, api: str) -> str:
        """The model asked for; a 400 in vLLM's words when only generating workers serve it."""
        model = await self._orch.resolve_model(requested)
        serving = [w for w in await self._clients.list_workers() if w.serves(model)]
        if serving and all(w.generates for w in serving):
            raise InvalidRequestError(f"The model does not support {api}", param="model")
        return model

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

    async def _pair_scores(self, parsed: protocol.PairRequest, model: str, deadline: float,
                           operation: str) -> tuple[list[float], int]:
        """Each pair's cosine score and the request's prompt tokens (vLLM's count)."""
        inputs, response = await self._embeddings.pool(parsed.embedding_request(), model,
                                                       deadline, operation=operation)
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
