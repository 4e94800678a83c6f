"""The one telemetry setup: OpenTelemetry traces and Prometheus metrics of a service process.

- `Telemetry(service_name, otlp_endpoint=...)` owns the process's tracer provider
  (resource `service.name`), exporting over OTLP/gRPC when an endpoint is configured;
  with no exporter it records no span of its own making (trace context still
  propagates, and a sampled parent is honoured). It also owns the Prometheus registry.
- W3C trace context (`traceparent`, `tracestate`) rides in HTTP headers
  (`inject_headers` / `extract_context`) and gRPC metadata
  (`trace_context_interceptors()` on channels, `Telemetry.server_rpc` around every
  served RPC, which opens a SERVER span whose parent is the caller's span).
- `/metrics` is served by `Telemetry.handle_metrics` (an aiohttp handler) or, for
  services without an HTTP server, `Telemetry.start_metrics_server`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

import grpc
from aiohttp import web
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.process_collector import ProcessCollector

from meshserve.shared.errors import MeshError
from meshserve.shared.health_http import HealthProbe, add_health_route
from meshserve.shared.status import grpc_code_for

# RPC latencies span sub-millisecond unary calls to minutes-long generation streams.
_RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                5.0, 10.0, 30.0, 60.0, 300.0)


def _propagator() -> TraceContextTextMapPropagator:
    # W3C trace context only, whatever OTEL_PROPAGATORS says: every hop must agree.
    return TraceContextTextMapPropagator()


def inject_headers(headers: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Add the current span's `traceparent` (and `tracestate`) to HTTP headers."""
    carrier: MutableMapping[str, str] = {} if headers is None else headers
    _propagator().inject(carrier)
    return carrier


def extract_context(headers: Mapping[str, str]) -> Context:
    """The trace context an HTTP request carries (an empty context when none)."""
    return _propagator().extract(headers)


def context_from_metadata(metadata: Iterable[tuple[str, Any]] | None) -> Context:
    """The trace context that gRPC invocation metadata carries."""
    carrier = {key: value for key, value in (metadata or ()) if isinstance(value, str)}
    return _propagator().extract(carrier)


def metadata_with_trace(metadata: Iterable[tuple[str, Any]] | None) -> grpc.aio.Metadata:
    """`metadata` plus the current span's trace context."""
    result = grpc.aio.Metadata(*(metadata or ()))
    for key, value in inject_headers({}).items():
        result[key] = value
    return result


