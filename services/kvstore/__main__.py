"""`python -m meshserve.services.kvstore`: run the KV block store on its own."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from meshserve.services.kvstore.config import KVStoreConfig
from meshserve.services.kvstore.service import KVStoreService
from meshserve.shared.errors import ConfigError, MeshError
from meshserve.shared.logs import setup_logging
from meshserve.shared.telemetry import Telemetry

_log = logging.getLogger("meshserve.kvstore")


async def serve(config: KVStoreConfig) -> int:
    """Serve until SIGTERM/SIGINT, then drain; returns the exit code."""
    telemetry = Telemetry("kvstore", otlp_endpoint=config.otlp_endpoint)
    telemetry.install_global()
    metrics = None
    try:
        if config.metrics_port is not None:
            metrics = await telemetry.start_metrics_server(config.host, config.metrics_port)
        service = await KVStoreService.start(config, telemetry)
        service.server.install_signal_handlers()
        _log.info("kvstore serving", extra={"port": service.port,
                                            "capacity_bytes": config.capacity_bytes})
        await service.server.wait_for_termination()
        await service.stop()
        return 0
    finally:
        if metrics is not None:
            await metrics.cleanup()
        telemetry.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `meshserve kvstore`; returns the process exit code."""
    try:
        config = KVStoreConfig.from_args(argv, prog="meshserve kvstore")
    except ConfigError as exc:
        print(f"meshserve kvstore: {exc}", file=sys.stderr)
        return 2
    setup_logging("kvstore", config.log_level, fmt=config.log_format)
    try:
        return asyncio.run(serve(config))
    except MeshError as exc:
        _log.error("kvstore failed: %s", exc, extra={"error_kind": exc.kind})
        return 1


if __name__ == "__main__":
    sys.exit(main())
