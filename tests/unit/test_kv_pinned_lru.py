"""Unit tests of the kvstore's LRU over a shared region: slots, reservations, leases (pins
that eviction skips), expiry on an injected clock, and blocks of another size on the heap."""

from __future__ import annotations

import hashlib

import pytest

from meshserve.services.kvstore.store import (
    BlockMeta,
    KVBlockStore,
    PutOutcome,
    ReserveOutcome,
    StoredBlock,
)
from meshserve.shared.errors import UnavailableError
from meshserve.shared.kv_events import BlockRemoved, BlockStored

NS = "tiny:float16"
BASE = 4096
SLOT = 64  # 32 float16 values: one cache line, so slot i is at BASE + 64 i
R, H, P = ReserveOutcome.RESERVED, ReserveOutcome.HELD, ReserveOutcome.PENDING


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def h(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def meta(name: str, elements: int = 32) -> BlockMeta:
    return BlockMeta(h(name), "float16", (elements,))


def block(name: str, elements: int = 32) -> StoredBlock:
    data = hashlib.shake_256(name.encode()).digest(2 * elements)
    return StoredBlock(block_hash=h(name), data=data, dtype="float16", shape=(elements,))


def make_store(slots: int = 4, clock: FakeClock | None = None
               ) -> tuple[KVBlockStore, memoryview]:
    region = memoryview(bytearray(BASE + slots * SLOT))
    store = KVBlockStore(slots * SLOT, region, BASE, lease_s=30.0, clock=clock or FakeClock())
    return store, region


def order(store: KVBlockStore) -> list[bytes]:
    return store.hashes(NS)


def write(region: memoryview, offset: int, name: str) -> None:
    region[offset:offset + SLOT] = block(name).data


def test_reserved_slots_are_invisible_until_committed() -> None:
    store, region = make_store()
    reserved = store.reserve(NS, [meta("a"), meta("b")])
    assert reserved.outcomes == [R, R]
    assert reserved.offsets == [BASE, BASE + SLOT]
    assert store.slot_bytes == SLOT and store.used_bytes == 2 * SLOT
    assert not store.contains(NS, h("a")) and store.get_many(NS, [h("a")]) == []
    write(region, BASE, "a")
    write(region, BASE + SLOT, "b")
    assert store.commit(reserved.reservation_id) == [PutOutcome.STORED] * 2
    assert order(store) == [h("b"), h("a")]  # the head is the most recent
    assert store.get_many(NS, [h("a"), h("b")]) == [block("a"), block("b")]
    assert store.commit(reserved.reservation_id) is None  # once only
    assert store.take_changes() == {NS: [BlockStored(block_hashes=(h("b"), h("a")),
                                                     parent_hash=None, token_ids=(),
                                                     block_size=0)]}


def test_put_writes_into_a_slot_that_acquire_points_at() -> None:
    store, region = make_store()
    assert store.put_many(NS, [block("a"), block("b")]) == [PutOutcome.STORED] * 2
    acquired = store.acquire(NS, [h("a"), h("b"), h("c")], prefix_only=True)
    offsets = [b.offset for b in acquired.blocks]
    assert offsets == [BASE + SLOT, BASE]  # put tail first: b got slot 0
    assert bytes(region[BASE + SLOT:BASE + 2 * SLOT]) == block("a").data
    assert store.reserve(NS, [meta("a"), meta("c")]).outcomes == [H, R]
    assert store.release(acquired.lease_id) and not store.release(acquired.lease_id)


def test_eviction_skips_leased_blocks() -> None:
    store, _ = make_store(slots=3)
    store.put_many(NS, [block("a"), block("b"), block("c")])
    lease = store.acquire(NS, [h("a")]).lease_id
    store.get_many(NS, [h("c"), h("b")])  # a is now the least recent, but pinned
    assert order(store) == [h("a"), h("b"), h("c")]
    store.put(NS, block("d"))
    assert order(store) == [h("a"), h("c"), h("d")]  # b went, not a
    store.release(lease)
    store.put(NS, block("e"))
    assert order(store) == [h("c"), h("d"), h("e")]
    assert store.stats().evictions == 2


def test_no_room_when_everything_is_pinned_evicts_nothing() -> None:
    store, _ = make_store(slots=2)
    store.put_many(NS, [block("a"), block("b")])
    lease = store.acquire(NS, [h("a"), h("b")]).lease_id
    reserved = store.reserve(NS, [meta("c")])
    assert (reserved.reservation_id, reserved.outcomes) == (0, [ReserveOutcome.REFUSED])
    assert store.put(NS, block("c")) is PutOutcome.REJECTED
    assert order(store) == [h("b"), h("a")] and store.stats().evictions == 0
    store.release(lease)
    assert store.reserve(NS, [meta("c")]).outcomes == [R]
    assert order(store) == [h("a")]  # b, the least recent, made room


def test_a_chain_too_long_for_the_room_keeps_its_head() -> None:
    store, _ = make_store(slots=2)
    reserved = store.reserve(NS, [meta("x0"), meta("x1"), meta("x2")])
    assert reserved.outcomes == [R, R, ReserveOutcome.REFUSED]
    assert reserved.offsets == [BASE, BASE + SLOT, 0]


def test_a_hash_being_written_is_pending_and_a_put_meanwhile_wins() -> None:
    store, _ = make_store()
    first = store.reserve(NS, [meta("a"), meta("b"), meta("a")])
    assert first.outcomes == [R, R, P]  # a duplicate within one call
    second = store.reserve(NS, [meta("b"), meta("c")])
    assert second.outcomes == [P, R]
    assert store.put(NS, block("a")) is PutOutcome.STORED  # slot 3 (0-2 are reserved)
    assert store.used_bytes == 4 * SLOT
    assert store.commit(first.reservation_id) == [PutOutcome.PRESENT, PutOutcome.STORED]
    assert store.used_bytes == 3 * SLOT  # the duplicate's slot went back
    assert store.abandon(second.reservation_id) and not store.abandon(second.reservation_id)
    assert store.used_bytes == 2 * SLOT
    assert sorted(order(store)) == sorted([h("a"), h("b")])


def test_leases_and_reservations_expire_on_the_clock() -> None:
    clock = FakeClock()
    store, _ = make_store(slots=2, clock=clock)
    store.put_many(NS, [block("a")])
    acquired = store.acquire(NS, [h("a")])
    reserved = store.reserve(NS, [meta("b")])
    clock.now = 29.9
    assert store.stats().pinned_blocks == 1 and store.stats().reservations == 1
    assert store.reserve(NS, [meta("c")]).outcomes == [ReserveOutcome.REFUSED]
    clock.now = 30.0
    stats = store.stats()
    assert (stats.leases, stats.reservations, stats.pinned_blocks, stats.expired) == (0, 0, 0, 2)
    assert store.used_bytes == SLOT  # the reservation's slot is free again
    with pytest.raises(UnavailableError):  # its slot may hold another block by now
        store.read(acquired.lease_id, acquired.blocks)
    assert store.commit(reserved.reservation_id) is None
    assert not store.release(acquired.lease_id)
    assert store.reserve(NS, [meta("c"), meta("d")]).outcomes == [R, R]
    assert order(store) == []  # a, unpinned by expiry, made room
    assert store.take_changes()[NS][-1] == BlockRemoved(block_hashes=(h("a"),))


def test_blocks_of_another_size_live_on_the_heap_within_the_capacity() -> None:
    store, _ = make_store(slots=4)
    store.put(NS, block("slot"))  # fixes the slot size at 64 bytes
    assert store.put(NS, block("heap", 48)) is PutOutcome.STORED  # 96 bytes, on the heap
    assert store.used_bytes == 160
    assert store.reserve(NS, [meta("other", 48)]).outcomes == [ReserveOutcome.BYTES_ONLY]
    acquired = store.acquire(NS, [h("heap"), h("slot")])
    assert [b.offset for b in acquired.blocks] == [None, BASE]
    assert store.read(acquired.lease_id, acquired.blocks) == [block("heap", 48), block("slot")]
    store.release(acquired.lease_id)
    assert order(store) == [h("slot"), h("heap")]
    store.put(NS, block("s1"))  # 224 of 256 bytes
    store.put(NS, block("s2"))  # 32 bytes short: the least recent goes
    assert order(store) == [h("heap"), h("s1"), h("s2")]
    store.put(NS, block("s3"))  # 32 bytes short again: the heap block goes
    assert order(store) == [h("s1"), h("s2"), h("s3")]
    assert store.used_bytes == 192


def test_when_only_a_slot_is_missing_heap_blocks_are_not_evicted_for_it() -> None:
    # 40-byte slots at a 64-byte stride: 4 slots in 256 bytes that could hold 6 blocks.
    region = memoryview(bytearray(BASE + 256))
    store = KVBlockStore(256, region, BASE, clock=FakeClock())
    store.put(NS, block("s0", 20))
    store.put(NS, block("heap", 12))  # 24 bytes on the heap
    store.put_many(NS, [block(f"s{i}", 20) for i in (3, 2, 1)])  # put s1, then s2, then s3
    assert store.used_bytes == 184
    store.put(NS, block("s4", 20))  # bytes would do; a slot is missing: s0 goes
    assert order(store) == [h("heap"), h("s1"), h("s2"), h("s3"), h("s4")]
    store.put(NS, block("s5", 20))  # the heap block frees no slot: s1 goes
    assert order(store) == [h("heap"), h("s2"), h("s3"), h("s4"), h("s5")]


def test_without_a_region_every_block_is_on_the_heap() -> None:
    store = KVBlockStore(4 * SLOT)
    store.put(NS, block("a"))
    assert store.slot_bytes == 0
    assert store.reserve(NS, [meta("b")]).outcomes == [ReserveOutcome.BYTES_ONLY]
    assert [b.offset for b in store.acquire(NS, [h("a")]).blocks] == [None]
