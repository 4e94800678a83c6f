"""`python -m meshserve.services.gateway`: run the gateway until SIGTERM / SIGINT."""

from __future__ import annotations

import asyncio
import gc
import signal
import sys
from collections.abc import Sequence

from meshserve.services.gateway.app import Gateway
from meshserve.services.gateway.config import GatewayConfig
from meshserve.shared.errors import UnavailableError
from meshserve.shared.service_main import run_service, service_telemetry
from meshserve.shared.torch_free import forbid_torch

# Allocations between two young collections (CPython's default: 700). A stream costs a few
# short-lived objects per worker step (its entry, delta, chunk); at 1000 streams the default
# collected several times a step and, every hundred of those, walked every request's state.
GC_THRESHOLDS = (10_000, 10, 10)


async def serve(config: GatewayConfig) -> int:
    """Serve until a stop signal, then drain; returns the exit status."""
    async with service_telemetry("gateway", config) as telemetry:
        gateway = Gateway(config, telemetry)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await gateway.start()
            settle_heap()
            await stop.wait()
        except OSError as exc:  # the port is taken, the host is not ours
            raise UnavailableError(
                f"cannot listen on {config.host}:{config.port}: {exc}") from exc
        finally:
            await gateway.stop()
        return 0


def settle_heap() -> None:
    """Once listening: what the start built (modules, the app, channels, metrics) lives as
    long as the process; frozen, the collector's full passes leave it out (they took a third
    of the gateway's CPU under 1000 streams: loadtest/reports/gateway-cost/). Young
    collections then come every GC_THRESHOLDS[0] allocations."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `meshserve gateway` / `python -m meshserve.services.gateway`."""
    forbid_torch()  # text and HTTP only: see shared/torch_free.py
    return run_service("gateway", GatewayConfig, serve, argv)


if __name__ == "__main__":
    sys.exit(main())
