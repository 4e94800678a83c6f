"""A real aiohttp server of test images on 127.0.0.1 and 127.0.0.2, recording which
address and path each request reached (the gateway's media tests fetch from it)."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from aiohttp import web
from PIL import Image


def picture(fmt: str, size: tuple[int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (10, 120, 240)).save(out, format=fmt)
    return out.getvalue()


PNG, JPEG = picture("PNG", (32, 24)), picture("JPEG", (40, 30))


@dataclass
class Gate:
    """Holds every request to /gate until `expected` of them have arrived."""

    expected: int = 2
    arrived: int = 0
    open: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.Response:
        self.arrived += 1
        if self.arrived >= self.expected:
            self.open.set()
        await self.open.wait()
        return web.Response(body=PNG, content_type="image/png")


@dataclass
class ImageServer:
    ports: dict[str, int]  # address -> port
    hits: list[tuple[str, str]]  # (address reached, path)
    gate: Gate
    stalled: asyncio.Event  # /slow waits on it

    def url(self, path: str, address: str = "127.0.0.1", host: str | None = None) -> str:
        return f"http://{host or address}:{self.ports[address]}{path}"


@asynccontextmanager
async def image_server() -> AsyncIterator[ImageServer]:
    hits: list[tuple[str, str]] = []
    gate, stalled = Gate(), asyncio.Event()

    @web.middleware
    async def record(request: web.Request, handler):  # type: ignore[no-untyped-def]
        hits.append((request.transport.get_extra_info("sockname")[0], request.path))
        return await handler(request)

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound(request.query["to"])

    async def slow(request: web.Request) -> web.Response:
        await stalled.wait()
        return web.Response(body=PNG, content_type="image/png")

    async def streamed(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()  # chunked: no Content-Length
        await response.prepare(request)
        for _ in range(10):
            await response.write(b"x" * 500)
        return response

    app = web.Application(middlewares=[record])
    app.router.add_get("/cat.png", _serving(PNG, "image/png"))
    app.router.add_get("/cat.jpg", _serving(JPEG, "image/jpeg"))
    app.router.add_get("/text", _serving(b"hello, not an image", "text/plain"))
    app.router.add_get("/big", _serving(b"x" * 5000, "image/png"))
    app.router.add_get("/streamed", streamed)
    app.router.add_get("/redirect", redirect)
    app.router.add_get("/slow", slow)
    app.router.add_get("/gate", gate.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    ports = {}
    for address in ("127.0.0.1", "127.0.0.2"):
        site = web.TCPSite(runner, address, 0)
        await site.start()
        ports[address] = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield ImageServer(ports, hits, gate, stalled)
    finally:
        stalled.set()
        await runner.cleanup()


def _serving(data: bytes, content_type: str) -> Callable[[web.Request],
                                                         Awaitable[web.Response]]:
    async def handle(request: web.Request) -> web.Response:
        return web.Response(body=data, content_type=content_type)
    return handle
