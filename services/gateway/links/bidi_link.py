"""One bidirectional stream of the gateway's data plane, and its life: open, read, break.

    link = BidiLink(stub.Session, name="worker 127.0.0.1:50053", on_message=handle,
                    on_break=fail_everything)
    link.open()                          # lazily, on first use
    await link.write(message)            # False once the stream has broken
    await link.aclose()                  # shutdown

The worker Session, the DetokenizeSession and the scheduler's RouteSession all hold one:
the call is opened in a clean context (a long-lived stream must not carry the trace of the
request that happened to open it), one task reads every message and hands it to
`on_message`, and the first failure of any kind (an RPC error, the peer ending the stream,
an error raised by `on_message`) breaks the link exactly once: `on_break` is told, with the
error the waiting requests should fail with, and a new link is opened on next use.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from meshserve.shared.errors import InternalError, MeshError, UnavailableError
from meshserve.shared.grpc_client import error_from_rpc

_log = logging.getLogger(__name__)


class BidiLink:
    """One bidirectional stream: its call, its reader task and its one failure."""

    def __init__(self, open_call: Callable[[], grpc.aio.StreamStreamCall], *, name: str,
                 on_message: Callable[[Any], Awaitable[None]],
                 on_break: Callable[[MeshError], None]) -> None:
        """`name` names the peer in errors ("worker 10.0.0.5:50053")."""
        self.name = name
        self._open_call = open_call
        self._on_message = on_message
        self._on_break = on_break
        self._call: grpc.aio.StreamStreamCall | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.failure: MeshError | None = None

    @property
    def usable(self) -> bool:
        """False once the stream has broken (a new link must be made)."""
        return self.failure is None

    @property
    def opened(self) -> bool:
        return self._call is not None

    def open(self, *tasks: Callable[[], Awaitable[None]]) -> None:
        """Open the call (once) and start the reader, and `tasks` beside it (a writer)."""
        if self._call is not None:
            return
        self._call = contextvars.Context().run(self._open_call)
        self._tasks = [asyncio.ensure_future(self._read()),
                       *(asyncio.ensure_future(self._guard(task)) for task in tasks)]

    async def write(self, message: Any) -> bool:
        """Send one message; False (and the link broken) when the stream is gone."""
        if self.failure is not None:
            return False
        assert self._call is not None, "open() the link before writing"
        try:
            await self._call.write(message)
        except (grpc.RpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            self.fail(self._stream_error(exc))
            return False
        return True

    async def _read(self) -> None:
        assert self._call is not None
        await self._guard(self._read_all)

    async def _read_all(self) -> None:
        assert self._call is not None
        while True:
            message = await self._call.read()
            if message is grpc.aio.EOF:
                raise UnavailableError(f"{self.name} ended the stream")
            await self._on_message(message)

    async def _guard(self, work: Callable[[], Awaitable[None]]) -> None:
        """Run `work`; whatever ends it with an error breaks the link."""
        try:
            await work()
        except (grpc.RpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            self.fail(self._stream_error(exc))
        except MeshError as exc:
            self.fail(exc)
        except Exception as exc:  # noqa: BLE001 (a bug: fail its requests loudly, never hang)
            _log.exception("stream to %s failed", self.name)
            self.fail(InternalError(f"stream to {self.name} failed: {type(exc).__name__}: "
                                    f"{exc}"))

    def fail(self, error: MeshError) -> None:
        """Break the link (once): tell the owner, cancel the call and the other tasks."""
        if self.failure is not None:
            return
        self.failure = error
        self._on_break(error)
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

    def _stream_error(self, exc: BaseException) -> MeshError:
        if isinstance(exc, grpc.RpcError):
            return UnavailableError(f"{self.name}: {error_from_rpc(exc).message}")
        return UnavailableError(f"{self.name}: the stream closed")
