"""The routing policies through a real Scheduler gRPC server over a real Redis.

Two registered workers, one of which holds the prompt's blocks in the block index:
`round-robin` alternates between them anyway, `kv-aware` sends the prompt to the holder
(or, once a kvstore holds the prompt too, to the idle worker that can fetch it). Every
RouteResponse says what the policy saw of the chosen worker; the route span and the
metrics registry record the same, and the gateway's route span copies the response.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from test_gateway_fakes import MODEL as GATEWAY_MODEL
from test_gateway_fakes import start_mesh
from test_scheduler_service import (
    BLOCK,
    NS,
    PROMPT,
    RouteSessionClient,
    register,
    route_request,
)

from meshserve.proto.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from meshserve.services.scheduler.config import SchedulerConfig
from meshserve.services.scheduler.service import SchedulerService
from meshserve.shared.block_hash import ImageSpan, hash_blocks
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.grpc_client import GrpcClient
from meshserve.shared.kv_events import BlockStored
from meshserve.shared.kv_index import KVIndex
from meshserve.shared.telemetry import Telemetry

PROMPT_BLOCKS = 5  # 17 tokens in blocks of 4: 4 full and one partial


@dataclass
class Scheduler:
    stub: scheduler_pb2_grpc.SchedulerStub
    telemetry: Telemetry
    spans: InMemorySpanExporter
    session: RouteSessionClient  # one route stream for the test's life

    def metric(self, name: str, **labels: str) -> float | None:
        return self.telemetry.registry.get_sample_value(name, labels)

    async def route(self, request_id: str) -> scheduler_pb2.RouteResponse:
        """Route, then release at once: every route sees the workers' reported load."""
        response = await self.session.route(route_request(request_id))
        self.session.release(request_id, response.worker_id)
        return response


@pytest.fixture
async def start_scheduler(redis_url: str, redis_client: aioredis.Redis
                          ) -> AsyncIterator[Callable[..., Awaitable[Scheduler]]]:
    """Starts a scheduler with `routing`, registers w0 and w1 (w1 busier, holding the
    prompt's 4 full blocks on its device); stops it afterwards."""
    started: list[tuple[SchedulerService, Any, RouteSessionClient]] = []

    async def start(routing: str, prefill_weight: float = 1.0) -> Scheduler:
        spans = InMemorySpanExporter()
        telemetry = Telemetry("scheduler", span_exporter=spans)
        # Weight 1 (not the default 32) keeps the costs below small, countable numbers.
        config = SchedulerConfig(port=0, block_size=BLOCK, drain_grace_s=0, heartbeat_ttl_s=10,
                                 routing=routing, prefill_weight=prefill_weight)
        service = await SchedulerService.start(config, redis_url, telemetry)
        channel = GrpcClient().channel(f"127.0.0.1:{service.port}")
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        session = RouteSessionClient(stub)
        started.append((service, channel, session))
        await register(stub, "w0")
        await register(stub, "w1", running=2, used=3)
        hashes = hash_blocks(PROMPT, BLOCK)
        await KVIndex(redis_client, NS).apply_events(
            "w1", 1, 1, [BlockStored(tuple(hashes), None, (), BLOCK)])
        return Scheduler(stub, telemetry, spans, session)

    yield start
    for service, channel, session in started:
        await session.close()
        await channel.close()
        await service.stop(grace_s=0)


