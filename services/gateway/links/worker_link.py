"""The gateway's Session stream to one worker: all its requests there, one message a step.

    link = WorkerLink(stub, address)             # opened on first submit
    link.submit(runner, add)                     # commands are batched per loop turn
    link.abort(handle, [index])

Commands queued in one event-loop turn go out as one SessionRequest. The reader takes
each SessionResponse (one engine step of every request here, columnar) and hands each
entry to its request's `SessionRunner`, which forwards it to that request's detokenize
stream; then every detokenize stream touched is flushed, so that one worker step becomes
one message per tokenizer replica. If the stream breaks (worker gone, connection lost),
every request still on it is told (`worker_lost`); a new session is opened on next use.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol

from meshserve.proto.v1 import worker_pb2, worker_pb2_grpc
from meshserve.services.gateway.links.bidi_link import BidiLink
from meshserve.services.gateway.links.detokenize import DetokenizeStream
from meshserve.shared.errors import MeshError
from meshserve.shared.proto_errors import error_from_pb

_log = logging.getLogger(__name__)


class SessionRunner(Protocol):
    """What the session needs of one request (a generation)."""

    def on_entry(self, index: int, token_ids: list[int], finish_reason: int,
                 detail: worker_pb2.EntryDetail | None) -> DetokenizeStream | None:
        """One entry of a step; returns the detokenize stream it was added to, if any."""

    def on_worker_error(self, error: MeshError) -> None:
        """The worker failed the request."""

    def on_worker_done(self, done: worker_pb2.RequestDone) -> None:
        """The worker finished every sequence of the request, or (`handed_off`, a prefill
        worker's part) the sequences still running go on at the decode worker, or
        (`refused`, a decode worker without room) the request goes elsewhere."""

    def worker_lost(self, error: MeshError) -> None:
        """The session broke before the request finished."""


class WorkerLink:
    """One Session stream to one worker (see the module doc)."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub, address: str) -> None:
        self.address = address
        self._stub = stub
        self._runners: dict[int, SessionRunner] = {}
        self._adds: list[worker_pb2.SessionAdd] = []
        self._aborts: list[worker_pb2.SessionAbort] = []
        self._wake_writer = asyncio.Event()
        self._link = BidiLink(stub.Session, name=f"worker {address}",
                              on_message=self._dispatch, on_break=self._break)

    @property
    def usable(self) -> bool:
        """False once the stream has broken or ended (a new one must be opened)."""
        return self._link.usable

    @property
    def failure(self) -> MeshError | None:
        return self._link.failure

    @property
    def num_requests(self) -> int:
        return len(self._runners)

    def submit(self, runner: SessionRunner, add: worker_pb2.SessionAdd) -> None:
        """Start a request on the worker (sent with this loop turn's other commands)."""
        if self._link.failure is not None:
            runner.worker_lost(self._link.failure)
            return
        self._link.open(self._write)
        self._runners[add.handle] = runner
        self._adds.append(add)
        self._wake_writer.set()

    def abort(self, handle: int, indices: Sequence[int] = ()) -> None:
        """Abort some (or all) sequences of a request; the session stops routing its
        output once all are aborted."""
        if not indices:
            self._runners.pop(handle, None)
        if self._link.usable and self._link.opened:
            self._aborts.append(worker_pb2.SessionAbort(handle=handle, indices=indices))
            self._wake_writer.set()

    def forget(self, handle: int) -> None:
        """Stop routing a request's output (it ended at the gateway)."""
        self._runners.pop(handle, None)

    async def _write(self) -> None:
        while True:
            await self._wake_writer.wait()
            self._wake_writer.clear()
            adds, aborts = self._adds, self._aborts
            self._adds, self._aborts = [], []
            if (adds or aborts) and not await self._link.write(
                    worker_pb2.SessionRequest(adds=adds, aborts=aborts)):
                return

    async def _dispatch(self, response: worker_pb2.SessionResponse) -> None:
        """Hand every entry to its request, then flush the detokenize streams touched."""
        runners = self._runners
        details = {d.entry: d for d in response.details} if response.details else {}
        token_ids = list(response.token_ids)
        touched: dict[int, DetokenizeStream] = {}
        position = 0
        for entry, (handle, index, size, reason) in enumerate(zip(
                response.handles, response.indices, response.num_tokens,
                response.finish_reasons, strict=True)):
            ids = token_ids[position:position + size]
            position += size
            runner = runners.get(handle)
            if runner is None:
                continue  # aborted or ended at the gateway; its abort is on its way
            stream = runner.on_entry(index, ids, reason, details.get(entry))
            if stream is not None:
                touched[id(stream)] = stream
        for failed in response.errors:
            runner = runners.pop(failed.handle, None)
            if runner is not None:
                runner.on_worker_error(error_from_pb(failed.error))
        for done in response.done:
            runner = runners.pop(done.handle, None)
            if runner is not None:
                runner.on_worker_done(done)
        for stream in touched.values():
            await stream.flush()

    def _break(self, error: MeshError) -> None:
        """The stream is gone: every request still on it is told."""
        runners = list(self._runners.values())
        self._runners.clear()
        if runners:
            _log.warning("session to worker %s broke with %d requests on it: %s",
                         self.address, len(runners), error)
        for runner in runners:
            runner.worker_lost(error)

    async def aclose(self) -> None:
        """End the stream (gateway shutdown)."""
        await self._link.aclose()
