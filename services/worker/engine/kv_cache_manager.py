"""The scheduler's only view of KV memory: per-request block tables over the block pool."""

from __future__ import annotations

from meshserve.services.worker.engine.block_pool import BlockPool, KVBlock
from meshserve.services.worker.engine.sequence import SequenceState
from meshserve.shared.block_hash import hash_blocks


class KVCacheManager:
    """Allocates, shares (prefix hits) and frees the blocks of each request."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self._blocks: dict[str, list[KVBlock]] = {}
        # The same tables as block ids, kept in step with `_blocks` (read every step).
        self._ids: dict[str, list[int]] = {}
        # Number of leading blocks of each request already indexed by hash.
        self._num_cached: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (the manager's own list: read it, do not change it)."""
        return self._ids.get(request_id, [])

    def _update_hashes(self, request: SequenceState) -> None:
        """Extend the request's chained block hashes over its newly full blocks."""
        known = len(request.block_hashes)
        num_known = request.num_known_tokens  # pending tokens have no id yet
        if num_known // self.block_size > known:
            parent = request.block_hashes[-1] if known else None
            request.block_hashes.extend(hash_blocks(
                request.token_ids(0, num_known), self.block_size, request.extra_keys, parent,
                known))

    def get_computed_blocks(self, request: SequenceState) -> list[KVBlock]:
        """Longest run of leading blocks already cached for this request's tokens.

        At least one token is always left to compute: its logits give the next
        token. Requests that want prompt logprobs compute every position.
        """
        if not self.enable_caching or request.params.prompt_logprobs is not None:
            return []
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(
        self, request: SequenceState, num_new_tokens: int, computed: list[KVBlock] | None = None
    ) -> bool:
        """Make room for `num_new_tokens` more tokens; False (and no change) if blocks run out.

        `computed` are prefix-hit blocks from get_computed_blocks, given only
        when the request is first scheduled (its num_computed_tokens already
        counts them).
        """
        total = request.num_computed_tokens + num_new_tokens
        held = self._blocks.get(request.request_id)
        if not computed and held is not None and self.blocks_needed(total) <= len(held):
            # A decode step inside the blocks it has: the common case, nothing to take.
            self._cache_new_full_blocks(request, total, 0)
            return True
        computed = computed or []
        if held is None:
            held = self._blocks[request.request_id] = []
            self._ids[request.request_id] = []
        num_new_blocks = self.blocks_needed(total) - len(held) - len(computed)
        # Prefix-hit blocks with no other user sit in the free list: touching them uses it up.
        num_evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if num_new_blocks + num_evictable_hits > self.pool.num_free_blocks:
            if not held:
                del self._blocks[request.request_id]
                del self._ids[request.request_id]
            return False
        self.pool.touch(computed)
        added = computed + (self.pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0
                            else [])
        held.extend(added)
        self._ids[request.request_id].extend(b.block_id for b in added)
        self._cache_new_full_blocks(request, total, len(computed))
        return True

    def _cache_new_full_blocks(self, request: SequenceState, num_tokens: int, num_hits: int) -> None:
        if not self.enable_caching:
            return
        rid = request.request_id
        start = max(self._num_cached.get(rid, 0), num_hits)
        end = min(num_tokens, request.num_known_tokens) // self.block_size
        self._num_cached[rid] = max(end, start)
        if end <= start:
            return
        self._update_hashes(request)
        held = self._blocks[rid]
        bs = self.block_size
        self.pool.cache_full_blocks(
            held[start:end],
            request.block_hashes[start:end],
            request.token_ids(start * bs, end * bs),
            bs,
            request.block_hashes[start - 1] if start else None,
        )

    def cache_computed_blocks(self, request: SequenceState) -> None:
        """Index the request's full computed blocks whose token ids have just become known
        (a block holding a pending token waits for its id)."""
        if request.request_id in self._blocks:
            self._cache_new_full_blocks(request, request.num_computed_tokens, 0)

    def trim(self, request: SequenceState, num_tokens: int) -> None:
        """Release the request's blocks beyond its first `num_tokens` tokens (rejected
        drafts' slots); those blocks hold no indexed (full, known) tokens."""
        held = self._blocks.get(request.request_id)
        keep = self.blocks_needed(num_tokens)
        if held is None or len(held) <= keep:
            return
        assert self._num_cached.get(request.request_id, 0) <= keep, "trimming indexed blocks"
        extra = held[keep:]
        del held[keep:]
        del self._ids[request.request_id][keep:]
        self.pool.free_blocks(reversed(extra))

    def free(self, request: SequenceState) -> None:
        """Release every block the request holds (its tail first in eviction order)."""
        blocks = self._blocks.pop(request.request_id, [])
        self._ids.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))
