"""GET /health on the metrics port mirrors the service's gRPC health (real HTTP, real gRPC
server): 503 while starting or NOT_SERVING, 200 while SERVING, 503 again once draining.
With reuse_port, two replicas' metrics servers share one port."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from meshserve.shared.grpc_server import GrpcServer
from meshserve.shared.health_http import HealthProbe
from meshserve.shared.redis_server import find_free_port
from meshserve.shared.telemetry import Telemetry


async def get(port: int, path: str = "/health") -> tuple[int, dict[str, str]]:
    async with (aiohttp.ClientSession() as session,
                session.get(f"http://127.0.0.1:{port}{path}") as response):
        body = await response.json() if path == "/health" else {}
        return response.status, body


def bound_port(runner: web.AppRunner) -> int:
    return int(runner.addresses[0][1])


@pytest.fixture
async def telemetry() -> AsyncIterator[tuple[Telemetry, int]]:
    telemetry = Telemetry("test")
    runner = await telemetry.start_metrics_server("127.0.0.1", 0)
    yield telemetry, bound_port(runner)
    await runner.cleanup()


def test_a_probe_reports_its_attached_status() -> None:
    probe = HealthProbe()
    assert (probe.attached, probe.status()) == (False, "STARTING")
    serving = [False]
    probe.attach(lambda: serving[0])
    assert probe.status() == "NOT_SERVING"
    serving[0] = True
    assert probe.status() == "SERVING"


async def test_health_is_503_before_the_grpc_server_exists(
        telemetry: tuple[Telemetry, int]) -> None:
    _, port = telemetry
    assert await get(port) == (503, {"status": "STARTING"})
    status, _ = await get(port, "/metrics")
    assert status == 200  # the metrics route is still served beside it


async def test_health_follows_the_grpc_health_through_serving_and_drain(
        telemetry: tuple[Telemetry, int]) -> None:
    tel, port = telemetry
    server = GrpcServer("127.0.0.1:0", service_names=["meshserve.v1.Test"], telemetry=tel,
                        grace_s=0)
    await server.start()
    assert await get(port) == (503, {"status": "NOT_SERVING"})
    await server.set_serving()
    assert await get(port) == (200, {"status": "SERVING"})
    await server.set_serving(False)
    assert await get(port) == (503, {"status": "NOT_SERVING"})
    await server.set_serving()
    await server.drain(0)
    assert await get(port) == (503, {"status": "NOT_SERVING"})


async def test_metrics_servers_share_a_port_only_with_reuse_port() -> None:
    port = find_free_port()
    first = await Telemetry("a").start_metrics_server("127.0.0.1", port, reuse_port=True)
    second = await Telemetry("b").start_metrics_server("127.0.0.1", port, reuse_port=True)
    try:
        with pytest.raises(OSError):
            await Telemetry("c").start_metrics_server("127.0.0.1", port)
        assert (await get(port))[0] == 503
    finally:
        await first.cleanup()
        await second.cleanup()