async def test_round_robin_alternates_even_when_one_worker_holds_the_prompt(
        start_scheduler: Callable[..., Awaitable[Scheduler]]) -> None:
    scheduler = await start_scheduler("round-robin")
    routed = [await scheduler.route(f"r{i}") for i in range(4)]
    assert [r.worker_id for r in routed] == ["w0", "w1", "w0", "w1"]
    assert [r.num_matched_blocks for r in routed] == [0, 4, 0, 4]
    assert {(r.policy, r.score, r.num_prompt_blocks) for r in routed} == \
        {("round-robin", 0.0, PROMPT_BLOCKS)}
    assert (routed[1].num_running, routed[1].num_waiting, routed[1].num_used_blocks) == \
        (2, 0, 3)

    for worker_id in ("w0", "w1"):
        assert scheduler.metric("meshserve:scheduler_route_decisions_total",
                                policy="round-robin", worker_id=worker_id) == 2
    assert scheduler.metric("meshserve:scheduler_prompt_tokens_total") == 4 * len(PROMPT)
    assert scheduler.metric("meshserve:scheduler_matched_prompt_tokens_total") == 2 * 4 * BLOCK
    # Overlap 0 twice (w0) and 4/5 twice (w1).
    assert scheduler.metric("meshserve:scheduler_route_overlap_ratio_count") == 4
    assert scheduler.metric("meshserve:scheduler_route_overlap_ratio_bucket", le="0.0") == 2
    assert scheduler.metric("meshserve:scheduler_route_overlap_ratio_bucket", le="0.7") == 2
    assert scheduler.metric("meshserve:scheduler_route_overlap_ratio_bucket", le="0.8") == 4
    assert scheduler.metric("meshserve:scheduler_route_overlap_ratio_sum") == \
        pytest.approx(2 * 4 / PROMPT_BLOCKS)


async def test_kv_aware_sends_the_prompt_to_its_holder_then_weighs_the_kvstore(
        start_scheduler: Callable[..., Awaitable[Scheduler]], redis_client: aioredis.Redis
        ) -> None:
    scheduler = await start_scheduler("kv-aware")
    # w1: 1 block to compute + 3 in use = 4; w0: 5 blocks to compute + 0 in use = 5.
    routed = [await scheduler.route(f"r{i}") for i in range(3)]
    assert [r.worker_id for r in routed] == ["w1", "w1", "w1"]
    first = routed[0]
    assert (first.policy, first.score, first.num_matched_blocks, first.num_kvstore_blocks,
            first.num_prompt_blocks) == ("kv-aware", 4.0, 4, 0, PROMPT_BLOCKS)
    assert (first.num_running, first.num_waiting, first.num_used_blocks) == (2, 0, 3)

    # The kvstore now holds the 4 full blocks too: w0 fetches them at a quarter of a block
    # each, 4 * 0.25 + 1 = 2 < 4, and is idle.
    await KVIndex(redis_client, NS).apply_events(
        "kvstore:s0", 1, 1, [BlockStored(tuple(hash_blocks(PROMPT, BLOCK)), None, (), BLOCK)])
    fetched = await scheduler.route("r3")
    assert (fetched.worker_id, fetched.score, fetched.num_matched_blocks,
            fetched.num_kvstore_blocks) == ("w0", 2.0, 0, 4)

    assert scheduler.metric("meshserve:scheduler_route_decisions_total",
                            policy="kv-aware", worker_id="w1") == 3
    assert scheduler.metric("meshserve:scheduler_route_decisions_total",
                            policy="kv-aware", worker_id="w0") == 1
    assert scheduler.metric("meshserve:scheduler_matched_prompt_tokens_total") == 3 * 4 * BLOCK
    assert scheduler.metric("meshserve:scheduler_kvstore_blocks_total") == 4

    # The scheduler's route span of the last decision carries what the response says.
    [span] = [s for s in scheduler.spans.get_finished_spans()
              if s.name == "meshserve.v1.Scheduler/Route"
              and s.attributes.get("meshserve.request_id") == "r3"]
    assert {k: span.attributes[k] for k in (
        "meshserve.worker_id", "meshserve.matched_blocks", "meshserve.kvstore_blocks",
        "meshserve.prompt_blocks", "meshserve.routing.policy", "meshserve.routing.score",
        "meshserve.worker.num_running", "meshserve.worker.num_waiting",
        "meshserve.worker.num_used_blocks")} == {
        "meshserve.worker_id": "w0", "meshserve.matched_blocks": 0,
        "meshserve.kvstore_blocks": 4, "meshserve.prompt_blocks": PROMPT_BLOCKS,
        "meshserve.routing.policy": "kv-aware", "meshserve.routing.score": 2.0,
        "meshserve.worker.num_running": 0, "meshserve.worker.num_waiting": 0,
        "meshserve.worker.num_used_blocks": 0}


