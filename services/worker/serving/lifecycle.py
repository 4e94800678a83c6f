"""What every worker process (generating or pooling) does around its model, in one part.

    life = ProcessLifecycle(config, server, load=lambda: batcher.load, info=lambda: info)
    thread = ...(on_fatal=life.on_fatal)        # NOT_SERVING, then the drain; exit code 1
    servicer = ...(draining=lambda: life.draining)
    ...                                         # start(): listen, warm up, SERVING
    life.register()                             # the last step of start()
    await life.run_until_stopped(on_drain=...)  # until SIGTERM or a fatal error
    await life.close()                          # the last step of close()

As the drain starts (SIGTERM, or after a fatal error), `draining` turns True (heartbeats
and servicers report it), the process's `on_drain` runs, and the worker deregisters from
the scheduler. `run_process` is a worker's `serve()`: telemetry, the model loaded in a
daemon thread, start / run until stopped / close, and the exit code (1 after a fatal
error).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol, TypeVar

import grpc

from meshserve.proto.v1 import common_pb2, scheduler_pb2_grpc
from meshserve.services.worker.config import WorkerConfig
from meshserve.services.worker.serving.registration import Registration
from meshserve.services.worker.serving.service import worker_info_pb, worker_load_pb
from meshserve.shared.grpc_client import GrpcClient
from meshserve.shared.grpc_server import GrpcServer
from meshserve.shared.service_main import in_daemon_thread, service_telemetry
from meshserve.shared.telemetry import Telemetry
from meshserve.shared.worker_registry import WorkerInfo, WorkerLoad

_log = logging.getLogger("meshserve.services.worker")


class ProcessLifecycle:
    """A worker process's failure, drain and scheduler membership (see the module doc)."""

    def __init__(self, config: WorkerConfig, server: GrpcServer,
                 load: Callable[[], WorkerLoad], info: Callable[[], WorkerInfo]) -> None:
        """`load` and `info` are read at each heartbeat: the info changes after start
        (address, epoch) and while serving (LoRA adapters)."""
        self.config = config
        self.server = server
        self._load = load
        self._info = info
        self.failure: BaseException | None = None
        self.draining = False
        self.registration: Registration | None = None
        self._scheduler_channel: grpc.aio.Channel | None = None

    def on_fatal(self, error: BaseException) -> None:
        """A device or engine failure (called on the event loop): NOT_SERVING, then stop."""
        self.failure = error
        asyncio.get_running_loop().create_task(self.server.set_serving(False))
        self.server.request_stop()

    def register(self) -> None:
        """Register with the scheduler, if one is configured, and heartbeat from now on."""
        if not self.config.scheduler_address:
            return
        channel = self._scheduler_channel = GrpcClient().channel(self.config.scheduler_address)
        self.registration = Registration(
            scheduler_pb2_grpc.SchedulerStub(channel), lambda: worker_info_pb(self._info()),
            self.load_pb, interval_s=self.config.heartbeat_interval_s)
        self.registration.start()

    def load_pb(self) -> common_pb2.WorkerLoad:
        """The heartbeat's load: the process's snapshot, its identity, and the drain."""
        info = self._info()
        return worker_load_pb(self._load(), info.worker_id, info.epoch, self.draining)

    async def run_until_stopped(self, on_drain: Callable[[], None] | None = None) -> None:
        """Serve until SIGTERM (or a fatal error), deregistering as the drain starts;
        `on_drain` runs once draining is set, before deregistering."""
        leave = asyncio.ensure_future(self._leave_on_drain(on_drain))
        try:
            await self.server.wait_for_termination()
        finally:
            await leave

    async def _leave_on_drain(self, on_drain: Callable[[], None] | None) -> None:
        await self.server.drain_started.wait()
        self.draining = True
        if on_drain is not None:
            on_drain()
        if self.registration is not None:
            await self.registration.stop(deregister=True)

    async def close(self) -> None:
        """Close the scheduler channel (the process's last step: deregistering is done)."""
        if self._scheduler_channel is not None:
            await self._scheduler_channel.close()


class LifecycleProcess(Protocol):
    """A worker process object as `run_process` drives it."""

    life: ProcessLifecycle

    async def start(self) -> None: ...

    async def run_until_stopped(self) -> None: ...

    async def close(self) -> None: ...


M = TypeVar("M")  # what the blocking load builds: an engine, an embedder


async def run_process(config: WorkerConfig, load: Callable[[], M],
                      make: Callable[[M, Telemetry], LifecycleProcess],
                      failed_message: str) -> int:
    """Run a worker process until stopped and drained; the process exit code.

    `load` builds the model (blocking; in a daemon thread, so a stop during a long load
    does not wait for it), `make` wires the process around it; `failed_message` (one %r:
    the failure) is logged when a fatal error stopped the process, which then exits 1.
    """
    async with service_telemetry("worker", config) as telemetry:
        model = await in_daemon_thread(load, "worker-load")
        process = make(model, telemetry)
        try:
            await process.start()
            await process.run_until_stopped()
        finally:
            await process.close()
        failure = process.life.failure
        if failure is not None:
            _log.error(failed_message, failure)
            return 1
        return 0
