"""A grpc.aio server with health, error mapping, tracing and graceful drain.

    server = GrpcServer(config.listen_address, service_names=["meshserve.v1.Worker"],
                        telemetry=telemetry, grace_s=config.drain_grace_s)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server.server)
    await server.start()
    server.install_signal_handlers()      # SIGTERM / SIGINT start the drain
    await engine.warm_up()
    await server.set_serving()            # health: NOT_SERVING -> SERVING
    await server.wait_for_termination()   # returns once drained

Every served call runs inside two wrappers: the outer one refuses new calls while
draining and maps errors (MeshError -> its status code with kind and param in
trailing metadata; any other exception -> INTERNAL, logged with its traceback);
the inner one (with telemetry) opens the call's SERVER span and records metrics.
Servicers must be async (coroutines or async generators).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshserve.shared.errors import InternalError, MeshError, UnavailableError
from meshserve.shared.grpc_client import DEFAULT_MAX_MESSAGE_BYTES, error_from_rpc
from meshserve.shared.status import error_metadata, grpc_code_for
from meshserve.shared.telemetry import Telemetry

_log = logging.getLogger(__name__)
_HEALTH_PREFIX = "/grpc.health.v1.Health/"

RpcAround = Callable[[grpc.HandlerCallDetails, grpc.aio.ServicerContext],
                     AbstractAsyncContextManager[None]]
"""Something run around every served call: (call details, context) -> async context manager."""


class HealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 for the server and each of its services ("" is the whole server).

    Every service starts NOT_SERVING. `close()` makes them NOT_SERVING for good and
    ends Watch streams after telling them, so that watchers do not hold up a drain.
    """

    def __init__(self, service_names: Sequence[str]) -> None:
        self._status: dict[str, int] = {name: health_pb2.HealthCheckResponse.NOT_SERVING
                        for name in ("", *service_names)}
        self._changed = asyncio.Event()
        self._closed = False

    def set_all(self, status: int) -> None:
        """Set every service's status (ignored once closed)."""
        if self._closed:
            return
        self._set_all(status)

    def serving(self) -> bool:
        """Whether the whole server ("") is SERVING (GET /health on the metrics port)."""
        return self._status[""] == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        """NOT_SERVING from now on; Watch streams end after sending it."""
        self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        self._closed = True

    def _set_all(self, status: int) -> None:
        for name in self._status:
            self._status[name] = status
        # Wake every watcher; each waits on the event that was current when it looked.
        self._changed.set()
        self._changed = asyncio.Event()

    async def Check(self, request: health_pb2.HealthCheckRequest,
                    context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def List(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=status)
            for name, status in self._status.items()})

    async def Watch(self, request: health_pb2.HealthCheckRequest,
                    context: grpc.aio.ServicerContext) -> None:
        last = None
        while True:
            changed = self._changed
            status = self._status.get(request.service,
                                      health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            if self._closed:
                return
            await changed.wait()


class AroundInterceptor(grpc.aio.ServerInterceptor):
    """Runs every served call inside `around(details, context)`."""

    def __init__(self, around: RpcAround) -> None:
        self._around = around

    async def intercept_service(self, continuation: Any,
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        details, around = handler_call_details, self._around
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, around, details),
                handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, around, details),
                handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(handler.stream_unary, around, details),
                handler.request_deserializer, handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(
            _wrap_stream(handler.stream_stream, around, details),
            handler.request_deserializer, handler.response_serializer)


def _wrap_unary(behavior: Any, around: RpcAround, details: grpc.HandlerCallDetails) -> Any:
    """Wrap a behavior that returns one response (or writes with context.write)."""
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with around(details, context):
            return await behavior(request, context)
    return call


def _wrap_stream(behavior: Any, around: RpcAround, details: grpc.HandlerCallDetails) -> Any:
    """Wrap a streaming behavior: an async generator, or a coroutine using context.write."""
    if not inspect.isasyncgenfunction(behavior):
        return _wrap_unary(behavior, around, details)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async with around(details, context):
            async for response in behavior(request, context):
                yield response
    return stream


async def abort_with(context: grpc.aio.ServicerContext, error: MeshError) -> None:
    """End the call with `error`: its status code, message, and kind/param as trailers."""
    await context.abort(grpc_code_for(error), error.message,
                        trailing_metadata=error_metadata(error))


