"""The scheduler when Redis goes away: it places by load, says it is degraded, recovers.

A real Redis server process is killed under a running scheduler with two registered
workers: routes still place requests (by load, no prefix matches), ListWorkers still lists
the workers and reports `degraded`, heartbeats keep their load. Redis started again empty
on the same port: the first heartbeat tells each worker to register again, and prefix
routing works once the index holds blocks again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from prometheus_client import generate_latest
from test_scheduler_service import (
    BLOCK,
    MODEL,
    NS,
    PROMPT,
    RouteSessionClient,
    load,
    register,
    route_request,
)

from meshserve.proto.v1 import scheduler_pb2, scheduler_pb2_grpc
from meshserve.services.scheduler.config import SchedulerConfig
from meshserve.services.scheduler.service import SchedulerService
from meshserve.shared.block_hash import hash_blocks
from meshserve.shared.grpc_client import GrpcClient
from meshserve.shared.kv_events import BlockStored
from meshserve.shared.kv_index import KVIndex
from meshserve.shared.redis_server import EmbeddedRedis, connect
from meshserve.shared.telemetry import Telemetry


@pytest.fixture
async def redis() -> AsyncIterator[EmbeddedRedis]:
    server = EmbeddedRedis().start()
    yield server
    server.stop()


async def _listed(stub: scheduler_pb2_grpc.SchedulerStub) -> scheduler_pb2.ListWorkersResponse:
    return await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(model=MODEL))


async def test_routes_survive_redis_loss_and_prefix_routing_returns_with_it(
        redis: EmbeddedRedis) -> None:
    telemetry = Telemetry("scheduler")
    registry = telemetry.registry
    service = await SchedulerService.start(
        SchedulerConfig(port=0, block_size=BLOCK, drain_grace_s=0, heartbeat_ttl_s=30),
        redis.url, telemetry)
    channel = GrpcClient().channel(f"127.0.0.1:{service.port}")
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    client = connect(redis.url, timeout_s=1.0)
    try:
        await register(stub, "w0")
        await register(stub, "w1")
        assert not (await _listed(stub)).degraded
        session = RouteSessionClient(stub)
        redis._process.kill()  # a crash: nothing is flushed, nothing answers
        redis._process.wait()

        # Requests are still placed, by load: w1 reports less, so it gets the first.
        beat = await stub.Heartbeat(scheduler_pb2.HeartbeatRequest(load=load("w0", running=7)))
        assert beat.registered
        routed = [(await session.route(route_request(f"r{i}"))) for i in range(3)]
        assert routed[0].worker_id == "w1"
        assert all(r.num_matched_blocks == 0 for r in routed)
        listed = await _listed(stub)
        assert listed.degraded and sorted(w.info.worker_id for w in listed.workers) == \
            ["w0", "w1"]
        assert "meshserve:scheduler_redis_up 0.0" in generate_latest(registry).decode()

        redis.restart()  # back, empty, on the same port
        beat = await stub.Heartbeat(scheduler_pb2.HeartbeatRequest(load=load("w0")))
        assert not beat.registered  # the registry was lost: w0 must register again
        await register(stub, "w0")
        hashes = hash_blocks(PROMPT, BLOCK)
        await KVIndex(client, NS).apply_events("w0", 1, 1, [BlockStored(
            tuple(hashes), None, (), BLOCK)])
        deadline = time.monotonic() + 10
        while True:  # the next read finds Redis again
            response = await session.route(route_request(f"again-{time.monotonic()}"))
            if response.num_matched_blocks:
                break
            assert time.monotonic() < deadline, "prefix routing did not come back"
            await asyncio.sleep(0.05)
        assert (response.worker_id, response.num_matched_blocks) == ("w0", 4)
        assert not (await _listed(stub)).degraded
        assert "meshserve:scheduler_redis_up 1.0" in generate_latest(registry).decode()
        await session.close()
    finally:
        await client.aclose()
        await channel.close()
        await service.stop(grace_s=0)
