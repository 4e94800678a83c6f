"""The gateway's aiohttp application and its lifecycle.

    gateway = Gateway(config, telemetry)
    port = await gateway.start()        # listening on config.host:config.port
    ...
    await gateway.stop()                # stop accepting, let requests finish, close channels

Handlers are cancelled when their client disconnects (`handler_cancellation`), which
aborts the request at the worker and closes it at the tokenizer at once (see
orchestrator.py).
"""

from __future__ import annotations

import logging

from aiohttp import web

from meshserve.services.gateway.anthropic.convert import COUNT_TOKENS_URL, MESSAGES_URL
from meshserve.services.gateway.anthropic.endpoint import MessagesEndpoint
from meshserve.services.gateway.api import middleware
from meshserve.services.gateway.api.batch_chat import BatchChat
from meshserve.services.gateway.api.embeddings import EmbeddingHandlers
from meshserve.services.gateway.api.handlers import Handlers
from meshserve.services.gateway.api.lora_admin import LoraAdmin
from meshserve.services.gateway.api.sagemaker import Invocations
from meshserve.services.gateway.api.scoring import ScoringHandlers
from meshserve.services.gateway.api.server_load import ServerLoad
from meshserve.services.gateway.api.service_handlers import ServiceHandlers
from meshserve.services.gateway.config import GatewayConfig
from meshserve.services.gateway.flow.admission import Admission
from meshserve.services.gateway.flow.drain import Drain
from meshserve.services.gateway.flow.orchestrator import Orchestrator
from meshserve.services.gateway.links.clients import MeshClients
from meshserve.services.gateway.merged_metrics import MergedMetrics, parse_targets
from meshserve.services.gateway.metrics import GatewayMetrics
from meshserve.services.gateway.responses.convert import RESPONSES_URL
from meshserve.services.gateway.responses.endpoint import ResponsesEndpoint
from meshserve.services.gateway.responses.store import ResponseStore
from meshserve.shared.openai_embeddings import EMBEDDINGS_URL
from meshserve.shared.openai_protocol import CHAT_COMPLETIONS_URL, COMPLETIONS_URL
from meshserve.shared.telemetry import Telemetry

_log = logging.getLogger(__name__)


def create_app(config: GatewayConfig, telemetry: Telemetry, clients: MeshClients,
               orchestrator: Orchestrator, metrics: GatewayMetrics,
               drain: Drain | None = None) -> web.Application:
    """The aiohttp application: middlewares (observe, errors, auth) and every route."""
    admission = Admission(config.max_concurrent_requests, metrics.in_flight,
                          metrics.admission_refusals)
    drain = drain or Drain()
    generation = Handlers(config, orchestrator, admission, drain)
    store = ResponseStore(config.redis_url, config.responses_ttl_s)
    answers = ResponsesEndpoint(generation, orchestrator, store, drain)
    messages = MessagesEndpoint(config, generation, orchestrator, drain)
    service = ServiceHandlers(config, orchestrator, clients, drain)
    lora_admin = LoraAdmin(config, clients)
    embeddings = EmbeddingHandlers(config, orchestrator, clients, admission, drain,
                                   telemetry.tracer)
    scoring = ScoringHandlers(config, orchestrator, clients, admission, drain, embeddings)
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[
        middleware.observe(telemetry.tracer, metrics),
        middleware.errors(config.retry_after_s),
        middleware.auth(config.api_key),
    ])
    app.on_response_prepare.append(
        middleware.request_id_header(config.enable_request_id_headers))
    load = ServerLoad(config.enable_server_load_tracking)
    batch_chat = BatchChat(generation)
    invocations = Invocations(generation.chat_completions, generation.completions,
                              scoring.pooled_input, scoring.rerank, scoring.score)
    routes = [
        ("POST", COMPLETIONS_URL, load.tracked(generation.completions)),
        ("POST", CHAT_COMPLETIONS_URL, load.tracked(generation.chat_completions)),
        ("POST", CHAT_COMPLETIONS_URL + "/batch", load.tracked(batch_chat.handle)),
        ("POST", EMBEDDINGS_URL, load.tracked(embeddings.embeddings)),
        ("POST", RESPONSES_URL, load.tracked(answers.create)),
        ("POST", MESSAGES_URL, load.tracked(messages.create)),
        ("POST", COUNT_TOKENS_URL, load.tracked(messages.count_tokens)),
        ("POST", "/invocations", load.tracked(invocations.handle)),
        ("GET", "/ping", service.health),  # SageMaker's health check, both methods
        ("POST", "/ping", service.health),
        ("GET", "/load", load.handle),
        ("GET", RESPONSES_URL + "/{response_id}", answers.retrieve),
        ("DELETE", RESPONSES_URL + "/{response_id}", answers.delete),
        ("GET", RESPONSES_URL + "/{response_id}/input_items", answers.input_items),
        ("GET", "/v1/models", service.models),
        ("GET", "/v1/models/{model:.+}", service.model),  # ids may hold slashes
        ("POST", "/v1/load_lora_adapter", lora_admin.load),
        ("POST", "/v1/unload_lora_adapter", lora_admin.unload),
        ("POST", "/tokenize", service.tokenize),
        ("POST", "/detokenize", service.detokenize),
        ("GET", "/health", service.health),
        ("GET", "/version", service.version),
        ("GET", "/metrics", telemetry.handle_metrics),
        ("GET", "/metrics/all", merged_metrics(config, telemetry, clients).handle),
    ]
    routes += [("POST", path, load.tracked(handler)) for path, handler in scoring.routes()]
    if config.enable_tokenizer_info_endpoint:  # unrouted (404) unless asked, as in vLLM
        routes.append(("GET", "/tokenizer_info", service.tokenizer_info))
    # Behind a proxy that serves the API under --root-path, requests may arrive with the
    # prefix (the proxy kept it) or without it (the proxy stripped it): both are served.
    prefixes = ["", config.root_path] if config.root_path else [""]
    for prefix in prefixes:
        for method, path, handler in routes:
            app.router.add_route(method, prefix + path, handler)
    if config.allowed_origins:
        _allow_cors(app, config.allowed_origins, config.allow_credentials)

    async def close_store(_: web.Application) -> None:
        await store.close()

    app.on_cleanup.append(close_store)
    return app