class GrpcServer:
    """A grpc.aio server: health, error mapping, tracing, limits, keepalive, drain."""

    def __init__(self, address: str, *, service_names: Sequence[str],
                 telemetry: Telemetry | None = None, grace_s: float = 30.0,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 keepalive_time_s: float = 30.0, keepalive_timeout_s: float = 10.0,
                 min_ping_interval_s: float | None = None, max_ping_strikes: int = 2,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                 reuse_port: bool = False, max_connection_age_s: float | None = None) -> None:
        """`service_names` are full proto names ("meshserve.v1.Worker") for health.

        Keepalive: the server pings idle connections every `keepalive_time_s` and drops
        them after `keepalive_timeout_s` without an answer. It accepts a client's pings
        every `min_ping_interval_s` (unset: keepalive_time_s / 6, so clients pinging at
        the same keepalive_time_s are always welcome, idle streams included); a client
        pinging more often gets a strike, and past `max_ping_strikes` the connection is
        closed with GOAWAY "too_many_pings".

        `reuse_port` (SO_REUSEPORT) lets replicas on one host listen on the same port, the
        kernel spreading new connections over them; off, a second process on a taken port
        fails to start instead of silently sharing it.

        `max_connection_age_s` ends each client connection after that long with GOAWAY:
        calls in flight (long-lived streams included) finish on it, new calls reconnect,
        and a client naming replicas by DNS resolves the name again, finding replicas
        added since. Unset: connections live as long as both ends do.
        """
        assert grace_s >= 0, f"grace_s must be >= 0, got {grace_s}"
        if min_ping_interval_s is None:
            min_ping_interval_s = keepalive_time_s / 6
        assert max_ping_strikes >= 0, f"max_ping_strikes must be >= 0, got {max_ping_strikes}"
        self.address = address
        self.grace_s = grace_s
        self.health = HealthServicer(service_names)
        self._draining = False
        self._stop_requested = asyncio.Event()
        self._force_stop = asyncio.Event()
        self.drain_started = asyncio.Event()
        self.port: int | None = None
        chain: list[grpc.aio.ServerInterceptor] = [AroundInterceptor(self._guard)]
        if telemetry is not None:
            chain.append(AroundInterceptor(telemetry.server_rpc))
        # The server's channel arguments (tests read them).
        self.options: list[tuple[str, Any]] = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.keepalive_time_ms", int(keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            # Clients ping every keepalive_time_s, also on idle long-lived streams (the
            # data plane's sessions); gRPC's default wants 5 minutes between pings without
            # data and answers faster ones with "too many pings".
            ("grpc.http2.min_ping_interval_without_data_ms", int(min_ping_interval_s * 1000)),
            ("grpc.http2.max_ping_strikes", max_ping_strikes),
            ("grpc.so_reuseport", int(reuse_port)),
        ]
        if max_connection_age_s is not None:
            assert max_connection_age_s > 0, f"must be > 0, got {max_connection_age_s}"
            self.options.append(("grpc.max_connection_age_ms", int(max_connection_age_s * 1000)))
        self.server = grpc.aio.server(interceptors=[*chain, *interceptors],
                                      options=self.options)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if telemetry is not None:  # GET /health on the metrics port answers from here
            telemetry.health.attach(self.health.serving)

    @property
    def draining(self) -> bool:
        return self._draining

    async def start(self) -> int:
        """Bind and start serving (health NOT_SERVING); returns the bound port."""
        try:
            port = self.server.add_insecure_port(self.address)
        except RuntimeError as exc:
            raise UnavailableError(f"cannot listen on {self.address}: {exc}",
                                   param="address") from exc
        if port == 0:
            raise UnavailableError(f"cannot listen on {self.address}", param="address")
        await self.server.start()
        self.port = port
        _log.info("gRPC server listening", extra={"address": self.address, "port": port})
        return port

    async def set_serving(self, serving: bool = True) -> None:
        """SERVING once warm; NOT_SERVING (e.g. on a fatal device error). No-op once draining."""
        self.health.set_all(health_pb2.HealthCheckResponse.SERVING if serving
                            else health_pb2.HealthCheckResponse.NOT_SERVING)

    def request_stop(self) -> None:
        """Start the drain (what SIGTERM does); a second request cancels in-flight calls."""
        if self._stop_requested.is_set():
            self._force_stop.set()
        self._stop_requested.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT request a stop (on the running event loop)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    async def wait_for_termination(self) -> None:
        """Wait for a stop request, then drain."""
        await self._stop_requested.wait()
        await self.drain()

    async def drain(self, grace_s: float | None = None) -> None:
        """NOT_SERVING, refuse new calls, let in-flight calls finish within the grace, stop."""
        grace = self.grace_s if grace_s is None else grace_s
        self._draining = True
        self.health.close()
        self.drain_started.set()
        _log.info("draining gRPC server", extra={"grace_s": grace})
        stop = asyncio.ensure_future(self.server.stop(grace))
        force = asyncio.ensure_future(self._force_stop.wait())
        try:
            await asyncio.wait({stop, force}, return_when=asyncio.FIRST_COMPLETED)
            if not stop.done():
                _log.warning("second stop request: cancelling in-flight calls")
                await self.server.stop(None)
            await stop
        finally:
            force.cancel()
        _log.info("gRPC server stopped")

    @asynccontextmanager
    async def _guard(self, details: grpc.HandlerCallDetails,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """Refuse calls while draining; map exceptions to statuses (see the module doc)."""
        if self._draining and not details.method.startswith(_HEALTH_PREFIX):
            await abort_with(context, UnavailableError(
                "server is draining; retry on another replica"))
        try:
            yield
        except grpc.aio.AbortError:
            raise  # the servicer (or an inner wrapper) already set the status
        except MeshError as exc:
            _log_mesh_error(details.method, exc)
            await abort_with(context, exc)
        except grpc.RpcError as exc:  # a downstream call that was not converted
            await abort_with(context, error_from_rpc(exc))
        except Exception as exc:  # noqa: BLE001 (logged with traceback, sent as INTERNAL)
            _log.exception("unexpected error in %s", details.method)
            await abort_with(context, InternalError(
                f"internal error in {details.method}: {type(exc).__name__}: {exc}"))


def _log_mesh_error(method: str, error: MeshError) -> None:
    # A bad request is the client's business; a server-side kind deserves attention.
    server_side = grpc_code_for(error) in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
    _log.log(logging.ERROR if server_side else logging.DEBUG, "%s failed: %s", method, error,
             exc_info=server_side, extra={"error_kind": error.kind, "error_param": error.param})
