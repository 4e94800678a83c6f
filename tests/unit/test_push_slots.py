"""A decode worker's listener taking pushes into its pool (tier/kv_push.py, tier/tcp_blocks.py's
RESERVE and COMMIT), over real sockets with a shared-memory pool: a reservation takes a slot
per key, all or none; only committed slots become visible to the worker's own probe and
lease; slots never committed come back after the reservation time, and a reservation read
past its deadline takes none; two reservations of one prompt hold it under different keys;
a kv_source names the listener and the reservation."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import torch

from meshserve.services.worker.tier import tcp_blocks
from meshserve.services.worker.tier.kv_push import (
    PendingSlots,
    parse_source,
    push_keys,
    push_source,
)
from meshserve.services.worker.tier.slot_pool import HEADER_BYTES, SlotPool
from meshserve.services.worker.tier.tcp_blocks import (
    BlockHolder,
    BlockServer,
    commit,
    lease,
    probe,
    reserve,
)

SLOT = 256
HASHES = [bytes([i]) * 32 for i in range(1, 5)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def listener() -> Iterator[tuple[str, SlotPool, BlockServer]]:
    pool = SlotPool(HEADER_BYTES + 6 * SLOT, torch.device("cpu"))
    pool.carve(SLOT)
    holder = BlockHolder(1 << 20, 60.0, release=pool.release)
    server = BlockServer(holder, "127.0.0.1", pool=pool)
    server.start()
    try:
        yield f"127.0.0.1:{server.port}", pool, server
    finally:
        server.stop()
        pool.close()


def test_reserved_slots_are_visible_only_once_committed(
        listener: tuple[str, SlotPool, BlockServer]) -> None:
    address, pool, _ = listener
    keys = push_keys(HASHES, b"r1")
    granted = reserve(address, keys, 5.0)
    assert granted is not None
    token, slots = granted
    assert token == pool.token and len(set(slots)) == len(keys)
    assert pool.free_slots == pool.slots - len(keys)
    assert probe(address, keys, 5.0) == 0, "a reserved slot is not yet written"
    for slot, fill in zip(slots, range(1, 5), strict=True):
        pool.data[slot].fill_(fill)  # the writer
    assert commit(address, keys[:3], 5.0) == 3
    assert probe(address, keys, 5.0) == 3
    leased = lease(address, keys[:3], 5.0)
    assert leased is not None and leased.slots == slots[:3]
    assert [int(pool.data[s][0]) for s in leased.slots] == [1, 2, 3]
    leased.close()
    assert commit(address, keys[:3], 5.0) == 0, "a commit counts once"


def test_a_reservation_is_all_or_none(listener: tuple[str, SlotPool, BlockServer]) -> None:
    address, pool, _ = listener
    assert reserve(address, push_keys(HASHES, b"a"), 5.0) is not None
    assert reserve(address, push_keys(HASHES, b"b"), 5.0) is None, "6 slots, 8 asked"
    assert pool.free_slots == 2, "a refused reservation keeps no slot"
    assert reserve(address, push_keys(HASHES, b"a")[:1], 5.0) is None, "a key reserved twice"


def test_uncommitted_slots_come_back_after_the_reservation_time() -> None:
    pool = SlotPool(HEADER_BYTES + 4 * SLOT, torch.device("cpu"))
    pool.carve(SLOT)
    clock = Clock()
    holder = BlockHolder(1 << 20, 60.0, release=pool.release, clock=clock)
    pending = PendingSlots(pool, holder.put, holder.evict_oldest, reserve_s=10.0, clock=clock)
    try:
        keys = push_keys(HASHES[:3], b"late")
        assert pending.reserve(keys) is not None and pool.free_slots == 1
        clock.now = 10.0
        assert pending.commit(keys) == 0, "past its time a reservation is gone"
        assert pool.free_slots == 4 and len(pending) == 0
        # Committed blocks not yet taken give their slots up to a new reservation, the
        # oldest first (one slot was free).
        assert pending.reserve(keys) is not None and pending.commit(keys) == 3
        assert pending.reserve(push_keys(HASHES[:3], b"next")) is not None
        assert holder.num_held(keys) == 0 and holder.num_held(keys[2:]) == 1
        assert pool.free_slots == 0
    finally:
        pool.close()


def test_a_source_names_the_listener_and_the_reservation() -> None:
    rid = bytes.fromhex("00ff10ab00ff10ab")
    source = push_source("10.0.0.5:7100", rid)
    address, keys = parse_source(source, HASHES)
    assert address == "10.0.0.5:7100" and keys == push_keys(HASHES, rid)
    assert push_keys(HASHES, rid) != push_keys(HASHES, b"another"), "keys of their own"
    assert all(len(key) == 32 for key in keys)
    assert parse_source("10.0.0.5:7000", HASHES) == ("10.0.0.5:7000", HASHES)


def test_a_reservation_read_past_its_deadline_keeps_no_slot(
        listener: tuple[str, SlotPool, BlockServer]) -> None:
    """A prefill worker that gave up waiting (the decode worker was stopped, then went on)
    must not leave slots reserved that nobody will write or release."""
    address, pool, server = listener
    host, _, port = address.rpartition(":")
    past = tcp_blocks._DEADLINE.pack(time.time_ns() - 1).ljust(tcp_blocks.HASH_BYTES, b"\0")
    with socket.create_connection((host, int(port)), timeout=5.0) as conn:
        conn.sendall(tcp_blocks._request(tcp_blocks.OP_RESERVE,
                                         [past, *push_keys(HASHES, b"late")]))
        count, _ = tcp_blocks._LEASED.unpack(conn.recv(tcp_blocks._LEASED.size))
    assert count == 0
    assert pool.free_slots == pool.slots and server.pending is not None
    assert len(server.pending) == 0
