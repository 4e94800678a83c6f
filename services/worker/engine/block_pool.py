"""The pool of KV blocks: free list in eviction order, reference counts, and the hash index."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from meshserve.shared.block_hash import BlockHash
from meshserve.shared.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)


class KVBlock:
    """One block of KV slots. `block_hash` is set once the block is full and cached."""

    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt})"


class BlockPool:
    """Owns every block. Free blocks wait in least-recently-freed-first order.

    A free block may still hold cached KV (it has a hash): it stays reusable by
    a prefix hit until it is handed out as a new block, which evicts it. So the
    free list doubles as the LRU list of the prefix cache.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        assert num_blocks > 0, f"the KV cache needs at least one block, got {num_blocks}"
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, KVBlock] = {}
        self._events: list[KVEvent] = []
        # (block id, hash, parent hash) of blocks indexed since the last take_new_cached,
        # kept only when a KV tier saves them (track_new_cached).
        self._new_cached: list[tuple[int, BlockHash, BlockHash | None]] | None = None
        self._new_owners: set[str] = set()  # the sequences those blocks are of

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def get_new_blocks(self, count: int) -> list[KVBlock]:
        """Take `count` free blocks from the head of the free list, evicting cached KV."""
        assert count <= len(self._free), f"asked for {count} blocks, {len(self._free)} free"
        taken: list[KVBlock] = []
        evicted: list[BlockHash] = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            assert block.ref_cnt == 0, f"free block {block_id} has ref_cnt {block.ref_cnt}"
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            taken.append(block)
        if evicted:
            self._events.append(BlockRemoved(tuple(evicted)))
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks found by a prefix hit."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the tail of the free list.

        Callers pass a sequence's blocks last-first, so that its tail blocks,
        the least likely to be shared, are evicted before its prefix.
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def track_new_cached(self) -> None:
        """Keep the blocks indexed from now on for take_new_cached (a KV tier saves them)."""
        if self._new_cached is None:
            self._new_cached = []

    def peek_new_cached(self) -> list[tuple[int, BlockHash, BlockHash | None]]:
        """The blocks take_new_cached would return now, left in place."""
        return list(self._new_cached or ())

    def take_new_cached(self) -> list[tuple[int, BlockHash, BlockHash | None]]:
        """(block id, hash, parent hash) of each block indexed since the last call."""
        if not self._new_cached:
            return []
        taken, self._new_cached = self._new_cached, []
        return taken

    def take_new_owners(self) -> set[str]:
        """The sequences whose blocks were indexed since the last call (`owner`)."""
        owners, self._new_owners = self._new_owners, set()
        return owners

    def cache_full_blocks(
        self,
        blocks: list[KVBlock],
        block_hashes: list[BlockHash],
        token_ids: list[int],
        block_size: int,
        parent_hash: BlockHash | None,
        *,
        from_tier: bool = False,
        owner: str = "",
    ) -> None:
        """Index newly filled blocks by hash (in chain order) and record a BlockStored event.

        A hash already held by another block keeps that block; this one stays
        an uncached duplicate and is simply freed later. Blocks `from_tier` were loaded
        from the KV tier, which therefore needs no copy of them. `owner`: the sequence
        they are of (a KV tier's saves say whose blocks they hold).
        """
        if not self.enable_caching:
            return
        stored: list[BlockHash] = []
        track = self._new_cached is not None and not from_tier
        for i, (block, block_hash) in enumerate(zip(blocks, block_hashes, strict=True)):
            assert block.block_hash is None, f"block {block.block_id} is already cached"
            if block_hash in self._cached:
                continue
            block.block_hash = block_hash
            self._cached[block_hash] = block
            stored.append(block_hash)
            if track:
                assert self._new_cached is not None
                self._new_cached.append(
                    (block.block_id, block_hash, block_hashes[i - 1] if i else parent_hash))
                if owner:
                    self._new_owners.add(owner)
        if stored:
            self._events.append(
                BlockStored(tuple(block_hashes), parent_hash, tuple(token_ids), block_size))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
