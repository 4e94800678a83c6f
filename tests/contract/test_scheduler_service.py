"""Contract tests of the Scheduler service: real grpc.aio servers on 127.0.0.1, real Redis."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import redis.asyncio as aioredis

from meshserve.proto.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from meshserve.services.scheduler.config import SchedulerConfig
from meshserve.services.scheduler.service import SchedulerService
from meshserve.shared.block_hash import hash_blocks
from meshserve.shared.errors import MeshError
from meshserve.shared.grpc_client import GrpcClient
from meshserve.shared.kv_events import BlockStored
from meshserve.shared.kv_index import KVIndex
from meshserve.shared.proto_errors import error_from_pb
from meshserve.shared.status import grpc_code_for

MODEL = "tiny"
NS = "tiny:float16"
BLOCK = 4
PROMPT = list(range(100, 117))  # 17 tokens: 4 full blocks and one partial


@dataclass
class Replica:
    service: SchedulerService
    channel: grpc.aio.Channel
    stub: scheduler_pb2_grpc.SchedulerStub


@pytest.fixture
async def start_replica(redis_url: str) -> AsyncIterator[Callable[..., Awaitable[Replica]]]:
    """Starts scheduler replicas over the test's Redis; stops them afterwards."""
    replicas: list[Replica] = []

    async def start(**overrides: Any) -> Replica:
        config = SchedulerConfig(port=0, block_size=BLOCK, drain_grace_s=0,
                                 **{"heartbeat_ttl_s": 10.0, **overrides})
        service = await SchedulerService.start(config, redis_url)
        channel = GrpcClient().channel(f"127.0.0.1:{service.port}")
        replica = Replica(service, channel, scheduler_pb2_grpc.SchedulerStub(channel))
        replicas.append(replica)
        return replica

    yield start
    for replica in replicas:
        await replica.channel.close()
        await replica.service.stop(grace_s=0)


def load(worker_id: str, epoch: int = 1, *, running: int = 0, max_running: int = 8,
         free: int = 100, used: int = 0) -> common_pb2.WorkerLoad:
    return common_pb2.WorkerLoad(worker_id=worker_id, epoch=epoch, num_running=running,
                                 max_running=max_running, num_free_blocks=free,
                                 num_total_blocks=100, num_used_blocks=used)


async def register(stub: scheduler_pb2_grpc.SchedulerStub, worker_id: str, epoch: int = 1,
                   **load_args: Any) -> None:
    info = common_pb2.WorkerInfo(worker_id=worker_id, epoch=epoch, address=f"{worker_id}:1",
                                 model_names=[MODEL], block_size=BLOCK, kv_namespace=NS)
    await stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(
        info=info, load=load(worker_id, epoch, **load_args)))


