"""Building an engine: the core's parts, each made once and handed in, and the features'
step hooks (engine/hooks.py).

    engine = build_engine(EngineConfig(model="path/to/model"))
    engine = build_engine(config, kv_tier=KVTierPlan(make_transport, backlog_bytes))

The order is the order of what each part needs: the model (and a draft model) loaded, the
KV cache sized from what memory is left, the runner with the features that act inside its
forward pass (LoRA slots, speculation's verifier), CUDA graphs captured, then the hooks
(structured outputs, speculation, the KV tier, LoRA) and the scheduler.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from meshserve.kernels import knobs
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.cuda_graphs import CaptureReport
from meshserve.services.worker.engine.device import resolve_device
from meshserve.services.worker.engine.engine import EngineParts, LLMEngine
from meshserve.services.worker.engine.hooks import ImageEmbedder, StepHook
from meshserve.services.worker.engine.kv_cache_manager import KVCacheManager
from meshserve.services.worker.engine.kv_copy import KVCaches
from meshserve.services.worker.engine.kv_sizing import (
    gpu_memory_and_name,
    kv_blocks_that_fit,
    piecewise_tokens,
)
from meshserve.services.worker.engine.model_runner import ModelRunner
from meshserve.services.worker.engine.prompt_embeds import PromptEmbedsRows
from meshserve.services.worker.engine.request_validator import RequestValidator
from meshserve.services.worker.engine.sampler import Sampler
from meshserve.services.worker.engine.step_scheduler import StepScheduler, StepSchedulerConfig
from meshserve.services.worker.loader import (
    ModelSource,
    load_model,
    load_model_config,
    load_quant_config,
    resolve_dtype,
    resolve_model,
)
from meshserve.services.worker.lora.hook import LoraHook
from meshserve.services.worker.lora.manager import LoraManager
from meshserve.services.worker.lora.setup import build_lora
from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.llama import CausalLM
from meshserve.services.worker.parallel.broadcast import StepSync
from meshserve.services.worker.parallel.config import ParallelConfig, ShardPlan
from meshserve.services.worker.parallel.ranks import RankGroup
from meshserve.services.worker.spec.setup import (
    DraftModel,
    DraftShape,
    build_spec_decoder,
    build_verifier,
    load_draft,
)
from meshserve.services.worker.structured.grammars import GrammarCompiler
from meshserve.services.worker.structured.hook import StructuredOutputsHook
from meshserve.services.worker.tier.kv_tier import KVTier, KVTransport
from meshserve.services.worker.vision.encoder import ImageEncoder, build_image_encoder
from meshserve.services.worker.vision.remote import RemoteRows
from meshserve.shared.errors import InvalidRequestError, ModelLoadError
from meshserve.shared.image_encoding import VisionModel
from meshserve.shared.kv_dtype import kv_cache_dtype_name
from meshserve.shared.lora_config import parse_lora_modules
from meshserve.shared.model_source import tokenizer_folder
from meshserve.shared.quantization import QuantConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVTierPlan:
    """The KV tier to build into the engine: `transport` makes the store's transport over
    the engine's KV cache tensors (services/worker/tier/transfer.py; started by it)."""

    transport: Callable[[KVCaches], KVTransport]
    max_save_backlog_bytes: int


@dataclass
class _Loaded:
    """The model and what was resolved on the way to it."""

    source: ModelSource
    model_config: ModelConfig
    model: CausalLM
    dtype: torch.dtype
    kv_dtype: torch.dtype
    max_model_len: int
    shard: ShardPlan | None
    draft: DraftModel | None


