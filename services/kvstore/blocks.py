"""The kvstore's block types: what a block is, and what the store did with it.

Validated at construction, so the store and the servicer see only well-formed blocks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from meshserve.shared.block_hash import BlockHash
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.kv_dtype import KV_DTYPE_BYTES, block_nbytes

_HASH_BYTES = 32


@dataclass(frozen=True)
class BlockMeta:
    """What a block is, apart from its bytes: C-contiguous `shape` of `dtype`."""

    block_hash: BlockHash
    dtype: str
    shape: tuple[int, ...]
    parent_hash: BlockHash = b""

    def __post_init__(self) -> None:
        if len(self.block_hash) != _HASH_BYTES:
            raise InvalidRequestError(f"block_hash has {len(self.block_hash)} bytes, expected "
                                      f"{_HASH_BYTES}", param="block_hash")
        if self.dtype not in KV_DTYPE_BYTES:
            raise InvalidRequestError(f"block {self.block_hash.hex()[:16]}: unsupported dtype "
                                      f"{self.dtype!r} (known: {sorted(KV_DTYPE_BYTES)})",
                                      param="dtype")
        if not self.shape or min(self.shape) <= 0:
            raise InvalidRequestError(f"block {self.block_hash.hex()[:16]}: shape "
                                      f"{list(self.shape)} must be non-empty and positive",
                                      param="shape")

    @property
    def nbytes(self) -> int:
        return block_nbytes(self.dtype, self.shape)


@dataclass(frozen=True)
class StoredBlock:
    """The KV of one full block for every layer, packed: `data` is C-contiguous `shape`."""

    block_hash: BlockHash
    data: bytes
    dtype: str
    shape: tuple[int, ...]
    parent_hash: BlockHash = b""

    def __post_init__(self) -> None:
        expected = self.meta.nbytes
        if expected != len(self.data):
            raise InvalidRequestError(
                f"block {self.block_hash.hex()[:16]}: shape {list(self.shape)} of {self.dtype} "
                f"needs {expected} bytes, data has {len(self.data)}", param="shape")

    @property
    def meta(self) -> BlockMeta:
        return BlockMeta(self.block_hash, self.dtype, self.shape, self.parent_hash)

    @property
    def nbytes(self) -> int:
        return len(self.data)


class PutOutcome(enum.Enum):
    """What put (or commit) did with one block."""

    STORED = "stored"
    PRESENT = "present"
    REJECTED = "rejected"


class ReserveOutcome(enum.Enum):
    """What reserve did for one block."""

    RESERVED = "reserved"  # a slot to write into, at its offset
    HELD = "held"  # already held: nothing to write
    PENDING = "pending"  # another reservation is writing it
    REFUSED = "refused"  # no room, even after evicting every unpinned block
    BYTES_ONLY = "bytes_only"  # no slot of its size: send it by Put


@dataclass(frozen=True)
class Reserved:
    """Slots reserved for writing; `reservation_id` 0 when none was."""

    reservation_id: int
    outcomes: list[ReserveOutcome]
    offsets: list[int]  # region offset of each RESERVED block, 0 for the others


@dataclass(frozen=True)
class HeldBlock:
    """A held block as a reader sees it."""

    meta: BlockMeta
    offset: int | None  # where its bytes start in the region; None: on the heap, as `data`
    data: bytes = b""


@dataclass(frozen=True)
class Acquired:
    """Blocks pinned under a lease; `lease_id` 0 when none was found."""

    lease_id: int
    blocks: list[HeldBlock]


@dataclass(frozen=True)
class StoreStats:
    """Occupancy and counters since start."""

    num_blocks: int
    used_bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    stored: int
    slot_bytes: int = 0
    leases: int = 0
    reservations: int = 0
    pinned_blocks: int = 0
    expired: int = 0
