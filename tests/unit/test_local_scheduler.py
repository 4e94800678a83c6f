"""Local scheduler: step composition, chunked prefill, preemption order and policies."""

from meshserve.services.worker.engine.kv_cache_manager import KVCacheManager
from meshserve.services.worker.engine.sequence import SequenceState, SequenceStatus
from meshserve.services.worker.engine.step_scheduler import StepScheduler, StepSchedulerConfig
from meshserve.shared.sampling_params import SamplingParams


def req(rid: str, n_tokens: int, *, arrival: float, priority: int = 0, base: int = 0) -> SequenceState:
    tokens = [base + i for i in range(n_tokens)]
    return SequenceState(rid, tokens, SamplingParams(max_tokens=64), max_tokens=64,
                   arrival_time=arrival, priority=priority)


def make(budget: int, blocks: int = 64, *, chunked: bool = True, policy: str = "fcfs",
         max_seqs: int = 8, long_prefill: int = 0) -> StepScheduler:
    kv = KVCacheManager(blocks, block_size=4, enable_caching=False)
    return StepScheduler(StepSchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                     enable_chunked_prefill=chunked, policy=policy,
                                     long_prefill_token_threshold=long_prefill), kv)


def composition(out) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def run_step(sched: StepScheduler, out, token: int = 7) -> None:
    """Advance and append a token to every request that finished its prompt, as the engine does."""
    for s in out.scheduled:
        completes = s.completes_prompt
        s.request.num_computed_tokens += s.num_new_tokens
        if completes:
            s.request.output_token_ids.append(token)


def test_chunked_prefill_splits_the_budget_and_mixes_decodes() -> None:
    sched = make(budget=32)
    a, b = req("a", 20, arrival=0), req("b", 20, arrival=1, base=100)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert composition(out) == [("a", 20), ("b", 12)]
    assert out.scheduled[0].completes_prompt and not out.scheduled[1].completes_prompt
    run_step(sched, out)
    out = sched.schedule()
    # a decodes one token; b finishes its prompt with the remaining 8.
    assert composition(out) == [("a", 1), ("b", 8)]


def test_decodes_go_before_a_prefill_admitted_earlier() -> None:
    sched = make(budget=10, blocks=128, long_prefill=8)
    long = req("long", 100, arrival=0)
    shorts = [req(f"s{i}", 2, arrival=1 + i, base=200 + 10 * i) for i in range(4)]
    for r in (long, *shorts):
        sched.add(r)
    out = sched.schedule()
    assert composition(out) == [("long", 8), ("s0", 2)]
    run_step(sched, out)
    out = sched.schedule()  # s0 decodes before long's next chunk; s1 gets what is left
    assert composition(out) == [("s0", 1), ("long", 8), ("s1", 1)]
    run_step(sched, out)
    out = sched.schedule()
    assert composition(out)[:1] == [("s0", 1)] and ("long", 8) in composition(out)


def test_a_prefill_sharing_its_step_is_capped_by_the_long_prefill_threshold() -> None:
    sched = make(budget=32, blocks=128, long_prefill=8)
    a, long = req("a", 4, arrival=0), req("long", 100, arrival=1, base=500)
    sched.add(long)
    out = sched.schedule()
    assert composition(out) == [("long", 32)]  # alone: the whole budget, not the cap
    run_step(sched, out)
    sched.add(a)
    out = sched.schedule()  # a waits: long's chunk is capped and a is admitted beside it
    assert composition(out) == [("long", 8), ("a", 4)]
    run_step(sched, out)
    steps = 0
    while long.is_prefilling:
        out = sched.schedule()
        assert composition(out) == [("a", 1), ("long", min(8, 100 - long.num_computed_tokens))]
        run_step(sched, out)
        steps += 1
    assert steps == 8  # the remaining 60 prompt tokens in chunks of at most 8


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget() -> None:
    sched = make(budget=32, chunked=False)
    a, b = req("a", 20, arrival=0), req("b", 20, arrival=1, base=100)
    sched.add(a)
    sched.add(b)
    assert composition(sched.schedule()) == [("a", 20)]


def test_max_num_seqs_caps_the_batch() -> None:
    sched = make(budget=100, max_seqs=2)
    for i in range(3):
        sched.add(req(f"r{i}", 4, arrival=i, base=10 * i))
    assert composition(sched.schedule()) == [("r0", 4), ("r1", 4)]


def test_preemption_takes_the_latest_running_request_and_requeues_it_first() -> None:
    # 4 blocks of 4 tokens: a (8 tokens) and b (8 tokens) fill the cache exactly.
    sched = make(budget=64, blocks=4)
    a, b, c = req("a", 8, arrival=0), req("b", 8, arrival=1, base=50), req("c", 4, arrival=2)
    for r in (a, b, c):
        sched.add(r)
    out = sched.schedule()
    assert composition(out) == [("a", 8), ("b", 8)]
    run_step(sched, out)
    # a's 9th token needs a fifth block: b (the latest) is preempted for it.
    out = sched.schedule()
    assert composition(out) == [("a", 1)]
    assert out.preempted == [b]
    assert b.status == SequenceStatus.PREEMPTED and b.num_computed_tokens == 0
    assert [r.request_id for r in sched.waiting] == ["b", "c"]  # b keeps its place before c
    assert sched.kv.num_free_blocks == 4 - 3


def test_a_request_preempts_itself_when_it_is_the_lowest_ranked() -> None:
    sched = make(budget=64, blocks=3, policy="priority")
    hi = req("hi", 8, arrival=1, priority=0)
    lo = req("lo", 4, arrival=0, priority=5, base=40)
    sched.add(hi)
    sched.add(lo)
    out = sched.schedule()
    assert composition(out) == [("hi", 8), ("lo", 4)]
    run_step(sched, out)
    # Both need a new block; only "lo" (lower priority) is preempted, even though it came first.
    out = sched.schedule()
    assert composition(out) == [("hi", 1)]
    assert out.preempted == [lo]


def test_priority_policy_admits_by_priority_then_arrival() -> None:
    sched = make(budget=8, policy="priority")
    sched.add(req("late-urgent", 4, arrival=5, priority=-1))
    sched.add(req("early", 4, arrival=0, priority=0, base=20))
    sched.add(req("early-2", 4, arrival=1, priority=0, base=40))
    assert composition(sched.schedule()) == [("late-urgent", 4), ("early", 4)]


def test_fcfs_ignores_priority_and_never_skips_a_blocked_head() -> None:
    sched = make(budget=100, blocks=3)
    sched.add(req("big", 16, arrival=0, priority=9))  # needs 4 blocks, the cache has 3
    sched.add(req("small", 4, arrival=1, priority=-9, base=90))
    assert composition(sched.schedule()) == []


def test_finish_frees_blocks_wherever_the_request_is() -> None:
    sched = make(budget=64, blocks=8, max_seqs=2)
    a, b, c = req("a", 8, arrival=0), req("b", 8, arrival=1, base=30), req("c", 8, arrival=2)
    for r in (a, b, c):
        sched.add(r)
    run_step(sched, sched.schedule())
    assert [r.request_id for r in sched.running] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]
    assert sched.kv.num_free_blocks == 8 - 4
    sched.finish(c, SequenceStatus.FINISHED_ABORTED)  # waiting
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)  # running
    assert sched.kv.num_free_blocks == 8 - 2
    sched.finish(b, SequenceStatus.FINISHED_STOPPED)
    assert sched.kv.num_free_blocks == 8 and sched.num_unfinished == 0
    assert c.status == SequenceStatus.FINISHED_ABORTED
