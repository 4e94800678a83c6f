"""A prefill worker's held blocks in a mappable pool (services/worker/tier/slot_pool.py) and
the listener's MAP and LEASE requests (tier/tcp_blocks.py), over real sockets on 127.0.0.1
with the pool in real POSIX shared memory: a mapped pool reads the bytes the holder wrote;
a lease lends exactly the held slots, keeps them out of use until the copy is said done
and frees them then; a pool that is full gives the oldest held block's slot to a new one;
a handle of another host, or whose token is stale, is not mapped; GET still serves
pool-held blocks to a peer that cannot map the pool."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest
import torch

from meshserve.services.worker.tier.slot_pool import HEADER_BYTES, SlotPool, map_pool
from meshserve.services.worker.tier.tcp_blocks import (
    BlockHolder,
    BlockServer,
    lease,
    pool_handle,
    probe,
    pull,
)
from meshserve.shared.errors import ConfigError

SLOT_BYTES = 4096 + 24
SLOTS = 6
CPU = torch.device("cpu")


def block_hash(i: int) -> bytes:
    return hashlib.sha256(f"pooled-{i}".encode()).digest()


def block_data(i: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + i)
    return torch.randint(0, 256, (SLOT_BYTES,), dtype=torch.uint8, generator=generator)


class Served:
    """A pool of SLOTS slots, its holder and listener."""

    def __init__(self) -> None:
        self.pool = SlotPool(HEADER_BYTES + SLOTS * SLOT_BYTES, CPU)
        self.pool.carve(SLOT_BYTES)
        self.holder = BlockHolder(1 << 30, 60.0, release=self.pool.release)
        self.server = BlockServer(self.holder, "127.0.0.1", pool=self.pool)
        self.server.start()
        self.address = f"127.0.0.1:{self.server.port}"

    def hold(self, i: int) -> bool:
        slot = self.pool.allocate()
        while slot is None and self.holder.evict_oldest():
            slot = self.pool.allocate()
        if slot is None:
            return False
        slot.copy_(block_data(i))
        self.holder.put(block_hash(i), slot)
        return True


@pytest.fixture
def served() -> Iterator[Served]:
    served = Served()
    try:
        yield served
    finally:
        served.server.stop()
        served.pool.close()


def test_a_leased_block_is_read_from_the_mapped_pool_and_freed_when_done(
        served: Served) -> None:
    for i in range(4):
        assert served.hold(i)
    mapped = map_pool(pool_handle(served.address, 5.0), CPU)
    assert mapped is not None and mapped.token == served.pool.token
    hashes = [block_hash(i) for i in (1, 2, 3)]
    lent = lease(served.address, hashes, 5.0)
    assert lent is not None and lent.token == served.pool.token
    assert served.pool.free_slots == SLOTS - 4  # lent slots stay out of use
    assert served.holder.num_held(hashes) == 0  # and out of the holder: pulled once
    for i, slot in zip((1, 2, 3), lent.slots, strict=True):
        assert torch.equal(mapped.data[slot], block_data(i))
    lent.close()
    assert served.pool.free_slots == SLOTS - 1  # only block 0 is still held
    assert served.holder.stats.pulled_blocks == 3
    mapped.close()


def test_a_lease_is_all_or_none(served: Served) -> None:
    assert served.hold(0)
    assert lease(served.address, [block_hash(0), block_hash(9)], 5.0) is None
    assert served.holder.num_held([block_hash(0)]) == 1
    assert served.pool.free_slots == SLOTS - 1


def test_a_full_pool_gives_the_oldest_held_slot_to_a_new_block(served: Served) -> None:
    for i in range(SLOTS + 2):
        assert served.hold(i)
    assert served.pool.free_slots == 0
    assert probe(served.address, [block_hash(0)], 5.0) == 0
    assert probe(served.address, [block_hash(1)], 5.0) == 0
    held = [block_hash(i) for i in range(2, SLOTS + 2)]
    assert probe(served.address, held, 5.0) == SLOTS
    assert served.holder.stats.expired_blocks == 2


def test_lent_slots_are_not_taken_for_new_blocks(served: Served) -> None:
    for i in range(SLOTS):
        assert served.hold(i)
    lent = lease(served.address, [block_hash(i) for i in range(SLOTS)], 5.0)
    assert lent is not None
    assert not served.hold(SLOTS)  # every slot is lent: the new block is not held
    lent.close()
    assert served.hold(SLOTS)


def test_pool_held_blocks_are_served_over_tcp_to_a_peer_that_cannot_map(
        served: Served) -> None:
    for i in range(3):
        assert served.hold(i)
    out = torch.zeros((3, SLOT_BYTES), dtype=torch.uint8)
    with ThreadPoolExecutor(2) as executor:
        assert pull(served.address, [block_hash(i) for i in range(3)], out, executor, 2, 5.0)
    for i in range(3):
        assert torch.equal(out[i], block_data(i))
    assert served.pool.free_slots == SLOTS  # sent, so given back


def test_a_handle_of_another_host_or_a_stale_token_is_not_mapped(served: Served) -> None:
    assert served.hold(0)
    fields = orjson.loads(pool_handle(served.address, 5.0))
    assert map_pool(orjson.dumps({**fields, "host": "another-host"}), CPU) is None
    assert map_pool(orjson.dumps({**fields, "token": fields["token"] + 1}), CPU) is None
    assert map_pool(orjson.dumps({**fields, "shm": "no-such-segment"}), CPU) is None
    assert map_pool(b"not json", CPU) is None
    mapped = map_pool(orjson.dumps(fields), CPU)
    assert mapped is not None
    mapped.close()


def test_a_listener_without_a_pool_answers_an_empty_handle_and_no_lease() -> None:
    holder = BlockHolder(1 << 20, 60.0)
    server = BlockServer(holder, "127.0.0.1")
    server.start()
    try:
        address = f"127.0.0.1:{server.port}"
        holder.put(block_hash(0), block_data(0))
        assert pool_handle(address, 5.0) == b""
        assert lease(address, [block_hash(0)], 5.0) is None
        assert holder.num_held([block_hash(0)]) == 1
    finally:
        server.stop()


def test_a_pool_larger_than_the_free_shared_memory_is_refused_at_start() -> None:
    real = os.statvfs("/dev/shm")
    nbytes = real.f_bavail * real.f_frsize + (1 << 20)
    with pytest.raises(ConfigError, match="--kv-handoff-hold-bytes"):
        SlotPool(nbytes, CPU)
