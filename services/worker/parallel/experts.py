"""Mixtures of experts over tensor-parallel ranks (docs/tensor_parallel.md, "Mixtures of
experts").

A sparse block's experts split over N ranks in one of two ways; either way the block leaves
a partial output that the norm after it sums over the ranks, as it sums a dense down_proj's
(parallel/layers.py's SummingNorm), so the block adds no collective of its own:

- tensor parallel (the default): every rank holds every expert, with a slice of its
  intermediate dimension, as a dense MLP is split: w13 [E, 2I/N, H] (this rank's gate rows,
  then its up rows), w2 [E, H, I/N]. Every rank runs every routed (token, slot) pair.
- expert parallel (`--enable-expert-parallel`): rank r holds experts [r E/N, (r+1) E/N)
  whole (`ExpertPlacement`). Routing is replicated: every rank computes the same top k over
  all E experts from the same hidden states; each rank then runs only the pairs routed to
  its own experts (`ExpertSlice`). With no data parallelism the tokens need no exchange
  other than the sum over ranks (as vLLM runs expert parallelism without data parallelism).

The routers and Qwen2-MoE's shared-expert gate are replicated (a few logits per token). The
shared expert is split as a dense MLP under both: it runs on every token, so splitting it
divides its weight reads and work by N, and its partial output joins the experts' in the
one sum; replicated, each rank would read all of it and only one rank's copy could be added.

A pair routed to another rank's expert keeps its place in the batch with weight 0 and
expert id -1 (`local_routing`): the step's shapes never depend on the routing and nothing is
read back to the host, so CUDA graphs capture it as at one rank, and the kernels skip such
pairs (kernels/triton_moe*.py: no weights read, zeros added), so a rank multiplies only the
pairs of its own experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshserve.services.worker.models.llama import CausalLM
from meshserve.services.worker.models.moe import Experts, SparseMoeBlock
from meshserve.shared.errors import ModelLoadError


@dataclass(frozen=True)
class ExpertPlacement:
    """Which of a layer's `num_experts` experts each of `world_size` ranks holds whole:
    rank r the contiguous block [r * per_rank, (r + 1) * per_rank), as vLLM's linear
    placement."""

    num_experts: int
    world_size: int
    rank: int = 0

    def __post_init__(self) -> None:
        if self.num_experts % self.world_size:
            raise ModelLoadError(
                f"--enable-expert-parallel: the model's {self.num_experts} experts do not "
                f"split evenly over --tensor-parallel-size {self.world_size} ranks; choose a "
                f"size that divides {self.num_experts}, or leave expert parallelism off",
                param="enable_expert_parallel")
        assert 0 <= self.rank < self.world_size, (
            f"rank {self.rank} is outside a world of {self.world_size}")

    @property
    def per_rank(self) -> int:
        return self.num_experts // self.world_size

    @property
    def first(self) -> int:
        """The global id of this rank's local expert 0."""
        return self.rank * self.per_rank

    def experts_of(self, rank: int) -> range:
        """The global ids of the experts rank `rank` holds."""
        return range(rank * self.per_rank, (rank + 1) * self.per_rank)

    def owner(self, expert: int) -> int:
        """The rank that holds global expert `expert`."""
        assert 0 <= expert < self.num_experts, f"expert {expert} of {self.num_experts}"
        return expert // self.per_rank

    def local_id(self, expert: int) -> int | None:
        """This rank's id of global expert `expert`, or None when another rank holds it."""
        return expert - self.first if self.owner(expert) == self.rank else None


def local_routing(weights: torch.Tensor, expert_ids: torch.Tensor, first: int,
                  count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing over all experts -> routing over experts [first, first + count), as ids
    0..count-1: weights [T, k] with the pairs of other experts zeroed, and their ids [T, k]
    set to -1, which the MoE kernels skip (no weight read, nothing added; the reference's
    loop over experts never matches it). Device operations only: no host sync, the same
    shapes whatever the routing."""
    local = expert_ids - first  # [T, k]
    theirs = (local < 0) | (local >= count)
    return weights.masked_fill(theirs, 0.0), local.masked_fill(theirs, -1)


class ExpertSlice(Experts):
    """A rank's experts under expert parallelism: global experts [first, first + E_local),
    whole, stored as local experts 0..E_local-1; it runs the pairs routed to them."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 first: int) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size)
        self.first = first

    def forward(self, x: torch.Tensor, weights: torch.Tensor,
                expert_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], routing over all experts [T, k] -> [T, H], this rank's experts' part."""
        weights, local = local_routing(weights, expert_ids, self.first, self.w13.shape[0])
        return super().forward(x, weights, local)


def place_experts(model: CausalLM, placement: ExpertPlacement) -> None:
    """Give each sparse block of `model` (built with a rank's local shapes, on the meta
    device) only this rank's experts."""
    for layer in model.model.layers:
        block = layer.mlp
        if not isinstance(block, SparseMoeBlock):
            continue
        total, two_inter, hidden = block.experts.w13.shape
        assert total == placement.num_experts, (
            f"a block of {total} experts placed as {placement.num_experts}")
        block.experts = ExpertSlice(placement.per_rank, hidden, two_inter // 2,
                                    placement.first)
