"""The collectives of a tensor-parallel model, fitted onto the model file's own modules.

`shard_modules` changes a `CausalLM` built with a rank's local shapes (`ShardPlan.
local_config`) in three places (four under expert parallelism, whose sparse blocks get only
this rank's experts: parallel/experts.py) and leaves the rest of the model file as it is:

- the embedding looks up only this rank's vocabulary rows and sums the ranks' lookups;
- the row-parallel projections (`o_proj`, `down_proj`) leave partial sums, and the norm that
  adds each of them to the residual stream (a layer's post-attention norm, the next layer's
  input norm, the final norm) sums it over the ranks first: one fused kernel on GPUs
  (`DeviceSum.add_rms_norm`), so whichever linear layer class the model uses keeps working
  and CUDA graphs capture the sums with the rest;
- the logits of the ranks' vocabulary slices are gathered into full rows on every rank.

Collectives run on the default process group (NCCL on GPUs, gloo on CPUs); the sums of
small tensors on GPUs take a one-shot all-reduce, or the fused sum + RMSNorm, once
`bind_device_sum` has set them up (device_sum.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from meshserve.services.worker.models.llama import CausalLM, DecoderLayer, RMSNorm
from meshserve.services.worker.parallel.config import ShardPlan
from meshserve.services.worker.parallel.device_sum import DeviceSum
from meshserve.services.worker.parallel.experts import place_experts


class RankSum:
    """The sums over ranks of one model: the embedding's, and the norms' (`sites` of them)."""

    def __init__(self) -> None:
        self.device_sum = DeviceSum()  # NCCL / gloo until bind_device_sum
        self.sites = 0


class SummingNorm(RMSNorm):
    """An RMSNorm whose `add_forward` input is a row-parallel layer's partial output: it is
    summed over the ranks, added to the residual stream and normalised (`forward`, a norm
    with nothing to add, is RMSNorm's)."""

    def __init__(self, norm: RMSNorm, rank_sum: RankSum) -> None:
        super().__init__(norm.weight.shape[0], norm.eps)
        self.rank_sum = rank_sum
        self.site = rank_sum.sites  # this norm's region of the fused kernel's buffers
        rank_sum.sites += 1

    def add_forward(self, x: torch.Tensor,
                    residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rank_sum.device_sum.add_rms_norm(x, residual, self.weight, self.eps,
                                                     self.site)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [start, start + num_rows) of the embedding matrix; ids outside
    them look up zeros, and the sum over ranks is the full lookup."""

    def __init__(self, num_rows: int, hidden_size: int, start: int, rank_sum: RankSum) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_rows, hidden_size))
        self.start = start
        self.rank_sum = rank_sum

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start  # [T]
        outside = (local < 0) | (local >= self.weight.shape[0])
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, H]
        hidden = hidden.masked_fill(outside[:, None], 0.0)
        return self.rank_sum.device_sum(hidden)


class LogitsGather(nn.Module):
    """[N, V / ranks] logits of this rank's vocabulary slice -> [N, V] logits of all."""

    def __init__(self, vocab_size: int, world_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.world_size = world_size

    def forward(self, local: torch.Tensor) -> torch.Tensor:
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local)
        # Rank r holds vocabulary rows [r * V/N, (r+1) * V/N); the padding tail is cut off.
        return torch.cat(parts, dim=-1)[:, : self.vocab_size].contiguous()


def shard_modules(model: CausalLM, plan: ShardPlan) -> None:
    """Make `model` (built with `plan.local_config()`) one rank of the tensor-parallel model.

    Call it where the model is built (on the meta device, before it gets storage)."""
    assert model.config.vocab_size == plan.vocab_per_rank, "build the model with local shapes"
    rank_sum = RankSum()
    model.rank_sum = rank_sum
    model.model.embed_tokens = VocabParallelEmbedding(
        plan.vocab_per_rank, model.config.hidden_size, plan.vocab_start, rank_sum)
    model.logits_gather = LogitsGather(plan.model.vocab_size, plan.parallel.world_size)
    # The norms that add a row-parallel output to the residual stream, in the order a
    # forward pass reaches them. Layer 0's input norm adds nothing (the embedding's lookup
    # is summed where it is made).
    layers: list[DecoderLayer] = []
    for layer in model.model.layers:
        assert isinstance(layer, DecoderLayer), f"no tensor-parallel plan for {type(layer)}"
        layers.append(layer)
    for index, layer in enumerate(layers):
        layer.post_attention_layernorm = SummingNorm(layer.post_attention_layernorm, rank_sum)
        if index + 1 < len(layers):
            following = layers[index + 1]
            following.input_layernorm = SummingNorm(following.input_layernorm, rank_sum)
    if len(model.model.layers):
        model.model.norm = SummingNorm(model.model.norm, rank_sum)
    if plan.expert_parallel:
        place_experts(model, plan.placement)


def bind_device_sum(model: CausalLM, plan: ShardPlan, device: torch.device,
                    dtype: torch.dtype) -> None:
    """Give the model's sums over ranks the one-shot all-reduce where it can run (every rank
    calls this at the same point, once the model has storage on `device`)."""
    rank_sum = model.rank_sum
    assert isinstance(rank_sum, RankSum), "shard_modules gives the model its RankSum"
    rank_sum.device_sum = DeviceSum.create(device, dtype, plan.parallel.custom_all_reduce,
                                           hidden_size=model.config.hidden_size,
                                           sites=rank_sum.sites,
                                           fused_norm=plan.parallel.fused_norm)
