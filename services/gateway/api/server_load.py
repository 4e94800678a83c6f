"""vLLM's server load tracking: GET /load answers {"server_load": N}, the generation and
pooling requests this gateway process has in flight.

    load = ServerLoad(enabled=config.enable_server_load_tracking)
    route = load.tracked(handler)   # counted from its start until its answer is complete

As in vLLM, /load is always served and the count stays 0 unless tracking is on
(--enable-server-load-tracking). A streamed answer counts until its last byte is written
(the handler returns only then). With several gateway processes each reports its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from meshserve.shared.openai_bodies import dumps

if TYPE_CHECKING:
    from aiohttp.typedefs import Handler


class ServerLoad:
    """The in-flight count behind GET /load."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.in_flight = 0

    def tracked(self, handler: Handler) -> Handler:
        """`handler`, counted while it runs when tracking is on (itself otherwise)."""
        if not self.enabled:
            return handler

        async def counted(request: web.Request) -> web.StreamResponse:
            self.in_flight += 1
            try:
                return await handler(request)
            finally:
                self.in_flight -= 1
        return counted

    async def handle(self, request: web.Request) -> web.Response:
        """GET /load."""
        return web.Response(body=dumps({"server_load": self.in_flight}),
                            content_type="application/json")
