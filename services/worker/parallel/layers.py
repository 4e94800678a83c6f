"""The collectives of a tensor-parallel model, fitted onto the model file's own modules.

`shard_modules` changes a `CausalLM` built with a rank's local shapes (`ShardPlan.
local_config`) in three places and leaves the rest of the model file as it is:

- the embedding looks up only this rank's vocabulary rows and sums the ranks' lookups;
- every row-parallel projection (`o_proj`, `down_proj`) sums its partial output over the
  ranks (an all-reduce in a forward hook, so whichever linear layer class the model uses
  keeps working, and CUDA graphs capture the all-reduce with the rest);
- the logits of the ranks' vocabulary slices are gathered into full rows on every rank.

Collectives run on the default process group (NCCL on GPUs, gloo on CPUs); the sums of
small tensors on GPUs take a one-shot all-reduce once `bind_device_sum` has set it up
(device_sum.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from meshserve.services.worker.models.llama import CausalLM
from meshserve.services.worker.parallel.config import ShardPlan
from meshserve.services.worker.parallel.device_sum import DeviceSum

# Modules whose outputs are partial sums over the ranks' slices of their input features.
_ROW_PARALLEL_SUFFIXES = (".o_proj", ".down_proj")


class RankSum:
    """The one sum over ranks that every row-parallel layer of a model shares (a hook:
    `module(...)`'s output [T, H] of partial sums becomes the full projection, in place)."""

    def __init__(self) -> None:
        self.device_sum = DeviceSum()  # NCCL / gloo until bind_device_sum

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return self.device_sum(output)


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
    for name, module in model.named_modules():
        if name.endswith(_ROW_PARALLEL_SUFFIXES):
            module.register_forward_hook(rank_sum)


def bind_device_sum(model: CausalLM, plan: ShardPlan, device: torch.device,
                    dtype: torch.dtype) -> None:
    """Give the model's sums over ranks the one-shot all-reduce where it can run (every rank
    calls this at the same point, once the model has storage on `device`)."""
    rank_sum: RankSum = model.rank_sum
    rank_sum.device_sum = DeviceSum.create(device, dtype, plan.parallel.custom_all_reduce)
