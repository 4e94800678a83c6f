"""The engine core: one model replica with a paged KV cache and continuous batching.

`step()` is the whole loop body: schedule, launch on the device, apply results. The
worker service runs it in a thread of its own. The engine is assembled from its parts by
services/worker/builder.py (`build_engine`); features (speculation, LoRA, structured
outputs, the KV tier) take part through the step hooks they are given as (hooks.py).

With async scheduling (the default on a GPU), a step queues its work on the device
and then reads the results of the step before it, so the CPU schedules and prepares
step N+1 while the device runs step N. Tokens that step N samples stay on the device
as step N+1's inputs; the host sees them one step later, and a sequence that turns
out to have stopped at N (EOS, a stop token) spends one discarded token of N+1.
Length limits are known in advance and never waste one. Steps whose sequences need
their whole token history on the host (penalties, bad words) wait for the step before
them; a step with constrained sequences (structured outputs) queues its forward pass
first, then reads the step before (its grammars take those tokens) and queues its sampling.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.beam_requests import BeamRequests, beam_sequence_params
from meshserve.services.worker.engine.cuda_graphs import CaptureReport
from meshserve.services.worker.engine.device_timeline import DeviceTimeline
from meshserve.services.worker.engine.hooks import ImageEmbedder, NewRequest, StepHook, Verified
from meshserve.services.worker.engine.images import PromptImage, check_images
from meshserve.services.worker.engine.kv_cache_manager import KVCacheManager
from meshserve.services.worker.engine.kv_copy import KVCaches
from meshserve.services.worker.engine.model_runner import LaunchedStep, ModelRunner, StepResult
from meshserve.services.worker.engine.request_validator import RequestValidator
from meshserve.services.worker.engine.sampler import make_generator
from meshserve.services.worker.engine.sequence import (
    PENDING_TOKEN,
    SequenceOutput,
    SequenceState,
    SequenceStatus,
)
from meshserve.services.worker.engine.step_outputs import (
    accept_grammar_tokens,
    delta_output,
    grammar_status,
    stop_status,
)
from meshserve.services.worker.engine.step_scheduler import StepScheduler
from meshserve.services.worker.loader import ModelSource
from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.parallel.broadcast import StepPlan
from meshserve.services.worker.parallel.config import ParallelConfig
from meshserve.services.worker.parallel.ranks import RankGroup
from meshserve.shared.block_hash import extra_keys_for
from meshserve.shared.errors import InvalidRequestError, NotFoundError
from meshserve.shared.kv_events import KVEvent
from meshserve.shared.logprobs import TokenLogprobs
from meshserve.shared.quantization import QuantConfig
from meshserve.shared.sampling_params import SamplingParams

HookT = TypeVar("HookT", bound=StepHook)


@dataclass
class EngineParts:
    """Everything an engine runs with, built by `build_engine` (services/worker/builder.py)."""

    config: EngineConfig
    parallel: ParallelConfig
    device: torch.device
    source: ModelSource
    model_config: ModelConfig
    dtype: torch.dtype
    kv_dtype: torch.dtype  # the KV cache's element type: the model's, or FP8
    max_model_len: int
    max_num_seqs: int
    kv: KVCacheManager
    scheduler: StepScheduler
    runner: ModelRunner
    validator: RequestValidator
    quant: QuantConfig | None = None  # the weights' quantization (None: unquantized)
    hooks: tuple[StepHook, ...] = ()
    ranks: RankGroup | None = None  # the tensor-parallel followers this process started
    graph_report: CaptureReport | None = None
    piecewise_report: CaptureReport | None = None


@dataclass(frozen=True)
class EngineLoad:
    """What the engine holds now, for load reports and metrics (engine.load())."""

    num_running: int
    num_waiting: int
    num_pending_prefill_tokens: int  # prompt tokens of running and waiting not computed yet
    num_active_tokens: int  # tokens of every running and waiting sequence
    num_free_blocks: int
    num_total_blocks: int


class LLMEngine:
    """Runs requests given as token ids; emits per-step deltas for every sequence."""

    def __init__(self, parts: EngineParts) -> None:
        self.config = parts.config
        self.parallel = parts.parallel
        self.device = parts.device
        self.source = parts.source
        self.model_config = parts.model_config
        self.dtype = parts.dtype
        self.kv_dtype = parts.kv_dtype
        self.max_model_len = parts.max_model_len
        self.max_num_seqs = parts.max_num_seqs
        self.kv = parts.kv
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.validator = parts.validator
        self.quant = parts.quant
        self.hooks = parts.hooks
        self.graph_report = parts.graph_report
        self.piecewise_report = parts.piecewise_report
        self.ranks = parts.ranks
        self._groups: dict[str, list[SequenceState]] = {}
        self._aborted: list[SequenceState] = []
        self.async_scheduling = self.config.async_scheduling == "on" or (
            self.config.async_scheduling == "auto" and self.device.type == "cuda")
        self._in_flight: LaunchedStep | None = None  # queued, results not read yet
        # Device time per step for the step trace (`time_device`); None: not timed.
        self.timeline: DeviceTimeline | None = None
        self._beams = BeamRequests(
            self.kv, self.scheduler, self._groups, admit=self._admit,
            finish=lambda seq: self._finish(seq, SequenceStatus.FINISHED_STOPPED))

    # ----- what outside code may ask ----------------------------------------------
    def hook(self, kind: type[HookT]) -> HookT | None:
        """This engine's hook of class `kind` (a feature's own object), or None."""
        for hook in self.hooks:
            if isinstance(hook, kind):
                return hook
        return None

    @property
    def images(self) -> ImageEmbedder | None:
        """A vision-language model's image encoder (None for a text model): its checks
        before admission, its counters."""
        return self.runner.images

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def num_kv_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def max_num_batched_tokens(self) -> int:
        return self.scheduler.config.max_num_batched_tokens

    @property
    def kv_caches(self) -> KVCaches:
        """Per layer (k_cache, v_cache), each [num_blocks, block_size, Hkv, D]."""
        return self.runner.kv_caches

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    def load(self) -> EngineLoad:
        """Running and waiting sequences and the KV blocks they leave free."""
        running, waiting = self.scheduler.running, self.scheduler.waiting
        pending = active = 0
        for seqs in (running, waiting):
            for seq in seqs:
                pending += max(seq.num_prompt_tokens - seq.num_computed_tokens, 0)
                active += seq.num_tokens
        return EngineLoad(len(running), len(waiting), pending, active,
                          self.kv.num_free_blocks, self.kv.num_blocks)

    def cache_counters(self) -> tuple[int, int, int]:
        """(preemptions, prefix cache queries, prefix cache hits) since start, in tokens."""
        scheduler = self.scheduler
        return (scheduler.num_preemptions, scheduler.prefix_cache_queries,
                scheduler.prefix_cache_hits)

    def time_device(self) -> None:
        """Time every step's work on the device from now on (`timeline`; CUDA only)."""
        if self.device.type == "cuda" and self.timeline is None:
            self.timeline = DeviceTimeline()

    def follow(self, plan: StepPlan) -> None:
        """A follower rank of a tensor-parallel worker: run the step rank 0 planned."""
        self.runner.follow(plan)

    def watch_layers(self, written: Callable[[int], None]) -> None:
        """Call `written(i)` as each step's layer i is queued (ModelRunner.watch_layers)."""
        self.runner.watch_layers(written)

    def take_kv_events(self) -> list[KVEvent]:
        return self.kv.pool.take_events()

    def close(self) -> None:
        """Stop the tensor-parallel ranks this engine started (nothing to do without)."""
        if self.ranks is not None:
            self.ranks.stop()
            self.ranks = None

    # ----- requests ---------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    *, priority: int = 0, cache_salt: str | None = None,
                    lora_id: int | None = None, arrival_time: float | None = None,
                    resumed: Mapping[int, Sequence[int]] | None = None,
                    store_lookup: bool = True, grammar: Any = None,
                    bad_words_ids: tuple[tuple[int, ...], ...] | None = None,
                    images: Sequence[PromptImage] = ()) -> None:
        """Queue a request (n sequences). Raises InvalidRequestError for a bad one.

        `grammar`: the compiled grammar of `params.structured` (the structured-outputs
        hook's `grammars.submit`); when a constrained request comes without it, that hook
        compiles it here, on the caller's thread (the worker's engine thread compiles before
        adding instead). `bad_words_ids`: `params.bad_words` tokenized, likewise.

        `store_lookup` False: the KV tier is not asked for its prompt blocks (the router
        saw none there). `images`: the prompt's images over their placeholder tokens (a
        vision-language model's; each must decode to as many rows as it has placeholders).

        `resumed` (sequence index -> output tokens it already produced elsewhere): only
        those sequences run, each continuing after its tokens, which count as its output
        as if sampled here. Their KV is computed again with the prompt's (a preempted
        sequence's path), from the prefix cache where it holds them.
        """
        if request_id in self._groups:
            raise InvalidRequestError(f"request id {request_id!r} is already running",
                                      param="request_id")
        max_tokens = self.validator.check(prompt_token_ids, params)
        if resumed is not None:
            self.validator.check_resumed(resumed, len(prompt_token_ids), params.n, max_tokens)
        images = tuple(images)
        embedder = self.runner.images
        check_images(images, len(prompt_token_ids), takes_images=embedder is not None)
        if images and embedder is not None:
            embedder.check(images)
        mrope = self.runner.prompt_positions(len(prompt_token_ids), images)
        beam = params.use_beam_search
        if beam:
            self._check_beam_search(params, resumed, len(prompt_token_ids) + max_tokens)
        if lora_id is not None and not self.config.enable_lora:
            raise NotFoundError(f"LoRA adapter {lora_id} is not loaded on this worker "
                                "(LoRA is off)", param="model")
        extra_keys = extra_keys_for(lora_id, cache_salt)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        sequences: list[SequenceState] = []
        # Siblings wait for the first sequence's prompt blocks when there are any to share.
        share = self.config.enable_prefix_caching and params.n > 1 and (
            len(prompt_token_ids) > self.config.block_size)
        indices = range(params.n) if resumed is None else sorted(resumed)
        run_params = params
        if beam:  # one sequence to start with: the search forks it
            share, indices = False, range(1)
            run_params = beam_sequence_params(params, self.model_config.eos_token_ids,
                                              self.validator.vocab_size)
        for index in indices:
            seq = SequenceState(
                request_id if params.n == 1 else f"{request_id}#{index}",
                list(prompt_token_ids), run_params, group_id=request_id, index=index,
                priority=priority, arrival_time=arrival,
                eos_token_ids=self.model_config.eos_token_ids, max_tokens=max_tokens,
                extra_keys=extra_keys, leader=sequences[0] if share and sequences else None,
                lora_id=lora_id, images=images, mrope=mrope)
            if resumed is not None:
                seq.output_token_ids.extend(resumed[index])
            seq.store_checked = not store_lookup
            if params.seed is not None:
                seq.generator = make_generator(params.seed, self.device, index)
            sequences.append(seq)
        new_request = NewRequest(request_id, run_params, lora_id, images, grammar, bad_words_ids)
        self._admit(sequences, new_request)
        if beam:
            self._beams.open(params, sequences[0], max_tokens, new_request)
        self._groups[request_id] = sequences
        for seq in sequences:
            self.scheduler.add(seq)

    def _check_beam_search(self, params: SamplingParams,
                           resumed: Mapping[int, Sequence[int]] | None, length: int) -> None:
        """Refuse what beam search cannot run with; `length`: the most tokens a beam reaches
        (a beam holds a block per block_size of them, even behind a sliding window)."""
        whole = self.kv.num_blocks * self.kv.block_size
        if length > whole:
            raise InvalidRequestError(
                f"a beam search needs {length} tokens of KV cache for each beam but the whole "
                f"cache holds {whole}; lower max_tokens", param="max_tokens")
        if resumed is not None:
            raise InvalidRequestError("a beam search cannot be resumed on another worker",
                                      param="use_beam_search")
        if self.config.speculative_config is not None:
            raise InvalidRequestError("beam search is not supported with speculative decoding",
                                      param="use_beam_search")

    def _admit(self, sequences: list[SequenceState], request: NewRequest) -> None:
        """Every hook admits the sequences, or the request is refused and what the hooks
        before the refusing one took is given back."""
        admitted: list[StepHook] = []
        try:
            for hook in self.hooks:
                hook.admit(sequences, request)
                admitted.append(hook)
        except BaseException:
            for hook in admitted:
                for seq in sequences:
                    hook.release(seq)
            raise

    def abort_request(self, request_id: str, indices: list[int] | None = None) -> None:
        """Stop a request (or only its sequences `indices`) wherever it is. Blocks are freed
        now; the sequences report finish reason "abort" at the next step. Unknown ids are
        ignored."""
        if request_id in self._beams:  # (its beams go on or stop together)
            indices = None
            self._beams.forget(request_id)
        for seq in self._groups.get(request_id, []):
            if not seq.is_finished and (indices is None or seq.index in indices):
                self._finish(seq, SequenceStatus.FINISHED_ABORTED)
                self._aborted.append(seq)
        self._forget_if_done(request_id)

    def _finish(self, seq: SequenceState, status: SequenceStatus) -> None:
        # A step still on the device may hold the sequence: its token there is dropped,
        # and the blocks it writes are reused only by steps queued after it.
        seq.drop_pending()
        self.scheduler.finish(seq, status)
        for hook in self.hooks:
            hook.release(seq)

    def sequences(self, request_id: str) -> list[SequenceState]:
        """The unfinished request's sequences (empty once it is done or unknown)."""
        return list(self._groups.get(request_id, ()))

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or bool(self._aborted) or self._in_flight is not None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ----- the loop ---------------------------------------------------------------
    def step(self) -> list[SequenceOutput]:
        """Schedule and launch one step; return what the last completed step produced."""
        outputs = [delta_output(seq, []) for seq in self._aborted]
        self._aborted = []
        hooks = self.hooks
        for hook in hooks:
            hook.step_begins()
        previous, self._in_flight = self._in_flight, None
        if previous is not None and (self._needs_history(previous) or any(
                hook.must_read_first(previous.sample_requests) for hook in hooks)):
            outputs.extend(self._apply(previous.result()))
            previous = None
        for hook in hooks:
            hook.before_schedule(self.scheduler.running)
        scheduled = self.scheduler.schedule()
        launched = None
        if not scheduled.empty:
            if self.timeline is not None:
                self.timeline.begin()
            launched = self.runner.launch(scheduled, previous)
            self.scheduler.advance(scheduled)
            for seq in launched.sample_requests:  # their tokens' places, until read
                seq.output_token_ids.append(PENDING_TOKEN)
                seq.num_pending += 1
        if launched is not None and launched.sample_deferred:
            # Constrained sequences: their grammars take the step before's tokens (read
            # now, while the device runs this step's forward), then this step samples.
            if previous is not None:
                outputs.extend(self._apply(previous.result()))
                previous = None
            self.runner.sample(launched)
        if launched is not None and self.timeline is not None:
            self.timeline.end()
        if previous is not None:
            outputs.extend(self._apply(previous.result()))
        if launched is not None:
            # A verify step changes its sequences' lengths by what it accepts: the next
            # step is scheduled from its results.
            if self.async_scheduling and launched.verify is None:
                self._in_flight = launched
            else:
                outputs.extend(self._apply(launched.result()))
        idle = launched is None and previous is None
        for hook in hooks:
            if hook.step_ends(idle) and self.timeline is not None:
                self.timeline.tier_queued()  # after the launch whose results it moves
        return outputs

    @staticmethod
    def _needs_history(step: LaunchedStep) -> bool:
        """Whether the next step needs `step`'s tokens on the host before it samples."""
        return any(seq.params.needs_history and not seq.is_finished
                   for seq in step.sample_requests)

    def _apply(self, result: StepResult) -> list[SequenceOutput]:
        outputs: list[SequenceOutput] = []
        for request, start, scored in result.prompt_logprobs:
            request.prompt_logprobs[start : start + len(scored)] = scored
        now = time.monotonic()
        accepted = accept_grammar_tokens(result.sampled)
        for seq, token, logprobs in result.sampled:
            if seq.is_finished:  # aborted, or stopped by the step before, while queued
                continue
            if seq.params.use_beam_search:  # the search picks the token
                assert logprobs is not None, "a beam's step has its top logprobs"
                seq.first_token_time = seq.first_token_time or now
                self._beams.report(seq, logprobs)
                continue
            # The oldest pending place is this step's (a later step's may follow it).
            place = len(seq.output_token_ids) - seq.num_pending
            seq.output_token_ids[place] = token
            seq.num_pending -= 1
            count = place + 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            status = stop_status(seq, token, count, self.max_model_len)
            if seq.grammar is not None and status is None:
                status = grammar_status(seq, token, accepted[id(seq)])
            if status is not None:
                self._finish(seq, status)
                self._forget_if_done(seq.group_id)
            elif (seq.num_prompt_tokens + count) % self.kv.block_size == 0:
                # This token completes a block whose hash waited for its id.
                self.kv.cache_computed_blocks(seq)
            outputs.append(delta_output(seq, [token], logprobs, count))
        for verified in result.verified:
            output = self._apply_verified(verified)
            if output is not None:
                outputs.append(output)
        outputs.extend(self._beams.advance())
        return outputs

    def _apply_verified(self, verified: Verified) -> SequenceOutput | None:
        """A speculating sequence's accepted drafts and correction/bonus token, cut at the
        first that finishes it; the slots of rejected drafts are given back."""
        seq = verified.request
        seq.spec_token_ids = []
        if seq.is_finished:  # aborted while its step ran
            return None
        for hook in self.hooks:
            hook.record_verified(verified)
        tokens: list[int] = []
        logprobs: list[TokenLogprobs] = []
        status = None
        for token, entry in zip(verified.token_ids, verified.logprobs, strict=True):
            seq.output_token_ids.append(token)
            tokens.append(token)
            if entry is not None:
                logprobs.append(entry)
            status = stop_status(seq, token, seq.num_output_tokens, self.max_model_len)
            if status is not None:
                break
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        if status is not None:
            self._finish(seq, status)
            self._forget_if_done(seq.group_id)
        else:
            # KV holds the last token and the accepted drafts; the new last token has none.
            seq.num_computed_tokens = seq.num_tokens - 1
            self.kv.trim(seq, seq.num_tokens)
            self.kv.cache_computed_blocks(seq)
        out = delta_output(seq, tokens, None, seq.num_output_tokens)
        out.new_logprobs = logprobs or None
        return out

    def _forget_if_done(self, group_id: str) -> None:
        group = self._groups.get(group_id)
        if group is not None and all(s.is_finished for s in group):
            del self._groups[group_id]


def random_request_id() -> str:
    return uuid.uuid4().hex
