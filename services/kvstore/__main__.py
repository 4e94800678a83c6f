"""`python -m meshserve.services.kvstore`: run the KV block store on its own."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from meshserve.services.kvstore.config import KVStoreConfig
from meshserve.services.kvstore.service import KVStoreService
from meshserve.shared.service_main import run_service, service_telemetry

_log = logging.getLogger("meshserve.kvstore")


async def serve(config: KVStoreConfig) -> int:
    """Serve until SIGTERM/SIGINT, then drain; returns the exit code."""
    async with service_telemetry("kvstore", config) as telemetry:
        service = await KVStoreService.start(config, telemetry)
        service.server.install_signal_handlers()
        _log.info("kvstore serving", extra={"port": service.port,
                                            "capacity_bytes": config.capacity_bytes})
        await service.server.wait_for_termination()
        await service.stop()
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `meshserve kvstore`; returns the process exit code."""
    return run_service("kvstore", KVStoreConfig, serve, argv)


if __name__ == "__main__":
    sys.exit(main())
