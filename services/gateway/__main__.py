"""`python -m meshserve.services.gateway`: run the gateway until SIGTERM / SIGINT."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Sequence

from meshserve.services.gateway.app import Gateway
from meshserve.services.gateway.config import GatewayConfig
from meshserve.shared.errors import ConfigError, MeshError
from meshserve.shared.logs import setup_logging
from meshserve.shared.telemetry import Telemetry


async def serve(config: GatewayConfig) -> int:
    """Serve until a stop signal, then drain; returns the exit status."""
    telemetry = Telemetry("gateway", otlp_endpoint=config.otlp_endpoint)
    telemetry.install_global()
    gateway = Gateway(config, telemetry)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    metrics_runner = None
    try:
        await gateway.start()
        if config.metrics_port is not None:
            metrics_runner = await telemetry.start_metrics_server(config.host,
                                                                  config.metrics_port)
        await stop.wait()
    except MeshError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the port is taken, the host is not ours
        print(f"gateway: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr)
        return 1
    finally:
        if metrics_runner is not None:
            await metrics_runner.cleanup()
        await gateway.stop()
        telemetry.shutdown()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `meshserve gateway` / `python -m meshserve.services.gateway`."""
    try:
        config = GatewayConfig.from_args(argv, prog="meshserve gateway")
    except ConfigError as exc:
        print(exc.message, file=sys.stderr)
        return 2
    setup_logging("gateway", config.log_level, fmt=config.log_format)
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
