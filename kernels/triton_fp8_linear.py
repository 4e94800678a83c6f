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
fastest. Every launch shape of the fma, f16 and f16t modes exists twice: widening with the
conversion instruction, and with `widen="bits"`, integer instructions that give the weight
times 2^-8 exactly (`meshserve.kernels.fp8_widen`; the 2^8 joins the row's scale), for when
the conversions' narrow pipe, not memory, would bound the kernel. On an H100 the integer
widening was 4-8% slower on every Llama-3.1-8B shape (loadtest/reports/fp8/README.md), so the
tuner measures it only with `--fp8-widen bits`.

One program owns BLOCK_N output rows of w over 1/SPLIT_K of K and streams them in BLOCK_K
chunks (BLOCK_K FP8 bytes per row, loaded 16 bytes per thread). A weight with few rows (q/k/v
and o of an 8B model: 4096-6144) gives too few programs to keep every SM's loads in flight, so
`split_k` > 1 splits K over a second grid axis: each program stores its partial sums in a
float32 workspace and counts itself done on a per-column-block counter; the program that
counts last adds the partials, writes y and resets the counter (one kernel, no memset and no
second reduction launch, so it captures in a CUDA graph as one node). The "f16t" mode is the
f16 product with the operands swapped (y^T = w @ x^T): the weight is the dot's first operand,
widened in registers.

`skinny_fp8_linear` checks its inputs; `fp8_config_for` picks the launch shape; the torch
reference is `meshserve.kernels.fp8_linear.fp8_linear_reference`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from meshserve.kernels import fp8_widen, pdl
from meshserve.kernels.fp8_widen import e4m3_to_f16_scaled
from meshserve.kernels.pdl import pdl_prologue
from meshserve.kernels.triton_linear import w_chunk

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_ROWS = 16
# bf16 activations are multiplied by 2^-X_SHIFT before becoming f16 (module docstring).
X_SHIFT = 8
# The largest first weight chunk (FP8 bytes) a program reads before the kernel before it ends.
EARLY_CHUNK: tl.constexpr = tl.constexpr(16384)


@dataclass(frozen=True)
class Fp8Config:
    """Launch shape of `_skinny_fp8_kernel`. `mode`: "f16" tensor-core products in float16
    (any M), "bf16" tensor-core products in x's dtype (the weight widened through float32),
    "fma" float32 FMA products (M == 1 only), "f16t" the f16 products with the weight as the
    first operand. `split_k`: programs per column block, each over 1/split_k of K.
    `widen`: how FP8 becomes float16/32: "cvt" Hopper's conversion instructions, "bits"
    integer instructions (`meshserve.kernels.fp8_widen`; not with mode "bf16")."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    mode: str = "f16"
    split_k: int = 1
    widen: str = "cvt"


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


# The shapes that came first or close on an H200 (CUDA-graph times of the Llama-3.1-8B
# projections at 1, 8 and 16 rows, loadtest/reports/fp8/kernels_graphs.md): FMA tiles for one
# row of the few-row weights, wide f16 tiles for gate_up, and split K (the swapped operands
# first) for 2-16 rows. Tiles 16 rows wide and the bf16 mode were slower on every shape.
# FMA tiles of 8 and 16 rows per program reuse each x value they load for more weight rows;
# 8 x 2048 reads half of a K = 4096 row block before the kernel before it ends (EARLY_CHUNK);
# 4 x 1024 with 2 warps came first for o and gate_up on an H100 by 0.0-0.6 us.
_SHAPES = (
    Fp8Config(block_n=4, block_k=2048, num_warps=4, num_stages=3, mode="fma"),
    Fp8Config(block_n=8, block_k=2048, num_warps=8, num_stages=3, mode="fma"),
    Fp8Config(block_n=4, block_k=1024, num_warps=2, num_stages=4, mode="fma"),
    Fp8Config(block_n=8, block_k=1024, num_warps=8, num_stages=3, mode="fma"),
    Fp8Config(block_n=8, block_k=1024, num_warps=4, num_stages=3, mode="fma"),
    Fp8Config(block_n=16, block_k=512, num_warps=4, num_stages=3, mode="fma"),
    Fp8Config(block_n=32, block_k=512, num_warps=4, num_stages=5, mode="bf16"),
    Fp8Config(block_n=32, block_k=128, num_warps=2, num_stages=4, mode="f16"),
    Fp8Config(block_n=64, block_k=256, num_warps=4, num_stages=4, mode="f16"),
    Fp8Config(block_n=128, block_k=128, num_warps=4, num_stages=4, mode="f16"),
    Fp8Config(block_n=32, block_k=256, num_warps=4, num_stages=4, mode="f16", split_k=2),
    Fp8Config(block_n=32, block_k=256, num_warps=4, num_stages=4, mode="f16t", split_k=2),
    Fp8Config(block_n=64, block_k=256, num_warps=4, num_stages=4, mode="f16t", split_k=2),
    Fp8Config(block_n=64, block_k=128, num_warps=4, num_stages=4, mode="f16t", split_k=4),
    Fp8Config(block_n=128, block_k=128, num_warps=8, num_stages=4, mode="f16t", split_k=4),
)
# Each shape with both widenings (Hopper's FP8 conversion and the integer one), but "bf16";
# `fp8_tuning` offers the integer one only when `--fp8-widen bits` asks for it.
CANDIDATES = tuple(c for shape in _SHAPES for c in (
    (shape,) if shape.mode == "bf16" else (shape, replace(shape, widen="bits"))))
"""Launch shapes `meshserve.kernels.fp8_tuning` measures (the FMA ones for one row only)."""


SMALL_CONFIG = Fp8Config(block_n=16, block_k=32, num_warps=4, num_stages=1)
"""A launch shape for small test matrices (the interpreter)."""
SMALL_FMA_CONFIG = Fp8Config(block_n=16, block_k=32, num_warps=4, num_stages=1, mode="fma")
"""The FMA path on small test matrices (one row)."""
MODES = {"fma": 0, "bf16": 1, "f16": 2, "f16t": 3}


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
    assert c.widen == "cvt" or (c.widen == "bits" and c.mode != "bf16"), (
        f"widen {c.widen} with mode {c.mode}")
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    shift = X_SHIFT if x.dtype == torch.bfloat16 and c.mode in ("f16", "f16t") else 0
    bits = c.widen == "bits"
    blocks = triton.cdiv(n, c.block_n)
    # K per split: whole BLOCK_K chunks, so no chunk straddles two splits.
    k_split = triton.cdiv(triton.cdiv(k, c.split_k), c.block_k) * c.block_k
    split_k = triton.cdiv(k, k_split)
    workspace, counters = (_split_buffers(x.device, n, split_k) if split_k > 1
                           else (out, out))  # unused with one split
    _skinny_fp8_kernel[(blocks, split_k)](
        x, weight, scale, out, workspace, counters, rows, n, k, k_split, x.stride(0),
        weight.stride(0), out.stride(0), 2.0**-shift,
        Y_SCALE=2.0**(shift + (fp8_widen.SHIFT if bits else 0)), MODE=MODES[c.mode],
        BLOCK_M=1 if c.mode == "fma" else MAX_ROWS,
        BLOCK_N=c.block_n, BLOCK_K=c.block_k, EVEN_K=k % c.block_k == 0, SPLIT_K=split_k,
        ONE_ROW=rows == 1 and c.mode in ("f16", "f16t"), BITS=bits,
        ASM=bits and fp8_widen.use_asm(x.device), num_warps=c.num_warps, num_stages=c.num_stages, **pdl.launch_options(x.device))
    return out


# (device, N, splits) -> (float32 partial sums [splits, MAX_ROWS, N], int32 counters, one per
# column block of the narrowest tile). Kept for the process's life: CUDA graphs hold their
# addresses. The counters start at zero and every launch leaves them at zero.
_split_workspaces: dict[tuple[torch.device, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
_NARROWEST_BLOCK_N = 4


def _split_buffers(device: torch.device, n: int, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (device, n, splits)
    buffers = _split_workspaces.get(key)
    if buffers is None:
        assert not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()), (
            "a split-K launch shape must run once before a CUDA graph captures it")
        buffers = (torch.empty(splits, MAX_ROWS, n, dtype=torch.float32, device=device),
                   torch.zeros(triton.cdiv(n, _NARROWEST_BLOCK_N), dtype=torch.int32,
                               device=device))
        _split_workspaces[key] = buffers
    return buffers


@triton.jit
def _x_tile_f16(x_ptr, m, m_ok, k, K, stride_xm, x_scale, ONE_ROW: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] as float16 times x_scale, rows past M zero. bf16 * 2^-8 is exact
    (8 exponent bits), in float32 before the narrowing; x_scale is an argument, not a
    constant, so the compiler cannot move the product after the conversion (where an
    |x| > 65504 would overflow). With one row, only that row is loaded and converted (the
    other 15 are zeros put in place, not conversions)."""
    if ONE_ROW:
        row = tl.load(x_ptr + k, mask=k < K, other=0.0)
        row16 = (row.to(tl.float32) * x_scale).to(tl.float16)  # [BLOCK_K]
        return tl.where((m == 0)[:, None], row16[None, :], 0.0).to(tl.float16)
    x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :],
                mask=m_ok[:, None] & (k < K)[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
    return (x.to(tl.float32) * x_scale).to(tl.float16)


@triton.jit
def _widen_f16(w, BITS: tl.constexpr, ASM: tl.constexpr):
    """The FP8 tile w as float16: exactly w (BITS false) or w * 2^-8 (BITS, fp8_widen)."""
    if BITS:
        w16 = e4m3_to_f16_scaled(w, ASM)
    else:
        w16 = w.to(tl.float16)
    return w16


@triton.jit
def _add_chunk(acc, w, x_ptr, m, m_ok, k, K, stride_xm, x_scale, EVEN_K: tl.constexpr,
               MODE: tl.constexpr, ONE_ROW: tl.constexpr, BITS: tl.constexpr,
               ASM: tl.constexpr):
    """acc plus the products of one K chunk: w [BLOCK_N, BLOCK_K] (FP8) with x's columns k.
    acc is [BLOCK_N, BLOCK_K] (MODE 0), [BLOCK_N, BLOCK_M] (3) or [BLOCK_M, BLOCK_N]."""
    # One return at the end: the compiler visits every statement after a taken branch.
    if MODE == 0:  # one row, float32 FMA
        if EVEN_K:
            x = tl.load(x_ptr + k)
        else:
            x = tl.load(x_ptr + k, mask=k < K, other=0.0)
        acc = acc + _widen_f16(w, BITS, ASM).to(tl.float32) * x.to(tl.float32)[None, :]
    elif MODE == 3:  # y^T = w @ x^T on the tensor cores in float16, the weight first
        x16 = _x_tile_f16(x_ptr, m, m_ok, k, K, stride_xm, x_scale, ONE_ROW)
        acc = tl.dot(_widen_f16(w, BITS, ASM), tl.trans(x16), acc)
    elif MODE == 2:
        x16 = _x_tile_f16(x_ptr, m, m_ok, k, K, stride_xm, x_scale, ONE_ROW)
        acc = tl.dot(x16, tl.trans(_widen_f16(w, BITS, ASM)), acc)
    else:
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :],
                    mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    return acc