def route_request(request_id: str, prompt: list[int] = PROMPT, **fields: Any
                  ) -> scheduler_pb2.RouteRequest:
    return scheduler_pb2.RouteRequest(request_id=request_id, model=MODEL,
                                      prompt_token_ids=prompt, **fields)


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    """Poll an observable condition until it holds (bounded)."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def worker_ids(stub: scheduler_pb2_grpc.SchedulerStub) -> list[str]:
    response = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(model=MODEL))
    return sorted(w.info.worker_id for w in response.workers)


class RouteSessionClient:
    """The client side of one RouteSession stream, kept for a test's life as the gateway
    keeps its RouteStream: ending the stream releases every route it decided, so a test
    routes and releases on one stream rather than opening one per call.

    `route()` numbers its own tickets (from 1000); outcomes of tickets sent by hand with
    `send()` are read with `outcomes()`.
    """

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        self.queue: asyncio.Queue[scheduler_pb2.RouteSessionRequest | None] = asyncio.Queue()
        self.call = stub.RouteSession(self._requests())
        self._tickets = itertools.count(1000)
        self._waiting: dict[int, asyncio.Future[scheduler_pb2.RouteOutcome]] = {}
        self._unclaimed: asyncio.Queue[scheduler_pb2.RouteOutcome] = asyncio.Queue()
        self._reader = asyncio.ensure_future(self._read())

    async def _requests(self) -> AsyncIterator[scheduler_pb2.RouteSessionRequest]:
        while (message := await self.queue.get()) is not None:
            yield message

    async def _read(self) -> None:
        ended: BaseException = EOFError("the stream ended before the route was decided")
        try:
            while (message := await self.call.read()) is not grpc.aio.EOF:
                for outcome in message.outcomes:
                    future = self._waiting.pop(outcome.ticket, None)
                    if future is None:
                        self._unclaimed.put_nowait(outcome)
                    elif not future.done():
                        future.set_result(outcome)
        except grpc.aio.AioRpcError as exc:  # the stream broke
            ended = exc
        for future in self._waiting.values():  # routes never decided fail
            if not future.done():
                future.set_exception(ended)

    def send(self, **fields: Any) -> None:
        self.queue.put_nowait(scheduler_pb2.RouteSessionRequest(**fields))

    async def route(self, request: scheduler_pb2.RouteRequest) -> scheduler_pb2.RouteResponse:
        """The decision for one request; the outcome's Error raised as a MeshError."""
        number = next(self._tickets)
        future: asyncio.Future[scheduler_pb2.RouteOutcome] = (
            asyncio.get_running_loop().create_future())
        self._waiting[number] = future
        self.send(routes=[scheduler_pb2.RouteTicket(ticket=number, request=request)])
        async with asyncio.timeout(10):
            outcome = await future
        if outcome.WhichOneof("result") == "error":
            raise error_from_pb(outcome.error)
        return outcome.route

    def cancel_waiting(self) -> None:
        """Cancel every route() still waiting (as the gateway does when its client leaves)."""
        self.send(cancels=list(self._waiting))

    def release(self, request_id: str, worker_id: str) -> None:
        self.send(releases=[scheduler_pb2.ReleaseRequest(request_id=request_id,
                                                         worker_id=worker_id)])

    async def outcomes(self, count: int) -> dict[int, scheduler_pb2.RouteOutcome]:
        got: dict[int, scheduler_pb2.RouteOutcome] = {}
        async with asyncio.timeout(10):
            while len(got) < count:
                outcome = await self._unclaimed.get()
                assert outcome.ticket not in got, "a ticket answered twice"
                got[outcome.ticket] = outcome
        return got

    async def close(self) -> None:
        """End the stream and wait for the scheduler to end its side (once no route is
        pending: a half-closed stream still answers the routes it holds)."""
        self.queue.put_nowait(None)
        async with asyncio.timeout(10):
            await self._reader
        assert self.call.done() and await self.call.code() == grpc.StatusCode.OK


def ticket(number: int, request_id: str, **fields: Any) -> scheduler_pb2.RouteTicket:
    return scheduler_pb2.RouteTicket(ticket=number, request=route_request(request_id, **fields))


async def test_route_prefers_the_worker_holding_the_prefix(
        start_replica: Callable[..., Awaitable[Replica]], redis_client: aioredis.Redis) -> None:
    stub = (await start_replica()).stub
    await register(stub, "w0")
    await register(stub, "w1")
    hashes = hash_blocks(PROMPT, BLOCK)
    index = KVIndex(redis_client, NS)
    await index.apply_events("w1", 1, 1, [BlockStored(tuple(hashes[:2]), None, (), BLOCK)])
    await index.apply_events("kvstore:s0", 1, 1, [BlockStored(tuple(hashes), None, (), BLOCK)])
    session = RouteSessionClient(stub)

    response = await session.route(route_request("r0"))
    assert (response.worker_id, response.address, response.epoch) == ("w1", "w1:1", 1)
    assert (response.num_matched_blocks, response.num_kvstore_blocks) == (2, 2)
    assert response.block_size == BLOCK

    # The same request by its block hashes instead of its tokens (r0's provisional load
    # would otherwise outweigh the prefix: it adds w1's 3 blocks to prefill).
    session.release("r0", "w1")
    by_hashes = scheduler_pb2.RouteRequest(request_id="r1", model=MODEL, block_hashes=hashes,
                                           num_prompt_tokens=len(PROMPT))
    assert (await session.route(by_hashes)).worker_id == "w1"
    # A cache salt changes every hash: no worker holds that prefix.
    salted = await session.route(route_request("r2", cache_salt="tenant-a"))
    assert (salted.num_matched_blocks, salted.num_kvstore_blocks) == (0, 0)
    await session.close()


