"""Which fixed-size slots of the shared arena are free.

Pure logic. The arena is `arena_bytes` long from `base` (the region's offset past its
header). The slot size is not known at start: the first block stored fixes it, since
all blocks of one model have one size; from then on the arena holds
`arena_bytes // stride` slots, where the stride is the slot size rounded up to
`ALIGNMENT` so every slot starts on a cache line. The lowest free slot is handed out
first, which keeps the used part of the region compact and the tests exact.
"""

from __future__ import annotations

import heapq

ALIGNMENT = 64


class SlotAllocator:
    """Fixed-size slots of an arena: `fix`, then `allocate` / `free` slot indices."""

    def __init__(self, arena_bytes: int, base: int = 0) -> None:
        assert arena_bytes > 0 and base >= 0, f"bad arena: {arena_bytes} bytes at {base}"
        self.arena_bytes = arena_bytes
        self.base = base
        self.slot_bytes = 0  # 0 until the first block fixes it
        self.num_slots = 0
        self._stride = 0
        self._next_unused = 0  # slots at and above it were never handed out
        self._freed: list[int] = []  # a heap of freed slots below _next_unused

    @property
    def fixed(self) -> bool:
        return self.slot_bytes > 0

    @property
    def num_free(self) -> int:
        return self.num_slots - self._next_unused + len(self._freed)

    def fits(self, nbytes: int) -> bool:
        """Whether a block of `nbytes` can live in a slot (once the size is fixed, or as
        the block that fixes it)."""
        if self.fixed:
            return nbytes == self.slot_bytes
        return 0 < nbytes <= self.arena_bytes

    def fix(self, nbytes: int) -> None:
        """Fix the slot size to `nbytes` (once; a no-op when already that size)."""
        assert self.fits(nbytes), f"a {nbytes}-byte block does not fit slots of " \
                                  f"{self.slot_bytes} bytes in {self.arena_bytes}"
        if self.fixed:
            return
        self.slot_bytes = nbytes
        self._stride = -(-nbytes // ALIGNMENT) * ALIGNMENT
        self.num_slots = self.arena_bytes // self._stride
        if self.num_slots == 0:  # a last block just under the arena's size: no room to align
            self._stride, self.num_slots = nbytes, 1

    def allocate(self) -> int | None:
        """The lowest free slot, now in use; None when every slot is in use."""
        assert self.fixed, "allocate before the slot size is fixed"
        if self._freed:
            return heapq.heappop(self._freed)
        if self._next_unused < self.num_slots:
            self._next_unused += 1
            return self._next_unused - 1
        return None

    def free(self, slot: int) -> None:
        """Give a slot in use back."""
        assert 0 <= slot < self._next_unused, f"slot {slot} was never allocated"
        heapq.heappush(self._freed, slot)

    def offset(self, slot: int) -> int:
        """Where a slot starts, from the start of the region."""
        assert 0 <= slot < self.num_slots, f"no slot {slot} of {self.num_slots}"
        return self.base + slot * self._stride
