"""The common start of every service process: config, logs, telemetry and exit codes.

    def main(argv=None) -> int:
        return run_service("kvstore", KVStoreConfig, serve, argv)

    async def serve(config) -> int:
        async with service_telemetry("kvstore", config) as telemetry:
            ...

Exit codes: 0 after a clean drain, 1 when the service failed (a MeshError: a taken port, a
model that does not load, Redis unreachable at start), 2 for a bad command line or
environment, 130 when interrupted before the service installed its own signal handlers.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TypeVar

from meshserve.shared.config import ServiceConfig
from meshserve.shared.errors import ConfigError, MeshError
from meshserve.shared.grpc_server import GrpcServer
from meshserve.shared.logs import setup_logging
from meshserve.shared.telemetry import Telemetry

C = TypeVar("C", bound=ServiceConfig)
T = TypeVar("T")
_log = logging.getLogger("meshserve.service")


# Set by `meshserve up` for its children: the launcher's process id.
PARENT_PID_ENV = "MESHSERVE_PARENT_PID"


def die_with_parent(environ: Mapping[str, str] = os.environ) -> None:
    """With MESHSERVE_PARENT_PID set (Linux): SIGTERM to this process when the launcher's
    thread that started it exits, and exit now if the launcher is already gone. Done here,
    at the start of the child, rather than between fork and exec: Python code run there in a
    child of a threaded launcher can abort on a lock another thread held at the fork."""
    parent = environ.get(PARENT_PID_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != int(parent):  # it exited before the prctl: nobody would stop us
        print(f"launcher {parent} exited before this service started", file=sys.stderr)
        raise SystemExit(1)


_PR_SET_PDEATHSIG = 1


def run_service(role: str, config_cls: type[C], serve: Callable[[C], Awaitable[int]],
                argv: Sequence[str] | None = None) -> int:
    """Parse the config, set up logs, run `serve(config)` in a new event loop."""
    die_with_parent()
    os.environ.pop(PARENT_PID_ENV, None)  # for this process only, not for its own children
    try:
        config = config_cls.from_args(argv, prog=f"meshserve {role}")
    except ConfigError as exc:
        print(f"meshserve {role}: {exc.message}", file=sys.stderr)
        return 2
    setup_logging(role, config.log_level, fmt=config.log_format)
    try:
        return asyncio.run(serve(config))  # type: ignore[arg-type]
    except MeshError as exc:
        _log.error("%s failed: %s", role, exc.message,
                   extra={"error_kind": exc.kind, "error_param": exc.param})
        return 1
    except KeyboardInterrupt:
        return 130


@asynccontextmanager
async def service_telemetry(role: str, config: ServiceConfig) -> AsyncIterator[Telemetry]:
    """The service's tracer (installed as the global one) and, with --metrics-port, its
    Prometheus endpoint; both are shut down on leaving."""
    telemetry = Telemetry(role, otlp_endpoint=config.otlp_endpoint)
    telemetry.install_global()
    metrics = None
    try:
        if config.metrics_port is not None:
            metrics = await telemetry.start_metrics_server(config.host, config.metrics_port,
                                                           reuse_port=config.reuse_port)
        yield telemetry
    finally:
        if metrics is not None:
            await metrics.cleanup()
        telemetry.shutdown()


async def in_daemon_thread(fn: Callable[[], T], name: str) -> T:
    """Run `fn()` in a daemon thread and await its result.

    Unlike asyncio.to_thread, whose workers are joined at exit, a stop during a long load
    (a model download, weights) does not wait for it.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.cancelled():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result, error = fn(), None
        except BaseException as exc:  # noqa: BLE001 (handed to the awaiting task)
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop has closed: the service stopped while loading
            pass

    threading.Thread(target=run, name=name, daemon=True).start()
    return await future


async def load_then_serve(server: GrpcServer, load: Callable[[], T], what: str,
                          serving: Callable[[T], Awaitable[None]]) -> int:
    """Load `what` with `load()` in a daemon thread while the server answers health checks
    (NOT_SERVING), then hand it to `serving` (which turns the server SERVING) and wait for a
    stop. The process exit code: 0 when drained (also when stopped while loading), 1 when
    the load failed (logged, the server stopped)."""
    loading = asyncio.ensure_future(in_daemon_thread(load, f"load-{what}"))
    stopping = asyncio.ensure_future(server.wait_for_termination())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not loading.done():
        loading.cancel()
        _log.info("stopped while loading the %s", what)
        return 0
    try:
        loaded = loading.result()
    except MeshError as exc:
        _log.error("cannot load the %s: %s", what, exc.message,
                   extra={"error_kind": exc.kind, "error_param": exc.param})
        server.request_stop()
        await stopping
        return 1
    except Exception:  # noqa: BLE001 (a bug: logged with its traceback, clean exit)
        _log.exception("cannot load the %s", what)
        server.request_stop()
        await stopping
        return 1
    await serving(loaded)
    await stopping
    return 0
