"""The engine: one model replica with a paged KV cache and continuous batching.

`step()` is the whole loop body: schedule, launch on the device, apply results.
The worker service runs it in a thread of its own.

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

import contextlib
import dataclasses
import gc
import logging
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from meshserve.services.worker.engine.config import EngineConfig
from meshserve.services.worker.engine.device import resolve_device
from meshserve.services.worker.engine.device_timeline import DeviceTimeline
from meshserve.services.worker.engine.kv_cache_manager import KVCacheManager
from meshserve.services.worker.engine.kv_sizing import (
    gpu_memory_and_name,
    kv_blocks_that_fit,
    piecewise_tokens,
)
from meshserve.services.worker.engine.kv_tier import KVTier, KVTransport
from meshserve.services.worker.engine.model_runner import LaunchedStep, ModelRunner, StepResult
from meshserve.services.worker.engine.request import (
    PENDING_TOKEN,
    Request,
    RequestOutput,
    RequestStatus,
)
from meshserve.services.worker.engine.request_validator import RequestValidator
from meshserve.services.worker.engine.sampler import make_generator
from meshserve.services.worker.engine.scheduler import (
    Scheduler,
    SchedulerConfig,
)
from meshserve.services.worker.engine.step_outputs import (
    accept_grammar_tokens,
    delta_output,
    grammar_status,
    stop_status,
)
from meshserve.services.worker.engine.structured_output import GrammarCompiler, new_matcher
from meshserve.services.worker.lora.manager import LoraManager
from meshserve.services.worker.lora.setup import build_lora
from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.llama import CausalLM
from meshserve.services.worker.models.loader import (
    ModelSource,
    load_model,
    load_model_config,
    load_quant_config,
    resolve_dtype,
    resolve_model,
)
from meshserve.services.worker.parallel.broadcast import StepSync
from meshserve.services.worker.parallel.config import ParallelConfig, ShardPlan
from meshserve.services.worker.parallel.ranks import RankGroup
from meshserve.services.worker.spec.decoder import SpecDecoder
from meshserve.services.worker.spec.setup import attach_speculation, load_draft
from meshserve.services.worker.spec.verify import Verified
from meshserve.shared.block_hash import extra_keys_for
from meshserve.shared.errors import InvalidRequestError, ModelLoadError, NotFoundError
from meshserve.shared.kv_dtype import kv_cache_dtype_name
from meshserve.shared.kv_events import KVEvent
from meshserve.shared.logprobs import TokenLogprobs
from meshserve.shared.lora_config import parse_lora_modules
from meshserve.shared.model_source import tokenizer_folder
from meshserve.shared.quantization import QuantConfig
from meshserve.shared.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# Longest wait for the KV tier when a step has nothing else to run; new requests arriving
# meanwhile are admitted at the next step, so this bounds their extra wait.
_TIER_IDLE_WAIT_S = 0.002

# A collection at least this long is logged (a step of a large model takes a few ms).
GC_PAUSE_LOG_S = 0.02
# The longest `settle_heap` waits for the engine's grammar preload (a 128k vocabulary takes
# seconds; a stuck one must not hold a starting server).
PRELOAD_WAIT_S = 60.0


def settle_heap(engine: LLMEngine | None = None) -> None:
    """Call once a serving process has built its engine and is ready to serve. What it
    built lives as long as the process (modules, graphs, caches, servers, clients, and what
    `engine`'s grammar preload loads, waited for here): frozen, it is left out of the
    collector's full passes, which would otherwise walk all of it between two steps, a
    pause of tens of ms that also stalls every other rank of a tensor-parallel group. Long
    pauses are logged. It blocks (the preload, one full collection): not on an event loop."""
    if engine is not None and not engine.grammars.wait_preloaded(PRELOAD_WAIT_S):
        log.warning("the grammar preload is still running after %.0f s; settling the heap "
                    "without it", PRELOAD_WAIT_S)
    if _collector_watch not in gc.callbacks:
        gc.callbacks.append(_collector_watch)
    _collector_watch.explicit = True  # this collection's pause is asked for: not logged
    try:
        gc.collect()
    finally:
        _collector_watch.explicit = False
    gc.freeze()


@contextlib.contextmanager
def settled_heap(engine: LLMEngine | None = None) -> Iterator[None]:
    """`settle_heap` for a run that ends before the process does (run-batch, bench): the
    heap is unfrozen after it, so what the engine built can be collected, and pauses are no
    longer logged (the collections of whatever the process does next are not the run's)."""
    settle_heap(engine)
    try:
        yield
    finally:
        gc.unfreeze()
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(_collector_watch)


class _CollectorWatch:
    """Logs every garbage collection of this process that takes GC_PAUSE_LOG_S or longer."""

    def __init__(self) -> None:
        self.began = 0.0
        self.explicit = False

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.began = time.perf_counter()
        elif (paused := time.perf_counter() - self.began) >= GC_PAUSE_LOG_S \
                and not self.explicit:
            log.warning("garbage collection of generation %d took %.1f ms (%d objects freed)",
                        info["generation"], paused * 1e3, info["collected"])


_collector_watch = _CollectorWatch()


class LLMEngine:
    """Runs requests given as token ids; emits per-step deltas for every sequence."""

    def __init__(self, config: EngineConfig, *, parallel: ParallelConfig | None = None,
                 sync: StepSync | None = None) -> None:
        """`parallel` and `sync` are given by a follower rank of a tensor-parallel worker
        (parallel/follower.py); rank 0 (every other caller) starts the followers itself."""
        self.config = config
        self.parallel = parallel or ParallelConfig(
            world_size=config.tensor_parallel_size,
            custom_all_reduce=not config.disable_custom_all_reduce)
        self.device = resolve_device(config.device, self.parallel.rank)
        torch.manual_seed(config.seed)
        self.source: ModelSource = resolve_model(config.model, config.load_format)
        self.model_config: ModelConfig = load_model_config(self.source)
        # Checked (a size that does not split the model is refused) before any rank starts.
        shard = ShardPlan(self.model_config, self.parallel) if self.parallel.enabled else None
        self.quant = self._quantization(split=shard is not None)
        self.ranks: RankGroup | None = None
        if shard is not None and sync is None:
            self.ranks = RankGroup.start(config, self.device)
            sync = self.ranks.sync
        self.step_sync = sync
        self.max_model_len = min(self.model_config.max_model_len,
                                 config.max_model_len or self.model_config.max_model_len)
        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device)
        # The KV cache's element type: the model's, or FP8 (--kv-cache-dtype).
        self.kv_dtype: torch.dtype = getattr(torch, kv_cache_dtype_name(
            config.kv_cache_dtype, str(self.dtype).removeprefix("torch.")))
        started = time.monotonic()
        model = load_model(self.source, self.model_config, self.dtype, self.device,
                           config.load_format, shard=shard, quant=self.quant)
        log.info("loaded %s (%s) in %.1fs", self.source.name, self.dtype,
                 time.monotonic() - started)
        # A draft model's weights load before the KV cache is sized, which then holds both
        # models' caches (the draft's has as many blocks as the target's).
        # With tensor parallelism the draft is whole on rank 0, which alone drafts (its
        # forward passes need no other rank); every rank runs the verify passes.
        self.draft = load_draft(config.speculative, model, self.model_config,
                                str(self.source.path), config.load_format, self.dtype,
                                self.device) if self.parallel.is_driver else None
        batched_tokens = config.batched_tokens(self.max_model_len, self.device.type == "cuda")
        self.max_num_seqs = config.seqs_limit(*gpu_memory_and_name(self.device))
        self.lora = self._lora(model, batched_tokens, shard)
        num_blocks = self._num_kv_blocks(model, batched_tokens)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_batched_tokens=batched_tokens,
            max_num_seqs=self.max_num_seqs,
            enable_chunked_prefill=config.enable_chunked_prefill,
            long_prefill_token_threshold=config.prefill_chunk_cap(self.device.type == "cuda"),
            policy=config.scheduling_policy,
            max_model_len=self.max_model_len,
            max_loras=config.max_loras if self.lora is not None else 0,
        ), self.kv)
        self.runner = ModelRunner(model, self.model_config, self.kv, self.kv_dtype, self.device,
                                  sync)
        self.runner.lora = self.lora
        self._capture_graphs(batched_tokens)
        spec = config.speculative  # verify steps take k+1 logit rows per sequence
        self.runner.warm_logits(self.max_num_seqs * (1 + (spec.num_speculative_tokens
                                                          if spec else 0)))
        self.validator = RequestValidator(self.model_config.vocab_size, self.max_model_len,
                                          num_blocks, config.block_size)
        self._groups: dict[str, list[Request]] = {}
        self._aborted: list[Request] = []
        self.async_scheduling = config.async_scheduling == "on" or (
            config.async_scheduling == "auto" and self.device.type == "cuda")
        self.spec: SpecDecoder | None = None
        if config.speculative is not None and self.parallel.is_driver:
            # Drafts are proposed from host tokens: a step that speculates runs after the
            # one before it is read, and is read before the next is scheduled (`step`).
            self.spec = attach_speculation(self, config.speculative)
        self._in_flight: LaunchedStep | None = None  # queued, results not read yet
        self.kv_tier: KVTier | None = None
        # Device time per step for the step trace (`time_device`); None: not timed.
        self.timeline: DeviceTimeline | None = None
        self.grammars = GrammarCompiler(
            lambda: tokenizer_folder(self.source), vocab_size=self.model_config.vocab_size,
            eos_token_ids=self.model_config.eos_token_ids,
            backend=config.structured_outputs_backend)
        self.grammars.preload()
        log.info("KV cache: %d blocks of %d tokens", num_blocks, config.block_size)

    # ----- construction parts -------------------------------------------------
    def _quantization(self, split: bool) -> QuantConfig | None:
        """The weights' quantization (the checkpoint's or --quantization), refused where it
        cannot run yet; called before any tensor-parallel rank starts."""
        config = self.config
        quant = load_quant_config(self.source, config.quantization)
        if config.quantize_lm_head:
            if quant is None:
                raise ModelLoadError("--quantize-lm-head needs FP8 weights (--quantization fp8 "
                                     "or an FP8 checkpoint)", param="quantize_lm_head")
            quant = dataclasses.replace(quant, lm_head=True)
        if split and quant is not None and quant.from_checkpoint \
                and config.load_format != "dummy":
            # The checkpoint's scales would need slicing with their weights.
            raise ModelLoadError(
                "FP8 checkpoints are not split over tensor-parallel ranks; serve this one "
                "with --tensor-parallel-size 1, or a bf16 checkpoint with --quantization fp8",
                param="tensor_parallel_size")
        return quant

    def _lora(self, model: CausalLM, batched_tokens: int,
              shard: ShardPlan | None) -> LoraManager | None:
        """The adapters' slots and host cache (None without --enable-lora); this rank's part
        of each adapter with tensor parallelism."""
        config = self.config
        if not config.enable_lora:
            return None
        return build_lora(
            model, self.model_config, max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank, max_cpu_loras=config.max_cpu_loras,
            max_tokens=max(batched_tokens, self.max_num_seqs),
            modules=parse_lora_modules(config.lora_modules), dtype=self.dtype,
            device=self.device, shard=shard)

    def _capture_graphs(self, batched_tokens: int) -> None:
        """Decode (and verify) CUDA graphs and piecewise prefill graphs, on a GPU unless
        --enforce-eager."""
        self.graph_report = None
        self.piecewise_report = None
        if self.device.type != "cuda" or self.config.enforce_eager:
            return
        spec = self.config.speculative  # verify steps query 2..k+1 tokens per sequence
        verify_lens = tuple(range(2, spec.num_speculative_tokens + 2)) if spec else ()
        self.graph_report = self.runner.capture_graphs(self.max_num_seqs, self.max_model_len,
                                                       verify_lens)
        self.piecewise_report = self.runner.capture_piecewise_graphs(
            piecewise_tokens(batched_tokens))

    # ----- sizing -------------------------------------------------------------
    def _num_kv_blocks(self, model: CausalLM, batched_tokens: int) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        draft_per_block = (0 if self.draft is None else
                           self.draft.kv_bytes_per_block(self.config.block_size, self.dtype))
        num_blocks = kv_blocks_that_fit(model, self.config, self.kv_dtype, self.device,
                                        self.max_num_seqs, batched_tokens, draft_per_block)
        if self.parallel.enabled:  # every rank holds every block: the tightest rank decides
            assert self.step_sync is not None
            num_blocks = self.step_sync.min_over_ranks(num_blocks)
        return num_blocks

    def attach_kv_tier(self, transport: KVTransport, max_save_backlog_bytes: int) -> KVTier:
        """Save computed blocks to, and load prompt blocks from, the KV tier behind
        `transport` from now on."""
        assert self.kv_tier is None, "a KV tier is already attached"
        if self.parallel.enabled:
            raise InvalidRequestError("the KV tier does not yet work with tensor parallelism "
                                      "(each rank holds part of every block)",
                                      param="tensor_parallel_size")
        if not self.config.enable_prefix_caching:
            raise InvalidRequestError("the KV tier needs prefix caching (blocks are found by "
                                      "hash)", param="enable_prefix_caching")
        self.kv_tier = KVTier(self.kv, self.runner.kv_caches, transport,
                              max_save_backlog_bytes=max_save_backlog_bytes)
        self.scheduler.store_gate = self.kv_tier.holds_back
        return self.kv_tier

    # ----- requests ---------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    *, priority: int = 0, cache_salt: str | None = None,
                    lora_id: int | None = None, arrival_time: float | None = None,
                    resumed: Mapping[int, Sequence[int]] | None = None,
                    store_lookup: bool = True, grammar: Any = None,
                    bad_words_ids: tuple[tuple[int, ...], ...] | None = None) -> None:
        """Queue a request (n sequences). Raises InvalidRequestError for a bad one.

        `grammar`: the compiled grammar of `params.structured` (`self.grammars.submit`);
        when a constrained request comes without it, it is compiled here, on the caller's
        thread (the worker's engine thread compiles before adding instead).
        `bad_words_ids`: `params.bad_words` tokenized (`self.grammars.bad_word_ids`), likewise.

        `store_lookup` False: the KV tier is not asked for its prompt blocks (the router
        saw none there).

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
        if params.structured is not None and grammar is None:
            grammar = self.grammars.compile(params.structured)
        if params.bad_words and bad_words_ids is None:
            bad_words_ids = self.grammars.bad_word_ids(params.bad_words)
        if lora_id is not None and self.lora is None:
            raise NotFoundError(f"LoRA adapter {lora_id} is not loaded on this worker "
                                "(LoRA is off)", param="model")
        extra_keys = extra_keys_for(lora_id, cache_salt)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        sequences: list[Request] = []
        # Siblings wait for the first sequence's prompt blocks when there are any to share.
        share = self.config.enable_prefix_caching and params.n > 1 and (
            len(prompt_token_ids) > self.config.block_size)
        indices = range(params.n) if resumed is None else sorted(resumed)
        for index in indices:
            seq = Request(
                request_id if params.n == 1 else f"{request_id}#{index}",
                list(prompt_token_ids), params, group_id=request_id, index=index,
                priority=priority, arrival_time=arrival,
                eos_token_ids=self.model_config.eos_token_ids, max_tokens=max_tokens,
                extra_keys=extra_keys, leader=sequences[0] if share and sequences else None,
                lora_id=lora_id)
            if resumed is not None:
                seq.output_token_ids.extend(resumed[index])
            seq.store_checked = not store_lookup
            if params.seed is not None:
                seq.generator = make_generator(params.seed, self.device, index)
            if grammar is not None:
                seq.grammar = self._matcher(grammar, seq)
            seq.bad_words = bad_words_ids or ()
            sequences.append(seq)
        if lora_id is not None and self.lora is not None:
            self.lora.acquire(lora_id, len(sequences))  # NotFoundError if not served
        self._groups[request_id] = sequences
        for seq in sequences:
            self.scheduler.add(seq)

    def _matcher(self, grammar: Any, seq: Request) -> Any:
        """The sequence's grammar matcher, past the output tokens it already has."""
        stop_ids = list(dict.fromkeys([*seq.eos_token_ids, *seq.params.stop_token_ids]))
        matcher = new_matcher(grammar, stop_ids)
        for token in seq.output_token_ids:  # a resumed sequence's tokens
            if not matcher.accept_token(token):
                raise InvalidRequestError("a resumed sequence's output does not follow its "
                                          "structured output constraint",
                                          param="structured_outputs")
        return matcher

    def abort_request(self, request_id: str, indices: list[int] | None = None) -> None:
        """Stop a request (or only its sequences `indices`) wherever it is. Blocks are freed
        now; the sequences report finish reason "abort" at the next step. Unknown ids are
        ignored."""
        for seq in self._groups.get(request_id, []):
            if not seq.is_finished and (indices is None or seq.index in indices):
                self._finish(seq, RequestStatus.FINISHED_ABORTED)
                self._aborted.append(seq)
        self._forget_if_done(request_id)

    def _finish(self, seq: Request, status: RequestStatus) -> None:
        # A step still on the device may hold the sequence: its token there is dropped,
        # and the blocks it writes are reused only by steps queued after it.
        seq.drop_pending()
        self.scheduler.finish(seq, status)
        if seq.lora_id is not None and self.lora is not None:
            self.lora.release(seq.lora_id)

    def sequences(self, request_id: str) -> list[Request]:
        """The unfinished request's sequences (empty once it is done or unknown)."""
        return list(self._groups.get(request_id, ()))

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or bool(self._aborted) or self._in_flight is not None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    def time_device(self) -> None:
        """Time every step's work on the device from now on (`timeline`; CUDA only)."""
        if self.device.type == "cuda" and self.timeline is None:
            self.timeline = DeviceTimeline()

    def take_kv_events(self) -> list[KVEvent]:
        return self.kv.pool.take_events()

    def close(self) -> None:
        """Stop the tensor-parallel ranks this engine started (nothing to do without)."""
        if self.ranks is not None:
            self.ranks.stop()
            self.ranks = None

    # ----- the loop ---------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; return what the last completed step produced."""
        outputs = [delta_output(seq, []) for seq in self._aborted]
        self._aborted = []
        if self.kv_tier is not None:
            self.kv_tier.poll()
        previous, self._in_flight = self._in_flight, None
        if previous is not None and (self._needs_history(previous) or (
                self.spec is not None and self.spec.waits_for(previous.sample_requests))):
            outputs.extend(self._apply(previous.result()))
            previous = None
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
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
        if self.kv_tier is not None:
            if self.kv_tier.save_new_blocks() and self.timeline is not None:
                self.timeline.tier_queued()  # after the launch that computes them
            if launched is None and previous is None and self.kv_tier.busy:
                self.kv_tier.wait(_TIER_IDLE_WAIT_S)  # only the store has work: no spinning
        return outputs

    @staticmethod
    def _needs_history(step: LaunchedStep) -> bool:
        """Whether the next step needs `step`'s tokens on the host before it samples."""
        return any(seq.params.needs_history and not seq.is_finished
                   for seq in step.sample_requests)

    def _apply(self, result: StepResult) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for request, start, scored in result.prompt_logprobs:
            request.prompt_logprobs[start : start + len(scored)] = scored
        now = time.monotonic()
        accepted = accept_grammar_tokens(result.sampled)
        for seq, token, logprobs in result.sampled:
            if seq.is_finished:  # aborted, or stopped by the step before, while queued
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
        return outputs

    def _apply_verified(self, verified: Verified) -> RequestOutput | None:
        """A speculating sequence's accepted drafts and correction/bonus token, cut at the
        first that finishes it; the slots of rejected drafts are given back."""
        seq = verified.request
        seq.spec_token_ids = []
        if seq.is_finished:  # aborted while its step ran
            return None
        assert self.spec is not None
        self.spec.record(verified)
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
