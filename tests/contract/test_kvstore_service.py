"""Contract tests of the KVStore service: a real grpc.aio server on 127.0.0.1, real Redis."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
import redis.asyncio as aioredis

from meshserve.proto.v1 import kvstore_pb2, kvstore_pb2_grpc
from meshserve.services.kvstore.config import KVStoreConfig
from meshserve.services.kvstore.service import KVStoreService
from meshserve.shared.grpc_client import GrpcClient
from meshserve.shared.kv_index import KVIndex

NS = "tiny:bfloat16"
HOLDER = "kvstore:s0"
SHAPE = (2, 2, 4, 2, 8)  # [layers, K/V, block_size, kv_heads, head_dim]
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 2  # bfloat16: 512 bytes


def h(i: int) -> bytes:
    return hashlib.sha256(f"kv-{i}".encode()).digest()


def kv_block(i: int) -> kvstore_pb2.KVBlock:
    """Block i of one chain, with random contents."""
    return kvstore_pb2.KVBlock(block_hash=h(i), parent_hash=h(i - 1) if i else b"",
                               data=os.urandom(BLOCK_BYTES), dtype=kvstore_pb2.KV_DTYPE_BFLOAT16,
                               shape=SHAPE)


Started = tuple[KVStoreService, kvstore_pb2_grpc.KVStoreStub]


@pytest.fixture
async def start_store(redis_url: str) -> AsyncIterator[Callable[..., Awaitable[Started]]]:
    """Starts kvstores publishing to the test's Redis; stops them afterwards."""
    running: list[tuple[KVStoreService, grpc.aio.Channel]] = []

    async def start(**overrides: Any) -> Started:
        config = KVStoreConfig(**{"port": 0, "redis_url": redis_url, "store_id": "s0",
                                  "capacity_bytes": 64 * BLOCK_BYTES, "drain_grace_s": 0,
                                  **overrides})
        service = await KVStoreService.start(config)
        channel = GrpcClient().channel(f"127.0.0.1:{service.port}")
        running.append((service, channel))
        return service, kvstore_pb2_grpc.KVStoreStub(channel)

    yield start
    for service, channel in running:
        await channel.close()
        await service.stop(grace_s=0)


async def put(stub: kvstore_pb2_grpc.KVStoreStub, *messages: list[kvstore_pb2.KVBlock],
              namespace: str = NS) -> kvstore_pb2.PutResponse:
    async def requests() -> AsyncIterator[kvstore_pb2.PutRequest]:
        for blocks in messages:
            yield kvstore_pb2.PutRequest(kv_namespace=namespace, blocks=blocks)
    return await stub.Put(requests())


async def get(stub: kvstore_pb2_grpc.KVStoreStub, hashes: list[bytes], prefix_only: bool = False
              ) -> list[kvstore_pb2.GetResponse]:
    request = kvstore_pb2.GetRequest(kv_namespace=NS, block_hashes=hashes,
                                     prefix_only=prefix_only)
    return [message async for message in stub.Get(request)]


async def test_put_get_round_trip_batches_messages(
        start_store: Callable[..., Awaitable[Started]]) -> None:
    _, stub = await start_store(get_message_bytes=3 * BLOCK_BYTES)
    blocks = [kv_block(i) for i in range(8)]
    result = await put(stub, blocks[:5], blocks[5:])
    assert (result.num_stored, result.num_present, result.num_rejected) == (8, 0, 0)
    again = await put(stub, blocks[:2])
    assert (again.num_stored, again.num_present) == (0, 2)

    messages = await get(stub, [b.block_hash for b in blocks])
    assert [len(m.blocks) for m in messages] == [3, 3, 2]  # up to 3 blocks' bytes each
    got = [b for m in messages for b in m.blocks]
    assert got == blocks  # bytes, hashes, parents, dtype and shape all survive


