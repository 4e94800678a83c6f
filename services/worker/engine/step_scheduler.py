"""The local scheduler: continuous batching under a token budget, with chunked prefill and preemption."""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from meshserve.services.worker.engine.kv_cache_manager import KVCacheManager
from meshserve.services.worker.engine.sequence import SequenceState, SequenceStatus


@dataclass(frozen=True)
class StepSchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    # Most prompt tokens one request prefills in a step while other requests run or wait
    # (0: no cap beyond the step budget). Caps a long prompt's chunks so that the decodes
    # sharing its steps keep their pace and new requests are admitted between its chunks;
    # alone, a prompt still takes the whole budget.
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"  # "fcfs" | "priority"
    max_model_len: int = 2048
    # Distinct LoRA adapters among running requests (the device slots; 0: LoRA is off).
    max_loras: int = 0
    # Never end a prefill chunk inside an image's placeholder run: the model's image rows
    # attend to their whole image (Gemma 3), so a run is computed in one step (`_image_cut`).
    whole_images: bool = False

    def __post_init__(self) -> None:
        assert self.policy in ("fcfs", "priority"), f"unknown scheduling policy {self.policy!r}"
        assert self.max_num_batched_tokens > 0 and self.max_num_seqs > 0
        assert self.long_prefill_token_threshold >= 0