async def test_a_prompts_images_enter_its_block_hashes_as_on_the_workers(
        start_scheduler: Callable[..., Awaitable[Scheduler]], redis_client: aioredis.Redis
        ) -> None:
    scheduler = await start_scheduler("kv-aware")
    cat, dog = hashlib.sha256(b"cat").digest(), hashlib.sha256(b"dog").digest()
    # w0 holds the prompt with a cat image over tokens 5..8 (blocks 1 and 2), hashed as
    # a worker hashes it.
    held = hash_blocks(PROMPT, BLOCK, images=[ImageSpan(5, 4, cat)])
    await KVIndex(redis_client, NS).apply_events(
        "w0", 1, 1, [BlockStored(tuple(held), None, (), BLOCK)])

    def with_image(request_id: str, digest: bytes) -> scheduler_pb2.RouteRequest:
        return route_request(request_id, images=[scheduler_pb2.RouteImage(
            hash=digest, range=common_pb2.PlaceholderRange(offset=5, length=4))])

    same = await scheduler.session.route(with_image("cat", cat))
    assert (same.worker_id, same.num_matched_blocks) == ("w0", 4)
    scheduler.session.release("cat", same.worker_id)
    other = await scheduler.session.route(with_image("dog", dog))  # block 0 is text only
    assert other.num_matched_blocks == (1 if other.worker_id == "w0" else 0)
    scheduler.session.release("dog", other.worker_id)
    with pytest.raises(InvalidRequestError, match="image hash must have 32 bytes"):
        await scheduler.session.route(with_image("short", b"x" * 8))


async def test_route_session_outcomes_carry_the_decision_record(
        start_scheduler: Callable[..., Awaitable[Scheduler]]) -> None:
    scheduler = await start_scheduler("least-loaded")

    async def one_ticket() -> AsyncIterator[scheduler_pb2.RouteSessionRequest]:
        yield scheduler_pb2.RouteSessionRequest(routes=[scheduler_pb2.RouteTicket(
            ticket=1, request=route_request("s0"))])

    [response] = [r async for r in scheduler.stub.RouteSession(one_ticket())]
    [outcome] = response.outcomes
    route = outcome.route
    # w0 runs nothing, w1 runs 2: least-loaded takes w0 whatever w1 holds.
    assert (route.worker_id, route.policy, route.score, route.num_running,
            route.num_prompt_blocks) == ("w0", "least-loaded", 0.0, 0, PROMPT_BLOCKS)


async def test_the_gateway_route_span_carries_the_decision_record() -> None:
    async with start_mesh() as mesh:
        worker_id, address = mesh.scheduler.workers[0]
        decided = scheduler_pb2.RouteResponse(
            worker_id=worker_id, address=address, epoch=1, block_size=16, num_matched_blocks=2,
            num_kvstore_blocks=1, num_prompt_blocks=3, queued_ns=5, policy="kv-aware",
            score=4.5, num_running=1, num_waiting=2, num_used_blocks=7)
        mesh.scheduler._route = lambda request: decided  # type: ignore[method-assign]
        async with aiohttp.ClientSession(mesh.base_url) as http, http.post(
                "/v1/completions", json={"model": GATEWAY_MODEL, "prompt": "hi",
                                         "max_tokens": 3}) as resp:
            assert resp.status == 200
        [span] = [s for s in mesh.spans.get_finished_spans() if s.name == "route"]
    attributes = dict(span.attributes or {})
    assert {k: v for k, v in attributes.items() if k.startswith("meshserve.")
            and k != "meshserve.num_excluded"} == {
        "meshserve.worker_id": worker_id, "meshserve.matched_blocks": 2,
        "meshserve.kvstore_blocks": 1, "meshserve.prompt_blocks": 3, "meshserve.queued_ns": 5,
        "meshserve.routing.policy": "kv-aware", "meshserve.routing.score": 4.5,
        "meshserve.worker.num_running": 1, "meshserve.worker.num_waiting": 2,
        "meshserve.worker.num_used_blocks": 7}
