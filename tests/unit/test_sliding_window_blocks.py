"""Blocks behind a sliding window: a KV cache manager whose model slides every layer releases
each sequence's blocks that no later query reads, as it advances. Exact block ids, placeholders,
prefix-cache hits of released blocks, and the capacity it frees for other sequences."""

from __future__ import annotations

import pytest

from meshserve.services.worker.engine.kv_cache_manager import (
    PLACEHOLDER_BLOCK_ID,
    KVCacheManager,
)
from meshserve.services.worker.engine.request_validator import RequestValidator
from meshserve.services.worker.engine.sequence import SequenceState, SequenceStatus
from meshserve.services.worker.engine.step_scheduler import StepScheduler, StepSchedulerConfig
from meshserve.shared.block_hash import hash_blocks
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.sampling_params import SamplingParams

P = PLACEHOLDER_BLOCK_ID


def make_request(rid: str, tokens: list[int], max_tokens: int = 64) -> SequenceState:
    return SequenceState(rid, tokens, SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)


def decode(kv: KVCacheManager, request: SequenceState, token: int) -> None:
    """One decode step as the engine runs it: slots for the last token, its KV computed,
    the sampled token appended."""
    assert kv.allocate_slots(request, 1)
    request.num_computed_tokens += 1
    request.output_token_ids.append(token)


def test_blocks_behind_the_window_are_released_as_the_sequence_advances() -> None:
    # Window 6, blocks of 4: the query at position p reads keys p-5..p.
    kv = KVCacheManager(num_blocks=8, block_size=4, window=6)
    a = make_request("a", list(range(10)))
    assert kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    a.output_token_ids.append(100)
    assert kv.block_ids("a") == [0, 1, 2]
    # The query at 10 reads 5..10: block 0 (positions 0-3) is behind it, released now.
    decode(kv, a, 101)
    assert kv.block_ids("a") == [P, 1, 2]
    assert kv.num_held_blocks("a") == 2 and kv.num_free_blocks == 6
    decode(kv, a, 102)  # the query at 11 reads 6..11: block 1 is still read
    assert kv.block_ids("a") == [P, 1, 2]
    decode(kv, a, 103)  # position 12 opens a block, taken from the head of the free list
    assert kv.block_ids("a") == [P, 1, 2, 3]
    decode(kv, a, 104)  # the query at 13 reads 8..13: block 1 (4-7) is released
    assert kv.block_ids("a") == [P, P, 2, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [0, 0, 1, 1]
    assert kv.num_free_blocks == 6
    kv.free(a)
    assert kv.num_free_blocks == 8 and kv.block_ids("a") == []


def test_without_a_window_every_block_is_held_until_the_end() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(10)))
    assert kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    a.output_token_ids.append(100)
    for token in range(101, 105):
        decode(kv, a, token)
    assert kv.block_ids("a") == [0, 1, 2, 3] and kv.num_held_blocks("a") == 4
    assert kv.behind_window(1000) == 0


def test_released_full_blocks_stay_cached_and_are_prefix_hits() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, window=6)
    a = make_request("a", list(range(13)))
    assert kv.allocate_slots(a, 13)
    a.num_computed_tokens = 13
    a.output_token_ids.append(100)
    decode(kv, a, 101)  # the query at 13 reads 8..13: blocks 0 and 1 are released
    assert kv.block_ids("a") == [P, P, 2, 3]
    hashes = hash_blocks(list(range(12)), 4)
    assert [kv.pool.get_cached_block(h).block_id for h in hashes] == [0, 1, 2]  # type: ignore[union-attr]
    # Free but cached: a request starting with those tokens hits them all.
    b = make_request("b", list(range(12)) + [50, 51])
    hits = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1, 2]
    b.num_computed_tokens = 12
    # b's first new token (position 12) reads 7..12: block 0 is behind it and is not taken;
    # block 1 comes back from the free list, block 2 is shared with a.
    assert kv.allocate_slots(b, 2, hits)
    assert kv.block_ids("b") == [P, 1, 2, 4]
    assert [kv.pool.blocks[i].ref_cnt for i in range(5)] == [0, 1, 2, 1, 1]
    assert kv.num_free_blocks == 4  # 5, 6, 7, 0
    kv.free(b)
    kv.free(a)
    assert kv.num_free_blocks == 8