@dataclass
class ScheduledSequence:
    request: SequenceState
    num_new_tokens: int

    @property
    def completes_prompt(self) -> bool:
        """Whether every known token has KV after this step, so the step samples a token."""
        return self.request.num_computed_tokens + self.num_new_tokens >= self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[SequenceState] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class StepScheduler:
    """Decides each step which requests run and how many of their tokens.

    Running requests go first (decodes, then unfinished prefills, each in the
    order they were admitted; while other requests run or wait, a prefill chunk
    is capped at long_prefill_token_threshold; with whole_images no chunk ends inside an
    image's placeholder run); when blocks run out the lowest-ranked running
    request is preempted (its KV freed, to be recomputed later). Waiting
    requests are admitted in policy order while budget, sequence slots and
    blocks last; FCFS never lets a later request jump a blocked earlier one.
    """

    def __init__(self, config: StepSchedulerConfig, kv: KVCacheManager, *,
                 store_gate: Callable[[SequenceState, int], bool] | None = None) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[SequenceState] = []  # sorted by _rank
        self.running: list[SequenceState] = []
        self._arrivals = 0
        self._order: dict[str, tuple[int, float, int]] = {}
        # The KV tier's hold on admission: given a waiting request and its local prefix
        # hits (blocks), whether it waits for blocks from the store (others go meanwhile).
        self.store_gate = store_gate
        # Totals since start for the worker's metrics (read from another thread: plain ints).
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up at first admission
        self.prefix_cache_hits = 0  # of them, found in the prefix cache

    # ----- queue management -------------------------------------------------
    def _rank(self, request: SequenceState) -> tuple[int, float, int]:
        return self._order[request.request_id]

    def add(self, request: SequenceState) -> None:
        priority = request.priority if self.config.policy == "priority" else 0
        self._order[request.request_id] = (priority, request.arrival_time, self._arrivals)
        self._arrivals += 1
        self._enqueue(request)

    def _enqueue(self, request: SequenceState) -> None:
        keys = [self._rank(r) for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, self._rank(request)), request)

    def fork(self, parent: SequenceState, child: SequenceState) -> None:
        """Queue `child`, a beam forked from `parent` (its blocks shared by
        KVCacheManager.fork), at the parent's rank: running beside a running parent (past
        max_num_seqs if need be: the siblings wait for it), else waiting."""
        self._order[child.request_id] = self._order[parent.request_id]
        if parent.status == SequenceStatus.RUNNING:
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        else:
            self._enqueue(child)

    def finish(self, request: SequenceState, status: SequenceStatus) -> None:
        """Remove a request wherever it is and free its blocks."""
        if request.status == SequenceStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = status
        self._order.pop(request.request_id, None)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ----- one step -----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # Decodes first: a prompt being prefilled in chunks never holds them back.
        decoding: list[SequenceState] = []
        prefilling: list[SequenceState] = []
        for r in self.running:
            (prefilling if r.is_prefilling else decoding).append(r)
        budget = self._schedule_running(out, budget, decoding)
        budget = self._schedule_running(out, budget, prefilling)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _chunk(self, num_new: int, budget: int) -> int:
        """Prompt tokens to prefill this step, under chunked prefill: capped while any other
        request is running or waiting, the whole budget for a prompt that is alone."""
        cap = self.config.long_prefill_token_threshold
        if cap and len(self.running) + len(self.waiting) > 1:
            num_new = min(num_new, cap)
        return min(num_new, budget)

    def _image_cut(self, request: SequenceState, start: int, num_new: int, budget: int) -> int:
        """With `whole_images`, the tokens from `start` to prefill instead of a chunk of
        `num_new` that would end inside an image's placeholder run: up to the run when the
        chunk starts before it; else the rest of the run, past a long-prefill cap, when it
        fits the step's `budget`; else none (a later step with fewer decodes has room), unless
        the run is longer than any step's budget: then the whole run, past the budget (the
        one way it can make progress)."""
        if not self.config.whole_images or not request.images:
            return num_new
        end = start + num_new
        # (Prompt embeddings' rows stay causal: their run is chunked as text is.)
        image = next((i for i in request.images
                      if not i.is_embeds and i.offset < end < i.end), None)
        if image is None:
            return num_new
        if image.offset > start:
            return image.offset - start
        run = image.end - start
        return run if run <= budget or run > self.config.max_num_batched_tokens else 0

    def _schedule_running(self, out: SchedulerOutput, budget: int,
                          requests: list[SequenceState]) -> int:
        for request in requests:
            if budget <= 0:
                break
            if request.status != SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            if self._at_length_limit(request):
                continue  # its last token is still on the device: it finishes when read
            drafts = request.spec_token_ids  # verified after the last token, if room allows
            num_new = request.num_tokens - request.num_computed_tokens + len(drafts)
            if self.config.enable_chunked_prefill:
                num_new = self._image_cut(request, request.num_computed_tokens,
                                          self._chunk(num_new, budget), budget)
            elif num_new > budget:
                continue
            if num_new == 0:
                continue  # its next image waits for a step with room for all of it
            del drafts[max(num_new - 1, 0):]
            if not (drafts and self.kv.allocate_slots(request, num_new)):
                num_new -= len(drafts)  # no room for drafts: no one is preempted for them
                drafts.clear()
                if not self._allocate_or_preempt(request, num_new, out):
                    continue
            out.scheduled.append(ScheduledSequence(request, num_new))
            budget -= num_new
        return budget

    def _allocate_or_preempt(self, request: SequenceState, num_new: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate_slots(request, num_new):
            victim = max(self.running, key=self._rank)
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _preempt(self, request: SequenceState, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = SequenceStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.spec_token_ids = []
        out.preempted.append(request)
        out.scheduled = [s for s in out.scheduled if s.request is not request]
        self._enqueue(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        for request in list(self.waiting):
            if budget <= 0:
                break
            if len(self.running) >= self.config.max_num_seqs and not request.params.use_beam_search:
                break  # (a beam goes past the cap: its siblings hold their slots waiting for it)
            if request.num_pending:
                continue  # preempted while its last token was on the device: wait for it
            if request.leader is not None and not self._leader_done(request.leader):
                continue  # an n>1 sibling waits to share its leader's prompt blocks
            if not self._lora_fits(request):
                continue  # every adapter slot is taken by running requests' adapters
            computed = self.kv.get_computed_blocks(request)
            if self.store_gate is not None and self.store_gate(request, len(computed)):
                continue
            num_computed = len(computed) * self.kv.block_size
            num_new = request.num_tokens - num_computed
            if self.config.enable_chunked_prefill:
                num_new = self._image_cut(request, num_computed, self._chunk(num_new, budget),
                                          budget)
            elif num_new > budget:
                break
            if num_new == 0:
                break  # (as a prompt over the budget: no later request goes first)
            request.num_computed_tokens = num_computed
            if not self.kv.allocate_slots(request, num_new, computed):
                request.num_computed_tokens = 0
                break
            self.waiting.remove(request)
            self.running.append(request)
            request.status = SequenceStatus.RUNNING
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
                request.first_scheduled_time = time.monotonic()
                if self.kv.enable_caching:
                    self.prefix_cache_queries += request.num_tokens
                    self.prefix_cache_hits += num_computed
            out.scheduled.append(ScheduledSequence(request, num_new))
            budget -= num_new

    def _lora_fits(self, request: SequenceState) -> bool:
        """Whether the request's adapter is running already or a slot is left for it."""
        if request.lora_id is None:
            return True
        running = {r.lora_id for r in self.running if r.lora_id is not None}
        return request.lora_id in running or len(running) < self.config.max_loras

    def _at_length_limit(self, request: SequenceState) -> bool:
        return (request.num_output_tokens >= request.max_tokens
                or request.num_tokens >= self.config.max_model_len)

    @staticmethod
    def _leader_done(leader: SequenceState) -> bool:
        return leader.is_finished or leader.prompt_done

    # ----- after the step ------------------------------------------------------
    def advance(self, out: SchedulerOutput) -> None:
        """Count the step's tokens as computed (their KV is now in the cache)."""
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
