"""The kvstore's memory: an LRU of immutable KV blocks keyed by (namespace, block hash).

Pure logic, no I/O. Capacity is in bytes of block data. Within one `put_many` or
`get_many` call the blocks are handled last to first, so a chain's head ends up more
recent than its tail and the tail is evicted first: a prefix without its head is
useless, a head without its tail is still a hit. Every change (stored, evicted) is
logged as KV events per namespace, for the Redis block index (`take_changes`).
"""

from __future__ import annotations

import enum
import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType

from meshserve.shared.block_hash import BlockHash
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.kv_events import BlockRemoved, BlockStored, KVEvent

KV_DTYPE_BYTES = MappingProxyType({
    "float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1,
})
"""Element size of each KV dtype the store accepts, in bytes."""

_HASH_BYTES = 32


@dataclass(frozen=True)
class KVBlock:
    """The KV of one full block for every layer, packed: `data` is C-contiguous `shape`."""

    block_hash: BlockHash
    data: bytes
    dtype: str
    shape: tuple[int, ...]
    parent_hash: BlockHash = b""

    def __post_init__(self) -> None:
        if len(self.block_hash) != _HASH_BYTES:
            raise InvalidRequestError(f"block_hash has {len(self.block_hash)} bytes, expected "
                                      f"{_HASH_BYTES}", param="block_hash")
        itemsize = KV_DTYPE_BYTES.get(self.dtype)
        if itemsize is None:
            raise InvalidRequestError(f"block {self.block_hash.hex()[:16]}: unsupported dtype "
                                      f"{self.dtype!r} (known: {sorted(KV_DTYPE_BYTES)})",
                                      param="dtype")
        expected = math.prod(self.shape) * itemsize
        if not self.shape or expected != len(self.data):
            raise InvalidRequestError(
                f"block {self.block_hash.hex()[:16]}: shape {list(self.shape)} of {self.dtype} "
                f"needs {expected} bytes, data has {len(self.data)}", param="shape")

    @property
    def nbytes(self) -> int:
        return len(self.data)


class PutOutcome(enum.Enum):
    """What put did with one block."""

    STORED = "stored"
    PRESENT = "present"
    REJECTED = "rejected"


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


_Key = tuple[str, BlockHash]


class KVBlockStore:
    """LRU of KV blocks under a byte capacity (least recently used evicted first)."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise InvalidRequestError(f"capacity_bytes must be positive, got {capacity_bytes}",
                                      param="capacity_bytes")
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[_Key, KVBlock] = OrderedDict()  # least recent first
        self._used_bytes = 0
        self._hits = self._misses = self._evictions = self._stored = 0
        self._changes: dict[str, list[tuple[bool, BlockHash]]] = {}  # (stored?, hash)

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    def put(self, namespace: str, block: KVBlock) -> PutOutcome:
        """Store one block (most recent), evicting least recent ones to make room."""
        key = (_checked(namespace), block.block_hash)
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return PutOutcome.PRESENT
        if block.nbytes > self.capacity_bytes:
            return PutOutcome.REJECTED
        while self._used_bytes + block.nbytes > self.capacity_bytes:
            self._evict_one()
        self._blocks[key] = block
        self._used_bytes += block.nbytes
        self._stored += 1
        self._log(namespace, True, block.block_hash)
        return PutOutcome.STORED

    def put_many(self, namespace: str, blocks: Sequence[KVBlock]) -> list[PutOutcome]:
        """Store blocks given head first; outcomes in the same order."""
        outcomes = [self.put(namespace, block) for block in reversed(blocks)]
        return outcomes[::-1]

    def get_many(self, namespace: str, block_hashes: Sequence[BlockHash],
                 prefix_only: bool = False) -> list[KVBlock]:
        """The held blocks among `block_hashes`, in their order (all made more recent).

        With `prefix_only`, stops at the first block not held. Counts hits and misses.
        """
        _checked(namespace)
        found: list[KVBlock] = []
        for block_hash in block_hashes:
            block = self._blocks.get((namespace, block_hash))
            if block is None:
                self._misses += 1
                if prefix_only:
                    break
                continue
            found.append(block)
        self._hits += len(found)
        for block in reversed(found):  # the head ends up the most recent
            self._blocks.move_to_end((namespace, block.block_hash))
        return found

    def contains(self, namespace: str, block_hash: BlockHash) -> bool:
        """Whether a block is held (recency and counters unchanged)."""
        return (namespace, block_hash) in self._blocks

    def hashes(self, namespace: str) -> list[BlockHash]:
        """Every held block hash of a namespace, least recent first."""
        return [h for ns, h in self._blocks if ns == namespace]

    def stats(self) -> StoreStats:
        return StoreStats(num_blocks=len(self._blocks), used_bytes=self._used_bytes,
                          capacity_bytes=self.capacity_bytes, hits=self._hits,
                          misses=self._misses, evictions=self._evictions, stored=self._stored)

    def take_changes(self) -> dict[str, list[KVEvent]]:
        """KV events since the last call, per namespace, in the order they happened."""
        changes, self._changes = self._changes, {}
        return {namespace: _as_events(log) for namespace, log in changes.items()}

    def _evict_one(self) -> None:
        (namespace, block_hash), block = self._blocks.popitem(last=False)
        self._used_bytes -= block.nbytes
        self._evictions += 1
        self._log(namespace, False, block_hash)

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
