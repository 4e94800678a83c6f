"""Contract tests of the Redis block index (shared/kv_index.py) against a real server."""

from __future__ import annotations

import asyncio
import hashlib

import redis.asyncio as aioredis

from meshserve.shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from meshserve.shared.kv_index import KVIndex
from meshserve.shared.redis_server import connect

NS = "tiny-llama:float16"


def h(i: int) -> bytes:
    """A distinct 32-byte block hash per integer."""
    return hashlib.sha256(f"block-{i}".encode()).digest()


def stored(*ids: int) -> BlockStored:
    hashes = tuple(h(i) for i in ids)
    return BlockStored(block_hashes=hashes, parent_hash=None, token_ids=(), block_size=16)


def removed(*ids: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=tuple(h(i) for i in ids))


async def test_events_are_applied_to_blocks_and_holder_set(redis_client: aioredis.Redis) -> None:
    index = KVIndex(redis_client, NS)
    assert await index.apply_events("w0", 3, 1, [stored(0, 1, 2)])
    assert await index.holders_of(h(1)) == {"w0": 3}
    assert await index.blocks_of("w0") == {h(0), h(1), h(2)}
    assert await redis_client.exists(f"ms:{NS}:blk:{h(0).hex()}") == 1

    assert await index.apply_events("w0", 3, 2, [removed(1), stored(7)])
    assert await index.holders_of(h(1)) == {}
    assert await redis_client.exists(f"ms:{NS}:blk:{h(1).hex()}") == 0  # empty hash is gone
    assert await index.blocks_of("w0") == {h(0), h(2), h(7)}

    # Events apply in order within a batch: cleared, then one block stored again.
    assert await index.apply_events("w0", 3, 3, [AllBlocksCleared(), stored(9)])
    assert await index.blocks_of("w0") == {h(9)}
    assert await index.holders_of(h(0)) == {}
    assert await redis_client.get(f"ms:{NS}:seq:w0") == b"3"


async def test_two_holders_share_a_block(redis_client: aioredis.Redis) -> None:
    index = KVIndex(redis_client, NS)
    await index.apply_events("w0", 1, 1, [stored(0)])
    await index.apply_events("kvstore:s0", 5, 1, [stored(0)])
    assert await index.holders_of(h(0)) == {"w0": 1, "kvstore:s0": 5}
    await index.apply_events("w0", 1, 2, [removed(0)])
    assert await index.holders_of(h(0)) == {"kvstore:s0": 5}


async def test_old_or_repeated_sequence_numbers_are_dropped(redis_client: aioredis.Redis) -> None:
    index = KVIndex(redis_client, NS)
    assert await index.apply_events("w0", 1, 5, [stored(0)])
    assert not await index.apply_events("w0", 1, 5, [stored(1)])  # replayed seq
    assert not await index.apply_events("w0", 1, 4, [removed(0)])  # older seq
    assert await index.blocks_of("w0") == {h(0)}
    assert await index.apply_events("w0", 1, 6, [stored(1)])
    assert await index.blocks_of("w0") == {h(0), h(1)}
    # Decimal strings compare exactly, beyond what a double holds.
    big = 2**60
    assert await index.apply_events("w0", 1, big, [])
    assert not await index.apply_events("w0", 1, big - 1, [stored(2)])
    assert await index.apply_events("w0", 1, big + 1, [stored(2)])


async def test_new_epoch_clears_what_the_old_epoch_held(redis_client: aioredis.Redis) -> None:
    index = KVIndex(redis_client, NS)
    await index.apply_events("w0", 1, 10, [stored(0, 1)])
    # A restarted worker starts its sequence numbers again, under a new epoch.
    assert await index.apply_events("w0", 2, 1, [stored(2)])
    assert await index.blocks_of("w0") == {h(2)}
    assert await index.holders_of(h(0)) == {}
    assert await index.epoch_of("w0") == 2
    # A late batch of the old epoch changes nothing.
    assert not await index.apply_events("w0", 1, 11, [stored(5)])
    assert await index.blocks_of("w0") == {h(2)}


