"""Unit tests of the kvstore's slot allocator and lease table: exact slots, ids, expiry."""

from __future__ import annotations

from meshserve.services.kvstore.leases import LeaseTable, PinCounts
from meshserve.services.kvstore.slots import SlotAllocator


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_first_block_fixes_the_slot_size_and_alignment() -> None:
    slots = SlotAllocator(arena_bytes=1000, base=4096)
    assert not slots.fixed and slots.num_free == 0
    assert slots.fits(1000) and not slots.fits(1001) and not slots.fits(0)
    slots.fix(100)  # stride 128: cache-line aligned
    assert (slots.slot_bytes, slots.num_slots, slots.num_free) == (100, 7, 7)
    assert slots.fits(100) and not slots.fits(128) and not slots.fits(64)
    slots.fix(100)  # the same size again: a no-op
    assert [slots.offset(i) for i in (0, 1, 6)] == [4096, 4096 + 128, 4096 + 768]


def test_lowest_free_slot_first_and_none_when_full() -> None:
    slots = SlotAllocator(arena_bytes=4 * 64)
    slots.fix(64)
    assert [slots.allocate() for _ in range(4)] == [0, 1, 2, 3]
    assert slots.allocate() is None and slots.num_free == 0
    slots.free(2)
    slots.free(0)
    assert slots.num_free == 2
    assert [slots.allocate(), slots.allocate(), slots.allocate()] == [0, 2, None]


def test_a_block_just_under_the_arena_gets_the_one_slot() -> None:
    slots = SlotAllocator(arena_bytes=100)
    slots.fix(99)  # its aligned stride (128) would not fit
    assert (slots.num_slots, slots.allocate(), slots.allocate()) == (1, 0, None)


def test_leases_expire_in_order_once_their_time_is_up() -> None:
    clock = FakeClock()
    table: LeaseTable[str] = LeaseTable(lease_s=30.0, clock=clock)
    first = table.add("a")
    clock.now += 10
    second = table.add("b")
    assert (first, second, len(table)) == (1, 2, 2)
    clock.now += 19.9  # "a" is 29.9 s old
    assert table.expire() == []
    clock.now += 0.1
    assert table.expire() == [(1, "a")]
    assert table.get(first) is None and table.pop(first) is None
    assert table.pop(second) == "b"  # released in time
    clock.now += 100
    assert table.expire() == [] and len(table) == 0
    assert table.add("c") == 3  # ids are never reused


def test_pins_count_holds_per_key() -> None:
    pins: PinCounts[str] = PinCounts()
    pins.pin(["x", "y", "x"])
    assert "x" in pins and len(pins) == 2
    pins.unpin(["x"])
    assert "x" in pins
    pins.unpin(["x", "y"])
    assert "x" not in pins and "y" not in pins and len(pins) == 0
