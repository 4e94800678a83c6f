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
from meshserve.services.encoder.model import load_served_vision
from meshserve.services.encoder.service import SERVICE_NAME, EncoderServicer
from meshserve.shared.errors import MeshError
from meshserve.shared.grpc_server import GrpcServer
from meshserve.shared.rows_files import RowsFiles
from meshserve.shared.service_main import in_daemon_thread, run_service, service_telemetry

_log = logging.getLogger("meshserve.services.encoder")


async def _expire_files(files: RowsFiles) -> None:
    """Delete unread answer files on a timer (a caller that went away never reads them)."""
    while True:
        await asyncio.sleep(files.ttl_s / 2)  # a timer, not a wait for some event
        files.expire()


async def _load_and_serve(config: EncoderConfig, server: GrpcServer,
                          servicer: EncoderServicer) -> int:
    """Load the vision half, go SERVING, and wait for a stop; 0 when drained, 1 if the
    load failed."""
    loading = asyncio.ensure_future(
        in_daemon_thread(lambda: load_served_vision(config), "encoder-load"))
    stopping = asyncio.ensure_future(server.wait_for_termination())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not loading.done():
        loading.cancel()
        _log.info("stopped while loading the vision model")
        return 0
    try:
        vision = loading.result()
    except MeshError as exc:
        _log.error("cannot load the vision model: %s", exc.message,
                   extra={"error_kind": exc.kind, "error_param": exc.param})
        server.request_stop()
        await stopping
        return 1
    servicer.set_vision(vision)
    await server.set_serving()
    _log.info("encoder serving", extra={"model": vision.name, "port": server.port,
                                        "device": str(vision.encoder.device)})
    await stopping
    return 0


async def serve(config: EncoderConfig) -> int:
    """Run the service until it is stopped and drained; the process exit code."""
    async with service_telemetry("encoder", config) as telemetry:
        files = RowsFiles(Path(config.shm_dir), config.shm_ttl_s)
        servicer = EncoderServicer(files, config.max_images_per_call, telemetry=telemetry)
        server = GrpcServer(config.listen_address, service_names=[SERVICE_NAME],
                            telemetry=telemetry, grace_s=config.drain_grace_s,
                            reuse_port=config.reuse_port)
        encoder_pb2_grpc.add_EncoderServicer_to_server(servicer, server.server)
        await server.start()
        server.install_signal_handlers()
        expiry = asyncio.ensure_future(_expire_files(files))
        try:
            return await _load_and_serve(config, server, servicer)
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