async def test_heartbeats_update_load_and_reject_stale_epochs(
        start_replica: Callable[..., Awaitable[Replica]]) -> None:
    stub = (await start_replica()).stub
    await register(stub, "w0", epoch=3)
    beat = await stub.Heartbeat(scheduler_pb2.HeartbeatRequest(load=load("w0", 3, running=5)))
    assert beat.registered
    stale = await stub.Heartbeat(scheduler_pb2.HeartbeatRequest(load=load("w0", 2)))
    assert not stale.registered
    [status] = (await stub.ListWorkers(scheduler_pb2.ListWorkersRequest())).workers
    assert (status.info.epoch, status.load.num_running, status.load.epoch) == (3, 5, 3)
    assert status.last_heartbeat_unix_ns > 0
    with pytest.raises(grpc.aio.AioRpcError) as err:  # the worker must choose its epoch
        await register(stub, "w1", epoch=0)
    assert dict(err.value.trailing_metadata())["meshserve-error-param"] == "info.epoch"
    removed = await stub.DeregisterWorker(scheduler_pb2.DeregisterWorkerRequest(
        worker_id="w0", epoch=3))
    assert removed.removed
    assert await worker_ids(stub) == []


async def test_worker_without_heartbeats_drops_out_after_its_ttl(
        start_replica: Callable[..., Awaitable[Replica]], redis_client: aioredis.Redis) -> None:
    stub = (await start_replica(heartbeat_ttl_s=1.0)).stub
    await register(stub, "w0")
    await register(stub, "w1")
    hashes = hash_blocks(PROMPT, BLOCK)
    await KVIndex(redis_client, NS).apply_events("w0", 1, 1, [BlockStored(tuple(hashes), None,
                                                                          (), BLOCK)])

    async def only_w1_left() -> bool:
        beat = await stub.Heartbeat(scheduler_pb2.HeartbeatRequest(load=load("w1")))
        assert beat.registered
        return await worker_ids(stub) == ["w1"]

    await eventually(only_w1_left)
    session = RouteSessionClient(stub)
    assert (await session.route(route_request("r0"))).worker_id == "w1"  # despite w0's prefix
    await session.close()
    assert await KVIndex(redis_client, NS).holders_of(hashes[0]) == {}


async def test_full_workers_queue_the_route_until_a_heartbeat_frees_one(
        start_replica: Callable[..., Awaitable[Replica]]) -> None:
    replica = await start_replica(max_waiting_per_worker=0, queue_capacity=1)
    stub = replica.stub
    await register(stub, "w0", running=1, max_running=1)
    session = RouteSessionClient(stub)
    waiting = asyncio.ensure_future(session.route(route_request("r0")))

    async def queued() -> bool:
        return len(replica.service.router.queue) == 1

    await eventually(queued)
    assert not waiting.done()
    with pytest.raises(MeshError) as overflow:  # the queue holds one request
        await session.route(route_request("r1"))
    assert grpc_code_for(overflow.value) == grpc.StatusCode.RESOURCE_EXHAUSTED

    await stub.Heartbeat(scheduler_pb2.HeartbeatRequest(load=load("w0", running=0,
                                                                  max_running=1)))
    response = await asyncio.wait_for(waiting, 5)
    assert response.worker_id == "w0"
    assert response.queued_ns > 0
    await session.close()


