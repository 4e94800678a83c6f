"""Triton kernels of the mixture-of-experts MLP behind `meshserve.kernels.moe`.

    gate/up: h [P, I] = act(x[token of pair] @ w13[e]^T (+ b13[e]))      (P = T*k pairs)
    down:    y [T*k, H] (pair order) = (h @ w2[e]^T (+ b2[e])) * routing weight
    combine: y.view(T, k, H).sum(1)

`act` is SiLU-and-multiply (gate rows first, then up rows, as kernels/activation.py) or
gpt-oss's clamped SwiGLU; the activation and the biases run in the products' epilogues.

Two ways to run the products, by the number of pairs:
- few pairs (decode of a few sequences, at most GEMV_MAX_PAIRS): matrix-vector products that
  read each pair's expert rows straight from its expert id, with no grouping at all: one
  program per (pair, block of gate/up columns), then one per (token, block of output
  columns) summing the token's k pairs (so the combine is no launch of its own). A layer is
  four launches: the router's product, `triton_moe_route.route` and the two products. Each
  pair reads its expert's weights once; with so few pairs they are mostly distinct experts,
  so nothing is read twice that grouping would save.
- more pairs: `triton_moe_route.align` sorts them by expert and cuts each expert's pairs into
  tiles of BLOCK_M rows that never straddle two experts; program (m, n) multiplies tile m's
  rows by columns n of that tile's one expert (tl.dot), so an expert's weights are read once
  per tile rather than once per pair.
The grids depend on T, k and E only (programs past the last tile return at once) and nothing
is read back to the host, so a decode step can be captured in a CUDA graph and replayed with
any routing. A pair whose expert id is negative is skipped (expert parallelism gives the pairs
of other ranks' experts id -1): it reads no weights and adds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from meshserve.kernels import pdl
from meshserve.kernels.fp8_linear import FP8_DTYPE
from meshserve.kernels.pdl import pdl_prologue
from meshserve.kernels.triton_moe_route import align

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ACTIVATIONS = {"silu": 0, "swiglu_oai": 1}
GEMV_MAX_PAIRS = 32
# Matrix-vector products, gate/up and down: (output columns, reduction chunk, warps, stages)
# per program.
# Fastest at 1 and 4 tokens of the Qwen3-30B-A3B shape on an H200 (loadtest/moe_kernel_bench.py
# --sweep; loadtest/reports/moe/).
GEMV_CONFIGS = {True: (8, 256, 8, 1), False: (16, 256, 8, 1)}
# Grouped GEMMs, by tile rows (`_block_m`): (output columns, reduction chunk, warps, stages),
# the fastest at 256, 512 and 1024 tokens of that shape on an H100 (the same sweep).
GROUPED_CONFIGS = {16: (64, 128, 4, 2), 32: (64, 128, 4, 3), 64: (64, 64, 4, 4)}


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  weights: torch.Tensor, expert_ids: torch.Tensor, *,
                  b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                  activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
                  w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights [T, k], expert_ids [T, k] (< 0: a
    skipped pair), optional biases b13 [E, 2I] and b2 [E, H] -> [T, H]. `alpha` and `limit`
    are the clamped SwiGLU's
    (activation "swiglu_oai"). FP8 expert weights (float8_e4m3fn) come with float32 scales
    per expert and output row, w13_scale [E, 2I] and w2_scale [E, H] (w = w_fp8 * scale):
    the kernels read the FP8 bytes and scale the products (weight-only FP8; the activations
    stay in their dtype).

    Shapes are checked by `moe.fused_experts`; dtypes and strides here."""
    assert x.is_cuda or isinstance(_gemv_down_kernel, InterpretedFunction), (
        f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {x.device}")
    assert x.dtype in SUPPORTED_DTYPES, f"fused_experts does not support {x.dtype}"
    fp8 = w13_scale is not None
    assert (w2_scale is not None) == fp8, "FP8 experts need both w13_scale and w2_scale"
    weight_dtype = FP8_DTYPE if fp8 else x.dtype
    assert w13.dtype == w2.dtype == weight_dtype, (
        f"expert weights {w13.dtype}/{w2.dtype} must be {weight_dtype} for {x.dtype} "
        f"activations{' with scales' if fp8 else ''}")
    assert w13.is_contiguous() and w2.is_contiguous(), "expert weights must be contiguous"
    assert activation in ACTIVATIONS, f"unknown activation {activation!r}"
    for per_row, w in ((b13, w13), (b2, w2), (w13_scale, w13), (w2_scale, w2)):
        assert per_row is None or (tuple(per_row.shape) == tuple(w.shape[:2])
                                   and per_row.is_contiguous()), (
            "biases and scales must be [E, N], contiguous")
    assert w13_scale is None or w2_scale is None or (
        w13_scale.dtype == w2_scale.dtype == torch.float32), "FP8 weight scales must be float32"
    if x.stride(1) != 1:
        x = x.contiguous()
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    top_k = expert_ids.shape[1]
    pairs = num_tokens * top_k
    if num_tokens == 0:
        return torch.empty(0, hidden, dtype=x.dtype, device=x.device)
    ids = expert_ids.reshape(-1)
    if ids.dtype != torch.int32 or not ids.is_contiguous():
        ids = ids.to(torch.int32).contiguous()
    scale = weights.reshape(-1)  # [P], pair order
    if scale.dtype != torch.float32 or not scale.is_contiguous():
        scale = scale.to(torch.float32).contiguous()
    act = _Activation(ACTIVATIONS[activation], float(alpha), float(limit))
    rows13, rows2 = _RowTerms(b13, w13_scale), _RowTerms(b2, w2_scale)
    inter = torch.empty(pairs, two_inter // 2, dtype=x.dtype, device=x.device)  # [P, I]
    if pairs <= GEMV_MAX_PAIRS:
        combined = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
        _gemv(x, w13, rows13, inter, ids, scale, top_k, True, act)
        _gemv(inter, w2, rows2, combined, ids, scale, top_k, False, act)
        return combined  # [T, H]
    out = torch.empty(num_tokens, top_k, hidden, dtype=x.dtype, device=x.device)  # [T, k, H]
    block_m = _block_m(pairs, num_experts)
    sorted_pairs, _, *schedule = align(ids, num_experts, block_m)
    _grouped(x, w13, rows13, inter, sorted_pairs, scale, schedule, top_k, block_m, True, act)
    _grouped(inter, w2, rows2, out.view(pairs, hidden), sorted_pairs, scale, schedule, top_k,
             block_m, False, act)
    return out.sum(dim=1)  # [T, H]


def _block_m(pairs: int, num_experts: int) -> int:
    """Tile rows for the grouped GEMMs: about the pairs an expert gets on average."""
    per_expert = pairs / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64


@dataclass(frozen=True)
class _Activation:
    """The gate/up epilogue's activation (ACTIVATIONS value) and the clamped SwiGLU's terms."""

    kind: int
    alpha: float
    limit: float


@dataclass(frozen=True)
class _RowTerms:
    """A product's optional per-(expert, output row) terms: bias and FP8 weight scale."""

    bias: torch.Tensor | None
    weight_scale: torch.Tensor | None

    @property
    def has_bias(self) -> bool:
        return self.bias is not None

    @property
    def has_scale(self) -> bool:
        return self.weight_scale is not None

    def args(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's bias and scale pointers: the weight stands in for an absent one (the
        kernel never reads it)."""
        return (w if self.bias is None else self.bias,
                w if self.weight_scale is None else self.weight_scale)


def _gemv(a: torch.Tensor, w: torch.Tensor, rows: _RowTerms, out: torch.Tensor,
          ids: torch.Tensor, scale: torch.Tensor, top_k: int, gate_up: bool,
          act: _Activation) -> None:
    """gate_up: out[p] = act(a[p // top_k] @ w[ids[p]]^T) for every pair p (out [P, I]).
    Else: out[t] = sum over t's k pairs p of weight[p] * (a[p] @ w[ids[p]]^T) (out [T, H])."""
    n = w.shape[1] // 2 if gate_up else w.shape[1]
    block_n, block_k, warps, stages = GEMV_CONFIGS[gate_up]
    grid = (out.shape[0], triton.cdiv(n, block_n))
    kernel = _gemv_gate_up_kernel if gate_up else _gemv_down_kernel
    kernel[grid](
        a, w, *rows.args(w), out, ids, scale, n, w.shape[2], a.stride(0),
        w.stride(0), w.stride(1), out.stride(0), act.alpha, act.limit,
        TOP_K=top_k, HAS_BIAS=rows.has_bias, HAS_WSCALE=rows.has_scale, ACT=act.kind,
        BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages, **pdl.launch_options(a.device))


def _grouped(a: torch.Tensor, w: torch.Tensor, rows: _RowTerms, out: torch.Tensor,
             sorted_pairs: torch.Tensor, scale: torch.Tensor, schedule: list[torch.Tensor],
             top_k: int, block_m: int, gate_up: bool, act: _Activation) -> None:
    """The grouped GEMM over every tile of `schedule` (expert, start, end)."""
    n = w.shape[1] // 2 if gate_up else w.shape[1]
    expert, start, end = schedule
    block_n, block_k, warps, stages = GROUPED_CONFIGS[block_m]
    grid = (expert.shape[0], triton.cdiv(n, block_n))
    # float32 models multiply exactly; 16-bit operands take the tensor cores' default.
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    _grouped_kernel[grid](
        a, w, *rows.args(w), out, sorted_pairs, scale, expert, start, end,
        n, w.shape[2], a.stride(0), w.stride(0), w.stride(1), out.stride(0), act.alpha,
        act.limit, w.shape[0], TOP_K=top_k, GATE_UP=gate_up, HAS_BIAS=rows.has_bias,
        HAS_WSCALE=rows.has_scale, ACT=act.kind,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision,
        num_warps=warps, num_stages=stages, **pdl.launch_options(a.device))


@triton.jit
def _activate(gate, up, dtype: tl.constexpr, ACT: tl.constexpr, alpha, limit):
    """gate, up [.., BN] float32 (already rounded to dtype) -> act in float32.

    ACT 0: silu(gate) * up, silu rounded to dtype as F.silu's output is.
    ACT 1: gpt-oss's clamp(gate, max=limit) * sigmoid(alpha * that) * (clamp(up, +-limit) + 1)."""
    if ACT == 0:
        silu = tl.div_rn(gate, 1.0 + tl.exp(-gate)).to(dtype).to(tl.float32)
        return silu * up
    else:
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        glu = (g * tl.sigmoid(g * alpha)).to(dtype).to(tl.float32)
        return (u + 1.0) * glu


@triton.jit
def _epilogue(acc, bias_ptr, ws_ptr, cols, col_mask, dtype: tl.constexpr,
              HAS_BIAS: tl.constexpr, HAS_WSCALE: tl.constexpr):
    """A product's float32 accumulator (times the FP8 weight scale, + bias) rounded to the
    activations' dtype, as the reference's F.linear output is. The pointers are at the
    expert's row of scales and biases."""
    if HAS_WSCALE:
        acc *= tl.load(ws_ptr + cols, mask=col_mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    return acc.to(dtype).to(tl.float32)


@triton.jit
def _gemv_gate_up_kernel(a_ptr, w_ptr, bias_ptr, ws_ptr, out_ptr, ids_ptr, scale_ptr, N, K,
                         stride_a,
                         stride_we, stride_wn, stride_out, alpha, limit, TOP_K: tl.constexpr,
                         HAS_BIAS: tl.constexpr, HAS_WSCALE: tl.constexpr, ACT: tl.constexpr,
                         BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Program (p, n): pair p's gate columns n and up columns n + N, then the activation."""
    pdl_prologue(PDL)
    p = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + p).to(tl.int64)
    # A skipped pair (id < 0) loads no weights and writes nothing (no column is in range):
    # its row of the intermediate is never read either.
    n_end = tl.where(expert >= 0, N, 0)
    expert = tl.maximum(expert, 0)
    a_row = a_ptr + (p // TOP_K) * stride_a
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_end
    w_base = w_ptr + expert * stride_we
    gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        mask = col_mask[:, None] & k_mask[None, :]
        a = tl.load(a_row + ks, mask=k_mask, other=0.0).to(tl.float32)[None, :]  # [1, BK]
        w_gate = tl.load(w_base + cols[:, None] * stride_wn + ks[None, :], mask=mask,
                         other=0.0)  # [BN, BK]
        w_up = tl.load(w_base + (cols + N)[:, None] * stride_wn + ks[None, :], mask=mask,
                       other=0.0)
        gate += tl.sum(w_gate.to(tl.float32) * a, axis=1)
        up += tl.sum(w_up.to(tl.float32) * a, axis=1)
    dtype = out_ptr.dtype.element_ty
    row = expert * 2 * N
    gate = _epilogue(gate, bias_ptr + row, ws_ptr + row, cols, col_mask, dtype, HAS_BIAS,
                     HAS_WSCALE)
    up = _epilogue(up, bias_ptr + row + N, ws_ptr + row + N, cols, col_mask, dtype, HAS_BIAS,
                   HAS_WSCALE)
    y = _activate(gate, up, dtype, ACT, alpha, limit)
    tl.store(out_ptr + p * stride_out + cols, y.to(dtype), mask=col_mask)


@triton.jit
def _gemv_down_kernel(a_ptr, w_ptr, bias_ptr, ws_ptr, out_ptr, ids_ptr, scale_ptr, N, K, stride_a,
                      stride_we, stride_wn, stride_out, alpha, limit, TOP_K: tl.constexpr,
                      HAS_BIAS: tl.constexpr, HAS_WSCALE: tl.constexpr, ACT: tl.constexpr,
                      BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Program (t, n): token t's output columns n, the weighted sum over its k pairs (each
    pair's product rounded to the dtype, times its weight rounded likewise, summed in float32:
    the combine needs no launch of its own)."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        p = t * TOP_K + j
        expert = tl.load(ids_ptr + p).to(tl.int64)
        kept = expert >= 0  # a skipped pair reads nothing and adds nothing
        expert = tl.maximum(expert, 0)
        k_end = tl.where(kept, K, 0)
        w_base = w_ptr + expert * stride_we
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < k_end
            a = tl.load(a_ptr + p * stride_a + ks, mask=k_mask, other=0.0).to(tl.float32)
            w = tl.load(w_base + cols[:, None] * stride_wn + ks[None, :],
                        mask=col_mask[:, None] & k_mask[None, :], other=0.0)  # [BN, BK]
            acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        y = _epilogue(acc, bias_ptr + expert * N, ws_ptr + expert * N, cols, col_mask, dtype,
                      HAS_BIAS, HAS_WSCALE)
        s = tl.load(scale_ptr + p).to(dtype).to(tl.float32)  # rounded as the reference's
        total += tl.where(kept, (y * s).to(dtype).to(tl.float32), 0.0)
    tl.store(out_ptr + t * stride_out + cols, total.to(dtype), mask=col_mask)


@triton.jit
def _grouped_kernel(a_ptr, w_ptr, bias_ptr, ws_ptr, out_ptr, pairs_ptr, scale_ptr, tile_expert_ptr,
                    tile_start_ptr, tile_end_ptr, N, K, stride_a, stride_we, stride_wn,
                    stride_out, alpha, limit, NUM_EXPERTS, TOP_K: tl.constexpr,
                    GATE_UP: tl.constexpr,
                    HAS_BIAS: tl.constexpr, HAS_WSCALE: tl.constexpr, ACT: tl.constexpr,
                    BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    """GATE_UP: a rows are the pairs' tokens, out rows the sorted positions (gate and up
    columns, then the activation). Else (down): a rows are the sorted positions, out rows the
    pairs (t*k + j), each scaled by its routing weight."""
    pdl_prologue(PDL)
    pid_m = tl.program_id(0)
    start = tl.load(tile_start_ptr + pid_m)
    end = tl.load(tile_end_ptr + pid_m)
    expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    if start < end and expert == NUM_EXPERTS and not GATE_UP:
        # The null expert's tile (skipped pairs): their rows of the output are zeros.
        rows = start + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        pairs = tl.load(pairs_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptr + pairs[:, None] * stride_out + cols[None, :], zeros,
                 mask=row_mask[:, None] & (cols < N)[None, :])
    if start < end and expert < NUM_EXPERTS:
        rows = start + tl.arange(0, BLOCK_M)  # sorted positions
        row_mask = rows < end
        pairs = tl.load(pairs_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        if GATE_UP:
            a_rows = pairs // TOP_K
            out_rows = rows.to(tl.int64)
        else:
            a_rows = rows.to(tl.int64)
            out_rows = pairs
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        w_base = w_ptr + expert * stride_we
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            a = tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :],
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
            w_mask = k_mask[:, None] & col_mask[None, :]
            w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=w_mask,
                        other=0.0)  # [BK, BN]; FP8 widened exactly to a's dtype
            acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PRECISION)
            if GATE_UP:
                w_up = tl.load(w_base + (cols + N)[None, :] * stride_wn + ks[:, None],
                               mask=w_mask, other=0.0)
                acc_up = tl.dot(a, w_up.to(a.dtype), acc_up, input_precision=DOT_PRECISION)
        dtype = out_ptr.dtype.element_ty
        if GATE_UP:
            row = expert * 2 * N
        else:
            row = expert * N
        y = _epilogue(acc, bias_ptr + row, ws_ptr + row, cols[None, :], col_mask[None, :],
                      dtype, HAS_BIAS, HAS_WSCALE)
        if GATE_UP:
            up = _epilogue(acc_up, bias_ptr + row + N, ws_ptr + row + N, cols[None, :],
                           col_mask[None, :], dtype, HAS_BIAS, HAS_WSCALE)
            y = _activate(y, up, dtype, ACT, alpha, limit)
        else:
            s = tl.load(scale_ptr + pairs, mask=row_mask, other=0.0)
            y = y * s.to(dtype).to(tl.float32)[:, None]
        tl.store(out_ptr + out_rows[:, None] * stride_out + cols[None, :], y.to(dtype),
                 mask=row_mask[:, None] & col_mask[None, :])
