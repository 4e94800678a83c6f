"""Run the encoder service: `python -m meshserve.services.encoder --model DIR`.

The gRPC server starts first (health NOT_SERVING) while the vision half loads in a
background thread; it turns SERVING once loaded and drains on SIGTERM / SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from pathlib import Path

from meshserve.proto.v1 import encoder_pb2_grpc
from meshserve.services.encoder.config import EncoderConfig
from meshserve.services.encoder.model import ServedVision, load_served_vision
from meshserve.services.encoder.service import SERVICE_NAME, EncoderServicer
from meshserve.shared.grpc_server import GrpcServer
from meshserve.shared.rows_files import RowsFiles
from meshserve.shared.service_main import load_then_serve, run_service, service_telemetry

_log = logging.getLogger("meshserve.services.encoder")


async def _expire_files(files: RowsFiles) -> None:
    """Delete unread answer files on a timer (a caller that went away never reads them)."""
    while True:
        await asyncio.sleep(files.ttl_s / 2)  # a timer, not a wait for some event
        files.expire()


async def _go_serving(server: GrpcServer, servicer: EncoderServicer,
                      vision: ServedVision) -> None:
    servicer.set_vision(vision)
    await server.set_serving()
    _log.info("encoder serving", extra={"model": vision.name, "port": server.port,
                                        "device": str(vision.encoder.device)})


async def serve(config: EncoderConfig) -> int:
    """Run the service until it is stopped and drained; the process exit code."""
    async with service_telemetry("encoder", config) as telemetry:
        files = RowsFiles(Path(config.shm_dir), config.shm_ttl_s)
        servicer = EncoderServicer(files, config.max_images_per_call, telemetry=telemetry)
        server = GrpcServer(config.listen_address, service_names=[SERVICE_NAME],
                            telemetry=telemetry, grace_s=config.drain_grace_s,
                            reuse_port=config.reuse_port,
                            max_connection_age_s=config.max_connection_age_s)
        encoder_pb2_grpc.add_EncoderServicer_to_server(servicer, server.server)
        await server.start()
        server.install_signal_handlers()
        expiry = asyncio.ensure_future(_expire_files(files))
        try:
            return await load_then_serve(
                server, lambda: load_served_vision(config), "vision model",
                lambda vision: _go_serving(server, servicer, vision))
        finally:
            expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await expiry
            servicer.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point of `meshserve encoder` / `python -m meshserve.services.encoder`."""
    return run_service("encoder", EncoderConfig, serve, argv)


if __name__ == "__main__":
    sys.exit(main())
