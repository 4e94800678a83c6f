"""`python -m meshserve.services.scheduler`: run the global scheduler on its own.

Without `--redis-url` it starts an embedded Redis for itself (a single-scheduler mesh);
replicas of the scheduler must share one Redis through `--redis-url`.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from meshserve.services.scheduler.config import SchedulerConfig
from meshserve.services.scheduler.service import SchedulerService
from meshserve.shared.redis_server import EmbeddedRedis
from meshserve.shared.service_main import run_service, service_telemetry

_log = logging.getLogger("meshserve.scheduler")


async def serve(config: SchedulerConfig) -> int:
    """Serve until SIGTERM/SIGINT, then drain; returns the exit code."""
    embedded: EmbeddedRedis | None = None
    redis_url = config.redis_url
    try:
        if not redis_url:
            started = await asyncio.to_thread(EmbeddedRedis().start)
            embedded, redis_url = started, started.url
            _log.info("started embedded Redis", extra={"redis_url": redis_url})
        async with service_telemetry("scheduler", config) as telemetry:
            service = await SchedulerService.start(config, redis_url, telemetry)
            service.server.install_signal_handlers()
            _log.info("scheduler serving", extra={"port": service.port})
            await service.server.wait_for_termination()
            await service.stop()
            return 0
    finally:
        if embedded is not None:
            embedded.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `meshserve scheduler`; returns the process exit code."""
    return run_service("scheduler", SchedulerConfig, serve, argv)


if __name__ == "__main__":
    sys.exit(main())
