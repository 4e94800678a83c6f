"""Which rank of how many this process is, and how the model's weights split over the ranks.

`ShardPlan` is pure arithmetic over a `ModelConfig`: the shapes of one rank's model (its
`local_config`) and the slice of every checkpoint tensor that rank holds (`take`):

    q/k/v, gate/up            column parallel: rows split by heads / columns
    o_proj, down_proj         row parallel: input columns split, outputs summed over ranks
    embed_tokens, lm_head     vocabulary parallel: rows split, the vocabulary padded to N
    norms                     replicated
    experts                   each expert's gate/up rows and down columns split (as a dense
                              MLP's), or with expert parallelism whole experts per rank
    shared expert             split as a dense MLP; routers and the shared-expert gate
                              replicated (parallel/experts.py says why)

With fewer KV heads than ranks, each rank keeps one KV head, shared by the ranks whose
query heads read it (replicated KV, as vLLM does). With expert parallelism a rank's model
numbers its experts from 0: `local_name` renames a checkpoint's expert tensors to them and
drops other ranks' experts unread.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch

from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.registry import refuse_unsupported
from meshserve.services.worker.parallel.experts import ExpertPlacement
from meshserve.shared.errors import ModelLoadError


@dataclass(frozen=True)
class ParallelConfig:
    """This process's place among the ranks of one tensor-parallel model replica."""

    world_size: int = 1
    rank: int = 0
    # Small sums over GPU ranks by the one-shot all-reduce (--disable-custom-all-reduce: NCCL).
    custom_all_reduce: bool = True
    # With the one-shot all-reduce: sum, residual add and RMSNorm in one kernel
    # (--no-tp-fused-norm: the sum, then the norm).
    fused_norm: bool = True
    # --enable-expert-parallel: a mixture of experts' experts placed whole on the ranks
    # instead of each split over all of them (dense models ignore it).
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        assert self.world_size >= 1, f"world_size must be >= 1, got {self.world_size}"
        assert 0 <= self.rank < self.world_size, (
            f"rank {self.rank} is outside a world of {self.world_size}")

    @property
    def enabled(self) -> bool:
        """Whether there is more than one rank (no collective runs at world size 1)."""
        return self.world_size > 1

    @property
    def is_driver(self) -> bool:
        """Rank 0 schedules, samples and serves; the other ranks follow its steps."""
        return self.rank == 0


# Checkpoint tensors split along their columns (input features); outputs are summed.
_ROW_PARALLEL = ("o_proj", "down_proj")
_VOCAB_PARALLEL = ("embed_tokens", "lm_head")
# An expert's tensor by checkpoint name (`experts.{e}.gate_proj.weight`, Mixtral's w1/w3/w2),
# or a layer's experts stacked as transformers holds them ([E, 2I, H] gate_up, [E, H, I] down).
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_STACKED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")
_EXPERT_ROW_PARALLEL = ("down_proj", "w2")


