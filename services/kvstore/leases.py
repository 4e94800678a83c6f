"""Time-limited holds on the store's memory, and the pins they put on blocks.

Pure logic; time comes from an injected clock. A client that reserves slots or
acquires blocks holds them under an id until it lets go; one that dies must not pin
memory forever, so every hold ends by itself `lease_s` after it began. All holds last
the same time, so they expire in the order they were taken: an ordered dict is the
expiry queue.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class LeaseTable(Generic[T]):
    """Items held under ids (1, 2, ...) until popped or `lease_s` after they were added."""

    def __init__(self, lease_s: float, clock: Callable[[], float]) -> None:
        assert lease_s > 0, f"lease_s must be positive, got {lease_s}"
        self.lease_s = lease_s
        self._clock = clock
        self._ids = itertools.count(1)
        self._held: OrderedDict[int, tuple[float, T]] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._held)

    def add(self, item: T) -> int:
        """Hold `item`; returns its id."""
        lease_id = next(self._ids)
        self._held[lease_id] = (self._clock() + self.lease_s, item)
        return lease_id

    def get(self, lease_id: int) -> T | None:
        """The item held under `lease_id`, None when released or expired."""
        held = self._held.get(lease_id)
        return None if held is None else held[1]

    def pop(self, lease_id: int) -> T | None:
        """Release `lease_id`; its item, or None when it was released or expired before."""
        held = self._held.pop(lease_id, None)
        return None if held is None else held[1]

    def expire(self) -> list[tuple[int, T]]:
        """Remove and return the (id, item) of every hold whose time is up, oldest first."""
        now = self._clock()
        expired: list[tuple[int, T]] = []
        while self._held:
            lease_id, (deadline, item) = next(iter(self._held.items()))
            if deadline > now:
                break
            del self._held[lease_id]
            expired.append((lease_id, item))
        return expired


K = TypeVar("K", bound=Hashable)


class PinCounts(Generic[K]):
    """How many holds pin each key; a pinned key must not be evicted."""

    def __init__(self) -> None:
        self._counts: Counter[K] = Counter()

    def __contains__(self, key: K) -> bool:
        return key in self._counts

    def __len__(self) -> int:
        """Keys pinned at least once."""
        return len(self._counts)

    def pin(self, keys: Iterable[K]) -> None:
        self._counts.update(keys)

    def unpin(self, keys: Iterable[K]) -> None:
        for key in keys:
            assert self._counts[key] > 0, f"unpinning {key!r}, which is not pinned"
            self._counts[key] -= 1
            if self._counts[key] == 0:
                del self._counts[key]
