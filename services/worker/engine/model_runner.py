"""Runs one scheduled step on the model: builds flat inputs, forwards, samples."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

import torch

from meshserve.kernels.attention import AttentionMetadata
from meshserve.kernels.linear import SKINNY_MAX_ROWS
from meshserve.services.worker.engine.cuda_graphs import (
    CaptureReport,
    CudaGraphRunner,
    PiecewiseGraphRunner,
)
from meshserve.services.worker.engine.hooks import (
    AdapterSlots,
    DraftVerifier,
    ImageEmbedder,
    PendingVerification,
    Verified,
)
from meshserve.services.worker.engine.images import (
    ImageSlice,
    PromptImage,
    image_lookahead,
    slices_in,
)
from meshserve.services.worker.engine.kv_cache_manager import KVCacheManager
from meshserve.services.worker.engine.mrope import (
    ImageGrids,
    MropePositions,
    image_grids,
    prompt_positions,
    step_positions,
)
from meshserve.services.worker.engine.sampler import (
    HostCopy,
    PendingSample,
    Sampler,
    SamplingRow,
    logprob_entries,
    logprob_table,
)
from meshserve.services.worker.engine.sequence import SequenceState
from meshserve.services.worker.engine.step_scheduler import SchedulerOutput
from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.llama import CausalLM, padded_logit_rows
from meshserve.services.worker.parallel.broadcast import StepPlan, StepSync
from meshserve.shared.errors import InternalError
from meshserve.shared.logprobs import TokenLogprobs


@dataclass
class StepResult:
    """What the model produced in one step."""

    # (sequence, its token, that token's logprobs) for every sequence that sampled
    sampled: list[tuple[SequenceState, int, TokenLogprobs | None]] = field(default_factory=list)
    # (sequence, first prompt position scored, logprobs from that position on)
    prompt_logprobs: list[tuple[SequenceState, int, list[TokenLogprobs | None]]] = field(
        default_factory=list)
    # Speculating sequences' accepted drafts and correction/bonus token (spec/verify.py)
    verified: list[Verified] = field(default_factory=list)


@dataclass
class StepInputs:
    """The flat token batch of one step, on the model's device."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: list[int]  # row in [T] of the last token of each request that samples
    sample_requests: list[SequenceState]
    # Requests wanting prompt logprobs, with the rows whose logits score their next prompt token.
    prompt_rows: list[tuple[SequenceState, list[int]]]
    # Rows whose token was sampled by the previous step and is still on the device, and
    # where that step's sampled tokens hold it.
    pending_rows: list[int] = field(default_factory=list)
    pending_sources: list[int] = field(default_factory=list)
    # The host lists, kept for the other tensor-parallel ranks (None without them).
    plan: StepPlan | None = None
    # Speculating sequences and the rows of their [last token + drafts] queries.
    verify_requests: list[SequenceState] = field(default_factory=list)
    verify_rows: list[int] = field(default_factory=list)
    # Rows on images' placeholder tokens, and the images' rows they take, in that order.
    image_rows: list[int] = field(default_factory=list)
    image_slices: list[ImageSlice] = field(default_factory=list)


@dataclass
class _PromptScores:
    request: SequenceState
    first_position: int
    table: HostCopy  # logprob_table's rows, on their way to the host
    leading_none: bool  # position 0 has no logprob (nothing precedes it)


class LaunchedStep:
    """A step queued on the device: its sampled tokens stay there for the next step's
    inputs, and `result()` waits for them on the host (the one wait of a step)."""

    def __init__(self, scheduled: SchedulerOutput, sample_requests: list[SequenceState],
                 sample: PendingSample | None, prompt_scores: list[_PromptScores]) -> None:
        self.scheduled = scheduled
        self.sample_requests = sample_requests
        self.sample = sample
        self.prompt_scores = prompt_scores
        # Sequence (by identity) -> its row in `sample.token_ids`.
        self.sample_index = {id(r): i for i, r in enumerate(sample_requests)}
        # [S, V] float32 logits of a step whose sampling is not queued yet.
        self.logits: torch.Tensor | None = None
        self.verify: PendingVerification | None = None  # speculating sequences' verify pass

    @property
    def sample_deferred(self) -> bool:
        """Whether `ModelRunner.sample` must still queue this step's sampling."""
        return self.logits is not None

    def result(self) -> StepResult:
        result = StepResult()
        for scores in self.prompt_scores:
            entries: list[TokenLogprobs | None] = [None] if scores.leading_none else []
            entries.extend(logprob_entries(scores.table.get().tolist()))
            result.prompt_logprobs.append((scores.request, scores.first_position, entries))
        if self.sample is not None:
            sampled = self.sample.read()
            result.sampled = list(zip(self.sample_requests, sampled.token_ids,
                                      sampled.logprobs, strict=True))
        if self.verify is not None:
            result.verified = self.verify.read()
        return result


