"""aiohttp middlewares of the gateway: observe (span + metrics), errors, auth.

Order, outermost first: `observe` opens the request's SERVER span (parent: the W3C
traceparent of the incoming headers, if any) and counts the answer by endpoint and
status; `errors` turns every failure into the OpenAI error body with the status from
shared/status.py (429 answers carry Retry-After: the refusal's estimate when it has one);
`auth` checks the Bearer key (or Anthropic's `x-api-key`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

from aiohttp import web
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

from meshserve.services.gateway.metrics import GatewayMetrics
from meshserve.shared.errors import AuthenticationError, MeshError, OverloadedError
from meshserve.shared.openai_bodies import dumps
from meshserve.shared.status import http_error, openai_error_body
from meshserve.shared.telemetry import extract_context

if TYPE_CHECKING:  # aiohttp's types of a middleware (the Protocol web.Application takes)
    from aiohttp.typedefs import Handler, Middleware

_log = logging.getLogger(__name__)
# Paths that answer probes and scrapers: no span (they would drown the traces), no auth.
_OPEN_PATHS = frozenset({"/health", "/ping", "/load", "/version", "/metrics", "/metrics/all"})
# Status proxies log for a request whose client went away before the answer.
CLIENT_CLOSED = 499
# OpenAI error type of HTTP errors aiohttp raises itself (no route, wrong method, ...).
_HTTP_ERROR_TYPES = {404: "not_found_error", 405: "invalid_request_error",
                     413: "invalid_request_error"}


def endpoint_of(request: web.Request) -> str:
    """The route's path pattern (bounded label values), "unmatched" for unknown paths."""
    resource = getattr(request.match_info.route, "resource", None)
    return resource.canonical if resource is not None else "unmatched"


def retry_after_of(error: MeshError, default_s: int) -> int:
    """Retry-After seconds of an error's answer: the refusal's own estimate (an overloaded
    request refused by its estimated wait), else the configured `default_s`."""
    own = error.retry_after_s if isinstance(error, OverloadedError) else None
    return own if own else default_s


def error_response(status: int, body: Mapping[str, object],
                   retry_after_s: int) -> web.Response:
    """A JSON error answer; 429 and 503 tell the client when to retry."""
    headers = {"Retry-After": str(retry_after_s)} if status in (429, 503) else None
    return web.Response(status=status, body=dumps(body), content_type="application/json",
                        headers=headers)


REQUEST_ID_HEADER = "X-Request-Id"
ACCESS_LOG = logging.getLogger("meshserve.services.gateway.access")


class AccessLogger(web.AbstractAccessLogger):
    """One line per API request, as uvicorn writes them (`--no-access-log` turns it off);
    /health, /version and /metrics are left out: probes and scrapers would drown it."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse,
            time: float) -> None:
        if request.path in _OPEN_PATHS:
            return
        self.logger.info('%s "%s %s HTTP/%d.%d" %d %d %.3fs', request.remote, request.method,
                         request.path_qs, *request.version, response.status,
                         response.body_length, time,
                         extra={"http_method": request.method, "url_path": request.path,
                                "http_status": response.status, "seconds": round(time, 6),
                                "request_id": request.headers.get(REQUEST_ID_HEADER, "")})

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)


def request_id_header(always: bool) -> Callable[[web.Request, web.StreamResponse],
                                                Awaitable[None]]:
    """on_response_prepare: a caller's X-Request-Id comes back on the response (streamed
    ones too: the headers are set just before they are sent); with `always`
    (--enable-request-id-headers, vLLM's) a response to a caller who sent none carries a
    new id (uuid4 hex), as vLLM's XRequestIdMiddleware does."""
    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        client_id = request.headers.get(REQUEST_ID_HEADER)
        if client_id:
            response.headers[REQUEST_ID_HEADER] = client_id[:256]
        elif always:
            response.headers[REQUEST_ID_HEADER] = uuid.uuid4().hex
    return on_prepare


def observe(tracer: Tracer, metrics: GatewayMetrics) -> Middleware:
    """The span and the request counter of every request."""
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        endpoint = endpoint_of(request)
        status = 500
        try:
            if request.path in _OPEN_PATHS:
                response = await handler(request)
                status = response.status
                return response
            with tracer.start_as_current_span(
                    f"{request.method} {endpoint}", context=extract_context(request.headers),
                    kind=SpanKind.SERVER, record_exception=False,
                    set_status_on_exception=False, attributes={
                        "http.request.method": request.method, "url.path": request.path,
                        "http.route": endpoint}) as span:
                client_id = request.headers.get(REQUEST_ID_HEADER)
                if client_id:  # the caller's id for this request, to find it in traces
                    span.set_attribute("meshserve.client_request_id", client_id[:256])
                try:
                    response = await handler(request)
                    status = response.status
                except (asyncio.CancelledError, ConnectionResetError):
                    status = CLIENT_CLOSED
                    raise
                finally:
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
                return response
        except (asyncio.CancelledError, ConnectionResetError):
            status = CLIENT_CLOSED
            raise
        finally:
            metrics.requests.labels(endpoint, str(status)).inc()
    return middleware


def errors(retry_after_s: int) -> Middleware:
    """Every failure as the OpenAI error body (a failing request never affects others)."""
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except MeshError as exc:
            status, body = http_error(exc)
            if status >= 500:
                _log.warning("%s %s failed: %s", request.method, request.path, exc,
                             extra={"error_kind": exc.kind})
            return error_response(status, body, retry_after_of(exc, retry_after_s))
        except web.HTTPException as exc:  # raised by aiohttp: no route, 405, body too large
            if exc.status < 400:
                raise
            error_type = _HTTP_ERROR_TYPES.get(exc.status, "invalid_request_error")
            code = "request_too_large" if exc.status == 413 else None
            message = exc.text or exc.reason
            if exc.status == 413:
                message = f"request body too large: {exc.text or exc.reason}"
            return error_response(exc.status, openai_error_body(message, error_type, code=code),
                                  retry_after_s)
        except ConnectionResetError:
            # The client went away mid-answer: nobody reads this one (aiohttp drops it
            # quietly), but it is logged and counted as 499.
            _log.info("client of %s %s went away", request.method, request.path)
            return web.Response(status=CLIENT_CLOSED)
        except Exception as exc:  # noqa: BLE001 (logged with traceback, answered as 500)
            _log.exception("unexpected error in %s %s", request.method, request.path)
            return error_response(500, openai_error_body(
                f"internal error: {type(exc).__name__}: {exc}", "server_error"), retry_after_s)
    return middleware


def auth(api_key: str | None) -> Middleware:
    """Require `Authorization: Bearer <api_key>` on the API paths (not on probes), or the
    key alone in `x-api-key`, the header Anthropic's clients send."""
    expected = f"Bearer {api_key}".encode() if api_key else None
    bare = api_key.encode() if api_key else b""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        preflight = request.method == "OPTIONS" \
            and "Access-Control-Request-Method" in request.headers  # browsers send no key
        if expected is not None and request.path not in _OPEN_PATHS and not preflight:
            # Bytes that are not UTF-8 arrive as surrogates: they compare unequal, not fail.
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            header_key = request.headers.get("x-api-key", "").encode("utf-8", "surrogateescape")
            if not (hmac.compare_digest(given, expected)
                    or (header_key and hmac.compare_digest(header_key, bare))):
                raise AuthenticationError("invalid or missing API key (expected "
                                          "'Authorization: Bearer <key>' or 'x-api-key: <key>')")
        return await handler(request)
    return middleware