def build_engine(config: EngineConfig, *, parallel: ParallelConfig | None = None,
                 sync: StepSync | None = None, kv_tier: KVTierPlan | None = None
                 ) -> LLMEngine:
    """Load the model, size the KV cache and assemble the engine (blocking: minutes for a
    large model). `parallel` and `sync` are given by a follower rank of a tensor-parallel
    worker (services/worker/follower.py); rank 0 (every other caller) starts the followers."""
    knobs.use(config.kernel_knobs)
    parallel = parallel or ParallelConfig(
        world_size=config.tensor_parallel_size,
        custom_all_reduce=not config.disable_custom_all_reduce,
        fused_norm=config.tp_fused_norm, expert_parallel=config.enable_expert_parallel)
    device = resolve_device(config.device, parallel.rank)
    torch.manual_seed(config.seed)
    source = resolve_model(config.model, config.load_format)
    model_config = load_model_config(source)
    # Checked (a size that does not split the model is refused) before any rank starts.
    shard = ShardPlan(model_config, parallel) if parallel.enabled else None
    if parallel.expert_parallel and not model_config.is_moe and parallel.is_driver:
        log.warning("--enable-expert-parallel: %s has no experts; ignored (as vLLM does)",
                    model_config.architecture)
    quant = _quantization(config, source, split=shard is not None)
    ranks: RankGroup | None = None
    if shard is not None and sync is None:
        ranks = RankGroup.start(config, device)
        sync = ranks.sync
    loaded = _load(config, source, model_config, device, parallel, shard, quant)
    on_gpu = device.type == "cuda"
    batched_tokens = config.batched_tokens(loaded.max_model_len, on_gpu)
    max_num_seqs = config.seqs_limit(*gpu_memory_and_name(device))
    lora = _lora(config, loaded, device, max(batched_tokens, max_num_seqs))
    num_blocks = _num_kv_blocks(config, loaded, device, max_num_seqs, batched_tokens,
                                parallel, sync)
    # (A model whose every layer slides frees the blocks behind its window.)
    kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                        window=model_config.kv_window)
    sampler = Sampler(model_config.vocab_size, device)
    speculate = config.speculative is not None and parallel.is_driver
    runner = ModelRunner(loaded.model, model_config, kv, loaded.kv_dtype, device, sync,
                         sampler=sampler, adapters=lora,
                         verifier=build_verifier(sampler, device, config.seed)
                         if speculate else None,
                         images=_image_rows(config, loaded, device))
    graphs, pieces = _capture_graphs(config, runner, max_num_seqs, loaded.max_model_len,
                                     batched_tokens)
    spec = config.speculative  # verify steps take k+1 logit rows per sequence
    runner.warm_logits(max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0)))
    tier = _tier(config, kv_tier, kv, runner, parallel)
    grammars = GrammarCompiler(
        lambda: tokenizer_folder(source), vocab_size=model_config.vocab_size,
        eos_token_ids=model_config.eos_token_ids, backend=config.structured_outputs_backend)
    draft_shape = DraftShape(num_blocks, config.block_size, loaded.dtype, device, max_num_seqs,
                             loaded.max_model_len, batched_tokens, cuda_graphs=graphs is not None)
    hooks = _hooks(config, grammars, loaded.draft if speculate else None, draft_shape, tier,
                   lora, speculate)
    _check_whole_images(loaded.model, batched_tokens)
    scheduler = StepScheduler(StepSchedulerConfig(
        max_num_batched_tokens=batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=config.enable_chunked_prefill,
        long_prefill_token_threshold=config.prefill_chunk_cap(on_gpu),
        policy=config.scheduling_policy,
        max_model_len=loaded.max_model_len,
        max_loras=config.max_loras if lora is not None else 0,
        whole_images=loaded.model.bidirectional_images,
    ), kv, store_gate=tier.holds_back if tier is not None else None)
    grammars.preload()
    log.info("KV cache: %d blocks of %d tokens", num_blocks, config.block_size)
    return LLMEngine(EngineParts(
        config=config, parallel=parallel, device=device, source=source,
        model_config=model_config, dtype=loaded.dtype, kv_dtype=loaded.kv_dtype,
        max_model_len=loaded.max_model_len, max_num_seqs=max_num_seqs, kv=kv, quant=quant,
        scheduler=scheduler, runner=runner,
        validator=RequestValidator(model_config.vocab_size, loaded.max_model_len,
                                   kv.sequence_capacity(batched_tokens, loaded.max_model_len),
                                   config.max_logprobs),
        hooks=hooks, ranks=ranks, graph_report=graphs, piecewise_report=pieces))