def test_a_hit_wholly_behind_the_window_takes_no_block() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4, window=4)
    a = make_request("a", list(range(17)))
    assert kv.allocate_slots(a, 17)
    kv.free(a)  # blocks 0-3 cached and free
    b = make_request("b", list(range(17)) + [99])
    hits = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1, 2, 3]
    b.num_computed_tokens = 16
    # Position 16 reads 13..16: only block 3 of the hits (12-15) is taken, then a new block.
    assert kv.allocate_slots(b, 2, hits)
    assert kv.block_ids("b") == [P, P, P, 3, 5]
    assert [kv.pool.blocks[i].ref_cnt for i in range(6)] == [0, 0, 0, 1, 0, 1]
    # The untaken hits stay cached and free (evictable), counted in no one's blocks.
    assert kv.num_free_blocks == 4 and kv.pool.num_cached_blocks == 4


def test_released_blocks_are_reused_by_other_sequences() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, window=4, enable_caching=False)
    a = make_request("a", list(range(8)))
    b = make_request("b", list(range(100, 108)))
    assert kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    a.output_token_ids.append(0)
    assert kv.allocate_slots(b, 4)  # b's first chunk
    b.num_computed_tokens = 4
    decode(kv, a, 1)  # a's query at 8 reads 5..8: block 0 released, block 3 opened
    assert kv.block_ids("a") == [P, 1, 3]
    assert kv.allocate_slots(b, 4)  # b's second block is the one a released
    assert kv.block_ids("b") == [2, 0] and kv.num_free_blocks == 0


def test_capacity_admits_more_sequences_than_without_releasing() -> None:
    """Three sequences growing to 40 tokens, blocks of 4, a 12-block cache: held whole (10
    blocks each) they cannot all stay and some are preempted; with a window of 8 each holds at
    most 3 blocks and all three run together to the end without one preemption."""
    def run(window: int | None) -> tuple[int, int]:
        kv = KVCacheManager(num_blocks=12, block_size=4, window=window, enable_caching=False)
        sched = StepScheduler(StepSchedulerConfig(max_num_batched_tokens=8, max_num_seqs=8), kv)
        for i in range(3):
            sched.add(make_request(f"r{i}", [100 * i + t for t in range(8)], max_tokens=32))
        most_running = 0
        while sched.running or sched.waiting:
            out = sched.schedule()
            most_running = max(most_running, len(sched.running))
            for s in out.scheduled:
                r = s.request
                held = kv.num_held_blocks(r.request_id)
                assert window is None or held <= 3, held
                done = s.completes_prompt
                r.num_computed_tokens += s.num_new_tokens
                if done:
                    r.output_token_ids.append(7)
                if r.num_tokens == 40:
                    sched.finish(r, SequenceStatus.FINISHED_LENGTH)
        assert kv.num_free_blocks == 12
        return most_running, sched.num_preemptions

    assert run(None)[1] > 0
    assert run(8) == (3, 0)


@pytest.mark.parametrize("window, capacity", [(None, 48), (8, 4096), (40, 48)])
def test_one_sequence_may_outgrow_the_cache_when_the_window_peak_fits(
        window: int | None, capacity: int) -> None:
    """A step of up to 16 tokens over a window W holds cdiv(W - 1 + 16, 4) + 1 blocks: with
    W = 8, 7 of the 12 blocks, so any length runs; with W = 40, 15: no more than the cache."""
    kv = KVCacheManager(num_blocks=12, block_size=4, window=window)
    assert kv.sequence_capacity(16, max_model_len=4096) == capacity
    validator = RequestValidator(vocab_size=1000, max_model_len=4096, capacity=capacity)
    params = SamplingParams(max_tokens=500)
    if capacity > 48:
        assert validator.check(list(range(100)), params) == 500
    else:
        with pytest.raises(InvalidRequestError, match="whole cache holds 48"):
            validator.check(list(range(100)), params)
