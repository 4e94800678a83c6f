"""Which rank of how many this process is, and how the model's weights split over the ranks.

`ShardPlan` is pure arithmetic over a `ModelConfig`: the shapes of one rank's model (its
`local_config`) and the slice of every checkpoint tensor that rank holds (`take`):

    q/k/v, gate/up            column parallel: rows split by heads / columns
    o_proj, down_proj         row parallel: input columns split, outputs summed over ranks
    embed_tokens, lm_head     vocabulary parallel: rows split, the vocabulary padded to N
    norms                     replicated

With fewer KV heads than ranks, each rank keeps one KV head, shared by the ranks whose
query heads read it (replicated KV, as vLLM does).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.registry import refuse_unsupported
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
        if m.intermediate_size % n:
            raise ModelLoadError(f"--tensor-parallel-size {n} must divide the model's "
                                 f"intermediate_size {m.intermediate_size}",
                                 param="tensor_parallel_size")

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
        return dataclasses.replace(
            self.model, num_attention_heads=self.heads_per_rank,
            num_key_value_heads=self.kv_heads_per_rank,
            intermediate_size=self.intermediate_per_rank, vocab_size=self.vocab_per_rank)

    def take(self, name: str, source: Any) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name`.

        `source` is a tensor or a safetensors slice (`safe_open(...).get_slice(name)`): both
        index like a tensor, and a slice reads only the indexed bytes from the file, so no
        rank ever holds the full matrix.
        """
        parts = name.rsplit(".", 2)
        module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)
        head_dim, rank = self.model.head_dim, self.parallel.rank
        if module == "q_proj":
            return _rows(source, rank * self.heads_per_rank * head_dim,
                         self.heads_per_rank * head_dim)
        if module in ("k_proj", "v_proj"):
            return _rows(source, self.first_kv_head * head_dim, self.kv_heads_per_rank * head_dim)
        if module in ("gate_proj", "up_proj"):
            size = self.intermediate_per_rank
            return _rows(source, rank * size, size)
        if module in _ROW_PARALLEL:
            if kind == "bias":  # added once, after the sum over ranks
                full = source[:]
                return full if rank == 0 else torch.zeros_like(full)
            size = (self.heads_per_rank * head_dim if module == "o_proj"
                    else self.intermediate_per_rank)
            return source[:, rank * size : (rank + 1) * size]
        if module in _VOCAB_PARALLEL:
            return self._vocab_rows(source)
        return source[:]

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