@torch.inference_mode()
def profile_activation_bytes(model: CausalLM, config: ModelConfig, num_tokens: int,
                             num_logit_rows: int, block_size: int, dtype: torch.dtype,
                             device: torch.device) -> int:
    """Peak GPU memory a step of `num_tokens` prompt tokens needs beyond the weights.

    Runs one prefill of that many tokens over a throw-away KV cache just big enough for it,
    plus the logits of `num_logit_rows` rows, and reads the allocator's peak.
    """
    num_blocks = -(-num_tokens // block_size) + 1
    shape = (num_blocks, block_size, config.cache_kv_heads, config.cache_head_dim)
    caches = [(torch.zeros(shape, dtype=dtype, device=device),
               torch.zeros(shape, dtype=dtype, device=device))
              for _ in range(config.num_hidden_layers)]
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    positions = torch.arange(num_tokens, device=device)
    meta = AttentionMetadata(
        slot_mapping=positions.clone(),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        max_query_len=num_tokens, max_seq_len=num_tokens,
        query_lens_cpu=[num_tokens], seq_lens_cpu=[num_tokens])
    ids = torch.randint(0, config.vocab_size, (num_tokens,), device=device)
    hidden = model(ids, positions, caches, meta)
    rows = hidden[:num_logit_rows]
    logits = model.compute_logits(rows)
    torch.log_softmax(logits, dim=-1)  # the sampler's largest temporary
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - baseline
    del caches, hidden, logits
    torch.cuda.empty_cache()
    return peak


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one block across all layers (for latent attention, the
    compressed rows: `ModelConfig.cache_kv_heads` / `cache_head_dim`)."""
    element = torch.tensor([], dtype=dtype).element_size()
    per_token = 2 * config.cache_kv_heads * config.cache_head_dim * element
    return per_token * block_size * config.num_hidden_layers


class ModelRunner:
    """Owns the model, its KV cache tensors and the sampler."""

    def __init__(self, model: CausalLM, config: ModelConfig, kv: KVCacheManager,
                 dtype: torch.dtype, device: torch.device, sync: StepSync | None = None, *,
                 sampler: Sampler | None = None, adapters: AdapterSlots | None = None,
                 verifier: DraftVerifier | None = None,
                 images: ImageEmbedder | None = None) -> None:
        """`sync`: hands each step to the other tensor-parallel ranks (None: no others).
        `adapters`: multi-LoRA serving's slots (None: off); `verifier`: speculation's verify
        pass (None: no drafts are scheduled); `sampler`: shared with the verifier;
        `images`: a vision-language model's encoder (None: the model takes no images)."""
        self.model = model
        self.config = config
        self.kv = kv
        self.device = device
        self.sync = sync
        self.block_size = kv.block_size
        # The model's own KV heads: a tensor-parallel rank holds only its share. (Latent
        # attention caches one compressed row a token: ModelConfig.cache_head_dim.)
        shape = (kv.num_blocks, kv.block_size, model.config.cache_kv_heads,
                 model.config.cache_head_dim)
        # Per layer: (k_cache, v_cache), each [num_blocks, block_size, Hkv, D]: views of one
        # [layers, 2, num_blocks, ...] tensor, so that the KV tier moves whole blocks of every
        # layer in one gather (kv_copy.py).
        storage = torch.zeros((config.num_hidden_layers, 2, *shape), dtype=dtype,
                              device=device)
        self.kv_caches = [(storage[layer, 0], storage[layer, 1])
                          for layer in range(config.num_hidden_layers)]
        self.sampler = sampler or Sampler(config.vocab_size, device)
        self.graphs: CudaGraphRunner | None = None
        self.pieces: PiecewiseGraphRunner | None = None
        self.lora = adapters
        self.verifier = verifier
        self.images = images
        # M-RoPE models (Qwen2.5-VL) take each step's positions from its sequences' images.
        self.mrope = bool(config.mrope_section)
        self.last_path = ""  # how the last forward ran: graph, verify_graph, piecewise, eager
        # cuBLAS's first LM-head product of each row count stalls the host: few counts.
        model.pad_logit_rows = device.type == "cuda"
        if device.type == "cuda":  # attention's kernels compiled now, not while serving
            from meshserve.kernels import triton_attention, triton_mla

            heads, dtype = model.config.num_attention_heads, model.model.embed_tokens.weight.dtype
            if model.config.kv_lora_rank:  # latent attention (models/deepseek_v2.py)
                triton_mla.compile_every_variant(*self.kv_caches[0], heads,
                                                 model.config.kv_lora_rank, dtype)
            else:
                triton_attention.compile_every_variant(*self.kv_caches[0], heads, dtype)

    @torch.inference_mode()
    def warm_logits(self, max_rows: int) -> int:
        """Run the LM head once at every padded row count up to `max_rows`, where the model
        pads its logit rows (GPUs; `CausalLM.compute_logits`): the first product of each
        size holds the host until the device is idle, which mid-serving stops the overlapped
        loop. Every tensor-parallel rank calls it (the logits gather is collective).
        Returns the number of sizes run."""
        if not self.model.pad_logit_rows:
            return 0
        sizes = sorted({padded_logit_rows(rows) for rows in range(SKINNY_MAX_ROWS + 1,
                                                                   max_rows + 1)})
        hidden_size = self.config.hidden_size
        dtype = self.model.model.embed_tokens.weight.dtype
        for rows in sizes:
            self.model.compute_logits(torch.zeros(rows, hidden_size, dtype=dtype,
                                                  device=self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return len(sizes)

    def capture_graphs(self, max_num_seqs: int, max_model_len: int,
                       verify_lens: tuple[int, ...] = ()) -> CaptureReport:
        """Capture decode CUDA graphs for batch buckets up to `max_num_seqs`, and verify
        graphs of q tokens per sequence for each q in `verify_lens` (speculation)."""
        assert self.device.type == "cuda", "CUDA graphs need a CUDA device"
        self.graphs = CudaGraphRunner(
            self.model, self.kv_caches, max_num_seqs=max_num_seqs,
            max_blocks_per_seq=self.kv.blocks_needed(max_model_len),
            max_model_len=max_model_len, hidden_size=self.config.hidden_size,
            device=self.device, verify_lens=verify_lens,
            lora=self.lora.stack if self.lora is not None else None)
        return self.graphs.capture()

    def capture_piecewise_graphs(self, max_tokens: int) -> CaptureReport:
        """Capture piecewise graphs (cut at attention) for steps of up to `max_tokens`."""
        assert self.device.type == "cuda", "CUDA graphs need a CUDA device"
        if self.lora is not None:  # the pieces always hold the adapters' kernels
            self.lora.stack.active = True
        self.pieces = PiecewiseGraphRunner(self.model, self.kv_caches, max_tokens=max_tokens,
                                           device=self.device)
        return self.pieces.capture()

    def watch_layers(self, written: Callable[[int], None]) -> None:
        """Call `written(i)` in every step that does not replay a whole-step graph, as soon
        as layer i's kernels (its KV write among them) are queued: the KV handoff pushes
        each layer's blocks while the later layers compute (tier/kv_push.py)."""
        for index, layer in enumerate(self.model.model.layers):
            layer.register_forward_hook(
                lambda _module, _args, _out, index=index: written(index))
        if self.pieces is not None:
            self.pieces.watch_layers(written)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Decode steps replay a whole-step graph; other steps up to the piecewise limit
        replay pieces around eager attention; larger ones, and steps with image rows, run
        eagerly."""
        meta = inputs.meta
        if inputs.image_rows:
            assert self.images is not None, "image rows scheduled without an encoder"
            self.last_path = "eager"
            rows = self._tensor(inputs.image_rows, torch.long)
            if self.model.bidirectional_images:  # image rows read the rest of their image
                ahead = image_lookahead(len(inputs.input_ids), inputs.image_rows,
                                        inputs.image_slices)
                meta = replace(meta, lookahead=self._tensor(ahead, torch.int32))
            return self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta,
                              image_rows=(rows, self.images.embed(inputs.image_slices)))
        graphs = self.graphs
        if graphs is not None and ((meta.decode_only and meta.num_seqs <= graphs.max_batch)
                                   or (inputs.verify_rows and graphs.verify_key(meta))):
            self.last_path = "graph" if meta.decode_only else "verify_graph"
            return graphs.run(inputs.input_ids, inputs.positions, meta)
        if self.pieces is not None and inputs.input_ids.shape[0] <= self.pieces.max_tokens:
            self.last_path = "piecewise"
            return self.pieces.run(inputs.input_ids, inputs.positions, meta)
        self.last_path = "eager"
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one step and wait for its results."""
        launched = self.launch(out)
        if launched.sample_deferred:
            self.sample(launched)
        return launched.result()

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, previous: LaunchedStep | None = None
               ) -> LaunchedStep:
        """Queue one step on the device without waiting for it.

        Tokens of the step's sequences that `previous` sampled (pending on the host) are
        taken from `previous`'s sampled tokens on the device.
        """
        inputs = self.prepare(out, previous)
        if self.lora is not None:
            groups = self.lora.prepare_step([(s.request.lora_id, s.num_new_tokens)
                                             for s in out.scheduled])
            if inputs.plan is not None:  # the other ranks group their rows the same way
                inputs.plan.lora_groups = groups
                inputs.plan.lora_writes = self.lora.take_writes()
        if inputs.pending_rows:
            assert previous is not None and previous.sample is not None
            sources = self._tensor(inputs.pending_sources, torch.long)
            inputs.input_ids[self._tensor(inputs.pending_rows, torch.long)] = (
                previous.sample.token_ids[sources])
        if self.sync is not None and inputs.plan is not None:
            self.sync.send(inputs.plan, inputs.input_ids)
        hidden = self.forward(inputs)
        prompt_scores = self._score_prompts(hidden, inputs)
        launched = LaunchedStep(out, inputs.sample_requests, None, prompt_scores)
        if inputs.verify_rows:
            assert self.verifier is not None, "drafts scheduled without a verifier"
            rows = self._tensor(inputs.verify_rows, torch.long)
            launched.verify = self.verifier.launch(self.model.compute_logits(hidden[rows]),
                                                   inputs.verify_requests)
        if inputs.sample_rows:
            rows = self._tensor(inputs.sample_rows, torch.long)
            launched.logits = self.model.compute_logits(hidden[rows])  # [S, V] float32
            if not any(r.grammar is not None for r in inputs.sample_requests):
                self.sample(launched)
        return launched

    @torch.inference_mode()
    def sample(self, launched: LaunchedStep) -> None:
        """Queue the sampling of a launched step whose sampling `launch` left to the caller
        (constrained sequences: their grammars must first take the tokens of the step
        before, which the caller reads while the device runs this step's forward)."""
        assert launched.logits is not None and launched.sample is None, "nothing to sample"
        rows = [_row(r) for r in launched.sample_requests]
        launched.sample = self.sampler.sample_async(launched.logits, rows)
        launched.logits = None

    def prepare(self, out: SchedulerOutput, previous: LaunchedStep | None = None
                ) -> StepInputs:
        """Flatten the step's requests into one token batch with its attention metadata."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_requests: list[SequenceState] = []
        prompt_rows: list[tuple[SequenceState, list[int]]] = []
        pending_rows: list[int] = []
        pending_sources: list[int] = []
        verify_requests: list[SequenceState] = []
        verify_rows: list[int] = []
        image_rows: list[int] = []
        image_slices: list[ImageSlice] = []
        for s in out.scheduled:
            r, n = s.request, s.num_new_tokens
            start = r.num_computed_tokens
            table = self.kv.block_ids(r.request_id)
            row0 = len(ids)
            drafts = r.spec_token_ids  # after the sequence's tokens, verified in this query
            if n == 1 and not drafts:  # a decode row: most rows of a large batch
                ids.extend(r.token_ids(start, start + 1))
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                ids.extend(r.token_ids(start, start + n - len(drafts)))
                ids.extend(drafts)
                positions.extend(range(start, start + n))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if r.images and start < r.images[-1].end:
                for part in slices_in(r.images, start, start + n):
                    first = row0 + part.image.offset + part.first - start
                    image_rows.extend(range(first, first + part.count))
                    image_slices.append(part)
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(table)
            known = r.num_known_tokens + len(drafts)
            if start + n > known:  # the last token was sampled by the step still running
                if start + n - known > 1 or previous is None or (
                        id(r) not in previous.sample_index):
                    raise InternalError(f"{r.request_id}: tokens {known}..{start + n} are not "
                                        f"known and not sampled by the running step")
                pending_rows.append(row0 + n - 1)
                pending_sources.append(previous.sample_index[id(r)])
            if r.params.prompt_logprobs is not None and start < r.num_prompt_tokens - 1:
                last = min(start + n, r.num_prompt_tokens - 1)
                prompt_rows.append((r, list(range(row0, row0 + last - start))))
            if drafts:
                verify_requests.append(r)
                verify_rows.extend(range(row0 + n - 1 - len(drafts), row0 + n))
            elif s.completes_prompt:
                sample_rows.append(row0 + n - 1)
                sample_requests.append(r)
        plan = None if self.sync is None else StepPlan(
            ids, positions, slots, query_lens, seq_lens, tables, sample_rows,
            [rows for _, rows in prompt_rows], pending_rows, verify_rows)
        return StepInputs(
            input_ids=self._tensor(ids, torch.long),
            positions=self._positions(out, positions),
            meta=self._metadata(slots, query_lens, seq_lens, tables),
            sample_rows=sample_rows,
            sample_requests=sample_requests,
            prompt_rows=prompt_rows,
            pending_rows=pending_rows,
            pending_sources=pending_sources,
            plan=plan,
            verify_requests=verify_requests,
            verify_rows=verify_rows,
            image_rows=image_rows,
            image_slices=image_slices,
        )

    @torch.inference_mode()
    def follow(self, plan: StepPlan) -> None:
        """A tensor-parallel rank other than 0: run the step rank 0 planned, with the same
        forward pass and the same logits (in `launch`'s order), for their collectives."""
        assert self.sync is not None, "only a tensor-parallel rank follows"
        if self.lora is not None:
            for slot, weights in plan.lora_writes:
                self.lora.write_slot(slot, weights)
            self.lora.set_step(plan.lora_groups)
        ids = self._tensor(plan.ids, torch.long)
        if plan.pending_rows:
            self.sync.receive_ids(ids)
        inputs = StepInputs(
            input_ids=ids, positions=self._tensor(plan.positions, torch.long),
            meta=self._metadata(plan.slots, plan.query_lens, plan.seq_lens, plan.tables),
            sample_rows=plan.sample_rows, sample_requests=[], prompt_rows=[],
            verify_rows=plan.verify_rows)  # the same forward path as rank 0's (graphs)
        hidden = self.forward(inputs)
        for rows in plan.prompt_rows:
            self.model.compute_logits(hidden[self._tensor(rows, torch.long)])
        if plan.verify_rows:
            self.model.compute_logits(hidden[self._tensor(plan.verify_rows, torch.long)])
        if plan.sample_rows:
            self.model.compute_logits(hidden[self._tensor(plan.sample_rows, torch.long)])

    def prompt_positions(self, num_tokens: int, images: Sequence[PromptImage],
                         ) -> MropePositions | None:
        """An M-RoPE model's positions of a prompt with `images` (None: other models, and
        prompts without images, whose positions are their indices)."""
        files = [image for image in images if not image.is_embeds]  # embeddings: text's
        if not self.mrope or not files:
            return None
        return prompt_positions(num_tokens, image_grids(cast(ImageGrids, self.model), files))

    def _positions(self, out: SchedulerOutput, positions: list[int]) -> torch.Tensor:
        """The step's positions [T] on the device; an M-RoPE model's from its sequences'
        (engine/mrope.py): [3, T] in steps with image rows, else shifted [T]."""
        if not self.mrope:
            return self._tensor(positions, torch.long)
        shifted = step_positions(out.scheduled)
        if isinstance(shifted, torch.Tensor):
            return shifted.to(self.device)
        return self._tensor(shifted, torch.long)

    def _metadata(self, slots: list[int], query_lens: list[int], seq_lens: list[int],
                  tables: list[list[int]]) -> AttentionMetadata:
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        return AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.long),
            query_start_loc=self._tensor(starts, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            block_tables=self._tensor(padded, torch.int32),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )

    def _tensor(self, values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _score_prompts(self, hidden: torch.Tensor, inputs: StepInputs) -> list[_PromptScores]:
        """Logprobs of prompt tokens, for requests that asked for prompt_logprobs (queued)."""
        scores = []
        for request, rows in inputs.prompt_rows:
            start = request.num_computed_tokens
            logits = self.model.compute_logits(hidden[self._tensor(rows, torch.long)])
            targets = self._tensor(
                request.prompt_token_ids[start + 1 : start + 1 + len(rows)], torch.long)
            table = logprob_table(logits, targets, request.params.prompt_logprobs or 0)
            scores.append(_PromptScores(request, 0 if start == 0 else start + 1,
                                        HostCopy(table), leading_none=start == 0))
        return scores


def _row(request: SequenceState) -> SamplingRow:
    eos = () if request.params.ignore_eos else tuple(request.eos_token_ids)
    stop_ids = eos + tuple(request.params.stop_token_ids)
    return SamplingRow(
        params=request.params,
        prompt_token_ids=request.prompt_token_ids,
        output_token_ids=request.output_token_ids,
        generator=request.generator,  # type: ignore[arg-type]
        stop_ids=stop_ids,
        # A finished sequence's token is dropped: its matcher may have terminated.
        grammar=None if request.is_finished else request.grammar,
        bad_words=request.bad_words,
    )
