"""Amazon SageMaker's two routes, as vLLM serves them: GET|POST /ping (the health check,
/health's answer) and POST /invocations, which answers a body as the endpoint whose
request it is would.

vLLM tries its request types in order (chat, then completion, then the pooling ones) and
takes the first that validates; the fields that tell them apart are `messages` (chat),
`prompt` (completion), `input` (embeddings, or classification for a sequence classifier),
`query` (rerank) and the two sides of a score request (`text_1`, `queries`, `data_1`), so
those pick the endpoint here. A body with none of them is a 400 naming what was expected.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from aiohttp import web

from meshserve.services.gateway.api.handlers import read_json
from meshserve.shared.errors import InvalidRequestError

if TYPE_CHECKING:
    from aiohttp.typedefs import Handler

# The fields that mark a request type, and the request type's name (vLLM's class names).
_MARKERS = ((("messages",), "ChatCompletionRequest"), (("prompt",), "CompletionRequest"),
            (("input",), "EmbeddingCompletionRequest"), (("query",), "RerankRequest"),
            (("text_1", "queries", "data_1"), "ScoreRequest"))


class Invocations:
    """POST /invocations: one handler per request type, in vLLM's order of preference."""

    def __init__(self, chat: Handler, completions: Handler, pooled_input: Handler,
                 rerank: Handler, score: Handler) -> None:
        """`pooled_input`: a body with `input` (embeddings, or a classifier's /classify)."""
        self._handlers: Sequence[Handler] = (chat, completions, pooled_input, rerank, score)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Answers the body as its endpoint does (the body is read once: aiohttp keeps it
        for the handler's own read)."""
        body = await read_json(request)
        for (fields, _), handler in zip(_MARKERS, self._handlers, strict=True):
            if any(field in body for field in fields):
                return await handler(request)
        names = [name for _, name in _MARKERS]
        raise InvalidRequestError("Cannot find suitable handler for request. Expected one "
                                  f"of: {names}", param="body")
