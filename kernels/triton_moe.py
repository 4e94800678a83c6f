"""Triton grouped GEMMs of the mixture-of-experts MLP behind `meshserve.kernels.moe`.

The step's P = T*k (token, slot) pairs are sorted by expert (`moe.group_by_expert`) and cut
into tiles of BLOCK_M pairs that never straddle two experts; program (m, n) multiplies tile m's
rows by columns n of that tile's ONE expert's weights:

    gate/up: inter [P, 2I] (sorted order) = x[token of pair] [., H] @ w13[e]^T
    silu_and_mul (kernels/activation.py): [P, 2I] -> [P, I]
    down:    out [T*k, H] (pair order)   = (inter [., I] @ w2[e]^T) * routing weight
    combine: out.view(T, k, H).sum(1)

The tile schedule (which expert and rows each program takes) is computed with torch on the
device, and the grid is sized by an upper bound that depends on T, k and E only
(cdiv(P, BLOCK_M) + min(E, P) tiles; programs past the last tile return at once). Nothing is
read back to the host, so a decode step can be captured in a CUDA graph and replayed with
any routing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from meshserve.kernels.activation import silu_and_mul
from meshserve.kernels.moe import ExpertGroups, group_by_expert

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_N = 64
BLOCK_K = 64


@dataclass(frozen=True)
class TileSchedule:
    """Per program m: its expert and the [start, end) positions of its sorted pairs
    (start == end for the programs past the last tile)."""

    expert: torch.Tensor  # [M] int32
    start: torch.Tensor  # [M] int32
    end: torch.Tensor  # [M] int32


def tile_schedule(groups: ExpertGroups, block_m: int) -> TileSchedule:
    """Cut each expert's pairs into tiles of block_m rows, on the device."""
    offsets = groups.offsets.to(torch.int64)  # [E+1]
    num_experts = offsets.shape[0] - 1
    counts = offsets[1:] - offsets[:-1]  # [E]
    tiles = (counts + block_m - 1) // block_m  # [E]
    tile_ends = torch.cumsum(tiles, 0)  # [E]
    grid_m = triton.cdiv(groups.num_pairs, block_m) + min(num_experts, groups.num_pairs)
    m = torch.arange(grid_m, device=offsets.device)  # [M]
    expert = torch.searchsorted(tile_ends, m, right=True)  # [M], E past the last tile
    valid = expert < num_experts
    expert = expert.clamp(max=num_experts - 1)
    first_tile = tile_ends[expert] - tiles[expert]  # [M]
    start = offsets[expert] + (m - first_tile) * block_m
    end = torch.minimum(start + block_m, offsets[expert + 1])
    start = torch.where(valid, start, 0)
    end = torch.where(valid, end, 0)
    return TileSchedule(expert.to(torch.int32), start.to(torch.int32), end.to(torch.int32))


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights [T, k], expert_ids [T, k] -> [T, H].

    Shapes are checked by `moe.fused_experts`; dtypes and strides here."""
    assert x.dtype in SUPPORTED_DTYPES, f"fused_experts does not support {x.dtype}"
    assert w13.dtype == w2.dtype == x.dtype, (
        f"expert weights {w13.dtype}/{w2.dtype} must match the activations' {x.dtype}")
    assert w13.is_contiguous() and w2.is_contiguous(), "expert weights must be contiguous"
    assert x.stride(1) == 1, "x needs contiguous rows"
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    top_k = expert_ids.shape[1]
    out = torch.empty(num_tokens, top_k, hidden, dtype=x.dtype, device=x.device)  # [T, k, H]
    if num_tokens == 0:
        return out.sum(dim=1)
    groups = group_by_expert(expert_ids, num_experts)
    block_m = 16 if groups.num_pairs <= 64 else 64
    schedule = tile_schedule(groups, block_m)
    scale = weights.reshape(-1).to(torch.float32).contiguous()  # [T*k], pair order
    inter = torch.empty(groups.num_pairs, two_inter, dtype=x.dtype, device=x.device)  # [P, 2I]
    _launch(x, w13, inter, groups, scale, schedule, top_k, block_m, scatter=False)
    hidden_act = silu_and_mul(inter)  # [P, I], sorted order
    _launch(hidden_act, w2, out.view(-1, hidden), groups, scale, schedule, top_k, block_m,
            scatter=True)
    return out.sum(dim=1)  # [T, H]


def _launch(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, groups: ExpertGroups,
            scale: torch.Tensor, schedule: TileSchedule, top_k: int, block_m: int,
            scatter: bool) -> None:
    """out rows = a rows @ w[e]^T for every tile; see the module docstring for the two modes."""
    n, k = w.shape[1], w.shape[2]
    grid = (schedule.expert.shape[0], triton.cdiv(n, BLOCK_N))
    # float32 models multiply exactly; 16-bit operands take the tensor cores' default.
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    _grouped_gemm_kernel[grid](
        a, w, out, groups.sorted_pairs, scale, schedule.expert, schedule.start, schedule.end,
        n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        TOP_K=top_k, SCATTER=scatter, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        DOT_PRECISION=precision, num_warps=4 if block_m <= 16 else 8)


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, out_ptr, pairs_ptr, scale_ptr, tile_expert_ptr,
                         tile_start_ptr, tile_end_ptr, N, K, stride_a, stride_we, stride_wn,
                         stride_out, TOP_K: tl.constexpr, SCATTER: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """SCATTER=False (gate/up): a rows are the pairs' tokens, out rows the sorted positions.
    SCATTER=True (down): a rows are the sorted positions, out rows the pairs (t*k + j), each
    scaled by its routing weight (rounded to out's dtype first, as transformers does)."""
    pid_m = tl.program_id(0)
    start = tl.load(tile_start_ptr + pid_m)
    end = tl.load(tile_end_ptr + pid_m)
    if start < end:
        expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
        rows = start + tl.arange(0, BLOCK_M)  # sorted positions
        row_mask = rows < end
        pairs = tl.load(pairs_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        if SCATTER:
            a_rows = rows.to(tl.int64)
            out_rows = pairs
        else:
            a_rows = pairs // TOP_K
            out_rows = rows.to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        w_base = w_ptr + expert * stride_we
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            a = tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :],
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
            w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None],
                        mask=k_mask[:, None] & col_mask[None, :], other=0.0)  # [BK, BN]
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        y = acc.to(out_ptr.dtype.element_ty)
        if SCATTER:
            s = tl.load(scale_ptr + pairs, mask=row_mask, other=0.0)
            s = s.to(out_ptr.dtype.element_ty).to(tl.float32)
            y = (y.to(tl.float32) * s[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + out_rows[:, None] * stride_out + cols[None, :], y,
                 mask=row_mask[:, None] & col_mask[None, :])