def merged_metrics(config: GatewayConfig, telemetry: Telemetry,
                   clients: MeshClients) -> MergedMetrics:
    """The /metrics/all handler: this gateway, --metrics-targets and the workers."""
    async def workers() -> list[tuple[str, str]]:
        return [(w.worker_id, w.metrics_url) for w in await clients.list_workers()
                if w.metrics_url]

    return MergedMetrics(telemetry.registry, "gateway", f"{config.host}:{config.port}",
                         parse_targets(config.metrics_targets), workers)


def _allow_cors(app: web.Application, origins: tuple[str, ...], credentials: bool) -> None:
    """CORS headers and preflight answers on every route (aiohttp-cors), for `origins`."""
    import aiohttp_cors  # only when CORS is configured

    options = aiohttp_cors.ResourceOptions(allow_credentials=credentials, expose_headers="*",
                                           allow_headers="*", allow_methods="*")
    cors = aiohttp_cors.setup(app, defaults=dict.fromkeys(origins, options))
    for route in list(app.router.routes()):
        cors.add(route)


class Gateway:
    """The gateway service: mesh clients, orchestrator and the HTTP server."""

    def __init__(self, config: GatewayConfig, telemetry: Telemetry,
                 clients: MeshClients | None = None) -> None:
        self.config = config
        self.telemetry = telemetry
        self.metrics = GatewayMetrics(telemetry.registry)
        self.clients = clients or MeshClients(config.tokenizer_addresses,
                                              config.scheduler_address,
                                              model_cache_ttl_s=config.model_cache_ttl_s)
        self.orchestrator = Orchestrator(config, self.clients, self.metrics, telemetry.tracer)
        self.drain = Drain()
        self.app = create_app(config, telemetry, self.clients, self.orchestrator, self.metrics,
                              self.drain)
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        """Listen on config.host:config.port (shared with other gateway processes when
        config.reuse_port); returns the bound port."""
        access = {"access_log_class": middleware.AccessLogger,
                  "access_log": middleware.ACCESS_LOG} if self.config.access_log \
            else {"access_log": None}
        runner = web.AppRunner(self.app, handler_cancellation=True,
                               shutdown_timeout=self.config.drain_grace_s, **access)
        await runner.setup()
        self._runner = runner
        await web.TCPSite(runner, self.config.host, self.config.port,
                          reuse_port=self.config.reuse_port, backlog=self.config.backlog).start()
        port = int(runner.addresses[0][1])
        self.metrics.listening.set(1)
        _log.info("gateway listening", extra={"host": self.config.host, "port": port,
                                              "reuse_port": self.config.reuse_port})
        return port

    async def stop(self) -> None:
        """Drain: new requests get 503 + Retry-After while those in flight get up to
        drain_grace_s, then the rest end with an error event; stop listening, close channels."""
        await self.drain.run(self.config.drain_grace_s)
        self.metrics.listening.set(0)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.clients.close()
        await self.orchestrator.close()
        _log.info("gateway stopped")