def _check_whole_images(model: CausalLM, batched_tokens: int) -> None:
    """A model whose image rows attend to each other computes an image in one step: the
    step's token budget (what activation memory is sized for) must hold one."""
    rows = getattr(getattr(model, "vision", None), "num_image_rows", 0)
    if model.bidirectional_images and rows > batched_tokens:
        raise ModelLoadError(
            f"--max-num-batched-tokens {batched_tokens} is smaller than one image's {rows} "
            f"rows, which {model.config.architecture} computes in one step; raise it to at "
            f"least {rows}", param="max_num_batched_tokens")


def _image_rows(config: EngineConfig, loaded: _Loaded,
                device: torch.device) -> ImageEmbedder | None:
    """Where the runner takes rows that replace token embeddings: the vision encoder, and
    with --enable-prompt-embeds the prompts' own rows (None: neither)."""
    images = _image_encoder(config, loaded, device)
    if not config.enable_prompt_embeds:
        return images
    return PromptEmbedsRows(loaded.model_config.hidden_size, loaded.dtype, device, images)


def _image_encoder(config: EngineConfig, loaded: _Loaded,
                   device: torch.device) -> ImageEncoder | None:
    """A vision-language model's encoder (None for a text model)."""
    if loaded.model_config.vision is None:
        return None
    addresses = config.encoder_address_list
    shared = {"auto": None, "on": True, "off": False}[config.encoder_shared_memory]
    remote = RemoteRows(addresses, loaded.source.name, shared_memory=shared) if addresses and (
        config.mm_encoder_placement != "worker") else None
    # A vision-language model class has rows_for and embed_images (models/llava.py).
    return build_image_encoder(cast(VisionModel, loaded.model), loaded.source.path, device,
                               config.mm_embedding_cache_memory,
                               config.mm_encoder_placement if remote else "worker", remote)


def _hooks(config: EngineConfig, grammars: GrammarCompiler, draft: DraftModel | None,
           draft_shape: DraftShape, tier: KVTier | None, lora: LoraManager | None,
           speculate: bool) -> tuple[StepHook, ...]:
    """The features' step hooks, in the order the engine calls them."""
    hooks: list[StepHook] = [StructuredOutputsHook(grammars)]
    if speculate:
        assert config.speculative is not None
        # Drafts are proposed from host tokens: a step that speculates runs after the one
        # before it is read, and is read before the next is scheduled (engine.step).
        hooks.append(build_spec_decoder(config.speculative, draft, shape=draft_shape))
    if tier is not None:
        hooks.append(tier)
    if lora is not None:  # last: an adapter is taken only once every other hook admitted
        hooks.append(LoraHook(lora))
    return tuple(hooks)


def _load(config: EngineConfig, source: ModelSource, model_config: ModelConfig,
          device: torch.device, parallel: ParallelConfig, shard: ShardPlan | None,
          quant: QuantConfig | None) -> _Loaded:
    """The model's weights (this rank's slice) and, on rank 0, a draft model's."""
    max_model_len = min(model_config.max_model_len,
                        config.max_model_len or model_config.max_model_len)
    dtype = resolve_dtype(config.dtype, model_config, device)
    kv_dtype: torch.dtype = getattr(torch, kv_cache_dtype_name(
        config.kv_cache_dtype, str(dtype).removeprefix("torch.")))
    started = time.monotonic()
    model = load_model(source, model_config, dtype, device, config.load_format, shard=shard,
                       quant=quant)
    log.info("loaded %s (%s) in %.1fs", source.name, dtype, time.monotonic() - started)
    # A draft model's weights load before the KV cache is sized, which then holds both
    # models' caches (the draft's has as many blocks as the target's). With tensor
    # parallelism the draft is whole on rank 0, which alone drafts (its forward passes need
    # no other rank); every rank runs the verify passes.
    draft = load_draft(config.speculative, model, model_config, str(source.path),
                       config.load_format, dtype, device) if parallel.is_driver else None
    return _Loaded(source, model_config, model, dtype, kv_dtype, max_model_len, shard, draft)


