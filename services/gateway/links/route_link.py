"""The gateway's RouteSession stream to the scheduler: every route and release, batched.

    routes = RouteStream(stub)                     # opened on first use
    response = await routes.route(request, traceparent=..., timeout_s=...)
    routes.release(request_id, worker_id)          # fire and forget

The routes, releases and cancellations queued in one event-loop turn go out as one
message; outcomes come back as the scheduler decides them. A burst of a thousand requests
is a handful of messages each way instead of two thousand unary calls, which cost the
gateway and the scheduler most of their per-request CPU. A route the caller stops waiting
for (deadline, client gone) is cancelled at the scheduler. If the stream breaks, every
route waiting on it fails with UnavailableError; the next route opens a new stream.
"""

from __future__ import annotations

import asyncio
import itertools

from meshserve.proto.v1 import scheduler_pb2, scheduler_pb2_grpc
from meshserve.services.gateway.links.bidi_link import BidiLink
from meshserve.shared.errors import DeadlineExceededError, MeshError
from meshserve.shared.proto_errors import error_from_pb


class RouteStream:
    """One RouteSession stream to the scheduler (see the module doc)."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        self._stub = stub
        self._tickets = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[scheduler_pb2.RouteOutcome]] = {}
        self._routes: list[scheduler_pb2.RouteTicket] = []
        self._releases: list[scheduler_pb2.ReleaseRequest] = []
        self._cancels: list[int] = []
        self._wake_writer = asyncio.Event()
        self._link = BidiLink(stub.RouteSession, name="scheduler", on_message=self._answer,
                              on_break=self._break)

    @property
    def usable(self) -> bool:
        """False once the stream has broken (a new one must be opened)."""
        return self._link.usable

    async def route(self, request: scheduler_pb2.RouteRequest, *, traceparent: str,
                    timeout_s: float) -> scheduler_pb2.RouteResponse:
        """The scheduler's decision for one request (its error, raised, when it has none)."""
        if self._link.failure is not None:
            raise self._link.failure
        self._link.open(self._write)
        ticket = next(self._tickets)
        answer = asyncio.get_running_loop().create_future()
        self._waiting[ticket] = answer
        self._routes.append(scheduler_pb2.RouteTicket(ticket=ticket, request=request,
                                                      traceparent=traceparent))
        self._wake_writer.set()
        try:
            async with asyncio.timeout(timeout_s):
                outcome = await answer
        except TimeoutError:
            self._cancel(ticket)
            raise DeadlineExceededError(f"no route within {timeout_s:.1f}s (the request's "
                                        "deadline)") from None
        except asyncio.CancelledError:
            self._cancel(ticket)
            raise
        if outcome.WhichOneof("result") == "error":
            raise error_from_pb(outcome.error)
        return outcome.route

    def release(self, request_id: str, worker_id: str) -> None:
        """Tell the scheduler a routed request ended (best effort)."""
        if self._link.usable and self._link.opened:
            self._releases.append(scheduler_pb2.ReleaseRequest(request_id=request_id,
                                                               worker_id=worker_id))
            self._wake_writer.set()

    def _cancel(self, ticket: int) -> None:
        self._waiting.pop(ticket, None)
        if self._link.usable:
            self._cancels.append(ticket)
            self._wake_writer.set()

    async def _write(self) -> None:
        while True:
            await self._wake_writer.wait()
            self._wake_writer.clear()
            routes, releases, cancels = self._routes, self._releases, self._cancels
            self._routes, self._releases, self._cancels = [], [], []
            if (routes or releases or cancels) and not await self._link.write(
                    scheduler_pb2.RouteSessionRequest(routes=routes, releases=releases,
                                                      cancels=cancels)):
                return

    async def _answer(self, response: scheduler_pb2.RouteSessionResponse) -> None:
        for outcome in response.outcomes:
            answer = self._waiting.pop(outcome.ticket, None)
            if answer is not None and not answer.done():
                answer.set_result(outcome)

    def _break(self, error: MeshError) -> None:
        """The stream is gone: every route waiting on it fails."""
        waiting = list(self._waiting.values())
        self._waiting.clear()
        for answer in waiting:
            if not answer.done():
                answer.set_exception(error)

    async def aclose(self) -> None:
        """End the stream (gateway shutdown)."""
        await self._link.aclose()
