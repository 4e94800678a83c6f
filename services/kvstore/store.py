"""The kvstore's memory: an LRU of immutable KV blocks keyed by (namespace, block hash).

Pure logic, no I/O: the shared region, when there is one, comes in as a memoryview.
Capacity is in bytes of block data. Blocks of the arena's slot size live in slots of
the region (`SlotAllocator`), where same-host clients read and write them in place;
blocks of any other size live on the heap and travel by Put/Get only. Both count
against the one capacity.

Clients that write in place first `reserve` slots (pinned, invisible) and `commit`
them; clients that read in place `acquire` blocks under a lease and `release` them.
Eviction skips pinned blocks; holds not let go within `lease_s` end by themselves
(`leases.py`), so a client that died pins nothing for long.

Within one call, a chain is handled so that its head ends up more recent than its
tail and the tail is evicted first: a prefix without its head is useless, a head
without its tail is still a hit. Every change (stored, evicted) is logged as KV events
per namespace, for the Redis block index (`take_changes`).
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshserve.services.kvstore.blocks import (
    Acquired,
    BlockMeta,
    HeldBlock,
    PutOutcome,
    Reserved,
    ReserveOutcome,
    StoredBlock,
    StoreStats,
)
from meshserve.services.kvstore.leases import LeaseTable, PinCounts
from meshserve.services.kvstore.slots import SlotAllocator
from meshserve.shared.block_hash import BlockHash
from meshserve.shared.errors import InvalidRequestError, UnavailableError
from meshserve.shared.kv_dtype import KV_DTYPE_BYTES
from meshserve.shared.kv_events import BlockRemoved, BlockStored, KVEvent

__all__ = ["KV_DTYPE_BYTES", "Acquired", "BlockMeta", "HeldBlock", "KVBlockStore", "PutOutcome",
           "ReserveOutcome", "Reserved", "StoreStats", "StoredBlock"]

_Key = tuple[str, BlockHash]


@dataclass
class _Entry:
    """A block in memory: held (in the LRU) or reserved (not yet visible)."""

    meta: BlockMeta
    slot: int | None  # its arena slot, or None: its bytes are `data`, on the heap
    data: bytes = b""


class KVBlockStore:
    """LRU of KV blocks under a byte capacity (least recently used unpinned evicted first).

    `region` is the shared region and `region_base` where its arena starts; without a
    region every block lives on the heap.
    """

    def __init__(self, capacity_bytes: int, region: memoryview | None = None,
                 region_base: int = 0, *, lease_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity_bytes <= 0:
            raise InvalidRequestError(f"capacity_bytes must be positive, got {capacity_bytes}",
                                      param="capacity_bytes")
        self.capacity_bytes = capacity_bytes
        self._region = region
        self._slots = None if region is None else SlotAllocator(
            min(capacity_bytes, len(region) - region_base), region_base)
        self._blocks: OrderedDict[_Key, _Entry] = OrderedDict()  # least recent first
        self._pins: PinCounts[_Key] = PinCounts()
        self._leases: LeaseTable[tuple[_Key, ...]] = LeaseTable(lease_s, clock)
        self._reservations: LeaseTable[list[tuple[_Key, _Entry]]] = LeaseTable(lease_s, clock)
        self._pending: dict[_Key, int] = {}  # reserved key -> its reservation
        self._used_bytes = 0
        self._hits = self._misses = self._evictions = self._stored = self._expired = 0
        self._changes: dict[str, list[tuple[bool, BlockHash]]] = {}  # (stored?, hash)

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def used_bytes(self) -> int:
        """Bytes of held and reserved blocks."""
        return self._used_bytes

    @property
    def slot_bytes(self) -> int:
        """Size of an arena slot; 0 until the first block fixes it (or without a region)."""
        return 0 if self._slots is None else self._slots.slot_bytes

    # -- the byte path -----------------------------------------------------------------

    def put(self, namespace: str, block: StoredBlock) -> PutOutcome:
        """Store one block (most recent), evicting least recent unpinned ones for room."""
        self._expire()
        key = (_checked(namespace), block.block_hash)
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return PutOutcome.PRESENT
        entry = self._allocate(block.meta)
        if entry is None:
            return PutOutcome.REJECTED
        if entry.slot is None:
            entry.data = bytes(block.data)
        else:
            self._write(entry, block.data)
        self._hold(namespace, key, entry)
        return PutOutcome.STORED

    def put_many(self, namespace: str, blocks: Sequence[StoredBlock]) -> list[PutOutcome]:
        """Store blocks given head first; outcomes in the same order."""
        outcomes = [self.put(namespace, block) for block in reversed(blocks)]
        return outcomes[::-1]

    def get_many(self, namespace: str, block_hashes: Sequence[BlockHash],
                 prefix_only: bool = False) -> list[StoredBlock]:
        """Copies of the held blocks among `block_hashes`, in their order (made more recent).

        With `prefix_only`, stops at the first block not held. Counts hits and misses.
        """
        acquired = self.acquire(namespace, block_hashes, prefix_only)
        try:
            return self.read(acquired.lease_id, acquired.blocks)
        finally:
            self.release(acquired.lease_id)

    def read(self, lease_id: int, blocks: Sequence[HeldBlock]) -> list[StoredBlock]:
        """Copies of blocks acquired under `lease_id`; UnavailableError once it expired
        (their slots may hold other blocks by now)."""
        if blocks and self._leases.get(lease_id) is None:
            raise UnavailableError(f"lease {lease_id} expired before its blocks were read")
        return [self._copy(block) for block in blocks]

    # -- reading in place ----------------------------------------------------------------

    def acquire(self, namespace: str, block_hashes: Sequence[BlockHash],
                prefix_only: bool = False) -> Acquired:
        """Pin the held blocks among `block_hashes` (in their order, made more recent)
        under a lease until `release`. With `prefix_only`, stops at the first not held.
        Counts hits and misses."""
        self._expire()
        _checked(namespace)
        found: list[tuple[_Key, _Entry]] = []
        for block_hash in block_hashes:
            key = (namespace, block_hash)
            entry = self._blocks.get(key)
            if entry is None:
                self._misses += 1
                if prefix_only:
                    break
                continue
            found.append((key, entry))
        self._hits += len(found)
        for key, _ in reversed(found):  # the head ends up the most recent
            self._blocks.move_to_end(key)
        if not found:
            return Acquired(0, [])
        keys = tuple(key for key, _ in found)
        self._pins.pin(keys)
        blocks = [HeldBlock(entry.meta, self._offset(entry), entry.data) for _, entry in found]
        return Acquired(self._leases.add(keys), blocks)

    def release(self, lease_id: int) -> bool:
        """Unpin a lease's blocks; False when it was unknown or had expired."""
        keys = self._leases.pop(lease_id)
        if keys is None:
            return False
        self._pins.unpin(keys)
        return True

    # -- writing in place ----------------------------------------------------------------

    def reserve(self, namespace: str, metas: Sequence[BlockMeta]) -> Reserved:
        """Reserve a slot for each block not held (head first: the tail is refused when
        room runs out), pinned and invisible until `commit`."""
        self._expire()
        _checked(namespace)
        keys = [(namespace, meta.block_hash) for meta in metas]
        for key in reversed(keys):  # held ones stay, the head the most recent
            if key in self._blocks:
                self._blocks.move_to_end(key)
        outcomes: list[ReserveOutcome] = []
        offsets: list[int] = []
        entries: list[tuple[_Key, _Entry]] = []
        refused = False
        for key, meta in zip(keys, metas, strict=True):
            outcome, entry = self._reserve_one(key, meta, refused)
            refused = refused or outcome is ReserveOutcome.REFUSED
            outcomes.append(outcome)
            offsets.append(0 if entry is None else self._offset(entry) or 0)
            if entry is not None:
                entries.append((key, entry))
                self._pending[key] = 0  # reserved: a duplicate hash later in this call waits
        if not entries:
            return Reserved(0, outcomes, offsets)
        reservation_id = self._reservations.add(entries)
        for key, _ in entries:
            self._pending[key] = reservation_id
        return Reserved(reservation_id, outcomes, offsets)

    def commit(self, reservation_id: int) -> list[PutOutcome] | None:
        """Make a reservation's blocks held (head most recent), in its order: STORED, or
        PRESENT when a Put stored the hash meanwhile. None when unknown or expired."""
        self._expire()
        entries = self._reservations.pop(reservation_id)
        if entries is None:
            return None
        outcomes: list[PutOutcome] = []
        for key, entry in reversed(entries):
            del self._pending[key]
            if key in self._blocks:
                self._drop(entry)
                outcomes.append(PutOutcome.PRESENT)
            else:
                self._hold(key[0], key, entry)
                outcomes.append(PutOutcome.STORED)
        return outcomes[::-1]

    def abandon(self, reservation_id: int) -> bool:
        """Give a reservation's slots back; False when unknown or expired."""
        entries = self._reservations.pop(reservation_id)
        if entries is None:
            return False
        self._unreserve(entries)
        return True

    # -- views -------------------------------------------------------------------------

    def contains(self, namespace: str, block_hash: BlockHash) -> bool:
        """Whether a block is held (recency and counters unchanged)."""
        return (namespace, block_hash) in self._blocks

    def hashes(self, namespace: str) -> list[BlockHash]:
        """Every held block hash of a namespace, least recent first."""
        return [h for ns, h in self._blocks if ns == namespace]

    def stats(self) -> StoreStats:
        self._expire()
        return StoreStats(num_blocks=len(self._blocks), used_bytes=self._used_bytes,
                          capacity_bytes=self.capacity_bytes, hits=self._hits,
                          misses=self._misses, evictions=self._evictions, stored=self._stored,
                          slot_bytes=self.slot_bytes, leases=len(self._leases),
                          reservations=len(self._reservations),
                          pinned_blocks=len(self._pins), expired=self._expired)

    def take_changes(self) -> dict[str, list[KVEvent]]:
        """KV events since the last call, per namespace, in the order they happened."""
        changes, self._changes = self._changes, {}
        return {namespace: _as_events(log) for namespace, log in changes.items()}

    # -- memory ------------------------------------------------------------------------

    def _reserve_one(self, key: _Key, meta: BlockMeta, refused: bool
                     ) -> tuple[ReserveOutcome, _Entry | None]:
        if key in self._blocks:
            return ReserveOutcome.HELD, None
        if key in self._pending:
            return ReserveOutcome.PENDING, None
        if self._slots is None or not self._slots.fits(meta.nbytes):
            return ReserveOutcome.BYTES_ONLY, None
        entry = None if refused else self._allocate(meta)
        if entry is None:
            return ReserveOutcome.REFUSED, None
        return ReserveOutcome.RESERVED, entry

    def _allocate(self, meta: BlockMeta) -> _Entry | None:
        """Room for a block (a slot when it fits one), evicting for it; None if none."""
        nbytes = meta.nbytes
        in_slot = self._slots is not None and self._slots.fits(nbytes)
        if nbytes > self.capacity_bytes or not self._make_room(nbytes, in_slot):
            return None
        slot = None
        if self._slots is not None and in_slot:
            self._slots.fix(nbytes)
            slot = self._slots.allocate()
            assert slot is not None, "no free slot after making room"
        self._used_bytes += nbytes
        return _Entry(meta, slot)

    def _make_room(self, nbytes: int, in_slot: bool) -> bool:
        """Evict least recent unpinned blocks until `nbytes` (and a slot) are free; evicts
        nothing and returns False when even evicting them all would not do."""
        excess = self._used_bytes + nbytes - self.capacity_bytes
        need_slot = in_slot and self._slots is not None and self._slots.fixed \
            and self._slots.num_free == 0
        victims: list[_Key] = []
        for key, entry in self._blocks.items():  # least recent first
            if excess <= 0 and not need_slot:
                break
            if key in self._pins or (excess <= 0 and entry.slot is None):
                continue  # pinned, or a heap block when only a slot is missing
            victims.append(key)
            excess -= entry.meta.nbytes
            need_slot = need_slot and entry.slot is None
        if excess > 0 or need_slot:
            return False
        for key in victims:
            self._drop(self._blocks.pop(key))
            self._evictions += 1
            self._log(key[0], False, key[1])
        return True

    def _hold(self, namespace: str, key: _Key, entry: _Entry) -> None:
        self._blocks[key] = entry
        self._stored += 1
        self._log(namespace, True, key[1])

    def _drop(self, entry: _Entry) -> None:
        """Free a block's memory (it is in no table any more)."""
        if entry.slot is not None:
            assert self._slots is not None
            self._slots.free(entry.slot)
        self._used_bytes -= entry.meta.nbytes

    def _unreserve(self, entries: list[tuple[_Key, _Entry]]) -> None:
        for key, entry in entries:
            del self._pending[key]
            self._drop(entry)

    def _expire(self) -> None:
        """End the holds whose time is up (called first by every method that changes state)."""
        for _, keys in self._leases.expire():
            self._pins.unpin(keys)
            self._expired += 1
        for _, entries in self._reservations.expire():
            self._unreserve(entries)
            self._expired += 1

    def _offset(self, entry: _Entry) -> int | None:
        if entry.slot is None:
            return None
        assert self._slots is not None
        return self._slots.offset(entry.slot)

    def _write(self, entry: _Entry, data: bytes) -> None:
        offset = self._offset(entry)
        assert self._region is not None and offset is not None
        self._region[offset:offset + len(data)] = data

    def _copy(self, block: HeldBlock) -> StoredBlock:
        meta = block.meta
        if block.offset is None:
            data = block.data
        else:
            assert self._region is not None
            data = bytes(self._region[block.offset:block.offset + meta.nbytes])
        return StoredBlock(meta.block_hash, data, meta.dtype, meta.shape, meta.parent_hash)

    def _log(self, namespace: str, stored: bool, block_hash: BlockHash) -> None:
        self._changes.setdefault(namespace, []).append((stored, block_hash))


def _as_events(changes: list[tuple[bool, BlockHash]]) -> list[KVEvent]:
    """Consecutive changes of one kind as one event each, in order."""
    events: list[KVEvent] = []
    for stored, run in itertools.groupby(changes, key=lambda change: change[0]):
        hashes = tuple(block_hash for _, block_hash in run)
        # The store knows no tokens; the index needs only the hashes.
        events.append(BlockStored(block_hashes=hashes, parent_hash=None, token_ids=(),
                                  block_size=0) if stored else BlockRemoved(block_hashes=hashes))
    return events


def _checked(namespace: str) -> str:
    if not namespace:
        raise InvalidRequestError("kv_namespace must not be empty", param="kv_namespace")
    return namespace
