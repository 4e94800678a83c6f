"""Block pool and KV cache manager: exact block ids, reference counts and eviction order."""

from meshserve.services.worker.engine.block_pool import BlockPool
from meshserve.services.worker.engine.kv_cache_manager import KVCacheManager
from meshserve.services.worker.engine.sequence import SequenceState
from meshserve.shared.block_hash import hash_blocks
from meshserve.shared.kv_events import BlockRemoved, BlockStored
from meshserve.shared.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], **params: object) -> SequenceState:
    sp = SamplingParams(max_tokens=8, **params)  # type: ignore[arg-type]
    return SequenceState(rid, tokens, sp, max_tokens=8)


def test_new_blocks_come_from_the_head_of_the_free_list() -> None:
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 3
    pool.free_blocks(reversed(blocks))
    # Freed blocks join the tail, last block first: 3, 4, 5, 2, 1, 0.
    assert [b.block_id for b in pool.get_new_blocks(6)] == [3, 4, 5, 2, 1, 0]


def test_shared_block_is_free_only_after_its_last_reference() -> None:
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert pool.num_free_blocks == 3
    pool.free_blocks([block])
    assert pool.num_free_blocks == 4


def test_cached_free_block_is_evicted_when_reused_and_reported() -> None:
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    hashes = hash_blocks(list(range(8)), 4)
    pool.cache_full_blocks([a, b], hashes, list(range(8)), 4, None)
    events = pool.take_events()
    assert events == [BlockStored(tuple(hashes), None, tuple(range(8)), 4)]
    pool.free_blocks([b, a])
    assert pool.get_cached_block(hashes[0]) is a
    # Both cached blocks are free; the least recently freed (b) goes first.
    (reused,) = pool.get_new_blocks(1)
    assert reused is b
    assert pool.get_cached_block(hashes[1]) is None
    assert pool.get_cached_block(hashes[0]) is a
    assert pool.take_events() == [BlockRemoved((hashes[1],))]


def test_prefix_hit_shares_blocks_and_counts_cached_tokens() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = make_request("a", list(range(10)))
    assert kv.get_computed_blocks(first) == []
    assert kv.allocate_slots(first, 10)
    assert kv.block_ids("a") == [0, 1, 2]
    # Blocks 0 and 1 are full (8 tokens) and now cached.
    second = make_request("b", list(range(8)) + [50, 51, 52])
    hits = kv.get_computed_blocks(second)
    assert [b.block_id for b in hits] == [0, 1]
    second.num_computed_tokens = 8
    assert kv.allocate_slots(second, 3, hits)
    assert kv.block_ids("b") == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    kv.free(first)
    assert kv.num_free_blocks == 8 - 3  # blocks 0, 1 (shared) and 3 still held
    kv.free(second)
    assert kv.num_free_blocks == 8


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = make_request("a", list(range(8)))
    assert kv.allocate_slots(first, 8)
    kv.free(first)
    again = make_request("b", list(range(8)))
    # 8 tokens = 2 full blocks, but the last token must run to produce logits.
    assert [b.block_id for b in kv.get_computed_blocks(again)] == [0]


def test_allocation_fails_without_side_effects_when_blocks_run_out() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    b = make_request("b", list(range(100, 108)))
    assert not kv.allocate_slots(b, 8)
    assert kv.num_free_blocks == 1 and kv.block_ids("b") == []


def test_cache_salt_separates_identical_prompts() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(9)))
    assert kv.allocate_slots(a, 9)
    salted = SequenceState("b", list(range(9)), SamplingParams(max_tokens=4), max_tokens=4,
                     extra_keys=(("salt", "tenant-2"),))
    assert kv.get_computed_blocks(salted) == []


def test_prompt_logprobs_requests_skip_the_prefix_cache() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots(make_request("a", list(range(9))), 9)
    wants_scores = make_request("b", list(range(9)), prompt_logprobs=1)
    assert kv.get_computed_blocks(wants_scores) == []