def _with_trace(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    return details._replace(metadata=metadata_with_trace(details.metadata))


# grpc.aio files an interceptor under the first of the four kinds it subclasses only,
# so each kind of call needs an interceptor class of its own.
class _UnaryUnaryTrace(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any,
                                    request: Any) -> Any:
        return await continuation(_with_trace(client_call_details), request)


class _UnaryStreamTrace(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any,
                                     request: Any) -> Any:
        return await continuation(_with_trace(client_call_details), request)


class _StreamUnaryTrace(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, client_call_details: Any,
                                     request_iterator: Any) -> Any:
        return await continuation(_with_trace(client_call_details), request_iterator)


def trace_context_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """Channel interceptors that put the current trace context into a call's metadata.

    Bidirectional streams get none: they are the long-lived session streams, which carry
    each request's trace context inside their messages (an interceptor would also route
    every message through an extra queue and task).
    """
    return [_UnaryUnaryTrace(), _UnaryStreamTrace(), _StreamUnaryTrace()]


def _normalise_endpoint(endpoint: str) -> str:
    # The exporter chooses TLS from the scheme; a bare host:port means plaintext.
    return endpoint if "://" in endpoint else f"http://{endpoint}"


class Telemetry:
    """Tracer provider, Prometheus registry and per-RPC instrumentation of one process."""

    def __init__(self, service_name: str, *, otlp_endpoint: str | None = None,
                 span_exporter: SpanExporter | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        """`span_exporter` adds an exporter of your own (tests use an in-memory one)."""
        self.service_name = service_name
        # GET /health on the metrics port; the gRPC server attaches its status.
        self.health = HealthProbe()
        resource = Resource.create({"service.name": service_name,
                                    "service.namespace": "meshserve"})
        # With nowhere to export, spans are not recorded (their context still travels, so
        # a caller that samples is honoured): a recorded span costs tens of microseconds a
        # request on the hot path for nothing.
        exports = bool(otlp_endpoint) or span_exporter is not None
        sampler = ParentBased(ALWAYS_ON if exports else ALWAYS_OFF)
        self.tracer_provider = TracerProvider(resource=resource, sampler=sampler)
        if otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            exporter = OTLPSpanExporter(endpoint=_normalise_endpoint(otlp_endpoint))
            self.tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
        if span_exporter is not None:
            self.tracer_provider.add_span_processor(SimpleSpanProcessor(span_exporter))
        self.tracer = self.tracer_provider.get_tracer("meshserve")
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics_port: int | None = None  # where start_metrics_server listens, once it does
        ProcessCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.rpc_duration = Histogram(
            "meshserve:rpc_server_duration_seconds", "Time to serve one gRPC call",
            ["method", "code"], registry=self.registry, buckets=_RPC_BUCKETS)
        self.rpc_in_flight = Gauge(
            "meshserve:rpc_server_in_flight", "gRPC calls being served", ["method"],
            registry=self.registry)

    def install_global(self) -> None:
        """Make this the process-wide tracer provider (once, in a service's main)."""
        trace.set_tracer_provider(self.tracer_provider)

    def shutdown(self) -> None:
        """Flush and stop span export."""
        self.tracer_provider.shutdown()

    @asynccontextmanager
    async def server_rpc(self, details: grpc.HandlerCallDetails,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """Around one served RPC: a SERVER span (child of the caller's) and RPC metrics."""
        method = details.method
        service, _, name = method.lstrip("/").partition("/")
        parent = context_from_metadata(details.invocation_metadata)
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}
        code = grpc.StatusCode.OK
        started = time.perf_counter()
        self.rpc_in_flight.labels(method).inc()
        with self.tracer.start_as_current_span(
                method.lstrip("/"), context=parent, kind=SpanKind.SERVER, attributes=attributes,
                record_exception=False, set_status_on_exception=False) as span:
            try:
                yield
            except BaseException as exc:
                code = _status_of(exc, context)
                if code != grpc.StatusCode.CANCELLED:
                    span.record_exception(exc)
                    span.set_status(Status(StatusCode.ERROR, f"{code.name}: {exc}"))
                raise
            finally:
                span.set_attribute("rpc.grpc.status_code", code.value[0])
                self.rpc_in_flight.labels(method).dec()
                self.rpc_duration.labels(method, code.name).observe(
                    time.perf_counter() - started)

    def metrics_text(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        """aiohttp handler for GET /metrics."""
        return web.Response(body=self.metrics_text(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def start_metrics_server(
            self, host: str, port: int,
            routes: Iterable[tuple[str, Callable[[web.Request], Awaitable[web.StreamResponse]]]]
            = (), *, reuse_port: bool = False) -> web.AppRunner:
        """Serve GET /metrics, /health (and GET `routes`, path -> handler) on host:port;
        `await runner.cleanup()` stops it."""
        app = web.Application()
        app.router.add_get("/metrics", self.handle_metrics)
        add_health_route(app, self.health)
        for path, handler in routes:
            app.router.add_get(path, handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port, reuse_port=reuse_port or None).start()
        self.metrics_port = runner.addresses[0][1]  # the bound port (port 0: a free one)
        return runner


def _status_of(exc: BaseException, context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """The status code a call that raised `exc` ends with."""
    if isinstance(exc, MeshError):
        return grpc_code_for(exc)
    if isinstance(exc, grpc.aio.AbortError):
        code = context.code()
        return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN
    if not isinstance(exc, Exception):  # CancelledError, GeneratorExit: the call went away
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.INTERNAL
