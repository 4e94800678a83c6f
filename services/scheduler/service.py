"""The Scheduler gRPC servicer (thin: protobuf <-> domain at the edge, wire.py) and its
assembly; a gateway's RouteSession stream is a RouteSession (route_session.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import redis.asyncio as aioredis
from opentelemetry import trace
from prometheus_client import CollectorRegistry

from meshserve.proto.v1 import scheduler_pb2, scheduler_pb2_grpc
from meshserve.services.scheduler.config import SchedulerConfig
from meshserve.services.scheduler.metrics import SchedulerMetrics
from meshserve.services.scheduler.policy import RoutingPolicy, make_policy
from meshserve.services.scheduler.queue import GlobalQueue
from meshserve.services.scheduler.route_session import RouteSession
from meshserve.services.scheduler.router import Router
from meshserve.services.scheduler.wire import (
    info_from_proto,
    load_from_proto,
    record_to_proto,
)
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.grpc_server import GrpcServer
from meshserve.shared.redis_server import connect, wait_for_redis
from meshserve.shared.telemetry import Telemetry
from meshserve.shared.worker_registry import WorkerRegistry

SERVICE_NAME = "meshserve.v1.Scheduler"


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """meshserve.v1.Scheduler over a Router."""

    def __init__(self, router: Router, config: SchedulerConfig, *,
                 tracer: trace.Tracer | None = None) -> None:
        self._router = router
        self._config = config
        # The service's own tracer (Telemetry's), not the global one: each route's span
        # goes to the exporters of the telemetry the service was started with.
        self._tracer = tracer or trace.get_tracer("meshserve.scheduler")

    async def RegisterWorker(self, request: scheduler_pb2.RegisterWorkerRequest,
                             context: grpc.aio.ServicerContext
                             ) -> scheduler_pb2.RegisterWorkerResponse:
        if not request.info.epoch:
            # The response has no epoch field: the worker must choose its own (it also tags
            # its KV events with it), e.g. its start time in ns; epochs must only grow.
            raise InvalidRequestError("info.epoch must be set by the worker (e.g. its start "
                                      "time in ns)", param="info.epoch")
        await self._router.register(info_from_proto(request.info),
                                    load_from_proto(request.load))
        return scheduler_pb2.RegisterWorkerResponse(
            heartbeat_interval_s=self._config.heartbeat_interval_s,
            ttl_s=self._config.heartbeat_ttl_s)

    async def Heartbeat(self, request: scheduler_pb2.HeartbeatRequest,
                        context: grpc.aio.ServicerContext) -> scheduler_pb2.HeartbeatResponse:
        load = request.load
        ok = await self._router.heartbeat(load.worker_id, load.epoch, load_from_proto(load))
        return scheduler_pb2.HeartbeatResponse(registered=ok)

    async def DeregisterWorker(self, request: scheduler_pb2.DeregisterWorkerRequest,
                               context: grpc.aio.ServicerContext
                               ) -> scheduler_pb2.DeregisterWorkerResponse:
        removed = await self._router.deregister(request.worker_id, request.epoch or None)
        return scheduler_pb2.DeregisterWorkerResponse(removed=removed)

    async def RouteSession(self, request_iterator: AsyncIterator[
                               scheduler_pb2.RouteSessionRequest],
                           context: grpc.aio.ServicerContext) -> None:
        session = RouteSession(self._router, wait_s=self._wait_s, tracer=self._tracer)
        reader = asyncio.ensure_future(session.read(request_iterator))
        try:
            async for response in session.responses(reader):
                await context.write(response)
        finally:
            reader.cancel()
            session.close()

    async def ListWorkers(self, request: scheduler_pb2.ListWorkersRequest,
                          context: grpc.aio.ServicerContext) -> scheduler_pb2.ListWorkersResponse:
        records = await self._router.list_workers(request.model or None)
        return scheduler_pb2.ListWorkersResponse(workers=[record_to_proto(r) for r in records],
                                                 degraded=self._router.degraded)

    def _wait_s(self, request: scheduler_pb2.RouteRequest) -> float:
        """Longest the request may wait: its own deadline or the configured cap."""
        limits = [self._config.max_queue_wait_s]
        if request.deadline_unix_ns:
            limits.append((request.deadline_unix_ns - time.time_ns()) / 1e9)
        return min(limits)


def build_policy(config: SchedulerConfig) -> RoutingPolicy:
    """The routing policy `config.routing` names, with its weights."""
    return make_policy(config.routing, prefill_weight=config.prefill_weight,
                       kvstore_block_weight=config.kvstore_block_weight,
                       max_waiting=config.max_waiting_per_worker)


def build_router(config: SchedulerConfig, redis_client: aioredis.Redis,
                 metrics_registry: CollectorRegistry | None = None) -> Router:
    """A Router over `redis_client` as `config` says (metrics into Telemetry's registry)."""
    queue = GlobalQueue(config.queue_capacity)
    metrics = (SchedulerMetrics(metrics_registry, queue)
               if metrics_registry is not None else None)
    router = Router(redis_client, WorkerRegistry(redis_client, config.heartbeat_ttl_s),
                    build_policy(config), queue, block_size=config.block_size,
                    disagg_min_prompt_tokens=config.disagg_min_prompt_tokens,
                    on_route=metrics.observe if metrics is not None else None,
                    registration_grace_s=config.registration_grace)
    if metrics is not None:
        metrics.redis_up.set_function(lambda: 0.0 if router.degraded else 1.0)
        metrics.wait_estimate.set_function(lambda: router.wait_estimate() or 0.0)
    return router


@dataclass
class SchedulerService:
    """A started scheduler: gRPC server (SERVING), router and its Redis client."""

    server: GrpcServer
    router: Router
    redis: aioredis.Redis
    port: int

    @classmethod
    async def start(cls, config: SchedulerConfig, redis_url: str,
                    telemetry: Telemetry | None = None) -> SchedulerService:
        """Listen, wait for Redis, subscribe to load changes, then report SERVING."""
        redis_client = connect(redis_url, client_name="meshserve-scheduler")
        router = build_router(config, redis_client,
                              telemetry.registry if telemetry is not None else None)
        server = GrpcServer(config.listen_address, service_names=[SERVICE_NAME],
                            telemetry=telemetry, grace_s=config.drain_grace_s,
                            reuse_port=config.reuse_port)
        servicer = SchedulerServicer(
            router, config, tracer=telemetry.tracer if telemetry is not None else None)
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server.server)
        try:
            port = await server.start()
            await wait_for_redis(redis_client, config.redis_wait_s)
            await router.start()
        except BaseException:
            await server.drain(grace_s=0)
            await router.close()
            await redis_client.aclose()
            raise
        await server.set_serving()
        return cls(server, router, redis_client, port)

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain the server (unless already drained), then close the router and Redis."""
        if not self.server.drain_started.is_set():
            await self.server.drain(grace_s)
        await self.router.close()
        await self.redis.aclose()
