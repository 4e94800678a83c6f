"""A pooling worker (`--runner pooling`): the model as an embedder, served over Embed.

Order of life, as a generating worker's (see __main__.py) without what only generation
needs (KV cache, KV events, kvstore): load the model (in a thread) -> listen (health
NOT_SERVING) -> claim an epoch -> start the embedding thread -> embed one input
(warm-up) -> SERVING -> register with the scheduler as a pooling worker and heartbeat.
On SIGTERM: NOT_SERVING, deregister, let in-flight calls finish within the grace, stop
the thread. A device error in the thread is fatal: NOT_SERVING, exit 1.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

import redis.asyncio as aioredis
import torch

from meshserve.proto.v1 import worker_pb2_grpc
from meshserve.services.worker.config import WorkerConfig
from meshserve.services.worker.pooling.batcher import EmbedBatcher
from meshserve.services.worker.pooling.embedder import Embedder
from meshserve.services.worker.pooling.service import PoolingServicer
from meshserve.services.worker.serving.lifecycle import ProcessLifecycle, run_process
from meshserve.shared.grpc_server import GrpcServer
from meshserve.shared.redis_server import connect
from meshserve.shared.telemetry import Telemetry
from meshserve.shared.worker_registry import RUNNER_POOLING, WorkerInfo

SERVICE_NAME = "meshserve.v1.Worker"
# (redis or None, worker id, redis url) -> a fresh epoch for the worker id.
ClaimEpoch = Callable[[aioredis.Redis | None, str, str], Awaitable[int]]
_log = logging.getLogger("meshserve.services.worker")


def build_embedder(config: WorkerConfig) -> Embedder:
    """Load the model as an embedder (blocking)."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    started = time.monotonic()
    embedder = Embedder(config, config.pooler_config)
    _log.info("embedder built", extra={
        "model": embedder.source.name, "dtype": str(embedder.dtype),
        "device": str(embedder.device), "max_model_len": embedder.max_model_len,
        "pooling_type": embedder.pooler.pooling_type, "normalize": embedder.pooler.normalize,
        "pooler_source": embedder.pooler.source,
        "max_batch_tokens": embedder.max_batch_tokens,
        "seconds": round(time.monotonic() - started, 2)})
    return embedder


class PoolingWorkerProcess:
    """The pieces of one running pooling worker, wired together (module doc)."""

    # Declared here: `life` reads them through callbacks made before they are set.
    batcher: EmbedBatcher
    info: WorkerInfo

    def __init__(self, config: WorkerConfig, embedder: Embedder, telemetry: Telemetry,
                 claim_epoch: ClaimEpoch) -> None:
        """`claim_epoch`: the generating worker's own rule for a fresh epoch."""
        self.config = config
        self._claim_epoch = claim_epoch
        self.server = GrpcServer(config.listen_address, service_names=[SERVICE_NAME],
                                 telemetry=telemetry, grace_s=config.drain_grace_s,
                                 reuse_port=config.reuse_port)
        # Failure, drain and scheduler membership: shared with the generating worker.
        self.life = ProcessLifecycle(config, self.server, lambda: self.batcher.load,
                                     lambda: self.info)
        self.batcher = EmbedBatcher(embedder, on_fatal=self.life.on_fatal)
        names = config.model_names(embedder.source.name)
        self.info = WorkerInfo(  # address and epoch are set once the port is bound
            worker_id="pending", address="pending", model_names=tuple(names),
            max_model_len=embedder.max_model_len, runner=RUNNER_POOLING,
            embedding_size=embedder.hidden_size, class_labels=embedder.class_labels,
            kv_namespace=f"{names[0]}@pooling")
        self.servicer = PoolingServicer(self.batcher, self.info, registry=telemetry.registry,
                                        draining=lambda: self.life.draining)
        worker_pb2_grpc.add_WorkerServicer_to_server(self.servicer, self.server.server)

    async def start(self) -> None:
        """Listen, take an identity and an epoch, start the thread, warm up, go SERVING."""
        port = await self.server.start()
        self.server.install_signal_handlers()
        worker_id = self.config.resolved_worker_id(port)
        redis = connect(self.config.redis_url, client_name="worker") \
            if self.config.redis_url else None
        try:
            epoch = await self._claim_epoch(redis, worker_id, self.config.redis_url or "")
        finally:
            if redis is not None:
                await redis.aclose()
        self.info = replace(self.info, worker_id=worker_id, epoch=epoch,
                            address=self.config.resolved_advertise_address(port))
        self.servicer.info = self.info
        self.batcher.start()
        started = time.monotonic()
        await self.batcher.submit([[0]], dimensions=self.batcher.embedder.hidden_size,
                                  normalize=True)
        _log.info("embedder warm", extra={"seconds": round(time.monotonic() - started, 3)})
        await self.server.set_serving()
        _log.info("pooling worker serving", extra={"worker_id": worker_id, "epoch": epoch,
                                                   "address": self.info.address, "port": port})
        self.life.register()

    async def run_until_stopped(self) -> None:
        """Serve until SIGTERM (or a fatal error), deregistering as the drain starts."""
        await self.life.run_until_stopped()

    async def close(self) -> None:
        """Stop the embedding thread and close the scheduler channel."""
        if self.batcher.started:
            self.batcher.stop()
            try:
                async with asyncio.timeout(10):
                    await self.batcher.wait_stopped()
            except TimeoutError:
                _log.warning("embedding thread did not stop within 10s")
        await self.life.close()


async def serve_pooling(config: WorkerConfig, claim_epoch: ClaimEpoch) -> int:
    """Run a pooling worker until stopped and drained; the process exit code."""
    return await run_process(
        config, lambda: build_embedder(config),
        lambda embedder, telemetry: PoolingWorkerProcess(config, embedder, telemetry,
                                                         claim_epoch),
        "pooling worker stopped after a failure: %r")
