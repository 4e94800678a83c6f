"""The other endpoints: /v1/models, /tokenize, /detokenize, /tokenizer_info (vLLM's
shapes), /health, /version. /metrics is Telemetry.handle_metrics.
"""

from __future__ import annotations

import asyncio
import time
from importlib import metadata
from typing import Any

from aiohttp import web

from meshserve.services.gateway.api.handlers import json_response, read_json
from meshserve.services.gateway.config import GatewayConfig
from meshserve.services.gateway.flow.drain import Drain
from meshserve.services.gateway.flow.job import ChatPrompt
from meshserve.services.gateway.flow.orchestrator import Orchestrator
from meshserve.services.gateway.links.clients import MeshClients
from meshserve.shared import openai_bodies as bodies
from meshserve.shared import openai_protocol as oai
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.status import openai_error_body


def _typed(body: dict[str, Any], key: str, kind: type, what: str, default: Any = None) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise InvalidRequestError(f"'{key}' must be {what}, got {value!r}"[:200], param=key)
    return value


def _version() -> str:
    try:
        return metadata.version("meshserve")
    except metadata.PackageNotFoundError:
        return "unknown"


class ServiceHandlers:
    """Models, tokenization helpers and probes."""

    def __init__(self, config: GatewayConfig, orchestrator: Orchestrator,
                 clients: MeshClients, drain: Drain) -> None:
        self._config = config
        self._orch = orchestrator
        self._clients = clients
        self._drain = drain
        self._created = int(time.time())

    def _deadline(self) -> float:
        return asyncio.get_running_loop().time() + self._config.request_timeout_s

    async def _model_card(self, name: str) -> dict[str, object]:
        """vLLM's model card; a LoRA adapter's names the model it adapts as its parent."""
        adapter = (await self._orch.lora_adapters()).get(name)
        return {"id": name, "object": "model", "created": self._created,
                "owned_by": "meshserve", "root": name,
                "parent": adapter.base_model if adapter is not None else None,
                "max_model_len": await self._clients.max_model_len(name)}

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: the served model names, then the LoRA adapters, with their context
        length when known."""
        names = await self._orch.model_names()
        names += [a for a in await self._orch.lora_adapters() if a not in names]
        data = [await self._model_card(name) for name in names]
        return json_response({"object": "list", "data": data})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{model}: one served model (404 naming it when not served)."""
        name = await self._orch.resolve_model(request.match_info["model"])
        return json_response(await self._model_card(name))

    async def tokenize(self, request: web.Request) -> web.Response:
        """POST /tokenize: {"prompt"} or {"messages", ...} -> {count, max_model_len, tokens};
        a chat's images are fetched and counted as their placeholder tokens."""
        body = await read_json(request)
        model = await self._orch.resolve_model(_typed(body, "model", str, "a string"))
        prompt: str | ChatPrompt
        if "messages" in body:
            parsed = oai.parse_chat_request(body)
            prompt = ChatPrompt.of(parsed)
            add_special = parsed.add_special_tokens
        else:
            if not isinstance(body.get("prompt"), str):
                raise InvalidRequestError("'prompt' (a string) or 'messages' is required",
                                          param="prompt")
            prompt = body["prompt"]
            add_special = _typed(body, "add_special_tokens", bool, "a boolean", True)
        strs = _typed(body, "return_token_strs", bool, "a boolean", False)
        model = await self._orch.base_model(model)  # an adapter tokenizes as its base
        # Images count as the placeholder tokens their sizes take, as vLLM counts them.
        images = await self._orch.load_images(prompt)
        response = await self._orch.tokenize(model, prompt, add_special_tokens=add_special,
                                             deadline=self._deadline(), return_token_strs=strs,
                                             images=images)
        tokens = list(response.token_ids)
        return json_response({"count": len(tokens), "max_model_len": response.max_model_len,
                              "tokens": tokens,
                              "token_strs": list(response.token_strs) if strs else None})

    async def detokenize(self, request: web.Request) -> web.Response:
        """POST /detokenize: {"tokens": [ids]} -> {"prompt": text}."""
        body = await read_json(request)
        model = await self._orch.resolve_model(_typed(body, "model", str, "a string"))
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
            raise InvalidRequestError("'tokens' must be an array of token ids", param="tokens")
        text = await self._orch.detokenize(await self._orch.base_model(model), tokens,
                                           self._deadline())
        return json_response({"prompt": text})

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        """GET /tokenizer_info (with --enable-tokenizer-info-endpoint, as vLLM): the
        tokenizer's configuration, its chat template included."""
        info = await self._clients.tokenizer_info(self._config.request_timeout_s)
        return web.Response(text=info, content_type="application/json")

    async def health(self, request: web.Request) -> web.Response:
        """GET /health: 200 when the scheduler and a tokenizer are SERVING and a worker is
        registered; 503 with what is missing otherwise, and 503 while the gateway drains."""
        if self._drain.draining:
            error = openai_error_body("the gateway is shutting down",
                                      "service_unavailable_error", code="unavailable")
            return web.Response(status=503, body=bodies.dumps(error), content_type="application/json",
                                headers={"Retry-After": str(self._config.retry_after_s)})
        report = await self._clients.health(self._config.health_timeout_s)
        if report.ok:
            return json_response(report.as_dict())
        missing = []
        if not report.scheduler_serving:
            missing.append("the scheduler is not SERVING")
        if not any(report.tokenizers_serving.values()):
            missing.append("no tokenizer replica is SERVING")
        if report.num_workers == 0:
            missing.append("no worker is registered")
        body: dict[str, Any] = openai_error_body(
            "not ready: " + "; ".join(missing), "service_unavailable_error", code="unavailable")
        body["health"] = report.as_dict()
        return json_response(body, status=503)

    async def version(self, request: web.Request) -> web.Response:
        """GET /version."""
        return json_response({"version": _version()})
