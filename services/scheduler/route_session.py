"""One gateway's RouteSession stream: its routes and releases, batched per event-loop turn.

    session = RouteSession(router, wait_s=servicer_wait, tracer=tracer)
    reader = asyncio.ensure_future(session.read(request_iterator))
    async for response in session.responses(reader):
        await context.write(response)
    session.close()

Each route ticket is decided on its own (a task running Router.route: it may wait in the
global queue without holding up the others); outcomes are sent in batches, as they come.
A route gets a SERVER span of its own, under the trace context the ticket carries. When
the stream ends, undecided routes are dropped and decided ones that were never released
are released, so that no provisional load is left behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from meshserve.proto.v1 import scheduler_pb2
from meshserve.services.scheduler.router import RouteQuery, Router
from meshserve.services.scheduler.wire import (
    decision_attributes,
    decision_to_proto,
    query_from_proto,
)
from meshserve.shared.errors import MeshError
from meshserve.shared.proto_errors import error_pb

_SPAN_NAME = "meshserve.v1.Scheduler/Route"


class RouteSession:
    """The tickets of one RouteSession stream (see the module doc)."""

    def __init__(self, router: Router, *, wait_s: Callable[[scheduler_pb2.RouteRequest], float],
                 tracer: trace.Tracer) -> None:
        """`wait_s(request)`: the longest a route may wait in the queue."""
        self._router = router
        self._wait_s = wait_s
        self._tracer = tracer
        self._pending: dict[int, asyncio.Task[None]] = {}
        self._decided: dict[int, tuple[str, str]] = {}  # ticket -> (request id, worker id)
        self._ticket_of: dict[tuple[str, str], int] = {}
        self._outcomes: list[scheduler_pb2.RouteOutcome] = []
        self._ready = asyncio.Event()

    async def read(self, requests: AsyncIterator[scheduler_pb2.RouteSessionRequest]) -> None:
        """Apply every message of the gateway until it stops sending."""
        try:
            async for message in requests:
                for ticket in message.routes:
                    self._start(ticket)
                for release in message.releases:
                    self._release(release.request_id, release.worker_id)
                for number in message.cancels:
                    self._cancel(number)
        finally:
            self._ready.set()

    def _start(self, ticket: scheduler_pb2.RouteTicket) -> None:
        if ticket.ticket in self._pending or ticket.ticket in self._decided:
            return  # a duplicate ticket number: the first one stands
        task = asyncio.ensure_future(self._route(ticket))
        self._pending[ticket.ticket] = task

    async def _route(self, ticket: scheduler_pb2.RouteTicket) -> None:
        request = ticket.request
        parent = None
        if ticket.traceparent:
            parent = TraceContextTextMapPropagator().extract({"traceparent": ticket.traceparent})
        span = self._tracer.start_span(_SPAN_NAME, context=parent, kind=SpanKind.SERVER,
                                       attributes={"meshserve.request_id": request.request_id})
        try:
            query: RouteQuery = query_from_proto(request, self._wait_s(request))
            decision = await self._router.route(query)
        except MeshError as exc:
            span.set_status(Status(StatusCode.ERROR, f"{exc.kind}: {exc.message}"))
            outcome = scheduler_pb2.RouteOutcome(ticket=ticket.ticket, error=error_pb(exc))
        else:
            span.set_attributes(decision_attributes(decision))
            self._decided[ticket.ticket] = (request.request_id, decision.worker_id)
            self._ticket_of[(request.request_id, decision.worker_id)] = ticket.ticket
            outcome = scheduler_pb2.RouteOutcome(ticket=ticket.ticket,
                                                 route=decision_to_proto(decision))
        finally:
            span.end()
            self._pending.pop(ticket.ticket, None)
        self._outcomes.append(outcome)
        self._ready.set()

    def _release(self, request_id: str, worker_id: str) -> None:
        ticket = self._ticket_of.pop((request_id, worker_id), None)
        if ticket is not None:
            self._decided.pop(ticket, None)
        self._router.release(request_id, worker_id)

    def _cancel(self, number: int) -> None:
        task = self._pending.pop(number, None)
        if task is not None:
            task.cancel()
        decided = self._decided.get(number)
        if decided is not None:
            self._release(*decided)

    async def responses(self, reader: asyncio.Future[None]
                        ) -> AsyncIterator[scheduler_pb2.RouteSessionResponse]:
        """Outcomes in batches, until the gateway stopped sending and nothing is pending."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            if self._outcomes:
                outcomes, self._outcomes = self._outcomes, []
                yield scheduler_pb2.RouteSessionResponse(outcomes=outcomes)
            if reader.done() and not self._pending and not self._outcomes:
                return

    def close(self) -> None:
        """The stream ended: drop undecided routes, release decided ones."""
        for task in self._pending.values():
            task.cancel()
        self._pending.clear()
        for request_id, worker_id in list(self._decided.values()):
            self._router.release(request_id, worker_id)
        self._decided.clear()
        self._ticket_of.clear()
