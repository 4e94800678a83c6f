"""Settings of the gateway: the OpenAI HTTP API in front of the mesh.

Choices, written down:
- `max_tokens` when a request leaves it out: legacy `/v1/completions` generate 16
  tokens, as the OpenAI API documents; `/v1/chat/completions` generate up to the
  model's context, as vLLM does (OpenAI's chat API has no fixed default either). Both
  are settings (`completions_default_max_tokens`, `chat_default_max_tokens`; 0 means
  "up to the context"). A default never makes a request fail: it is capped at what the
  context leaves, while an explicit `max_tokens` past the context is a 400.
- Admission (docs/operations.md, "Overload"): a request that finds every worker full
  waits in the scheduler's global queue only while the scheduler's estimate of its wait
  to start stays within `max_queue_delay_s` (a minute) and its deadline; past that it is
  refused at once with 429 and a Retry-After from the estimate. `max_concurrent_requests`
  stays as a ceiling on the gateway's memory. A request is only refused before its
  answer starts: once admitted (routed), it keeps its place, and a request moving to
  another worker after a failure is never refused by the estimate.
- `served_model_names` empty: the gateway serves the model names the registered
  workers announce (the scheduler's ListWorkers, cached for `model_cache_ttl_s`).
- `/health` is 200 when the scheduler and at least one tokenizer replica are SERVING
  and at least one worker is registered; otherwise 503 with what is missing.
- An `api_key` guards `/v1/*`, `/tokenize` and `/detokenize` (as vLLM guards `/v1`);
  `/health`, `/version` and `/metrics` stay open for probes and scrapers. With
  `api_key_file` (a compose or Kubernetes secret) the key is the file's first line, read
  once at start, so that it appears in no command line or environment.
- `reuse_port` (SO_REUSEPORT, off by default) lets several gateway processes listen on
  one host:port, the kernel spreading new connections over them; `meshserve up
  --gateways N` turns it on when N > 1. Off otherwise, so that a second gateway started
  by mistake on a taken port fails instead of silently sharing it.
- Images in chat requests (docs/behaviour.md, "Images"): fetched within 5 s each (vLLM's
  `VLLM_IMAGE_FETCH_TIMEOUT`), up to 20 MiB a file, never from a non-public address unless
  `allow_private_media_urls` or `allowed_media_networks` say so, with no redirect followed
  unless `media_max_redirects` allows some (vLLM follows them by default: a redirect to an
  internal address is the classic way around an SSRF check).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from meshserve.services.gateway.media.policy import (
    MediaSettings,
    images_per_prompt,
    parse_limit_mm_per_prompt,
    parse_networks,
)
from meshserve.shared.config import ServiceConfig, option
from meshserve.shared.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class GatewayConfig(ServiceConfig):
    """Settings of the gateway service (flags `--field-name`, env `MESHSERVE_FIELD_NAME`)."""

    port: int = option(8000, "HTTP port of the OpenAI API (0: any free port)")
    backlog: int = option(
        4096, "pending connections the listening socket queues (a burst of N clients "
              "opening connections at once needs N; past it the kernel drops their SYNs and "
              "they retry a second later); capped by net.core.somaxconn")
    reuse_port: bool = option(False, "listen with SO_REUSEPORT so that several gateway "
                                     "processes share the port (the kernel spreads connections)")
    # Defaults: the tokenizer's and the scheduler's own default ports on this host.
    tokenizer_addresses: tuple[str, ...] = option(
        ("127.0.0.1:50051",), "tokenizer replicas host:port, comma-separated (round-robin)")
    scheduler_address: str = option("127.0.0.1:50052", "scheduler host:port")
    served_model_names: tuple[str, ...] = option(
        (), "model names the API serves, comma-separated (empty: those the workers announce)")
    api_key: str | None = option(None, "Bearer token clients must send (unset: no auth)")
    metrics_targets: tuple[str, ...] = option(
        (), "other services' /metrics that GET /metrics/all merges, as name=url, "
            "comma-separated (the registered workers' come from the scheduler)")
    api_key_file: Path | None = option(  # noqa: RUF009 (option() is the config pattern)
        None, "file whose first line is the API key (a secret mount; instead of --api-key)")
    allowed_origins: tuple[str, ...] = option(
        (), "origins a browser may call the API from (CORS), comma-separated; '*': any "
            "(empty: no CORS headers, preflights refused)")
    allow_credentials: bool = option(False, "CORS: let browsers send credentials (cookies, "
                                            "HTTP auth) with cross-origin requests")
    max_concurrent_requests: int = option(
        1024, "generation requests in flight in this gateway before answering 429: a hard "
              "ceiling on its memory (what may start soon is bounded by --max-queue-delay-s)")
    max_queue_delay_s: float = option(
        60.0, "answer 429 at once (Retry-After from the estimate) when every worker is full "
              "and a request's estimated wait to start passes this many seconds, or its "
              "deadline; 0: no refusal by estimate (requests queue up to the fixed bounds)")
    retry_after_s: int = option(1, "Retry-After seconds sent with 429 answers that carry no "
                                   "estimate of their own (and with 503 answers)")
    max_body_bytes: int = option(8 * 1024 * 1024, "largest request body accepted (else 413)")
    request_timeout_s: float = option(600.0, "deadline of one request, end to end (else 504)")
    completions_default_max_tokens: int = option(
        16, "max_tokens of /v1/completions when the request gives none (0: up to the context)")
    chat_default_max_tokens: int = option(
        0, "max_tokens of /v1/chat/completions when the request gives none "
           "(0: up to the context)")
    route_output_estimate: int = option(
        256, "output tokens the scheduler assumes per sequence when max_tokens is unbounded")
    max_generate_attempts: int = option(
        2, "workers tried for one request when a worker is unavailable before its first token")
    max_failovers: int = option(
        2, "times one request moves to another worker, continuing from the tokens it already "
           "has, when its worker is lost mid-generation (0: such a request ends with an error)")
    detokenize_failover_wait_s: float = option(
        30.0, "seconds a stream whose tokenizer replica was lost waits for a replica to take "
              "its detokenization over (another one, or the same once restarted) before it "
              "ends with an error (0: it ends at once)")
    scheduler_failover_wait_s: float = option(
        10.0, "seconds a request waits for the scheduler when it cannot be reached (it died "
              "and is being restarted) before it is answered 503 (0: at once)")
    model_cache_ttl_s: float = option(5.0, "seconds the worker list (models, context) is cached")
    health_timeout_s: float = option(2.0, "deadline of the checks behind GET /health")
    access_log: bool = option(True, "log one line per API request (client, method, path, "
                                    "status, bytes, seconds); probes and scrapes are not logged")
    redis_url: str | None = option(
        None, "Redis where /v1/responses keeps stored responses, shared by every gateway "
              "replica (unset: kept in this process)")
    responses_ttl_s: float = option(3600.0, "seconds a stored /v1/responses answer can be "
                                            "retrieved or continued")
    root_path: str = option(
        "", "path prefix the API is served under behind a proxy, e.g. /llm (requests are "
            "answered with and without it)")
    tool_call_parser: str | None = option(
        None, "how tool calls are read from a model's output for tool_choice 'auto': hermes, "
              "qwen3, qwen3_coder, llama3_json or mistral (required and named tool choices "
              "need none: they are enforced with structured outputs)")
    enable_auto_tool_choice: bool = option(
        False, "let tool_choice 'auto' parse tool calls with --tool-call-parser (as vLLM)")
    reasoning_parser: str | None = option(
        None, "split a reasoning model's thinking into reasoning_content: deepseek_r1 or qwen3")
    limit_mm_per_prompt: str = option(
        "", "items allowed per prompt by modality, as vLLM's JSON: '{\"image\": 4}' "
            "(a modality left out: 999, vLLM's default); past it a request is a 400")
    media_fetch_timeout_s: float = option(
        5.0, "seconds to fetch one image URL, lookup, redirects and body included (vLLM's "
             "5 s)")
    media_max_bytes: int = option(
        20 * 2**20, "largest image file accepted, fetched or in a data URL (20M: 20 MiB)")
    media_max_image_pixels: int = option(
        89_478_485, "most pixels (width x height) an image may have (a decompression bomb "
                    "is refused before it is decoded); Pillow's own threshold")
    media_max_redirects: int = option(
        0, "redirects followed when fetching an image URL, each hop checked again "
           "(0: none)")
    allowed_media_domains: tuple[str, ...] = option(
        (), "hosts image URLs may name, comma-separated (empty: any host)")
    allow_private_media_urls: bool = option(
        False, "let image URLs reach loopback, private, link-local, multicast, reserved and "
               "other non-public addresses (off: such URLs are a 400, an SSRF guard)")
    allowed_media_networks: tuple[str, ...] = option(
        (), "networks (CIDR, comma-separated) image URLs may reach although not public, "
            "e.g. an internal image store at 10.2.0.0/16")
    allow_runtime_lora_updating: bool = option(
        False, "answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM, off "
               "unless asked: they read adapter folders on the workers' file systems)",
        env="VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    enable_tokenizer_info_endpoint: bool = option(
        False, "answer GET /tokenizer_info: the tokenizer's configuration, chat template "
               "included (as vLLM, off unless asked: 404)")
    enable_server_load_tracking: bool = option(
        False, "count the generation and pooling requests in flight, reported by GET /load "
               "as server_load (as vLLM; off: it stays 0)")
    enable_request_id_headers: bool = option(
        False, "an X-Request-Id header on every response: the caller's own, else a new "
               "one (off: only a caller's X-Request-Id comes back)")
    enable_prompt_embeds: bool = option(
        False, "take prompt_embeds on /v1/completions (base64 torch.save'd tensors [rows, "
               "hidden size]; the workers need the flag too); off: refused with vLLM's 400")

    def validate(self) -> None:
        super().validate()
        self.require(bool(self.tokenizer_addresses), "needs at least one address",
                     "tokenizer_addresses")
        self.require(bool(self.scheduler_address), "must not be empty", "scheduler_address")
        bad = [t for t in self.metrics_targets if "=" not in t.strip("=")]
        self.require(not bad, f"each target is name=url, got {bad}", "metrics_targets")
        self.require(self.backlog >= 1, f"must be >= 1, got {self.backlog}", "backlog")
        self.require(not (self.reuse_port and self.port == 0),
                     "needs a fixed --port (with port 0 each process would get its own)",
                     "reuse_port")
        self.require(self.api_key is None or bool(self.api_key), "must not be empty when set",
                     "api_key")
        if self.api_key_file is not None:
            self.require(self.api_key is None, "give --api-key or --api-key-file, not both",
                         "api_key_file")
            object.__setattr__(self, "api_key", self._read_api_key(self.api_key_file))
        for name in ("max_concurrent_requests", "max_body_bytes", "retry_after_s",
                     "route_output_estimate", "max_generate_attempts"):
            value = getattr(self, name)
            self.require(value >= 1, f"must be >= 1, got {value}", name)
        self.require(self.max_queue_delay_s >= 0, f"must be >= 0 (0: off), got "
                     f"{self.max_queue_delay_s}", "max_queue_delay_s")
        self.require(self.max_failovers >= 0, f"must be >= 0, got {self.max_failovers}",
                     "max_failovers")
        self.require(self.scheduler_failover_wait_s >= 0,
                     f"must be >= 0, got {self.scheduler_failover_wait_s}",
                     "scheduler_failover_wait_s")
        self.require(self.detokenize_failover_wait_s >= 0,
                     f"must be >= 0, got {self.detokenize_failover_wait_s}",
                     "detokenize_failover_wait_s")
        for name in ("completions_default_max_tokens", "chat_default_max_tokens"):
            value = getattr(self, name)
            self.require(value >= 0, f"must be >= 0 (0: up to the context), got {value}", name)
        self.require(not self.root_path or (self.root_path.startswith("/")
                                            and not self.root_path.endswith("/")),
                     f"must start with '/' and not end with one, got {self.root_path!r}",
                     "root_path")
        self.require(not self.enable_auto_tool_choice or self.tool_call_parser is not None,
                     "needs --tool-call-parser", "enable_auto_tool_choice")
        self._require_parser("tool_call_parser", "tool_parsers", "TOOL_PARSERS")
        self._require_parser("reasoning_parser", "reasoning_parsers", "REASONING_PARSERS")
        self._validate_media()
        for name in ("request_timeout_s", "model_cache_ttl_s", "health_timeout_s",
                     "responses_ttl_s", "media_fetch_timeout_s"):
            value = getattr(self, name)
            self.require(value > 0, f"must be > 0, got {value}", name)

    def _validate_media(self) -> None:
        for name in ("media_max_bytes", "media_max_image_pixels"):
            value = getattr(self, name)
            self.require(value >= 1, f"must be >= 1, got {value}", name)
        self.require(self.media_max_redirects >= 0,
                     f"must be >= 0, got {self.media_max_redirects}", "media_max_redirects")
        self.media  # noqa: B018 (parsed to validate the limits and networks)

    @property
    def media(self) -> MediaSettings:
        """How images in chat requests are fetched and checked."""
        limits = parse_limit_mm_per_prompt(self.limit_mm_per_prompt)
        return MediaSettings(
            fetch_timeout_s=self.media_fetch_timeout_s, max_bytes=self.media_max_bytes,
            max_redirects=self.media_max_redirects,
            allowed_domains=frozenset(d.strip().rstrip(".").lower()
                                      for d in self.allowed_media_domains),
            allow_private=self.allow_private_media_urls,
            allowed_networks=parse_networks(self.allowed_media_networks,
                                            "allowed_media_networks"),
            max_pixels=self.media_max_image_pixels, max_images=images_per_prompt(limits))

    def _read_api_key(self, path: Path) -> str:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ConfigError(f"{type(self).__name__}.api_key_file: cannot read {path}: "
                              f"{exc.strerror}", param="api_key_file") from None
        key = lines[0].strip() if lines else ""
        self.require(bool(key), f"{path} holds no key (its first line is empty)", "api_key_file")
        return key

    def _require_parser(self, name: str, module: str, table: str) -> None:
        value = getattr(self, name)
        if value is None:
            return
        import importlib

        known = getattr(importlib.import_module(f"meshserve.services.gateway.parsers.{module}"), table)
        self.require(value in known, f"must be one of {', '.join(sorted(known))}, got "
                                     f"{value!r}", name)

    def default_max_tokens(self, chat: bool) -> int | None:
        """max_tokens applied when a request gives none; None: up to the context."""
        value = self.chat_default_max_tokens if chat else self.completions_default_max_tokens
        return value or None
