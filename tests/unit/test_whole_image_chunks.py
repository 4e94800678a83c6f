"""Chunked prefill for models whose image rows attend to their whole image (Gemma 3): no chunk
ends inside an image's placeholder run. A chunk that would is cut back to the run's start; at
the run, the whole run goes in one step when the step has room (past a long-prefill cap),
waits for a step that has when it does not, and goes past the budget only when it is longer
than any step's budget."""

from __future__ import annotations

from meshserve.services.worker.engine.images import PromptImage
from meshserve.services.worker.engine.kv_cache_manager import KVCacheManager
from meshserve.services.worker.engine.sequence import SequenceState
from meshserve.services.worker.engine.step_scheduler import StepScheduler, StepSchedulerConfig
from meshserve.shared.sampling_params import SamplingParams


def image(offset: int, length: int) -> PromptImage:
    return PromptImage(b"", bytes(32), offset, length)


def req(rid: str, n_tokens: int, images: tuple[PromptImage, ...] = (), *,
        arrival: float, base: int = 0) -> SequenceState:
    return SequenceState(rid, [base + i for i in range(n_tokens)], SamplingParams(max_tokens=8),
                         max_tokens=8, arrival_time=arrival, images=images)


def make(budget: int, *, whole: bool = True, long_prefill: int = 0) -> StepScheduler:
    kv = KVCacheManager(128, block_size=4, enable_caching=False)
    return StepScheduler(StepSchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8,
                                             long_prefill_token_threshold=long_prefill,
                                             whole_images=whole), kv)


def steps(sched: StepScheduler, count: int) -> list[list[tuple[str, int]]]:
    """The composition of `count` steps, each advanced as the engine does."""
    seen = []
    for _ in range(count):
        out = sched.schedule()
        seen.append([(s.request.request_id, s.num_new_tokens) for s in out.scheduled])
        for s in out.scheduled:
            completes = s.completes_prompt
            s.request.num_computed_tokens += s.num_new_tokens
            if completes:
                s.request.output_token_ids.append(7)
    return seen


def test_chunks_end_before_an_image_then_take_it_whole() -> None:
    sched = make(budget=8)
    sched.add(req("a", 30, (image(6, 8), image(20, 4)), arrival=0))
    # 0..6 (not into the image at 6), the image 6..14 in one step, 14..20, 20..28, 28..30.
    assert steps(sched, 5) == [[("a", 6)], [("a", 8)], [("a", 6)], [("a", 8)], [("a", 2)]]


def test_without_whole_images_chunks_cut_through_them() -> None:
    sched = make(budget=8, whole=False)
    sched.add(req("a", 30, (image(6, 8),), arrival=0))
    assert steps(sched, 4) == [[("a", 8)], [("a", 8)], [("a", 8)], [("a", 6)]]


def test_an_image_longer_than_the_budget_goes_whole_past_it() -> None:
    sched = make(budget=4)
    sched.add(req("a", 16, (image(2, 10),), arrival=0))
    assert steps(sched, 3) == [[("a", 2)], [("a", 10)], [("a", 4)]]


def test_an_image_waits_for_a_step_with_room_and_others_fill_the_step() -> None:
    sched = make(budget=8)
    sched.add(req("d", 2, arrival=0, base=100))
    sched.add(req("e", 2, arrival=1, base=200))
    sched.add(req("a", 20, (image(2, 7),), arrival=2))
    # Step 1: d, e and a's text before its image; then d and e decode, which leaves 6 tokens
    # but the image needs 7: a waits while they run (8 outputs each), then goes whole.
    seen = steps(sched, 9)
    assert seen[0] == [("d", 2), ("e", 2), ("a", 2)]
    assert seen[1:8] == [[("d", 1), ("e", 1)]] * 7
    assert seen[8] == [("a", 8)]  # the image 2..9 and one token after it


def test_a_waiting_request_at_its_image_does_not_let_a_later_one_first() -> None:
    sched = make(budget=8)
    sched.add(req("d", 3, arrival=0, base=100))
    sched.add(req("a", 12, (image(0, 7),), arrival=1))
    sched.add(req("b", 3, arrival=2, base=200))
    seen = steps(sched, 2)
    assert seen[0] == [("d", 3)]  # a's image (7) does not fit the 5 left; b waits behind a
    assert seen[1] == [("d", 1), ("a", 7)]


def test_an_image_run_fitting_the_budget_goes_past_a_long_prefill_cap() -> None:
    sched = make(budget=16, long_prefill=4)
    sched.add(req("a", 20, (image(4, 6),), arrival=0))
    sched.add(req("b", 2, arrival=1, base=100))
    seen = steps(sched, 3)
    assert seen[0] == [("a", 4), ("b", 2)]
    assert seen[1] == [("b", 1), ("a", 6)]  # the whole run, over the cap of 4
    assert seen[2] == [("b", 1), ("a", 4)]


def test_a_chunk_starting_inside_an_image_takes_the_rest_of_it() -> None:
    """After a prefix-cache hit that ends inside an image, the rest of the image goes whole."""
    sched = make(budget=4)
    a = req("a", 20, (image(2, 9),), arrival=0)
    a.num_computed_tokens = 5  # (as a running request resumed there)
    assert sched._image_cut(a, 5, 4, 4) == 6
    assert sched._image_cut(a, 5, 4, 8) == 6
    assert sched._image_cut(a, 0, 4, 4) == 2
    assert sched._image_cut(a, 11, 4, 4) == 4


def test_prompt_embeddings_chunk_as_text() -> None:
    sched = make(budget=8)
    embeds = PromptImage(b"", bytes(32), 0, 20, dtype="float32")  # a prompt_embeds prompt
    sched.add(req("a", 20, (embeds,), arrival=0))
    assert steps(sched, 3) == [[("a", 8)], [("a", 8)], [("a", 4)]]
