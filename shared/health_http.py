"""GET /health on a service's metrics port: its grpc.health.v1 status as an HTTP status.

Container and load-balancer probes speak HTTP far more cheaply than gRPC: a compose
health check is then one bash `/dev/tcp` request (compose/healthcheck.sh) instead of a
Python process that imports grpc, and Kubernetes can use a plain `httpGet` probe.

The answer mirrors the server-wide gRPC health ("" service): 200 while SERVING, 503
otherwise, including before the gRPC server exists (the metrics port opens first, while
the model loads) and once draining began. The body is a small JSON object for people.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from aiohttp import web

HEALTH_PATH = "/health"


class HealthProbe:
    """What GET /health reports: the service's gRPC health, once its server is attached.

    The metrics HTTP server owns a probe from its start; the gRPC server attaches its
    status function when it is built (`attach`), so that the two need not start in any
    particular order.
    """

    def __init__(self) -> None:
        self._serving: Callable[[], bool] | None = None

    def attach(self, serving: Callable[[], bool]) -> None:
        """Report `serving()` from now on (the gRPC server's overall status)."""
        self._serving = serving

    @property
    def attached(self) -> bool:
        return self._serving is not None

    def status(self) -> str:
        """SERVING, NOT_SERVING, or STARTING while no gRPC server is attached."""
        if self._serving is None:
            return "STARTING"
        return "SERVING" if self._serving() else "NOT_SERVING"

    async def handle(self, request: web.Request) -> web.Response:
        """aiohttp handler for GET /health: 200 when SERVING, else 503."""
        status = self.status()
        return web.Response(status=200 if status == "SERVING" else 503,
                            body=json.dumps({"status": status}).encode(),
                            content_type="application/json")


def add_health_route(app: web.Application, probe: HealthProbe) -> None:
    """Serve GET /health from `probe` on `app`."""
    app.router.add_get(HEALTH_PATH, probe.handle)
