"""Building speculation's parts for the engine builder: the draft model (loaded before the KV
cache is sized, so that its weights and cache come out of the same budget), the verifier
the target's runner takes, and the step hook that proposes drafts."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from meshserve.services.worker.engine.kv_sizing import piecewise_tokens
from meshserve.services.worker.engine.model_runner import kv_cache_bytes_per_block
from meshserve.services.worker.engine.sampler import Sampler
from meshserve.services.worker.loader import (
    load_model,
    load_model_config,
    resolve_model,
)
from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.llama import CausalLM
from meshserve.services.worker.spec.decoder import NgramBatchProposer, Proposer, SpecDecoder
from meshserve.services.worker.spec.draft_model import DraftModelProposer
from meshserve.services.worker.spec.rejection import RejectionSampler
from meshserve.services.worker.spec.verify import Verifier
from meshserve.shared.errors import ConfigError
from meshserve.shared.speculative_config import SpeculativeConfig

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


def build_spec_decoder(spec: SpeculativeConfig, draft: DraftModel | None, *,
                       shape: DraftShape) -> SpecDecoder:
    """The engine's speculation hook: the proposer (n-gram, or the draft model with a KV
    cache of the target's block count) and the drafting rules."""
    proposer: Proposer
    if spec.method == "ngram":
        proposer = NgramBatchProposer(spec)
    else:
        assert draft is not None, "a draft_model config without its draft loaded"
        proposer = build_draft_proposer(draft.model, draft.config, shape)
    return SpecDecoder(spec, proposer, shape.max_model_len)


def build_verifier(sampler: Sampler, device: torch.device, seed: int) -> Verifier:
    """The verify pass the target's runner runs over speculating sequences' queries."""
    return Verifier(sampler, RejectionSampler(device, seed=seed))


@dataclass(frozen=True)
class DraftShape:
    """What a draft model's runner mirrors of the target engine's."""

    num_blocks: int
    block_size: int
    dtype: torch.dtype
    device: torch.device
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    cuda_graphs: bool  # whether the target runs on CUDA graphs (the draft then does too)


def build_draft_proposer(model: CausalLM, config: ModelConfig,
                         shape: DraftShape) -> DraftModelProposer:
    """A draft-model proposer with a KV cache of `shape.num_blocks`, on CUDA graphs of its
    own when the target's runner has them."""
    drafter = DraftModelProposer(model, config, shape.num_blocks, shape.block_size,
                                 shape.dtype, shape.device)
    if shape.cuda_graphs:
        decode, pieces = drafter.capture_graphs(
            shape.max_num_seqs, shape.max_model_len,
            piecewise_tokens(shape.max_num_batched_tokens))
        log.info("draft model on CUDA graphs: %d decode and %d piecewise buckets, %.1fs, "
                 "%d MiB", len(decode.buckets), len(pieces.buckets),
                 decode.seconds + pieces.seconds,
                 (decode.memory_bytes + pieces.memory_bytes) >> 20)
    drafter.runner.warm_logits(shape.max_num_seqs)  # its LM head's row counts, as the target's
    return drafter
