"""A Triton product for skinny inputs against an FP8 weight with one scale per output row:
y [M, N] = (x [M, K] @ w_fp8 [N, K]^T) * scale [N], M <= 16, weight-only FP8.

Decode multiplies a handful of rows by every weight, so the step should be bound by reading
the weights: an FP8 weight is half the bytes of a bf16 one, but each byte then carries twice
the elements to widen, and widening limits a kernel that turns every FP8 element into float32
(e4m3 -> f16 -> f32: two conversion instructions per element, and conversions issue at a
fraction of the FMA rate) or into bf16 (e4m3 -> f16 -> bf16, the same). The "f16" mode
multiplies on the tensor cores in float16 (rows padded to 16): e4m3 widens to f16 exactly with
one instruction per two elements (`cvt.rn.f16x2.e4m3x2`), and bf16 activations become f16
after a multiplication by 2^-8 (exact for |x| >= 2^-6; a bf16 value up to 65504 * 2^8 stays
finite; smaller values keep an absolute precision of 2^-17, far below bf16's own rounding of
O(1) activations). The sum is float32; the row's scale (and 2^8) are applied once at the end.
The first kernel's modes (float32 FMA for one row, tl.dot in x's dtype) remain candidates:
`meshserve.kernels.fp8_tuning` measures `CANDIDATES` per shape on the GPU and keeps the
fastest.

One program owns BLOCK_N output rows of w over the whole of K (no split-K) and streams them in
BLOCK_K chunks (BLOCK_K FP8 bytes per row, loaded 16 bytes per thread).

`skinny_fp8_linear` checks its inputs; `fp8_config_for` picks the launch shape; the torch
reference is `meshserve.kernels.fp8_linear.fp8_linear_reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_ROWS = 16
# bf16 activations are multiplied by 2^-X_SHIFT before becoming f16 (module docstring).
X_SHIFT = 8


@dataclass(frozen=True)
class Fp8Config:
    """Launch shape of `_skinny_fp8_kernel`. `mode`: "f16" tensor-core products in float16
    (any M), "bf16" tensor-core products in x's dtype (the weight widened through float32),
    "fma" float32 FMA products (M == 1 only). The last two (the earlier kernel) stay for
    measurement."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    mode: str = "f16"


def fp8_config_for(rows: int, n: int, k: int) -> Fp8Config:
    """The fallback launch shape for [rows, k] @ fp8 [n, k]^T, rows <= 16: the shapes of the
    first measured kernel (float32 FMA for one row, 4 rows x 2048 bytes per program; tl.dot in
    x's dtype for more, 32 or 64 rows x 512 bytes). `meshserve.kernels.fp8_tuning` measures
    `CANDIDATES` per shape during the engine's warm-up and uses the fastest instead."""
    del k
    if rows == 1:
        return Fp8Config(block_n=4, block_k=2048, num_warps=4, num_stages=3, mode="fma")
    return Fp8Config(block_n=32 if n <= 4096 else 64, block_k=512, num_warps=4, num_stages=5,
                     mode="bf16")


# f16 tiles widen a [16, BLOCK_K] tile of x (spread over the program's threads) besides w:
# wider BLOCK_N shares that cost over more weight; narrower BLOCK_N gives N = 4096 more programs.
CANDIDATES = (
    Fp8Config(block_n=4, block_k=2048, num_warps=4, num_stages=3, mode="fma"),
    Fp8Config(block_n=8, block_k=1024, num_warps=8, num_stages=3, mode="fma"),
    Fp8Config(block_n=32, block_k=512, num_warps=4, num_stages=5, mode="bf16"),
    Fp8Config(block_n=64, block_k=512, num_warps=4, num_stages=5, mode="bf16"),
    Fp8Config(block_n=16, block_k=512, num_warps=4, num_stages=4, mode="f16"),
    Fp8Config(block_n=32, block_k=256, num_warps=4, num_stages=4, mode="f16"),
    Fp8Config(block_n=64, block_k=256, num_warps=4, num_stages=4, mode="f16"),
    Fp8Config(block_n=32, block_k=128, num_warps=2, num_stages=4, mode="f16"),
)
"""Launch shapes `meshserve.kernels.fp8_tuning` measures (the FMA ones for one row only)."""


SMALL_CONFIG = Fp8Config(block_n=16, block_k=32, num_warps=4, num_stages=1)
"""A launch shape for small test matrices (the interpreter)."""
SMALL_FMA_CONFIG = Fp8Config(block_n=16, block_k=32, num_warps=4, num_stages=1, mode="fma")
MODES = {"fma": 0, "bf16": 1, "f16": 2}
"""The FMA path on small test matrices (one row)."""


def skinny_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                      config: Fp8Config | None = None) -> torch.Tensor:
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
    c = config or fp8_config_for(rows, n, k)
    assert c.mode in MODES and (c.mode != "fma" or rows == 1), f"mode {c.mode} for {rows} rows"
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    shift = X_SHIFT if x.dtype == torch.bfloat16 and c.mode == "f16" else 0
    _skinny_fp8_kernel[(triton.cdiv(n, c.block_n),)](
        x, weight, scale, out, rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
        2.0**-shift, Y_SCALE=2.0**shift, MODE=MODES[c.mode],
        BLOCK_M=1 if c.mode == "fma" else MAX_ROWS,
        BLOCK_N=c.block_n, BLOCK_K=c.block_k, EVEN_K=k % c.block_k == 0,
        num_warps=c.num_warps, num_stages=c.num_stages)
    return out


@triton.jit
def _skinny_fp8_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       x_scale, Y_SCALE: tl.constexpr, MODE: tl.constexpr,
                       BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
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
            if MODE == 2:
                # bf16 * 2^-8 is exact (8 exponent bits), in float32 before the narrowing;
                # x_scale is an argument, not a constant, so the compiler cannot move the
                # product after the conversion (where an |x| > 65504 would overflow).
                x16 = (x.to(tl.float32) * x_scale).to(tl.float16)
                acc2 = tl.dot(x16, tl.trans(w.to(tl.float16)), acc2)
            else:
                acc2 = tl.dot(x, tl.trans(w.to(x.dtype)), acc2)
        y2 = acc2 * (row_scale * Y_SCALE)[None, :]  # [BLOCK_M, BLOCK_N]
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
