"""Wiring speculation into an engine: the draft model (loaded before the KV cache is sized,
so that its weights and cache come out of the same budget), the proposer and the verifier."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from meshserve.services.worker.engine.kv_sizing import piecewise_tokens
from meshserve.services.worker.engine.model_runner import kv_cache_bytes_per_block
from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.llama import CausalLM
from meshserve.services.worker.models.loader import (
    load_model,
    load_model_config,
    resolve_model,
)
from meshserve.services.worker.spec.decoder import NgramBatchProposer, Proposer, SpecDecoder
from meshserve.services.worker.spec.draft_model import DraftModelProposer
from meshserve.services.worker.spec.rejection import RejectionSampler
from meshserve.services.worker.spec.verify import Verifier
from meshserve.shared.errors import ConfigError
from meshserve.shared.speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    from meshserve.services.worker.engine.engine import LLMEngine

log = logging.getLogger(__name__)


class DraftModel:
    """The draft's weights and config; the target's own module when the draft names the
    target's weights (its KV cache stays separate)."""

    def __init__(self, model: CausalLM, config: ModelConfig) -> None:
        self.model = model
        self.config = config

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return kv_cache_bytes_per_block(self.config, block_size, dtype)


def load_draft(spec: SpeculativeConfig | None, target: CausalLM, target_config: ModelConfig,
               target_source_path: str, load_format: str, dtype: torch.dtype,
               device: torch.device) -> DraftModel | None:
    """The draft model of a draft_model config (None for other methods)."""
    if spec is None or spec.method != "draft_model":
        return None
    assert spec.model is not None
    source = resolve_model(spec.model, load_format)
    if str(source.path) == target_source_path:
        return DraftModel(target, target_config)
    config = load_model_config(source)
    if config.vocab_size != target_config.vocab_size:
        raise ConfigError(f"--speculative-config: the draft model's vocabulary "
                          f"({config.vocab_size}) differs from the target's "
                          f"({target_config.vocab_size})", param="speculative_config")
    return DraftModel(load_model(source, config, dtype, device, load_format), config)


def attach_speculation(engine: LLMEngine, spec: SpeculativeConfig) -> SpecDecoder:
    """The engine's SpecDecoder; its runner verifies drafts from now on."""
    proposer: Proposer
    if spec.method == "ngram":
        proposer = NgramBatchProposer(spec)
    else:
        draft = engine.draft
        assert draft is not None, "a draft_model config without its draft loaded"
        proposer = build_draft_proposer(engine, draft.model, draft.config,
                                        engine.kv.num_blocks)
    runner = engine.runner
    runner.verifier = Verifier(runner.sampler,
                               RejectionSampler(engine.device, seed=engine.config.seed))
    return SpecDecoder(spec, proposer, engine.max_model_len)


def build_draft_proposer(engine: LLMEngine, model: CausalLM, config: ModelConfig,
                         num_blocks: int) -> DraftModelProposer:
    """A draft-model proposer with a KV cache of `num_blocks`, on CUDA graphs of its own
    when the target's runner has them."""
    drafter = DraftModelProposer(model, config, num_blocks, engine.kv.block_size, engine.dtype,
                                 engine.device)
    if engine.graph_report is not None:
        decode, pieces = drafter.capture_graphs(
            engine.max_num_seqs, engine.max_model_len,
            piecewise_tokens(engine.scheduler.config.max_num_batched_tokens))
        log.info("draft model on CUDA graphs: %d decode and %d piecewise buckets, %.1fs, "
                 "%d MiB", len(decode.buckets), len(pieces.buckets),
                 decode.seconds + pieces.seconds,
                 (decode.memory_bytes + pieces.memory_bytes) >> 20)
    drafter.runner.warm_logits(engine.max_num_seqs)  # its LM head's row counts, as the target's
    return drafter
