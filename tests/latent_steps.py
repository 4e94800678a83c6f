"""Random steps of latent attention (kernels/mla.py) over a paged cache of compressed rows,
for the Triton kernel's tests: the interpreter's (tests/kernel_ops/test_mla_kernels.py) and
the GPU's (tests/gpu/test_gpu_deepseek.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from meshserve.kernels.attention import AttentionMetadata, to_cache_dtype
from meshserve.kernels.mla import mla_attention, write_latents


@dataclass
class LatentStep:
    query: torch.Tensor  # [T, H, R + P], a strided view (as the model's are not packed)
    k_cache: torch.Tensor  # [N, bs, 1, (R + P) / 2], junk outside the sequences' rows
    v_cache: torch.Tensor
    meta: AttentionMetadata
    rank: int

    @property
    def scale(self) -> float:
        """(nope + P) ** -0.5 with 16 nope dims."""
        return (16 + self.query.shape[-1] - self.rank) ** -0.5

    def to(self, device: str | torch.device) -> LatentStep:
        meta = dataclasses.replace(self.meta, **{
            name: getattr(self.meta, name).to(device) for name in
            ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")})
        return LatentStep(self.query.to(device), self.k_cache.to(device),
                          self.v_cache.to(device), meta, self.rank)

    def reference(self) -> torch.Tensor:
        """The PyTorch reference's output in float32, on the CPU: [T, H, R]."""
        cpu = self.to("cpu")
        return mla_attention(cpu.query.float(), cpu.k_cache.float(), cpu.v_cache.float(),
                             cpu.meta, self.scale, self.rank)


def make_latent_step(ctx_lens: list[int], q_lens: list[int], heads: int, rank: int, rope: int,
                     bs: int, dtype: torch.dtype = torch.float32,
                     cache_dtype: torch.dtype | None = None, seed: int = 0) -> LatentStep:
    """Random sequences in shuffled, non-contiguous blocks (tables padded with 0), every row
    of every sequence written, this step's included (the model writes them before attending).
    On the CPU; `LatentStep.to` moves it."""
    g = torch.Generator().manual_seed(seed)
    half = (rank + rope) // 2
    num_blocks = sum(-(-c // bs) for c in ctx_lens) * 2 + 1
    k_cache = to_cache_dtype(torch.randn(num_blocks, bs, 1, half, generator=g),
                             cache_dtype or dtype)
    v_cache = to_cache_dtype(torch.randn(num_blocks, bs, 1, half, generator=g),
                             cache_dtype or dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[perm.pop() for _ in range(-(-c // bs))] for c in ctx_lens]
    slots = [t[p // bs] * bs + p % bs for t, c in zip(tables, ctx_lens) for p in range(c)]
    rows = torch.randn(len(slots), rank + rope, generator=g).to(dtype)
    write_latents(rows, k_cache, v_cache, torch.tensor(slots))
    # Queries a little larger than a unit vector's scale, so that softmaxes are not flat.
    padded = torch.randn(sum(q_lens), heads, rank + rope + 8, generator=g) * 0.3
    width = max(map(len, tables)) + 1
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([t[p // bs] * bs + p % bs for t, c, q in
                                   zip(tables, ctx_lens, q_lens) for p in range(c - q, c)]),
        query_start_loc=torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(
            0, dtype=torch.int32),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                  dtype=torch.int32),
        max_query_len=max(q_lens), max_seq_len=max(ctx_lens),
        query_lens_cpu=q_lens, seq_lens_cpu=ctx_lens)
    return LatentStep(padded.to(dtype)[..., : rank + rope], k_cache, v_cache, meta, rank)
