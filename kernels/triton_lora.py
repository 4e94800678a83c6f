"""Triton kernels of batched LoRA behind `meshserve.kernels.lora` (shrink, then expand).

Both kernels run over a grid of (row tiles, ..., slots): program (m, ., s) takes the m-th tile
of BLOCK_M rows among those of slot s (gathered through `sorted_rows`) and returns at once when
slot s has fewer rows, so a step of T rows launches cdiv(T, BLOCK_M) x S programs whatever its
grouping, which is what a CUDA graph replays. Rows of one slot share that slot's A and B, so a
tile is a dense [BLOCK_M, K] x [K, n*R] product (tensor cores for prefill; for decode, where a
slot has few rows, reading A and B is the cost and split-K spreads that over more programs).
The grid depends only on T, K and S, so a CUDA graph captured for T tokens replays any mix.

shrink: h [T, n*R] float32 = x [T, K] @ A[s]^T, accumulated over SPLIT_K programs with atomics
        (h starts zeroed).
expand: y [T, N] += h[:, i*R:(i+1)*R] @ B[s, cols of slice i]^T for every output slice i, in
        one launch when a column tile divides every slice (the model's shapes), else one per
        slice (h rounded to the weights' dtype first, as PEFT's layers compute).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from meshserve.kernels.lora import LoraBatch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             slices: Sequence[int], batch: LoraBatch) -> None:
    """y [T, N] += LoRA(x [T, K]) for each row's slot; shapes checked by `lora.add_lora`."""
    assert x.dtype in SUPPORTED_DTYPES, f"unsupported dtype {x.dtype}"
    assert x.stride(1) == 1 and y.stride(1) == 1, "x and y need contiguous rows"
    assert a.is_contiguous() and b.is_contiguous(), "A and B must be contiguous"
    assert batch.sorted_rows.dtype == batch.slot_start.dtype == batch.slot_count.dtype == (
        torch.int32), "the batch's tensors must be int32"
    num_tokens, k = x.shape
    num_slots, nr, _ = a.shape
    rank = b.shape[2]
    h = torch.zeros(num_tokens, nr, dtype=torch.float32, device=x.device)  # [T, n*R]
    # float32 models multiply exactly; 16-bit operands take the tensor cores' default.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    block_m = 16 if num_tokens <= 16 else 32 if num_tokens <= 64 else 64
    block_k = 64
    # Each program reduces at most 8 blocks of K: reading A is most of the cost when a slot
    # has few rows (decode), and only one row tile per slot is busy then, so the split is
    # what spreads a slot's A over many programs.
    split_k = max(1, min(16, triton.cdiv(k, block_k * 8)))
    _shrink_kernel[(triton.cdiv(num_tokens, block_m), split_k, num_slots)](
        x, a, h, batch.sorted_rows, batch.slot_start, batch.slot_count,
        k, nr, x.stride(0), a.stride(0), a.stride(1), h.stride(0),
        BLOCK_M=block_m, BLOCK_N=max(16, triton.next_power_of_2(nr)), BLOCK_K=block_k,
        SPLIT_K=split_k, DOT_PRECISION=precision,
        num_warps=8 if block_m >= 64 else 4)  # 4 warps spill a 64 x 64 tile (sm_90)
    block_r = max(16, triton.next_power_of_2(rank))
    grid_m = triton.cdiv(num_tokens, block_m)
    block_n = _common_block(slices)
    if block_n is not None:  # one launch for every slice: no tile straddles two of them
        bounds = [sum(slices[:i + 1]) for i in range(len(slices))] + [b.shape[1]] * 2
        _expand_kernel[(grid_m, triton.cdiv(b.shape[1], block_n), num_slots)](
            h, b, y, batch.sorted_rows, batch.slot_start, batch.slot_count,
            b.shape[1], rank, bounds[0], bounds[1], h.stride(0), b.stride(0), b.stride(1),
            y.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
            DOT_PRECISION=precision)
        return
    offset = 0
    for i, size in enumerate(slices):  # odd slice sizes: a launch per slice, on views
        h_i = h[:, i * rank:(i + 1) * rank]  # [T, R]
        b_i = b[:, offset:offset + size]  # [S, size, R]
        y_i = y[:, offset:offset + size]  # [T, size]
        block = 64 if size >= 64 else max(16, triton.next_power_of_2(size))
        _expand_kernel[(grid_m, triton.cdiv(size, block), num_slots)](
            h_i, b_i, y_i, batch.sorted_rows, batch.slot_start, batch.slot_count,
            size, rank, size, size, h_i.stride(0), b_i.stride(0), b_i.stride(1),
            y_i.stride(0), BLOCK_M=block_m, BLOCK_N=block, BLOCK_R=block_r,
            DOT_PRECISION=precision)
        offset += size


