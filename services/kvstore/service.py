"""The KVStore gRPC servicer (thin: protobuf <-> domain at the edge) and its assembly."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from types import MappingProxyType

import grpc
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from meshserve.proto.v1 import kvstore_pb2, kvstore_pb2_grpc
from meshserve.services.kvstore.config import KVStoreConfig
from meshserve.services.kvstore.publisher import HoldingsPublisher
from meshserve.services.kvstore.store import KVBlock, KVBlockStore, PutOutcome
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.grpc_server import GrpcServer
from meshserve.shared.redis_server import connect, wait_for_redis
from meshserve.shared.telemetry import Telemetry

SERVICE_NAME = "meshserve.v1.KVStore"

DTYPE_BY_ENUM = MappingProxyType({
    kvstore_pb2.KV_DTYPE_FLOAT16: "float16",
    kvstore_pb2.KV_DTYPE_BFLOAT16: "bfloat16",
    kvstore_pb2.KV_DTYPE_FLOAT32: "float32",
    kvstore_pb2.KV_DTYPE_FLOAT8_E4M3FN: "float8_e4m3fn",
    kvstore_pb2.KV_DTYPE_FLOAT8_E5M2: "float8_e5m2",
})
ENUM_BY_DTYPE = MappingProxyType({name: value for value, name in DTYPE_BY_ENUM.items()})


def block_from_proto(msg: kvstore_pb2.KVBlock) -> KVBlock:
    dtype = DTYPE_BY_ENUM.get(msg.dtype)
    if dtype is None:
        raise InvalidRequestError(f"block {msg.block_hash.hex()[:16]}: dtype must be set "
                                  f"(got {msg.dtype})", param="dtype")
    return KVBlock(block_hash=msg.block_hash, data=msg.data, dtype=dtype,
                   shape=tuple(msg.shape), parent_hash=msg.parent_hash)


def block_to_proto(block: KVBlock) -> kvstore_pb2.KVBlock:
    return kvstore_pb2.KVBlock(block_hash=block.block_hash, parent_hash=block.parent_hash,
                               data=block.data, dtype=ENUM_BY_DTYPE[block.dtype],
                               shape=block.shape)


def batches(blocks: list[KVBlock], max_bytes: int) -> Iterator[list[KVBlock]]:
    """Consecutive runs of blocks of at most `max_bytes` of data (a larger block alone)."""
    batch: list[KVBlock] = []
    size = 0
    for block in blocks:
        if batch and size + block.nbytes > max_bytes:
            yield batch
            batch, size = [], 0
        batch.append(block)
        size += block.nbytes
    if batch:
        yield batch


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    """meshserve.v1.KVStore over a KVBlockStore, publishing holdings after every Put."""

    def __init__(self, store: KVBlockStore, publisher: HoldingsPublisher | None,
                 get_message_bytes: int) -> None:
        self._store = store
        self.publisher = publisher
        self._get_message_bytes = get_message_bytes

    async def Put(self, request_iterator: AsyncIterator[kvstore_pb2.PutRequest],
                  context: grpc.aio.ServicerContext) -> kvstore_pb2.PutResponse:
        counts: Counter[PutOutcome] = Counter()
        try:
            async for request in request_iterator:
                blocks = [block_from_proto(b) for b in request.blocks]
                counts.update(self._store.put_many(request.kv_namespace, blocks))
        finally:  # what was stored before a bad message is published all the same
            if self.publisher is not None:
                await self.publisher.publish()
        return kvstore_pb2.PutResponse(num_stored=counts[PutOutcome.STORED],
                                       num_present=counts[PutOutcome.PRESENT],
                                       num_rejected=counts[PutOutcome.REJECTED])

    async def Get(self, request: kvstore_pb2.GetRequest,
                  context: grpc.aio.ServicerContext) -> AsyncIterator[kvstore_pb2.GetResponse]:
        blocks = self._store.get_many(request.kv_namespace, list(request.block_hashes),
                                      request.prefix_only)
        for batch in batches(blocks, self._get_message_bytes):
            yield kvstore_pb2.GetResponse(blocks=[block_to_proto(b) for b in batch])

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
            hits=s.hits, misses=s.misses, evictions=s.evictions, stored=s.stored)


class StoreCollector(Collector):
    """Prometheus view of the store's counters, read at scrape time."""

    def __init__(self, store: KVBlockStore) -> None:
        self._store = store

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._store.stats()
        yield GaugeMetricFamily("meshserve_kvstore_blocks", "Blocks held", value=s.num_blocks)
        yield GaugeMetricFamily("meshserve_kvstore_used_bytes", "Bytes of block data held",
                                value=s.used_bytes)
        yield GaugeMetricFamily("meshserve_kvstore_capacity_bytes", "Bytes the store may hold",
                                value=s.capacity_bytes)
        for name, value in (("hits", s.hits), ("misses", s.misses),
                            ("evictions", s.evictions), ("stored", s.stored)):
            yield CounterMetricFamily(f"meshserve_kvstore_{name}", f"Blocks {name} since start",
                                      value=value)


@dataclass
class KVStoreService:
    """A started kvstore: gRPC server (SERVING), its store, and the index publisher."""

    server: GrpcServer
    store: KVBlockStore
    publisher: HoldingsPublisher | None
    redis: aioredis.Redis | None
    port: int

    @classmethod
    async def start(cls, config: KVStoreConfig, telemetry: Telemetry | None = None,
                    registry: CollectorRegistry | None = None) -> KVStoreService:
        """Listen; with a Redis URL, wait for it and clear a previous run's holdings; SERVING."""
        store = KVBlockStore(config.capacity_bytes)
        metrics_registry = registry or (telemetry.registry if telemetry is not None else None)
        if metrics_registry is not None:
            metrics_registry.register(StoreCollector(store))
        server = GrpcServer(config.listen_address, service_names=[SERVICE_NAME],
                            telemetry=telemetry, grace_s=config.drain_grace_s)
        servicer = KVStoreServicer(store, None, config.get_message_bytes)
        kvstore_pb2_grpc.add_KVStoreServicer_to_server(servicer, server.server)
        redis_client = connect(config.redis_url) if config.redis_url else None
        try:
            port = await server.start()
            if redis_client is not None:  # the store's id may be its bound port
                await wait_for_redis(redis_client, config.redis_wait_s)
                servicer.publisher = HoldingsPublisher(
                    redis_client, config.resolved_store_id(port), store)
                await servicer.publisher.reset()
        except BaseException:
            await server.drain(grace_s=0)
            if redis_client is not None:
                await redis_client.aclose()
            raise
        await server.set_serving()
        return cls(server, store, servicer.publisher, redis_client, port)

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain the server (unless already drained), then close Redis."""
        if not self.server.drain_started.is_set():
            await self.server.drain(grace_s)
        if self.redis is not None:
            await self.redis.aclose()
