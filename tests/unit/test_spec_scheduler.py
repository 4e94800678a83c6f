"""The local scheduler with drafts: a speculating sequence's query is its last token plus
its drafts, cut to the budget, and drafts never cost another sequence its blocks."""

from __future__ import annotations

from meshserve.services.worker.engine.kv_cache_manager import KVCacheManager
from meshserve.services.worker.engine.sequence import SequenceState
from meshserve.services.worker.engine.step_scheduler import StepScheduler, StepSchedulerConfig
from meshserve.shared.sampling_params import SamplingParams


def two_decoding(num_blocks: int, budget: int = 64) -> tuple[StepScheduler, SequenceState, SequenceState]:
    """Two sequences with 3-token prompts (one 4-token block each) and one output token."""
    kv = KVCacheManager(num_blocks, block_size=4, enable_caching=False)
    scheduler = StepScheduler(StepSchedulerConfig(max_num_batched_tokens=budget), kv)
    params = SamplingParams(temperature=0.0, max_tokens=20)
    a = SequenceState("a", [1, 2, 3], params, max_tokens=20)
    b = SequenceState("b", [4, 5, 6], params, max_tokens=20)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.advance(scheduler.schedule())
    a.output_token_ids.append(7)
    b.output_token_ids.append(8)
    return scheduler, a, b


def test_drafts_join_the_query_and_take_their_blocks() -> None:
    scheduler, a, _ = two_decoding(num_blocks=4)
    a.spec_token_ids = [9, 9, 9]
    out = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 4),
                                                                                 ("b", 1)]
    assert len(scheduler.kv.block_ids("a")) == 2  # positions 3..6
    assert a.spec_token_ids == [9, 9, 9] and not out.preempted


def test_no_room_for_drafts_decodes_without_them_and_preempts_no_one() -> None:
    scheduler, a, _ = two_decoding(num_blocks=2)
    a.spec_token_ids = [9, 9, 9]
    out = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1),
                                                                                 ("b", 1)]
    assert a.spec_token_ids == [] and not out.preempted


def test_budget_cuts_the_drafts() -> None:
    scheduler, a, _ = two_decoding(num_blocks=8, budget=3)
    a.spec_token_ids = [9, 9, 9]
    out = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 3)]
    assert a.spec_token_ids == [9, 9]


def test_trim_gives_back_the_blocks_of_rejected_drafts() -> None:
    scheduler, a, _ = two_decoding(num_blocks=4)
    a.spec_token_ids = [9, 9, 9]
    scheduler.advance(scheduler.schedule())
    free = scheduler.kv.num_free_blocks
    scheduler.kv.trim(a, 5)  # one draft accepted plus the bonus: 5 tokens
    assert len(scheduler.kv.block_ids("a")) == 2 and scheduler.kv.num_free_blocks == free
    scheduler.kv.trim(a, 4)
    assert len(scheduler.kv.block_ids("a")) == 1 and scheduler.kv.num_free_blocks == free + 1