@dataclass(frozen=True)
class ShardPlan:
    """How the full model `model` splits over `parallel`'s ranks (and which part is ours)."""

    model: ModelConfig
    parallel: ParallelConfig

    def __post_init__(self) -> None:
        n, m = self.parallel.world_size, self.model
        if n > 1:
            refuse_unsupported(m.architecture, "tensor_parallel")
        if m.num_attention_heads % n:
            raise ModelLoadError(f"--tensor-parallel-size {n} must divide the model's "
                                 f"{m.num_attention_heads} attention heads",
                                 param="tensor_parallel_size")
        kv = m.num_key_value_heads
        if kv % n and n % kv:
            raise ModelLoadError(f"--tensor-parallel-size {n} and the model's {kv} KV heads: "
                                 "one must divide the other", param="tensor_parallel_size")
        if self._has_dense_mlp and m.intermediate_size % n:
            raise ModelLoadError(f"--tensor-parallel-size {n} must divide the model's "
                                 f"intermediate_size {m.intermediate_size}",
                                 param="tensor_parallel_size")
        if m.num_experts:
            self._check_experts()

    def _check_experts(self) -> None:
        n, m = self.parallel.world_size, self.model
        if self.expert_parallel:
            ExpertPlacement(m.num_experts, n)  # raises unless the experts split evenly
        elif m.moe_intermediate_size % n:
            raise ModelLoadError(
                f"--tensor-parallel-size {n} must divide the model's moe_intermediate_size "
                f"{m.moe_intermediate_size} (each expert's intermediate size), or place whole "
                "experts on the ranks with --enable-expert-parallel",
                param="tensor_parallel_size")
        if m.shared_expert_intermediate_size % n:
            raise ModelLoadError(
                f"--tensor-parallel-size {n} must divide the model's "
                f"shared_expert_intermediate_size {m.shared_expert_intermediate_size}",
                param="tensor_parallel_size")

    @property
    def _has_dense_mlp(self) -> bool:
        """Whether any layer runs the dense MLP of intermediate_size (a mixture of experts
        may have none: Mixtral's intermediate_size is its experts')."""
        return any(not self.model.is_sparse_layer(i)
                   for i in range(self.model.num_hidden_layers))

    @property
    def expert_parallel(self) -> bool:
        """Whether this rank holds whole experts (--enable-expert-parallel on a mixture of
        experts) rather than a slice of every expert."""
        return self.parallel.expert_parallel and self.model.num_experts > 0

    @property
    def placement(self) -> ExpertPlacement:
        """Which experts each rank holds under expert parallelism."""
        assert self.expert_parallel, "experts are placed only under expert parallelism"
        return ExpertPlacement(self.model.num_experts, self.parallel.world_size,
                               self.parallel.rank)

    @property
    def expert_intermediate_per_rank(self) -> int:
        """Each local expert's intermediate size: a slice, or whole under expert parallelism."""
        inter = self.model.moe_intermediate_size
        return inter if self.expert_parallel else inter // self.parallel.world_size

    @property
    def heads_per_rank(self) -> int:
        return self.model.num_attention_heads // self.parallel.world_size

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.model.num_key_value_heads // self.parallel.world_size)

    @property
    def first_kv_head(self) -> int:
        """The first KV head of this rank (ranks share one when KV heads are fewer)."""
        return self.parallel.rank * self.model.num_key_value_heads // self.parallel.world_size

    @property
    def intermediate_per_rank(self) -> int:
        return self.model.intermediate_size // self.parallel.world_size

    @property
    def vocab_per_rank(self) -> int:
        """Rows of the embedding and LM head per rank; the last rank's tail is padding."""
        return -(-self.model.vocab_size // self.parallel.world_size)

    @property
    def vocab_start(self) -> int:
        return self.parallel.rank * self.vocab_per_rank

    def local_config(self) -> ModelConfig:
        """The shapes of this rank's model modules."""
        # num_experts stays the model's: every rank routes over all of them (under expert
        # parallelism parallel/experts.py swaps in each sparse block's own experts).
        return dataclasses.replace(
            self.model, num_attention_heads=self.heads_per_rank,
            num_key_value_heads=self.kv_heads_per_rank,
            intermediate_size=self.intermediate_per_rank, vocab_size=self.vocab_per_rank,
            moe_intermediate_size=self.expert_intermediate_per_rank,
            shared_expert_intermediate_size=(self.model.shared_expert_intermediate_size
                                             // self.parallel.world_size))

    def local_name(self, name: str) -> str | None:
        """The name this rank's model gives checkpoint tensor `name`, or None when the tensor
        is not this rank's (another rank's expert, under expert parallelism)."""
        match = _EXPERT.search(name) if self.expert_parallel else None
        if match is None:
            return name
        local = self.placement.local_id(int(match[1]))
        if local is None:
            return None
        return f"{name[:match.start()]}.experts.{local}.{name[match.end():]}"

    def take(self, name: str, source: Any) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name`.

        `source` is a tensor or a safetensors slice (`safe_open(...).get_slice(name)`): both
        index like a tensor, and a slice reads only the indexed bytes from the file, so no
        rank ever holds the full matrix.
        """
        if ".experts." in name:
            return self._take_experts(name, source)
        parts = name.rsplit(".", 2)
        module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)
        head_dim, rank = self.model.head_dim, self.parallel.rank
        if module == "q_proj":
            return _rows(source, rank * self.heads_per_rank * head_dim,
                         self.heads_per_rank * head_dim)
        if module in ("k_proj", "v_proj"):
            return _rows(source, self.first_kv_head * head_dim, self.kv_heads_per_rank * head_dim)
        if module in ("gate_proj", "up_proj"):
            size = self._mlp_per_rank(name)
            return _rows(source, rank * size, size)
        if module in _ROW_PARALLEL:
            if kind == "bias":  # added once, after the sum over ranks
                full = source[:]
                return full if rank == 0 else torch.zeros_like(full)
            size = (self.heads_per_rank * head_dim if module == "o_proj"
                    else self._mlp_per_rank(name))
            return source[:, rank * size : (rank + 1) * size]
        if module in _VOCAB_PARALLEL:
            return self._vocab_rows(source)
        return source[:]

    def _mlp_per_rank(self, name: str) -> int:
        """The intermediate slice of a dense MLP: the layer's, or Qwen2-MoE's shared expert."""
        if ".shared_expert." in name:
            return self.model.shared_expert_intermediate_size // self.parallel.world_size
        return self.intermediate_per_rank

    def _take_experts(self, name: str, source: Any) -> torch.Tensor:
        """This rank's part of one expert's tensor (gate/up [I, H], down [H, I]) or of a
        layer's stacked experts (gate_up [E, 2I, H], down [E, H, I])."""
        stacked = _STACKED_EXPERTS.search(name)
        if self.expert_parallel:  # whole experts; local_name drops other ranks' single ones
            if stacked is None:
                return source[:]
            first, count = self.placement.first, self.placement.per_rank
            return source[first : first + count]
        size = self.expert_intermediate_per_rank
        start = self.parallel.rank * size
        if stacked is None:
            module = name.rsplit(".", 2)[-2]
            if module in _EXPERT_ROW_PARALLEL:
                return source[:, start : start + size]
            return _rows(source, start, size)
        if stacked[1] == "down_proj":
            return source[:, :, start : start + size]
        full = self.model.moe_intermediate_size  # gate rows, then up rows: both sliced
        return torch.cat([source[:, start : start + size],
                          source[:, full + start : full + start + size]], dim=1)

    def _vocab_rows(self, source: Any) -> torch.Tensor:
        start, size = self.vocab_start, self.vocab_per_rank
        end = min(start + size, self.model.vocab_size)
        rows = source[start:end]  # [<= size, H]
        if rows.shape[0] == size:
            return rows
        padded = rows.new_zeros((size, *rows.shape[1:]))  # padding rows: never sampled
        padded[: rows.shape[0]] = rows
        return padded


def _rows(source: Any, start: int, size: int) -> torch.Tensor:
    return source[start : start + size]

