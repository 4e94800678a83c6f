"""The block index after Redis loses everything: a worker's KV event publisher restores it.

A real Redis server process is stopped and started empty on the same port while the
publisher keeps writing; its next write finds the index has forgotten the worker and
restores every block the worker's events say it holds.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from meshserve.services.worker.serving.engine_thread import KVEventBatch
from meshserve.services.worker.serving.kv_publisher import KVEventPublisher
from meshserve.shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from meshserve.shared.kv_index import Applied, KVIndex
from meshserve.shared.redis_server import EmbeddedRedis, connect

NS = "recovery-ns"
HASHES = [bytes([i]) * 32 for i in range(1, 6)]


@pytest.fixture
async def redis() -> AsyncIterator[EmbeddedRedis]:
    server = EmbeddedRedis().start()
    yield server
    server.stop()


def stored(*hashes: bytes) -> BlockStored:
    return BlockStored(tuple(hashes), None, (), 16)


async def test_a_publisher_restores_its_blocks_after_redis_comes_back_empty(
        redis: EmbeddedRedis) -> None:
    client = connect(redis.url, timeout_s=1.0)
    index = KVIndex(client, NS)
    assert await index.apply_events("w0", 1, 0, [AllBlocksCleared()]) == Applied.APPLIED_UNKNOWN
    publisher = KVEventPublisher(index, "w0", retry_initial_s=0.01, retry_max_s=0.1)
    publisher.start()
    try:
        publisher.put(KVEventBatch(1, 1, (stored(*HASHES[:3]),)))
        assert await publisher.flush(10)
        assert await index.blocks_of("w0") == set(HASHES[:3])
        redis.restart()  # a new, empty server on the same port
        assert await index.blocks_of("w0") == set()
        # Events while and after Redis was away: the index ends with what the worker holds.
        publisher.put(KVEventBatch(1, 2, (stored(HASHES[3]), BlockRemoved((HASHES[0],)))))
        assert await publisher.flush(20)
        assert await index.blocks_of("w0") == set(HASHES[1:4])
        assert publisher.num_restores == 1
        assert await index.match_prefix([HASHES[1], HASHES[2]]) == {"w0": 2}
        publisher.put(KVEventBatch(1, 3, (stored(HASHES[4]),)))  # and goes on as before
        assert await publisher.flush(10)
        assert await index.blocks_of("w0") == set(HASHES[1:])
        assert publisher.num_restores == 1
    finally:
        await publisher.stop()
        await client.aclose()