async def test_clear_holder_respects_a_newer_epoch(redis_client: aioredis.Redis) -> None:
    index = KVIndex(redis_client, NS)
    await index.apply_events("w0", 4, 1, [stored(0, 1)])
    assert not await index.clear_holder("w0", epoch=3)  # a dead epoch 3 must not clear 4
    assert await index.blocks_of("w0") == {h(0), h(1)}
    assert await index.clear_holder("w0", epoch=4)
    assert await index.blocks_of("w0") == set()
    assert await index.holders_of(h(0)) == {}


async def test_claim_epoch_starts_fresh(redis_client: aioredis.Redis) -> None:
    index = KVIndex(redis_client, NS)
    first = await index.claim_epoch("kvstore:s0")
    await index.apply_events("kvstore:s0", first, 1, [stored(0)])
    second = await index.claim_epoch("kvstore:s0")
    assert second == first + 1
    assert await index.blocks_of("kvstore:s0") == set()
    assert await index.apply_events("kvstore:s0", second, 1, [stored(1)])  # seq restarts
    assert await index.blocks_of("kvstore:s0") == {h(1)}


async def _prefix_fixture(index: KVIndex) -> None:
    await index.apply_events("w1", 1, 1, [stored(0, 1, 2, 3)])
    await index.apply_events("w2", 1, 1, [stored(0, 2, 3)])  # gap at block 1
    await index.apply_events("w3", 1, 1, [stored(1, 2)])  # lacks the first block
    await index.apply_events("w4", 7, 1, [stored(0, 1)])


async def test_match_prefix_counts_leading_blocks_per_holder(redis_client: aioredis.Redis
                                                             ) -> None:
    index = KVIndex(redis_client, NS)
    await _prefix_fixture(index)
    prompt = [h(0), h(1), h(2), h(3), h(4)]
    assert await index.match_prefix(prompt) == {"w1": 4, "w2": 1, "w4": 2}
    assert await index.match_prefix(prompt, holders=["w1", "w3", "absent"]) == {
        "w1": 4, "w3": 0, "absent": 0}
    assert await index.match_prefix(prompt[1:]) == {"w1": 3, "w3": 2, "w4": 1}
    assert await index.match_prefix([]) == {}
    assert await KVIndex(redis_client, "other-namespace").match_prefix(prompt) == {}

    # An entry written under an epoch that is no longer the holder's does not count.
    await redis_client.set(index.epoch_key("w4"), 8)
    assert await index.match_prefix(prompt) == {"w1": 4, "w2": 1}
    # The server forgot its scripts (a restart): they are loaded again on the way.
    await redis_client.script_flush()
    assert await index.match_prefix(prompt) == {"w1": 4, "w2": 1}


async def test_match_prefix_is_one_round_trip(redis_url: str) -> None:
    client, watcher = connect(redis_url), connect(redis_url)
    try:
        index = KVIndex(client, NS)
        await _prefix_fixture(index)
        prompt = [h(i) for i in range(6)]
        await index.match_prefix(prompt)  # loads the script
        async with watcher.monitor() as monitor:
            result = await index.match_prefix(prompt)
            await client.echo("end-of-test")
            commands = []
            while True:
                cmd = await asyncio.wait_for(monitor.next_command(), 5)
                if cmd["command"] == "ECHO end-of-test":
                    break
                commands.append(cmd)
    finally:
        await client.aclose()
        await watcher.aclose()
    assert result == {"w1": 4, "w2": 1, "w4": 2}
    sent = [c["command"].split()[0].lower() for c in commands if c["client_type"] != "lua"]
    assert sent == ["evalsha"]
    # Inside the script: block 4 has no holder, so the walk stops there (blocks 0..4 read).
    inner = [c["command"].split()[0].lower() for c in commands if c["client_type"] == "lua"]
    assert inner.count("hgetall") == 5