async def test_provisional_load_spreads_a_burst_until_release(
        start_replica: Callable[..., Awaitable[Replica]]) -> None:
    replica = await start_replica(max_waiting_per_worker=0)
    stub = replica.stub
    await register(stub, "w0", max_running=1)
    await register(stub, "w1", max_running=1)
    session = RouteSessionClient(stub)
    first = await session.route(route_request("r0"))
    second = await session.route(route_request("r1"))
    assert {first.worker_id, second.worker_id} == {"w0", "w1"}  # no heartbeat in between
    third = asyncio.ensure_future(session.route(route_request("r2")))

    async def queued() -> bool:
        return len(replica.service.router.queue) == 1

    await eventually(queued)
    session.release("r0", first.worker_id)
    assert (await asyncio.wait_for(third, 5)).worker_id == first.worker_id
    assert len(replica.service.router.inflight) == 2  # r1 and r2; r0 no longer tracked
    # Releasing r0 again frees nothing: the next route waits, both workers being full.
    session.release("r0", first.worker_id)
    fourth = asyncio.ensure_future(session.route(route_request("r3")))
    await eventually(queued)
    assert not fourth.done()
    assert len(replica.service.router.inflight) == 2
    session.cancel_waiting()
    await session.close()  # releases r1 and r2
    await eventually(lambda: _no_inflight(replica))
    assert len(replica.service.router.queue) == 0
    with pytest.raises(EOFError):  # cancelled: never decided
        await fourth


async def test_queue_gives_up_at_the_request_deadline(
        start_replica: Callable[..., Awaitable[Replica]]) -> None:
    stub = (await start_replica(max_waiting_per_worker=0)).stub
    await register(stub, "w0", running=1, max_running=1)
    session = RouteSessionClient(stub)
    deadline = time.time_ns() + 200_000_000
    with pytest.raises(MeshError) as err:
        await session.route(route_request("r0", deadline_unix_ns=deadline))
    assert grpc_code_for(err.value) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.time_ns() >= deadline
    await session.close()