@triton.jit
def _skinny_fp8_kernel(x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, K_SPLIT,
                       stride_xm, stride_wn, stride_ym, x_scale, Y_SCALE: tl.constexpr,
                       MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr,
                       ONE_ROW: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr,
                       PDL: tl.constexpr):
    pid = tl.program_id(0)
    # A whole number of BLOCK_K chunks: the loads stay aligned (vectorised and pipelined).
    k_lo = tl.multiple_of(tl.program_id(1) * K_SPLIT, BLOCK_K)
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    # Rows of w past N read row N - 1 again (never stored), so the loads need no N mask.
    n_safe = tl.minimum(n, N - 1)
    w_rows = w_ptr + n_safe.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    kk = tl.arange(0, BLOCK_K)
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    # The scales and the first K chunk of the weight are read before waiting for the kernel
    # before (kernels/pdl.py): no kernel writes them, and the read overlaps that kernel's end.
    # A chunk past EARLY_CHUNK bytes would stay in registers too long (spills): not read early.
    row_scale = tl.load(s_ptr + n_safe)  # [BLOCK_N] float32
    if MODE == 0:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    elif MODE == 3:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if BLOCK_N * BLOCK_K <= EARLY_CHUNK:
        # Every split holds at least one chunk (k_lo < K, `skinny_fp8_linear`), and K_SPLIT
        # is whole chunks: the first chunk lies inside this split, masked only at K.
        k = k_lo + kk
        w = w_chunk(w_rows, k, K, EVEN_K)
        pdl_prologue(PDL)
        acc = _add_chunk(acc, w, x_ptr, m, m_ok, k, K, stride_xm, x_scale, EVEN_K, MODE,
                         ONE_ROW, BITS, ASM)
        k_next = k_lo + BLOCK_K
    else:
        pdl_prologue(PDL)
        k_next = k_lo
    for k0 in range(k_next, k_hi, BLOCK_K):
        k = k0 + kk
        w = w_chunk(w_rows, k, K, EVEN_K)
        acc = _add_chunk(acc, w, x_ptr, m, m_ok, k, K, stride_xm, x_scale, EVEN_K, MODE,
                         ONE_ROW, BITS, ASM)
    if MODE == 0:
        part = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
    elif MODE == 3:
        part = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    else:
        part = acc
    part = part * (row_scale * Y_SCALE)[None, :]  # [BLOCK_M, BLOCK_N]
    out_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], part.to(y_ptr.dtype.element_ty),
                 mask=out_mask)
    else:
        # Partial sums to the workspace [SPLIT_K, MAX_ROWS = 16, N]; the last program of this column
        # block to finish adds them up. The barrier puts every thread's stores before the
        # counter's release; the acquire puts the other programs' stores before the reads.
        ws = ws_ptr + m[:, None] * N + n[None, :]
        tl.store(ws + tl.program_id(1) * 16 * N, part, mask=out_mask)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for split in range(SPLIT_K):
                total += tl.load(ws + split * 16 * N, mask=out_mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(y_ptr + m[:, None] * stride_ym + n[None, :],
                     total.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(cnt_ptr + pid, 0)


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