def _quantization(config: EngineConfig, source: ModelSource, split: bool
                  ) -> QuantConfig | None:
    """The weights' quantization (the checkpoint's or --quantization), refused where it
    cannot run yet; called before any tensor-parallel rank starts."""
    quant = load_quant_config(source, config.quantization)
    if config.quantize_lm_head:
        if quant is None:
            raise ModelLoadError("--quantize-lm-head needs FP8 weights (--quantization fp8 "
                                 "or an FP8 checkpoint)", param="quantize_lm_head")
        quant = dataclasses.replace(quant, lm_head=True)
    if split and quant is not None and quant.from_checkpoint and config.load_format != "dummy":
        # The checkpoint's scales would need slicing with their weights.
        raise ModelLoadError(
            "FP8 checkpoints are not split over tensor-parallel ranks; serve this one "
            "with --tensor-parallel-size 1, or a bf16 checkpoint with --quantization fp8",
            param="tensor_parallel_size")
    return quant


def _lora(config: EngineConfig, loaded: _Loaded, device: torch.device,
          max_tokens: int) -> LoraManager | None:
    """The adapters' slots and host cache (None without --enable-lora); this rank's part
    of each adapter with tensor parallelism."""
    if not config.enable_lora:
        return None
    return build_lora(
        loaded.model, loaded.model_config, max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank, max_cpu_loras=config.max_cpu_loras,
        max_tokens=max_tokens, modules=parse_lora_modules(config.lora_modules),
        dtype=loaded.dtype, device=device, shard=loaded.shard)


def _num_kv_blocks(config: EngineConfig, loaded: _Loaded, device: torch.device,
                   max_num_seqs: int, batched_tokens: int, parallel: ParallelConfig,
                   sync: StepSync | None) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    draft = loaded.draft
    draft_per_block = (0 if draft is None else
                       draft.kv_bytes_per_block(config.block_size, loaded.dtype))
    num_blocks = kv_blocks_that_fit(loaded.model, config, loaded.kv_dtype, device,
                                    max_num_seqs, batched_tokens, draft_per_block)
    if parallel.enabled:  # every rank holds every block: the tightest rank decides
        assert sync is not None
        num_blocks = sync.min_over_ranks(num_blocks)
    return num_blocks


def _capture_graphs(config: EngineConfig, runner: ModelRunner, max_num_seqs: int,
                    max_model_len: int, batched_tokens: int
                    ) -> tuple[CaptureReport | None, CaptureReport | None]:
    """Decode (and verify) CUDA graphs and piecewise prefill graphs, on a GPU unless
    --enforce-eager."""
    if runner.device.type != "cuda" or config.enforce_eager:
        return None, None
    spec = config.speculative  # verify steps query 2..k+1 tokens per sequence
    verify_lens = tuple(range(2, spec.num_speculative_tokens + 2)) if spec else ()
    graphs = runner.capture_graphs(max_num_seqs, max_model_len, verify_lens)
    return graphs, runner.capture_piecewise_graphs(piecewise_tokens(batched_tokens))


def _tier(config: EngineConfig, plan: KVTierPlan | None, kv: KVCacheManager,
          runner: ModelRunner, parallel: ParallelConfig) -> KVTier | None:
    """The KV tier over the store behind `plan` (None without one)."""
    if plan is None:
        return None
    if parallel.enabled:
        raise InvalidRequestError("the KV tier does not yet work with tensor parallelism "
                                  "(each rank holds part of every block)",
                                  param="tensor_parallel_size")
    if not config.enable_prefix_caching:
        raise InvalidRequestError("the KV tier needs prefix caching (blocks are found by "
                                  "hash)", param="enable_prefix_caching")
    return KVTier(kv, runner.kv_caches, plan.transport(runner.kv_caches),
                  max_save_backlog_bytes=plan.max_save_backlog_bytes)