async def test_eviction_under_the_byte_cap_shows_in_stats_and_redis(
        start_store: Callable[..., Awaitable[Started]], redis_client: aioredis.Redis) -> None:
    _, stub = await start_store(capacity_bytes=4 * BLOCK_BYTES)
    await put(stub, [kv_block(i) for i in range(6)])  # a chain, head first
    stats = await stub.Stats(kvstore_pb2.StatsRequest())
    assert (stats.num_blocks, stats.used_bytes, stats.capacity_bytes) == (
        4, 4 * BLOCK_BYTES, 4 * BLOCK_BYTES)
    assert (stats.stored, stats.evictions) == (6, 2)

    index = KVIndex(redis_client, NS)
    epoch = await index.epoch_of(HOLDER)
    assert epoch is not None
    assert await index.blocks_of(HOLDER) == {h(i) for i in range(4)}  # the tail went first
    assert await index.holders_of(h(0)) == {HOLDER: epoch}
    assert await index.holders_of(h(5)) == {}
    assert await index.match_prefix([h(i) for i in range(6)]) == {HOLDER: 4}

    await put(stub, [kv_block(10)])  # evicts the least recent: block 3
    assert await index.blocks_of(HOLDER) == {h(0), h(1), h(2), h(10)}
    assert (await stub.Stats(kvstore_pb2.StatsRequest())).evictions == 3


async def test_get_returns_only_held_blocks_in_request_order(
        start_store: Callable[..., Awaitable[Started]]) -> None:
    _, stub = await start_store()
    blocks = {i: kv_block(i) for i in range(4)}
    await put(stub, list(blocks.values()))
    wanted = [h(2), h(99), h(0), h(3)]
    got = [b.block_hash for m in await get(stub, wanted) for b in m.blocks]
    assert got == [h(2), h(0), h(3)]
    prefix = [b.block_hash for m in await get(stub, wanted, prefix_only=True) for b in m.blocks]
    assert prefix == [h(2)]
    assert await get(stub, [h(98), h(99)]) == []  # nothing held: an empty stream
    stats = await stub.Stats(kvstore_pb2.StatsRequest())
    assert (stats.hits, stats.misses) == (4, 4)

    contains = await stub.Contains(kvstore_pb2.ContainsRequest(kv_namespace=NS,
                                                               block_hashes=[h(0), h(1), h(7),
                                                                             h(3)]))
    assert (list(contains.present), contains.num_prefix_present) == ([True, True, False, True],
                                                                      2)
    other = await stub.Contains(kvstore_pb2.ContainsRequest(kv_namespace="other",
                                                            block_hashes=[h(0)]))
    assert list(other.present) == [False]


async def test_bad_blocks_are_invalid_arguments(
        start_store: Callable[..., Awaitable[Started]]) -> None:
    _, stub = await start_store()
    no_dtype = kvstore_pb2.KVBlock(block_hash=h(0), data=bytes(4), shape=[2])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await put(stub, [no_dtype])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    wrong_shape = kv_block(0)
    wrong_shape.shape[:] = [3]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await put(stub, [wrong_shape])
    assert dict(err.value.trailing_metadata())["meshserve-error-param"] == "shape"


async def test_restarted_store_clears_its_old_holdings(
        start_store: Callable[..., Awaitable[Started]], redis_client: aioredis.Redis) -> None:
    first, stub = await start_store()
    await put(stub, [kv_block(0), kv_block(1)])
    index = KVIndex(redis_client, NS)
    old_epoch = await index.epoch_of(HOLDER)
    assert await index.blocks_of(HOLDER) == {h(0), h(1)}
    await first.stop(grace_s=0)

    _, stub = await start_store()  # same store id, empty memory
    assert await index.blocks_of(HOLDER) == set()
    await put(stub, [kv_block(2)])
    assert await index.holders_of(h(2)) == {HOLDER: old_epoch + 1}
    assert await index.holders_of(h(0)) == {}
