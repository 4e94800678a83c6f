"""The KVStore gRPC servicer (thin: protobuf <-> domain at the edge) and its assembly."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import grpc
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from meshserve.proto.v1 import kvstore_pb2, kvstore_pb2_grpc
from meshserve.services.kvstore import wire
from meshserve.services.kvstore.arena import SharedArena
from meshserve.services.kvstore.blocks import PutOutcome
from meshserve.services.kvstore.config import KVStoreConfig
from meshserve.services.kvstore.publisher import HoldingsPublisher
from meshserve.services.kvstore.store import KVBlockStore
from meshserve.shared.errors import NotFoundError
from meshserve.shared.grpc_server import GrpcServer
from meshserve.shared.kv_region import TOKEN_BYTES
from meshserve.shared.redis_server import connect, wait_for_redis
from meshserve.shared.telemetry import Telemetry

SERVICE_NAME = "meshserve.v1.KVStore"

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreRun:
    """What Attach tells a client about this run of the store, apart from its id."""

    token: bytes  # random per run: names this run (and its region) to clients
    lease_s: float
    arena: SharedArena | None


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    """meshserve.v1.KVStore over a KVBlockStore, publishing holdings after every change."""

    def __init__(self, store: KVBlockStore, run: StoreRun, get_message_bytes: int) -> None:
        self._store = store
        self._run = run
        self._get_message_bytes = get_message_bytes
        # Both known once the server has bound its port (the id may be hostname-port).
        self.store_id = ""
        self.publisher: HoldingsPublisher | None = None

    async def Put(self, request_iterator: AsyncIterator[kvstore_pb2.PutRequest],
                  context: grpc.aio.ServicerContext) -> kvstore_pb2.PutResponse:
        counts: Counter[PutOutcome] = Counter()
        try:
            async for request in request_iterator:
                blocks = [wire.block_from_proto(b) for b in request.blocks]
                counts.update(self._store.put_many(request.kv_namespace, blocks))
        finally:  # what was stored before a bad message is published all the same
            await self._publish()
        return kvstore_pb2.PutResponse(num_stored=counts[PutOutcome.STORED],
                                       num_present=counts[PutOutcome.PRESENT],
                                       num_rejected=counts[PutOutcome.REJECTED])

    async def Get(self, request: kvstore_pb2.GetRequest,
                  context: grpc.aio.ServicerContext) -> AsyncIterator[kvstore_pb2.GetResponse]:
        # Pinned while streaming: the slots read last must not be reused meanwhile.
        acquired = self._store.acquire(request.kv_namespace, list(request.block_hashes),
                                       request.prefix_only)
        try:
            for batch in wire.batches(acquired.blocks, self._get_message_bytes):
                blocks = self._store.read(acquired.lease_id, batch)
                yield kvstore_pb2.GetResponse(blocks=[wire.block_to_proto(b) for b in blocks])
        finally:
            self._store.release(acquired.lease_id)

    async def Contains(self, request: kvstore_pb2.ContainsRequest,
                       context: grpc.aio.ServicerContext) -> kvstore_pb2.ContainsResponse:
        present = [self._store.contains(request.kv_namespace, h) for h in request.block_hashes]
        prefix = next((i for i, held in enumerate(present) if not held), len(present))
        return kvstore_pb2.ContainsResponse(present=present, num_prefix_present=prefix)

    async def Stats(self, request: kvstore_pb2.StatsRequest,
                    context: grpc.aio.ServicerContext) -> kvstore_pb2.StatsResponse:
        s = self._store.stats()
        return kvstore_pb2.StatsResponse(
            num_blocks=s.num_blocks, used_bytes=s.used_bytes, capacity_bytes=s.capacity_bytes,
            hits=s.hits, misses=s.misses, evictions=s.evictions, stored=s.stored,
            slot_bytes=s.slot_bytes, leases=s.leases, reservations=s.reservations,
            pinned_blocks=s.pinned_blocks, expired=s.expired)

    async def Attach(self, request: kvstore_pb2.AttachRequest,
                     context: grpc.aio.ServicerContext) -> kvstore_pb2.AttachResponse:
        arena = self._run.arena
        return kvstore_pb2.AttachResponse(
            shm_path=arena.path if arena else "", region_bytes=arena.size if arena else 0,
            region_token=self._run.token, slot_bytes=self._store.slot_bytes, pid=os.getpid(),
            host=socket.gethostname(), store_id=self.store_id, lease_s=self._run.lease_s)

    async def Reserve(self, request: kvstore_pb2.ReserveRequest,
                      context: grpc.aio.ServicerContext) -> kvstore_pb2.ReserveResponse:
        self._check_token(request.region_token)
        metas = wire.metas_from_reserve(request)
        try:
            reserved = self._store.reserve(request.kv_namespace, metas)
        finally:  # making room may have evicted blocks
            await self._publish()
        return wire.reserve_to_proto(reserved, metas[0].nbytes if metas else 0)

    async def Commit(self, request: kvstore_pb2.CommitRequest,
                     context: grpc.aio.ServicerContext) -> kvstore_pb2.CommitResponse:
        self._check_token(request.region_token)
        outcomes = self._store.commit(request.reservation_id)
        await self._publish()
        return wire.commit_to_proto(outcomes)

    async def Abandon(self, request: kvstore_pb2.AbandonRequest,
                      context: grpc.aio.ServicerContext) -> kvstore_pb2.AbandonResponse:
        self._check_token(request.region_token)
        return kvstore_pb2.AbandonResponse(
            abandoned=self._store.abandon(request.reservation_id))

    async def Acquire(self, request: kvstore_pb2.AcquireRequest,
                      context: grpc.aio.ServicerContext) -> kvstore_pb2.AcquireResponse:
        self._check_token(request.region_token)
        acquired = self._store.acquire(request.kv_namespace, list(request.block_hashes),
                                       request.prefix_only)
        return kvstore_pb2.AcquireResponse(
            lease_id=acquired.lease_id,
            blocks=[wire.acquired_to_proto(block) for block in acquired.blocks])

    async def Release(self, request: kvstore_pb2.ReleaseLeaseRequest,
                      context: grpc.aio.ServicerContext) -> kvstore_pb2.ReleaseLeaseResponse:
        self._check_token(request.region_token)
        return kvstore_pb2.ReleaseLeaseResponse(released=self._store.release(request.lease_id))

    def _check_token(self, token: bytes) -> None:
        """Refuse offsets and ids meant for another run of the store (or another store)."""
        if token and token != self._run.token:
            raise NotFoundError("region token is not this store's (it restarted): attach "
                                "again", param="region_token")

    async def _publish(self) -> None:
        if self.publisher is not None:
            await self.publisher.publish()


def _shared_arena(config: KVStoreConfig) -> SharedArena | None:
    """The shared region, unless it is off or cannot be made here (then: the byte path)."""
    if config.shm == "off":
        return None
    try:
        return SharedArena(config.capacity_bytes)
    except OSError as exc:
        _log.warning("kvstore runs without a shared region (Put/Get only): %s", exc)
        return None


class StoreCollector(Collector):
    """Prometheus view of the store's counters, read at scrape time."""

    def __init__(self, store: KVBlockStore) -> None:
        self._store = store

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._store.stats()
        yield GaugeMetricFamily("meshserve:kvstore_blocks", "Blocks held", value=s.num_blocks)
        yield GaugeMetricFamily("meshserve:kvstore_used_bytes", "Bytes of block data held",
                                value=s.used_bytes)
        yield GaugeMetricFamily("meshserve:kvstore_capacity_bytes", "Bytes the store may hold",
                                value=s.capacity_bytes)
        yield GaugeMetricFamily("meshserve:kvstore_leases", "Leases held by readers",
                                value=s.leases)
        yield GaugeMetricFamily("meshserve:kvstore_reservations",
                                "Reservations open for writers", value=s.reservations)
        for name, value in (("hits", s.hits), ("misses", s.misses),
                            ("evictions", s.evictions), ("stored", s.stored),
                            ("expired", s.expired)):
            yield CounterMetricFamily(f"meshserve:kvstore_{name}", f"Blocks {name} since start",
                                      value=value)


