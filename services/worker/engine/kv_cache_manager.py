"""The scheduler's only view of KV memory: per-request block tables over the block pool.

Sliding windows. When every layer of the model attends over at most its last `window`
positions (`ModelConfig.kv_window`: Mistral-style models, a Gemma 3 config whose every layer
slides), a query at position p reads no key before p - window + 1, and a sequence's queries
only move forward. So as a sequence advances, its blocks wholly before its next query's
window are released to the pool (vLLM's sliding-window manager does the same): full, hashed
ones stay in the prefix cache as evictable blocks, like a finished request's. The block table
keeps their places, holding `PLACEHOLDER_BLOCK_ID`; attention never reads a table entry of a
block wholly outside the window (kernels/attention.py), so a placeholder is never read.

When SOME layer is global (Gemma 2/3's and gpt-oss's interleaved layers: `kv_window` None),
that layer reads every block of the sequence through the one block table all layers share,
so nothing is freed before the sequence ends and a sequence holds a block per block_size of
its tokens. (A second block table for the sliding layers, as vLLM's hybrid manager keeps,
would free their share of the memory: not done here.)
"""

from __future__ import annotations

from meshserve.services.worker.engine.block_pool import BlockPool, KVBlock
from meshserve.services.worker.engine.sequence import SequenceState
from meshserve.shared.block_hash import hash_blocks

# The block table entry of a block released behind the window (never read by attention).
PLACEHOLDER_BLOCK_ID = -1
# Stands in `_blocks` where a released block was (the pool never hands it out).
_RELEASED = KVBlock(PLACEHOLDER_BLOCK_ID)


