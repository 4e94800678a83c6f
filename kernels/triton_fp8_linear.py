"""A Triton product for skinny inputs against an FP8 weight with one scale per output row:
y [M, N] = (x [M, K] @ w_fp8 [N, K]^T) * scale [N], M <= 16, weight-only FP8.

Decode multiplies a handful of rows by every weight, so the step is bound by reading the
weights: an FP8 weight is half the bytes of a bf16 one. The layout follows
`meshserve.kernels.triton_linear`: one program owns BLOCK_N output rows of w over the whole
of K (no split-K), streams them in BLOCK_K chunks, converts each FP8 tile to float32 (M == 1,
FMA accumulation in a [BLOCK_N, BLOCK_K] tile) or to x's dtype (1 < M <= 16, rows padded to
16 for tl.dot), and applies the row's scale once, after the sum over K.

`skinny_fp8_linear` checks its inputs; the torch reference is
`meshserve.kernels.fp8_linear.fp8_linear_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from meshserve.kernels.triton_linear import SkinnyConfig, config_for

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_ROWS = 16


def skinny_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                      config: SkinnyConfig | None = None) -> torch.Tensor:
    """x [M <= 16, K] @ (weight [N, K] float8_e4m3fn * scale [N])^T -> [M, N] in x's dtype."""
    assert x.device == weight.device == scale.device, (
        f"x on {x.device}, weight on {weight.device}, scale on {scale.device}")
    assert x.is_cuda or isinstance(_skinny_fp8_kernel, InterpretedFunction), (
        f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {x.device}")
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (
        f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    assert 1 <= x.shape[0] <= MAX_ROWS, f"x must have 1..{MAX_ROWS} rows, got {x.shape[0]}"
    assert x.dtype in SUPPORTED_DTYPES, f"x must be float16 or bfloat16, got {x.dtype}"
    assert weight.dtype == torch.float8_e4m3fn, f"weight must be float8_e4m3fn, got {weight.dtype}"
    assert scale.dtype == torch.float32 and scale.shape == (weight.shape[0],), (
        f"scale must be float32 [{weight.shape[0]}], got {scale.dtype} {tuple(scale.shape)}")
    assert x.stride(1) == 1 and weight.stride(1) == 1, "x and weight must be contiguous in K"
    rows, k = x.shape
    n = weight.shape[0]
    # FP8 rows are half as wide in bytes: twice the K chunk reads the same bytes per step.
    base = config or config_for(rows, n, k)
    if config is None:
        base = SkinnyConfig(block_n=base.block_n, block_k=base.block_k * 2,
                            num_warps=base.num_warps, num_stages=base.num_stages)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    _skinny_fp8_kernel[(triton.cdiv(n, base.block_n),)](
        x, weight, scale, out, rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=1 if rows == 1 else MAX_ROWS, BLOCK_N=base.block_n, BLOCK_K=base.block_k,
        EVEN_K=k % base.block_k == 0, num_warps=base.num_warps, num_stages=base.num_stages)
    return out


SMALL_CONFIG = SkinnyConfig(block_n=16, block_k=32, num_warps=4, num_stages=1)
"""A launch shape for small test matrices (the interpreter)."""


@triton.jit
def _skinny_fp8_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       EVEN_K: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    # Rows of w past N read row N - 1 again (never stored), so the loads need no N mask.
    n_safe = tl.minimum(n, N - 1)
    w_rows = w_ptr + n_safe.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    row_scale = tl.load(s_ptr + n_safe)  # [BLOCK_N] float32
    kk = tl.arange(0, BLOCK_K)
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            if EVEN_K:
                w = tl.load(w_rows + k[None, :])
                x = tl.load(x_ptr + k)
            else:
                w = tl.load(w_rows + k[None, :], mask=(k < K)[None, :], other=0.0)
                x = tl.load(x_ptr + k, mask=k < K, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1) * row_scale  # [BLOCK_N]
        tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)
    else:
        m = tl.arange(0, BLOCK_M)
        m_ok = m < M
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            if EVEN_K:
                w = tl.load(w_rows + k[None, :])
            else:
                w = tl.load(w_rows + k[None, :], mask=(k < K)[None, :], other=0.0)
            x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :],
                        mask=m_ok[:, None] & (k < K)[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            acc2 = tl.dot(x, tl.trans(w.to(x.dtype)), acc2)
        y2 = acc2 * row_scale[None, :]  # [BLOCK_M, BLOCK_N]
        tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], y2.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16) -> (float8_e4m3fn [M, K], float32 scale [M, 1]) in one pass:
    scale = max(|row|) / 448 (at least 1e-12), q = saturate(row / scale).

    The torch reference, `meshserve.kernels.fp8_linear.quantize_per_token`, takes five
    passes over the activations and a float32 copy of them."""
    assert x.is_cuda or isinstance(_quantize_rows_kernel, InterpretedFunction), (
        f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {x.device}")
    assert x.dim() == 2 and x.stride(1) == 1, f"x must be [M, K] contiguous in K, got {x.shape}"
    assert x.dtype in (*SUPPORTED_DTYPES, torch.float32), f"x dtype {x.dtype} not supported"
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(k)
        _quantize_rows_kernel[(rows,)](x, q, scale, k, x.stride(0), BLOCK_K=block,
                                       num_warps=8 if block >= 4096 else 4)
    return q, scale


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, BLOCK_K: tl.constexpr):
    # One program per row: the whole row [BLOCK_K] in registers (K <= 16384 for Llama MLPs).
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / 448.0, 1e-12)
    q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
    tl.store(q_ptr + row * K + k, q.to(q_ptr.dtype.element_ty), mask=k < K)
    tl.store(s_ptr + row, scale)
