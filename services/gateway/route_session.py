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
import contextvars
import itertools
import logging

import grpc

from meshserve.proto.v1 import scheduler_pb2, scheduler_pb2_grpc
from meshserve.shared.errors import (
    DeadlineExceededError,
    InternalError,
    MeshError,
    UnavailableError,
)
from meshserve.shared.grpc_client import error_from_rpc
from meshserve.shared.proto_errors import error_from_pb

_log = logging.getLogger(__name__)


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
        self._call: grpc.aio.StreamStreamCall | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.failure: MeshError | None = None

    @property
    def usable(self) -> bool:
        """False once the stream has broken (a new one must be opened)."""
        return self.failure is None

    async def route(self, request: scheduler_pb2.RouteRequest, *, traceparent: str,
                    timeout_s: float) -> scheduler_pb2.RouteResponse:
        """The scheduler's decision for one request (its error, raised, when it has none)."""
        if self.failure is not None:
            raise self.failure
        self._ensure_open()
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
        if self.failure is None and self._call is not None:
            self._releases.append(scheduler_pb2.ReleaseRequest(request_id=request_id,
                                                               worker_id=worker_id))
            self._wake_writer.set()

    def _cancel(self, ticket: int) -> None:
        self._waiting.pop(ticket, None)
        if self.failure is None:
            self._cancels.append(ticket)
            self._wake_writer.set()

    def _ensure_open(self) -> None:
        if self._call is not None:
            return
        # A clean context: the stream must not carry the trace of the request that opened it.
        self._call = contextvars.Context().run(self._stub.RouteSession)
        self._tasks = [asyncio.ensure_future(self._write()), asyncio.ensure_future(self._read())]

    async def _write(self) -> None:
        assert self._call is not None
        try:
            while True:
                await self._wake_writer.wait()
                self._wake_writer.clear()
                routes, releases, cancels = self._routes, self._releases, self._cancels
                self._routes, self._releases, self._cancels = [], [], []
                if routes or releases or cancels:
                    await self._call.write(scheduler_pb2.RouteSessionRequest(
                        routes=routes, releases=releases, cancels=cancels))
        except (grpc.RpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            self._break(_stream_error(exc))

    async def _read(self) -> None:
        assert self._call is not None
        try:
            while True:
                response = await self._call.read()
                if response is grpc.aio.EOF:
                    raise UnavailableError("the scheduler ended the RouteSession stream")
                for outcome in response.outcomes:
                    answer = self._waiting.pop(outcome.ticket, None)
                    if answer is not None and not answer.done():
                        answer.set_result(outcome)
        except grpc.RpcError as exc:
            self._break(_stream_error(exc))
        except MeshError as exc:
            self._break(exc)
        except Exception as exc:  # noqa: BLE001 (a bug: fail its routes loudly, never hang)
            _log.exception("route stream failed")
            self._break(InternalError(f"route stream failed: {type(exc).__name__}: {exc}"))

    def _break(self, error: MeshError) -> None:
        if self.failure is not None:
            return
        self.failure = error
        waiting = list(self._waiting.values())
        self._waiting.clear()
        for answer in waiting:
            if not answer.done():
                answer.set_exception(error)
        if self._call is not None:
            self._call.cancel()
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()

    async def aclose(self) -> None:
        """End the stream (gateway shutdown)."""
        if self._call is not None:
            self._call.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _stream_error(exc: BaseException) -> MeshError:
    if isinstance(exc, grpc.RpcError):
        return UnavailableError(f"scheduler: {error_from_rpc(exc).message}")
    return UnavailableError("scheduler: the RouteSession stream closed")
