"""The worker's membership in the mesh: RegisterWorker, heartbeats with load, deregistration.

    registration = Registration(scheduler_stub, info_fn, load_fn, interval_s=None)
    registration.start()            # registers (retrying), then heartbeats
    ...
    await registration.stop(deregister=True)

A heartbeat answered `registered=False` (the scheduler restarted or dropped us)
registers again at once. A scheduler that cannot be reached is retried with
backoff; serving goes on meanwhile (the worker keeps its requests, only routing
to it pauses). Waits use an event, so stopping never waits out an interval.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from meshserve.proto.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 2.0


class Registration:
    """Keeps one worker registered with the scheduler and reports its load."""

    def __init__(self, scheduler: scheduler_pb2_grpc.SchedulerStub,
                 info: Callable[[], common_pb2.WorkerInfo],
                 load: Callable[[], common_pb2.WorkerLoad], *,
                 interval_s: float | None = None, call_timeout_s: float = 5.0,
                 retry_initial_s: float = 0.1, retry_max_s: float = 5.0) -> None:
        """`interval_s` None: the interval the scheduler asks for at registration."""
        self._scheduler = scheduler
        self._info = info
        self._load = load
        self._configured_interval = interval_s
        self.interval_s = interval_s or DEFAULT_INTERVAL_S
        self.ttl_s: float | None = None
        self._call_timeout_s = call_timeout_s
        self._retry = (retry_initial_s, retry_max_s)
        self._stop = asyncio.Event()
        self.registered = asyncio.Event()
        self.num_registrations = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Register and heartbeat in a background task."""
        assert self._task is None, "Registration.start() called twice"
        self._task = asyncio.create_task(self._run(), name="worker-registration")

    async def stop(self, *, deregister: bool) -> None:
        """Stop heartbeating; with `deregister`, leave the registry (best effort)."""
        self._stop.set()
        if self._task is not None:
            await self._task
            self._task = None
        if deregister and self.registered.is_set():
            await self.deregister()

    async def deregister(self) -> bool:
        """DeregisterWorker for this worker's id and epoch; False if it failed."""
        info = self._info()
        try:
            response = await self._scheduler.DeregisterWorker(
                scheduler_pb2.DeregisterWorkerRequest(worker_id=info.worker_id,
                                                      epoch=info.epoch),
                timeout=self._call_timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.warning("deregistering from the scheduler failed: %s", exc.details())
            return False
        self.registered.clear()
        log.info("deregistered from the scheduler", extra={"removed": response.removed})
        return True

    async def _run(self) -> None:
        delay = self._retry[0]
        while not self._stop.is_set():
            try:
                if self.registered.is_set():
                    await self._heartbeat()
                else:
                    await self._register()
                delay = self._retry[0]
                wait = self.interval_s if self.registered.is_set() else 0.0
            except grpc.aio.AioRpcError as exc:
                log.warning("scheduler call failed (%s: %s); retrying in %.1fs",
                            exc.code().name, exc.details(), delay)
                wait, delay = delay, min(delay * 2, self._retry[1])
            await self._pause(wait)

    async def _pause(self, seconds: float) -> None:
        """Wait `seconds`, or less if stopped meanwhile."""
        if seconds <= 0:
            return
        try:
            async with asyncio.timeout(seconds):
                await self._stop.wait()
        except TimeoutError:
            pass

    async def _register(self) -> None:
        info = self._info()
        response = await self._scheduler.RegisterWorker(
            scheduler_pb2.RegisterWorkerRequest(info=info, load=self._load()),
            timeout=self._call_timeout_s)
        if self._configured_interval is None and response.heartbeat_interval_s > 0:
            self.interval_s = response.heartbeat_interval_s
        self.ttl_s = response.ttl_s or None
        self.num_registrations += 1
        self.registered.set()
        log.info("registered with the scheduler", extra={
            "worker_id": info.worker_id, "epoch": info.epoch, "address": info.address,
            "heartbeat_interval_s": self.interval_s, "ttl_s": self.ttl_s})

    async def announce(self) -> None:
        """Register again now, so the scheduler sees what the worker's info says now (its
        LoRA adapters changed). Scheduler errors propagate."""
        if self.registered.is_set():
            await self._register()

    async def _heartbeat(self) -> None:
        response = await self._scheduler.Heartbeat(
            scheduler_pb2.HeartbeatRequest(load=self._load()), timeout=self._call_timeout_s)
        if not response.registered:
            log.warning("the scheduler no longer knows this worker; registering again")
            self.registered.clear()
