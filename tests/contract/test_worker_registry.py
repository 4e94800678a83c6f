"""Contract tests of the worker registry (shared/worker_registry.py) against a real Redis."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable

import pytest
import redis.asyncio as aioredis

from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.kv_events import BlockStored
from meshserve.shared.kv_index import KVIndex
from meshserve.shared.worker_registry import LOAD_CHANNEL, WorkerLoad, WorkerRegistry


def info(worker_id: str, epoch: int = 0, models: tuple[str, ...] = ("tiny",)) -> dict:
    return {"worker_id": worker_id, "address": f"127.0.0.1:{9000 + len(worker_id)}",
            "model_names": list(models), "block_size": 4, "kv_namespace": "tiny:f16",
            "epoch": epoch}


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    """Poll an observable condition until it holds (bounded)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_register_assigns_growing_epochs_and_is_idempotent(redis_client: aioredis.Redis
                                                                 ) -> None:
    registry = WorkerRegistry(redis_client, ttl_s=10)
    assert await registry.register(info("w0"), {"num_running": 1}) == 1
    assert await registry.register(info("w0"), {}) == 2
    assert await registry.register(info("w0", epoch=2), {"num_running": 3}) == 2  # same epoch
    [record] = await registry.live_workers()
    assert (record.epoch, record.load.num_running, record.info.epoch) == (2, 3, 2)
    with pytest.raises(InvalidRequestError, match="older"):
        await registry.register(info("w0", epoch=1), {})
    # Epochs keep growing across deregistration, so KV events of old epochs stay stale.
    assert await registry.deregister("w0", 2)
    assert await registry.register(info("w0"), {}) == 3
    assert await registry.claim_epoch("w0") == 4
    assert await registry.register(info("w0", epoch=2**62), {}) == 2**62


async def test_heartbeat_needs_the_current_epoch(redis_client: aioredis.Redis) -> None:
    registry = WorkerRegistry(redis_client, ttl_s=10)
    epoch = await registry.register(info("w0"), {})
    assert await registry.heartbeat("w0", epoch, WorkerLoad(num_running=5, max_running=8))
    assert not await registry.heartbeat("w0", epoch + 1, {})
    assert not await registry.heartbeat("unknown", 1, {})
    [record] = await registry.live_workers("tiny")
    assert (record.load.num_running, record.load.max_running) == (5, 8)
    assert await registry.live_workers("other-model") == []


async def test_stale_deregistration_keeps_the_newer_worker(redis_client: aioredis.Redis) -> None:
    registry = WorkerRegistry(redis_client, ttl_s=10)
    old = await registry.register(info("w0"), {})
    new = await registry.register(info("w0"), {})
    assert not await registry.deregister("w0", old)
    assert [r.epoch for r in await registry.live_workers()] == [new]
    assert await registry.deregister("w0", new)
    assert await registry.live_workers() == []
    assert not await registry.deregister("w0", new)


async def test_dead_workers_drop_out_and_lose_their_blocks(redis_client: aioredis.Redis) -> None:
    registry = WorkerRegistry(redis_client, ttl_s=0.3)
    index = KVIndex(redis_client, "tiny:f16")
    block = hashlib.sha256(b"b0").digest()
    epochs = {w: await registry.register(info(w), {}) for w in ("w0", "w1")}
    for w, epoch in epochs.items():
        await index.apply_events(w, epoch, 1, [BlockStored((block,), None, (), 4)])

    async def only_w1_alive() -> bool:
        assert await registry.heartbeat("w1", epochs["w1"], {})  # w1 keeps beating
        return [r.worker_id for r in await registry.live_workers()] == ["w1"]

    await eventually(only_w1_alive)
    assert await redis_client.smembers("ms:workers") == {b"w1"}
    assert await redis_client.exists("ms:worker:w0") == 0
    assert await index.holders_of(block) == {"w1": epochs["w1"]}
    assert not await registry.heartbeat("w0", epochs["w0"], {})  # must register again


async def test_changes_are_published(redis_client: aioredis.Redis) -> None:
    registry = WorkerRegistry(redis_client, ttl_s=10)
    pubsub = redis_client.pubsub()
    await pubsub.subscribe(LOAD_CHANNEL)
    epoch = await registry.register(info("w0"), {})
    await registry.heartbeat("w0", epoch, {})
    await registry.deregister("w0", epoch)
    seen = []
    async with asyncio.timeout(5):
        async for message in pubsub.listen():
            if message["type"] == "message":
                seen.append(message["data"])
            if len(seen) == 3:
                break
    await pubsub.aclose()
    assert seen == [b"w0"] * 3


async def test_bad_info_names_the_field(redis_client: aioredis.Redis) -> None:
    registry = WorkerRegistry(redis_client, ttl_s=10)
    with pytest.raises(InvalidRequestError) as err:
        await registry.register({**info("w0"), "colour": "red"}, {})
    assert err.value.param == "colour"
    with pytest.raises(InvalidRequestError) as err:
        await registry.register({**info("w0"), "block_size": 0}, {})
    assert err.value.param == "block_size"