async def test_route_errors(start_replica: Callable[..., Awaitable[Replica]]) -> None:
    # No registration grace: with no worker at all, the first route fails at once.
    stub = (await start_replica(queue_capacity=0, registration_grace_s=0.0)).stub
    session = RouteSessionClient(stub)
    with pytest.raises(MeshError) as err:
        await session.route(route_request("r0"))
    assert grpc_code_for(err.value) == grpc.StatusCode.UNAVAILABLE
    await register(stub, "w0", running=8, max_running=8, free=0)
    with pytest.raises(MeshError) as err:
        await session.route(route_request("r1", exclude_worker_ids=["w0"]))
    assert grpc_code_for(err.value) == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(MeshError) as err:  # full, and no queue to wait in
        await session.route(route_request("r2"))
    assert grpc_code_for(err.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(MeshError) as err:
        await session.route(scheduler_pb2.RouteRequest(request_id="r3", model=MODEL))
    assert grpc_code_for(err.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.param == "prompt_token_ids"
    await session.close()  # each route failed alone; the stream is intact


async def test_two_replicas_share_workers_and_wake_each_other(
        start_replica: Callable[..., Awaitable[Replica]]) -> None:
    a = await start_replica(max_waiting_per_worker=0)
    b = await start_replica(max_waiting_per_worker=0)
    await register(a.stub, "w0", running=1, max_running=1)
    await register(b.stub, "w1", running=1, max_running=1)
    assert await worker_ids(a.stub) == await worker_ids(b.stub) == ["w0", "w1"]

    session = RouteSessionClient(b.stub)
    waiting = asyncio.ensure_future(session.route(route_request("r0")))

    async def queued_on_b() -> bool:
        return len(b.service.router.queue) == 1

    await eventually(queued_on_b)
    # The heartbeat reaches replica A; replica B hears of it through Redis.
    await a.stub.Heartbeat(scheduler_pb2.HeartbeatRequest(load=load("w1", running=0,
                                                                    max_running=1)))
    assert (await asyncio.wait_for(waiting, 5)).worker_id == "w1"
    await session.close()


async def test_route_session_answers_each_ticket_and_queues_alone(
        start_replica: Callable[..., Awaitable[Replica]]) -> None:
    replica = await start_replica(max_waiting_per_worker=0, queue_capacity=4)
    stub = replica.stub
    await register(stub, "w0", max_running=2)
    session = RouteSessionClient(stub)
    # Four routes in one message: the first two fit (first come, first served), two wait in
    # the queue; one more names no model.
    session.send(routes=[ticket(1, "a"), ticket(2, "b"), ticket(3, "c"), ticket(4, "d"),
                         scheduler_pb2.RouteTicket(ticket=5, request=scheduler_pb2.RouteRequest(
                             request_id="bad", prompt_token_ids=PROMPT))])
    first = await session.outcomes(3)
    assert {t: o.WhichOneof("result") for t, o in first.items()} == {
        1: "route", 2: "route", 5: "error"}
    assert first[5].error.kind == "invalid_request" and first[5].error.param == "model"
    # Releasing one frees a place: exactly one waiting route is decided.
    session.send(releases=[scheduler_pb2.ReleaseRequest(request_id="a", worker_id="w0")])
    (decided,) = (await session.outcomes(1)).values()
    assert decided.ticket in (3, 4) and decided.route.worker_id == "w0"
    # The other waiting one is cancelled; ending the stream releases what it had decided.
    session.send(cancels=[7 - decided.ticket])
    assert len(replica.service.router.inflight) == 2  # b and the decided one
    await session.close()
    await eventually(lambda: _no_inflight(replica))
    assert len(replica.service.router.queue) == 0


async def _no_inflight(replica: Replica) -> bool:
    return len(replica.service.router.inflight) == 0


async def test_a_young_scheduler_holds_a_route_until_a_worker_registers(
        start_replica: Callable[..., Awaitable[Replica]]) -> None:
    # A scheduler restarted while workers ran: their records expired with no one to renew
    # them, and they register again at their next heartbeat.
    replica = await start_replica(registration_grace_s=30.0)
    session = RouteSessionClient(replica.stub)
    route = asyncio.ensure_future(session.route(route_request("r0")))

    async def queued() -> bool:
        return len(replica.service.router.queue) == 1

    await eventually(queued)
    await register(replica.stub, "w0")
    assert (await route).worker_id == "w0"
    await session.close()


async def test_past_the_registration_grace_a_route_with_no_worker_fails(
        start_replica: Callable[..., Awaitable[Replica]]) -> None:
    replica = await start_replica(registration_grace_s=0.5)
    session = RouteSessionClient(replica.stub)
    started = time.monotonic()
    with pytest.raises(MeshError, match="no live worker serves model") as err:
        await session.route(route_request("r0"))
    assert grpc_code_for(err.value) == grpc.StatusCode.UNAVAILABLE
    assert 0.4 <= time.monotonic() - started < 5.0  # held for the grace, then refused
    with pytest.raises(MeshError, match="no live worker serves model"):
        await session.route(route_request("r1"))  # at once, now
    assert len(replica.service.router.queue) == 0
    await session.close()


async def test_a_route_waits_for_a_worker_the_registry_lost_within_the_grace(
        start_replica: Callable[..., Awaitable[Replica]]) -> None:
    # A worker that beat here moments ago and is gone from the registry (Redis came back
    # empty, or it is being restarted) holds a route for the grace, as a young scheduler
    # does; one that left by deregistering does not.
    replica = await start_replica(registration_grace_s=2.0, heartbeat_ttl_s=0.2)
    session = RouteSessionClient(replica.stub)
    with pytest.raises(MeshError, match="no live worker serves model 'other'"):
        # No worker of this model ever beat here: it fails at the young grace's end.
        await session.route(scheduler_pb2.RouteRequest(request_id="young", model="other",
                                                       prompt_token_ids=PROMPT))
    await register(replica.stub, "w0")

    async def expired() -> bool:
        return await worker_ids(replica.stub) == []

    await eventually(expired)  # no heartbeat: its record is gone after the 0.2 s TTL
    route = asyncio.ensure_future(session.route(route_request("r0")))

    async def queued() -> bool:
        return len(replica.service.router.queue) == 1

    await eventually(queued)
    await register(replica.stub, "w0", epoch=2)  # back
    assert (await route).worker_id == "w0"
    await replica.stub.DeregisterWorker(scheduler_pb2.DeregisterWorkerRequest(
        worker_id="w0", epoch=2))
    started = time.monotonic()
    with pytest.raises(MeshError, match="no live worker serves model 'tiny'"):
        await session.route(route_request("r1"))
    assert time.monotonic() - started < 1.0  # at once: it said it left
    await session.close()
