"""The gateway's route waits for a scheduler it cannot reach (MeshClients.route): a real
grpc.aio Scheduler on 127.0.0.1 with a fake RouteSession, started only once the gateway's
first attempts failed, answers the route; an error the scheduler answers is raised at once;
with no scheduler the route gives up after its wait. The worker list outlives a scheduler
that went away (the last one read stands)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from meshserve.proto.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from meshserve.services.gateway.links.clients import MeshClients
from meshserve.services.gateway.links.route_link import RouteStream
from meshserve.shared.errors import UnavailableError
from meshserve.shared.grpc_server import GrpcServer
from meshserve.shared.proto_errors import error_pb
from meshserve.shared.redis_server import find_free_port

REQUEST = scheduler_pb2.RouteRequest(request_id="r1", model="tiny", prompt_token_ids=[1, 2, 3],
                                     num_prompt_tokens=3)
WAIT_S = 30.0


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Answers every route with worker-a, or with `error` when one is given."""

    def __init__(self, error: UnavailableError | None = None) -> None:
        self.error = error

    async def RouteSession(self, request_iterator: AsyncIterator[
            scheduler_pb2.RouteSessionRequest], context: object
                           ) -> AsyncIterator[scheduler_pb2.RouteSessionResponse]:
        async for message in request_iterator:
            outcomes = [scheduler_pb2.RouteOutcome(ticket=t.ticket, error=error_pb(self.error))
                        if self.error else scheduler_pb2.RouteOutcome(
                            ticket=t.ticket, route=scheduler_pb2.RouteResponse(
                                worker_id="worker-a"))
                        for t in message.routes]
            if outcomes:
                yield scheduler_pb2.RouteSessionResponse(outcomes=outcomes)

    async def ListWorkers(self, request: scheduler_pb2.ListWorkersRequest,
                          context: object) -> scheduler_pb2.ListWorkersResponse:
        worker = scheduler_pb2.WorkerStatus(info=common_pb2.WorkerInfo(
            worker_id="worker-a", address="127.0.0.1:1", model_names=["tiny"]))
        return scheduler_pb2.ListWorkersResponse(workers=[worker])


async def serve(address: str, servicer: FakeScheduler) -> GrpcServer:
    server = GrpcServer(address, service_names=["meshserve.v1.Scheduler"], grace_s=0)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server.server)
    await server.start()
    await server.set_serving()
    return server


class CountingClients(MeshClients):
    """MeshClients that count the route streams asked for and tell when the n-th is."""

    def __init__(self, scheduler_address: str, nth: int) -> None:
        super().__init__(["127.0.0.1:1"], scheduler_address)
        self.asked = 0
        self.reached = asyncio.Event()
        self._nth = nth

    def route_stream(self) -> RouteStream:
        self.asked += 1
        if self.asked == self._nth:
            self.reached.set()
        return super().route_stream()


@pytest.fixture
def address() -> str:
    return f"127.0.0.1:{find_free_port('127.0.0.1')}"


async def test_a_route_waits_for_the_scheduler_to_come_back(address: str) -> None:
    clients = CountingClients(address, nth=3)  # two attempts failed: nobody listened
    route = asyncio.ensure_future(clients.route(REQUEST, traceparent="", timeout_s=WAIT_S,
                                                wait_s=WAIT_S))
    await asyncio.wait_for(clients.reached.wait(), WAIT_S)
    server = await serve(address, FakeScheduler())
    try:
        response = await asyncio.wait_for(route, WAIT_S)
        assert response.worker_id == "worker-a"
        assert clients.asked >= 3
    finally:
        await server.drain(grace_s=0)
        await clients.close()


async def test_an_error_the_scheduler_answers_is_not_waited_out(address: str) -> None:
    server = await serve(address, FakeScheduler(UnavailableError("no worker serves tiny")))
    clients = CountingClients(address, nth=0)
    try:
        with pytest.raises(UnavailableError, match="no worker serves tiny"):
            await clients.route(REQUEST, traceparent="", timeout_s=WAIT_S, wait_s=WAIT_S)
        assert clients.asked == 1
    finally:
        await server.drain(grace_s=0)
        await clients.close()


async def test_without_a_scheduler_the_route_gives_up_after_its_wait(address: str) -> None:
    clients = CountingClients(address, nth=0)
    started = time.monotonic()
    try:
        with pytest.raises(UnavailableError):
            await clients.route(REQUEST, traceparent="", timeout_s=WAIT_S, wait_s=0.5)
        assert clients.asked >= 2  # tried again at least once
        assert time.monotonic() - started < 10.0  # the wait, not the request's deadline
    finally:
        await clients.close()


async def test_the_worker_list_outlives_a_scheduler_that_went_away(address: str) -> None:
    server = await serve(address, FakeScheduler())
    clients, fresh = MeshClients(["127.0.0.1:1"], address), None
    try:
        assert [w.worker_id for w in await clients.list_workers()] == ["worker-a"]
        await server.drain(grace_s=0)
        assert [w.worker_id for w in await clients.list_workers(refresh=True)] == ["worker-a"]
        fresh = MeshClients(["127.0.0.1:1"], address)
        with pytest.raises(UnavailableError):  # never read: nothing to fall back on
            await fresh.list_workers()
    finally:
        await clients.close()
        if fresh is not None:
            await fresh.close()
