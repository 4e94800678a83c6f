"""A Triton matrix product for skinny inputs: y [M, N] = x [M, K] @ w [N, K]^T with M <= 16.

Decoding few sequences multiplies a handful of rows by every weight matrix, so the step reads
each weight once and does almost no arithmetic per byte: the product is a matrix-vector
product bound by memory bandwidth. One program owns BLOCK_N output columns over the whole of K
(no split-K, so no partial sums and no second reduction kernel) and streams its rows of w in
BLOCK_K chunks, software-pipelined over NUM_STAGES. With M == 1 the products run on the FMA
units, accumulated elementwise in a [BLOCK_N, BLOCK_K] tile that is reduced once at the end;
with 1 < M <= 16 the rows are padded to 16 and multiplied with tl.dot.

`skinny_linear` checks its inputs; `SkinnyConfig` is the launch shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from meshserve.kernels import pdl
from meshserve.kernels.pdl import pdl_prologue

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_ROWS = 16


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch shape of `_skinny_kernel`."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


DEFAULT_CONFIG = SkinnyConfig(block_n=16, block_k=256, num_warps=4, num_stages=4)


def config_for(rows: int, n: int, k: int) -> SkinnyConfig:
    """The launch shape for an [rows, k] @ [n, k]^T product, from a grid measured on an H100
    for each Llama-3.1-8B projection (loadtest/gpu_op_probe.py).

    One row: 4 columns per program in chunks of 1024 were the fastest or within 1% of it for
    every projection; the LM head's very wide output wants 8 warps. Several rows (tl.dot): 32
    columns per program for narrow outputs (N <= 4096), else 64.
    """
    if rows == 1:
        return SkinnyConfig(block_n=4, block_k=1024, num_warps=8 if n > 65536 else 4,
                            num_stages=3)
    return SkinnyConfig(block_n=32 if n <= 4096 else 64, block_k=256, num_warps=4,
                        num_stages=5)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor,
                  config: SkinnyConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """x [M <= 16, K] @ weight [N, K]^T -> [M, N] in x's dtype (float32 accumulation)."""
    assert x.device == weight.device, f"x on {x.device}, weight on {weight.device}"
    assert x.is_cuda or isinstance(_skinny_kernel, InterpretedFunction), (
        f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {x.device}")
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (
        f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    assert 1 <= x.shape[0] <= MAX_ROWS, f"x must have 1..{MAX_ROWS} rows, got {x.shape[0]}"
    assert x.dtype == weight.dtype and x.dtype in SUPPORTED_DTYPES, (
        f"x {x.dtype} and weight {weight.dtype} must both be float16 or bfloat16")
    assert x.stride(1) == 1 and weight.stride(1) == 1, "x and weight must be contiguous in K"
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    _skinny_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, out, rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=1 if rows == 1 else MAX_ROWS, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0, num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl.launch_options(x.device))
    return out


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    # Rows of w past N read row N - 1 again (never stored), so the loads need no N mask.
    w_rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    kk = tl.arange(0, BLOCK_K)
    # The first K chunk of the weight is read before waiting for the kernel before
    # (kernels/pdl.py): no kernel writes it, and the read overlaps that kernel's end.
    w = w_chunk(w_rows, kk, K, EVEN_K)
    pdl_prologue(PDL)
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    if BLOCK_M == 1:
        acc = _add_row_chunk(tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32), w, x_ptr, kk, K,
                             EVEN_K)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            k = k0 + kk
            acc = _add_row_chunk(acc, w_chunk(w_rows, k, K, EVEN_K), x_ptr, k, K, EVEN_K)
        y = tl.sum(acc, axis=1)  # [BLOCK_N]
        tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)
    else:
        acc2 = _add_rows_chunk(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), w, x_ptr, m,
                               m_ok, kk, K, stride_xm)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            k = k0 + kk
            acc2 = _add_rows_chunk(acc2, w_chunk(w_rows, k, K, EVEN_K), x_ptr, m, m_ok, k, K,
                                   stride_xm)
        tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], acc2.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def w_chunk(w_rows, k, K, EVEN_K: tl.constexpr):
    """The weight's columns k [BLOCK_K] of the program's rows, zero past K (also read by the
    FP8 product's kernel)."""
    if EVEN_K:
        w = tl.load(w_rows + k[None, :])
    else:
        w = tl.load(w_rows + k[None, :], mask=(k < K)[None, :], other=0.0)
    return w


@triton.jit
def _add_row_chunk(acc, w, x_ptr, k, K, EVEN_K: tl.constexpr):
    """acc [BLOCK_N, BLOCK_K] plus w times x's one row at columns k (float32 FMA)."""
    if EVEN_K:
        x = tl.load(x_ptr + k)
    else:
        x = tl.load(x_ptr + k, mask=k < K, other=0.0)
    return acc + w.to(tl.float32) * x.to(tl.float32)[None, :]


@triton.jit
def _add_rows_chunk(acc, w, x_ptr, m, m_ok, k, K, stride_xm):
    """acc [BLOCK_M, BLOCK_N] plus x's rows at columns k times w^T (tensor cores)."""
    x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :],
                mask=m_ok[:, None] & (k < K)[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
    return tl.dot(x, tl.trans(w), acc)
