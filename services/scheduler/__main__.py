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
from meshserve.shared.errors import ConfigError, MeshError
from meshserve.shared.logs import setup_logging
from meshserve.shared.redis_server import EmbeddedRedis
from meshserve.shared.telemetry import Telemetry

_log = logging.getLogger("meshserve.scheduler")


async def serve(config: SchedulerConfig, redis_url: str) -> int:
    """Serve until SIGTERM/SIGINT, then drain; returns the exit code."""
    telemetry = Telemetry("scheduler", otlp_endpoint=config.otlp_endpoint)
    telemetry.install_global()
    metrics = None
    try:
        if config.metrics_port is not None:
            metrics = await telemetry.start_metrics_server(config.host, config.metrics_port)
        service = await SchedulerService.start(config, redis_url, telemetry)
        service.server.install_signal_handlers()
        _log.info("scheduler serving", extra={"port": service.port})
        await service.server.wait_for_termination()
        await service.stop()
        return 0
    finally:
        if metrics is not None:
            await metrics.cleanup()
        telemetry.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `meshserve scheduler`; returns the process exit code."""
    try:
        config = SchedulerConfig.from_args(argv, prog="meshserve scheduler")
    except ConfigError as exc:
        print(f"meshserve scheduler: {exc}", file=sys.stderr)
        return 2
    setup_logging("scheduler", config.log_level, fmt=config.log_format)
    embedded: EmbeddedRedis | None = None
    try:
        redis_url = config.redis_url
        if not redis_url:
            embedded = EmbeddedRedis().start()
            redis_url = embedded.url
            _log.info("started embedded Redis", extra={"redis_url": redis_url})
        return asyncio.run(serve(config, redis_url))
    except MeshError as exc:
        _log.error("scheduler failed: %s", exc, extra={"error_kind": exc.kind})
        return 1
    finally:
        if embedded is not None:
            embedded.stop()


if __name__ == "__main__":
    sys.exit(main())