class KVCacheManager:
    """Allocates, shares (prefix hits) and frees the blocks of each request."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 window: int | None = None) -> None:
        """`window`: how far back every layer's attention reaches (`ModelConfig.kv_window`);
        blocks behind it are released as sequences advance. None: blocks are held until
        the sequence is freed."""
        assert window is None or window >= 1, f"window must be >= 1, got {window}"
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.window = window
        self.pool = BlockPool(num_blocks, enable_caching)
        self._blocks: dict[str, list[KVBlock]] = {}
        # The same tables as block ids, kept in step with `_blocks` (read every step).
        self._ids: dict[str, list[int]] = {}
        # Number of leading blocks of each request already indexed by hash.
        self._num_cached: dict[str, int] = {}
        # Number of leading blocks of each request released behind the window (placeholders).
        self._num_released: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (the manager's own list: read it, do not change it).
        Blocks released behind the window hold PLACEHOLDER_BLOCK_ID."""
        return self._ids.get(request_id, [])

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (its table less the released placeholders)."""
        return len(self._ids.get(request_id, ())) - self._num_released.get(request_id, 0)

    def behind_window(self, num_computed_tokens: int) -> int:
        """Leading blocks no query at or after position `num_computed_tokens` reads: those
        wholly before its window's first key, num_computed_tokens - window + 1 (0 without
        a window)."""
        if self.window is None:
            return 0
        return max(num_computed_tokens - self.window + 1, 0) // self.block_size

    def sequence_capacity(self, max_step_tokens: int, max_model_len: int) -> int:
        """Most tokens one sequence can reach alone in the cache when a step computes at most
        `max_step_tokens` of its tokens: every block's worth; with a window, any length up to
        `max_model_len` once a step's peak fits, the blocks of its window and its tokens
        (vLLM's cdiv(window - 1 + tokens, block_size) + 1)."""
        whole = self.num_blocks * self.block_size
        if self.window is None:
            return whole
        peak = self.blocks_needed(self.window - 1 + max_step_tokens) + 1
        return max(whole, max_model_len) if peak <= self.num_blocks else whole

    def update_hashes(self, request: SequenceState) -> None:
        """Extend the request's chained block hashes over its newly full blocks."""
        known = len(request.block_hashes)
        num_known = request.num_known_tokens  # pending tokens have no id yet
        if num_known // self.block_size > known:
            parent = request.block_hashes[-1] if known else None
            request.block_hashes.extend(hash_blocks(
                request.token_ids(0, num_known), self.block_size, request.extra_keys, parent,
                known, [image.span for image in request.images]))

    def get_computed_blocks(self, request: SequenceState) -> list[KVBlock]:
        """Longest run of leading blocks already cached for this request's tokens.

        At least one token is always left to compute: its logits give the next
        token. Requests that want prompt logprobs compute every position. With a
        window, the hits behind the window of the first token left to compute are not
        taken by allocate_slots (only their hashes vouch for the run).
        """
        if not self.enable_caching or request.params.prompt_logprobs is not None:
            return []
        self.update_hashes(request)
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
        """Make room for `num_new_tokens` more tokens; False (and no new block taken) if
        blocks run out.

        `computed` are prefix-hit blocks from get_computed_blocks, given only
        when the request is first scheduled (its num_computed_tokens already
        counts them). With a window, the request's blocks behind the window of its first
        new token are released first (even when False is returned: no query reads them).
        """
        total = request.num_computed_tokens + num_new_tokens
        held = self._blocks.get(request.request_id)
        # (A beam keeps its blocks behind the window: a fork's first queries reach back
        # further than its parent's next one.)
        if held is not None and self.window is not None and not request.params.use_beam_search:
            self._release_behind_window(request, held)
        if not computed and held is not None and self.blocks_needed(total) <= len(held):
            # A decode step inside the blocks it has: the common case, nothing to take.
            self._cache_new_full_blocks(request, total, 0)
            return True
        computed = computed or []
        if held is None:
            held = self._blocks[request.request_id] = []
            self._ids[request.request_id] = []
        num_new_blocks = self.blocks_needed(total) - len(held) - len(computed)
        # Prefix hits behind the first new token's window are not taken: placeholders.
        skipped = (self.behind_window(request.num_computed_tokens)
                   if computed and not request.params.use_beam_search else 0)
        taken = computed[skipped:]
        # Prefix-hit blocks with no other user sit in the free list: touching them uses it up.
        num_evictable_hits = sum(1 for b in taken if b.ref_cnt == 0)
        if num_new_blocks + num_evictable_hits > self.pool.num_free_blocks:
            if not held:
                del self._blocks[request.request_id]
                del self._ids[request.request_id]
            return False
        self.pool.touch(taken)
        added = [_RELEASED] * skipped + taken + (
            self.pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else [])
        held.extend(added)
        self._ids[request.request_id].extend(b.block_id for b in added)
        if skipped:
            self._num_released[request.request_id] = skipped
        self._cache_new_full_blocks(request, total, len(computed))
        return True

    def _release_behind_window(self, request: SequenceState, held: list[KVBlock]) -> None:
        """Give the pool back the request's blocks that no query of it will read again."""
        rid = request.request_id
        start = self._num_released.get(rid, 0)
        end = min(self.behind_window(request.num_computed_tokens), len(held))
        if end <= start:
            return
        released = held[start:end]
        held[start:end] = [_RELEASED] * (end - start)
        self._ids[rid][start:end] = [PLACEHOLDER_BLOCK_ID] * (end - start)
        self._num_released[rid] = end
        # Last first, as a finished request's: a prefix keeps its first blocks the longest.
        self.pool.free_blocks(reversed(released))

    def _cache_new_full_blocks(self, request: SequenceState, num_tokens: int, num_hits: int) -> None:
        if not self.enable_caching:
            return
        rid = request.request_id
        # (A block released before its last token's id was known is never indexed.)
        start = max(self._num_cached.get(rid, 0), num_hits, self._num_released.get(rid, 0))
        end = min(num_tokens, request.num_known_tokens) // self.block_size
        self._num_cached[rid] = max(end, start)
        if end <= start:
            return
        self.update_hashes(request)
        held = self._blocks[rid]
        bs = self.block_size
        self.pool.cache_full_blocks(
            held[start:end],
            request.block_hashes[start:end],
            request.token_ids(start * bs, end * bs),
            bs,
            request.block_hashes[start - 1] if start else None,
            owner=rid,
        )

    def cache_computed_blocks(self, request: SequenceState) -> None:
        """Index the request's full computed blocks whose token ids have just become known
        (a block holding a pending token waits for its id)."""
        if request.request_id in self._blocks:
            self._cache_new_full_blocks(request, request.num_computed_tokens, 0)

    def fork(self, parent: SequenceState, child: SequenceState) -> None:
        """Give `child`, a beam holding `parent`'s tokens and one more, `parent`'s full
        computed blocks by reference (no KV is copied); the child computes the tokens of
        the parent's partial last block again, in a block of its own."""
        pid, cid = parent.request_id, child.request_id
        held = self._blocks.get(pid, [])
        shared = min(parent.num_computed_tokens // self.block_size, len(held))
        child.num_computed_tokens = shared * self.block_size
        if not shared:
            return  # (a preempted parent holds none: the child computes all it has)
        assert not self._num_released.get(pid), "a beam keeps its blocks behind the window"
        self.pool.touch(held[:shared])
        self._blocks[cid] = held[:shared]
        self._ids[cid] = self._ids[pid][:shared]
        # The shared blocks are the parent's to index: the child indexes only its own.
        self._num_cached[cid] = shared
        child.block_hashes = parent.block_hashes[:shared]

    def trim(self, request: SequenceState, num_tokens: int) -> None:
        """Release the request's blocks beyond its first `num_tokens` tokens (rejected
        drafts' slots); those blocks hold no indexed (full, known) tokens."""
        held = self._blocks.get(request.request_id)
        keep = self.blocks_needed(num_tokens)
        if held is None or len(held) <= keep:
            return
        assert self._num_cached.get(request.request_id, 0) <= keep, "trimming indexed blocks"
        assert self._num_released.get(request.request_id, 0) <= keep, (
            "trimming back into blocks released behind the window")
        extra = held[keep:]
        del held[keep:]
        del self._ids[request.request_id][keep:]
        self.pool.free_blocks(reversed(extra))

    def free(self, request: SequenceState) -> None:
        """Release every block the request holds (its tail first in eviction order)."""
        blocks = self._blocks.pop(request.request_id, [])
        self._ids.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        released = self._num_released.pop(request.request_id, 0)
        self.pool.free_blocks(reversed(blocks[released:]))