def _common_block(slices: Sequence[int]) -> int | None:
    """The widest column tile (64, 32 or 16) that divides every slice of at most three, so
    that each tile of a single expand launch lies in one slice; None if there is none."""
    if len(slices) > 3:
        return None
    return next((block for block in (64, 32, 16)
                 if all(size % block == 0 for size in slices)), None)


@triton.jit
def _slot_rows(sorted_ptr, start_ptr, count_ptr, slot, pid_m, BLOCK_M: tl.constexpr):
    """(rows [BLOCK_M] of this tile, their mask, whether the tile has any row)."""
    count = tl.load(count_ptr + slot)
    start = tl.load(start_ptr + slot)
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = offs < count
    rows = tl.load(sorted_ptr + start + offs, mask=mask, other=0)
    return rows, mask, pid_m * BLOCK_M < count


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, sorted_ptr, start_ptr, count_ptr,
                   K, NR, stride_xm, stride_as, stride_an, stride_hm,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    slot = tl.program_id(2)
    rows, mask_m, any_rows = _slot_rows(sorted_ptr, start_ptr, count_ptr, slot, pid_m, BLOCK_M)
    if any_rows:
        offs_n = tl.arange(0, BLOCK_N)
        mask_n = offs_n < NR
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        a_base = a_ptr + slot.to(tl.int64) * stride_as
        for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + offs_k[None, :],
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
            a = tl.load(a_base + offs_n[None, :] * stride_an + offs_k[:, None],
                        mask=mask_n[None, :] & mask_k[:, None], other=0.0)  # [BK, BN]
            acc += tl.dot(x, a, input_precision=DOT_PRECISION)
        h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_hm + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        if SPLIT_K == 1:
            tl.store(h_ptrs, acc, mask=mask)
        else:
            tl.atomic_add(h_ptrs, acc, mask=mask)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, y_ptr, sorted_ptr, start_ptr, count_ptr,
                   N, R, END0, END1, stride_hm, stride_bs, stride_bn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """Columns [0, END0) are slice 0, [END0, END1) slice 1, the rest slice 2: a tile's
    slice picks its R columns of h (tiles never straddle two slices)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.program_id(2)
    rows, mask_m, any_rows = _slot_rows(sorted_ptr, start_ptr, count_ptr, slot, pid_m, BLOCK_M)
    if any_rows:
        first = pid_n * BLOCK_N
        piece = (first >= END0).to(tl.int32) + (first >= END1).to(tl.int32)
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        offs_n = first + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        rows64 = rows.to(tl.int64)
        h = tl.load(h_ptr + rows64[:, None] * stride_hm + piece * R + offs_r[None, :],
                    mask=mask_m[:, None] & mask_r[None, :], other=0.0)  # [BM, BR] float32
        b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_n[None, :] * stride_bn
                    + offs_r[:, None], mask=mask_n[None, :] & mask_r[:, None],
                    other=0.0)  # [BR, BN]
        # The shrunk rows are rounded to the weights' dtype first, as a PEFT layer does.
        delta = tl.dot(h.to(b.dtype), b, input_precision=DOT_PRECISION)  # [BM, BN] float32
        y_ptrs = y_ptr + rows64[:, None] * stride_ym + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta.to(y.dtype).to(tl.float32)).to(y.dtype),
                 mask=mask)