@dataclass
class KVStoreService:
    """A started kvstore: gRPC server (SERVING), its store, region and index publisher."""

    server: GrpcServer
    store: KVBlockStore
    publisher: HoldingsPublisher | None
    redis: aioredis.Redis | None
    port: int
    arena: SharedArena | None = None

    @classmethod
    async def start(cls, config: KVStoreConfig, telemetry: Telemetry | None = None,
                    registry: CollectorRegistry | None = None,
                    clock: Callable[[], float] = time.monotonic) -> KVStoreService:
        """Listen; with a Redis URL, wait for it and clear a previous run's holdings; SERVING.

        `clock` times leases (tests pass their own)."""
        arena = _shared_arena(config)
        store = KVBlockStore(config.capacity_bytes, arena.buffer if arena else None,
                             arena.base if arena else 0, lease_s=config.lease_s, clock=clock)
        metrics_registry = registry or (telemetry.registry if telemetry is not None else None)
        if metrics_registry is not None:
            metrics_registry.register(StoreCollector(store))
        server = GrpcServer(config.listen_address, service_names=[SERVICE_NAME],
                            telemetry=telemetry, grace_s=config.drain_grace_s,
                            reuse_port=config.reuse_port)
        run = StoreRun(arena.token if arena else os.urandom(TOKEN_BYTES), config.lease_s, arena)
        servicer = KVStoreServicer(store, run, config.get_message_bytes)
        kvstore_pb2_grpc.add_KVStoreServicer_to_server(servicer, server.server)
        redis_client = connect(config.redis_url) if config.redis_url else None
        try:
            port = await server.start()
            servicer.store_id = config.resolved_store_id(port)
            if redis_client is not None:
                await wait_for_redis(redis_client, config.redis_wait_s)
                servicer.publisher = HoldingsPublisher(redis_client, servicer.store_id, store)
                await servicer.publisher.reset()
        except BaseException:
            await server.drain(grace_s=0)
            if redis_client is not None:
                await redis_client.aclose()
            if arena is not None:
                arena.close()
            raise
        await server.set_serving()
        return cls(server, store, servicer.publisher, redis_client, port, arena)

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain the server (unless already drained), then close Redis and the region."""
        if not self.server.drain_started.is_set():
            await self.server.drain(grace_s)
        if self.redis is not None:
            await self.redis.aclose()
        if self.arena is not None:
            self.arena.close()
            self.arena = None

