"""Triton RMSNorm and fused residual-add + RMSNorm behind `meshserve.kernels.norm`.

Two orders of the weight multiply: Llama's (below) and the float32 one of gpt-oss and Gemma
(`rms_norm_f32_weight`: the normalised row stays float32, is multiplied by `weight + offset`
in float32, and is rounded once).

One program normalises one row of H elements. The arithmetic follows the reference in
`norm.py` step for step, so the results match it bit for bit except where the order of the
sum of squares differs: the residual add is rounded to the activations' dtype, the mean of
squares and the normalisation are float32, the normalised row is rounded to the input dtype,
and only then multiplied by the weight (one product of two 16-bit numbers is exact in float32,
so rounding it once gives what PyTorch gives).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from meshserve.kernels import pdl
from meshserve.kernels.pdl import pdl_prologue

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HIDDEN = 65536  # one row per program must fit in registers


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim. x: [..., H], weight: [H] -> [..., H], contiguous, in the
    dtype PyTorch gives `weight * normed` (x's dtype when weight has the same dtype)."""
    _check(_rms_norm_kernel, x, weight)
    rows = _rows(x)  # [R, H]
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype),
                      device=x.device)
    if rows.shape[0] == 0:
        return out
    hidden = x.shape[-1]
    _rms_norm_kernel[(rows.shape[0],)](
        rows, weight, out, rows.stride(0), hidden, eps,
        BLOCK_H=triton.next_power_of_2(hidden), num_warps=_num_warps(hidden),
        **pdl.launch_options(x.device))
    return out


def fused_add_rms_norm(
    x: torch.Tensor,  # [..., H]
    residual: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    *,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`new_residual = x + residual`; returns `(rms_norm(new_residual), new_residual)`.

    With `inplace=True` the results overwrite `x` (normed) and `residual` (new residual), which
    must then be contiguous and share weight's dtype; each row is read before it is written.
    """
    _check_add(_fused_add_rms_norm_kernel, x, residual, weight)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if inplace:
        assert x.is_contiguous() and residual.is_contiguous() and out_dtype == x.dtype, (
            "inplace fused_add_rms_norm needs contiguous x and residual and weight in x's dtype")
        rows, res_rows = x.view(-1, x.shape[-1]), residual.view(-1, x.shape[-1])
        out, new_residual = x, residual
    else:
        rows, res_rows = _rows(x), _rows(residual)
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return _add_norm(_fused_add_rms_norm_kernel, rows, res_rows, weight, out, new_residual, eps)


def rms_norm_f32_weight(x: torch.Tensor, weight: torch.Tensor, eps: float,
                        offset: float = 0.0) -> torch.Tensor:
    """RMSNorm whose `weight + offset` multiplies the float32 normalised row before its one
    cast back to x's dtype (norm.rms_norm_f32_weight). x: [..., H] -> [..., H], contiguous."""
    _check(_rms_norm_f32_kernel, x, weight)
    rows = _rows(x)  # [R, H]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out
    hidden = x.shape[-1]
    _rms_norm_f32_kernel[(rows.shape[0],)](
        rows, weight, out, rows.stride(0), hidden, eps, offset,
        BLOCK_H=triton.next_power_of_2(hidden), num_warps=_num_warps(hidden),
        **pdl.launch_options(x.device))
    return out


def fused_add_rms_norm_f32_weight(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                  eps: float, offset: float = 0.0
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`new_residual = x + residual`; returns `(rms_norm_f32_weight(new_residual),
    new_residual)`, both new contiguous tensors in x's dtype."""
    _check_add(_fused_add_rms_norm_f32_kernel, x, residual, weight)
    return _add_norm(_fused_add_rms_norm_f32_kernel, _rows(x), _rows(residual), weight,
                     torch.empty_like(x, memory_format=torch.contiguous_format),
                     torch.empty_like(x, memory_format=torch.contiguous_format), eps, offset)


def _add_norm(kernel: Any, rows: torch.Tensor, res_rows: torch.Tensor, weight: torch.Tensor,
              out: torch.Tensor, new_residual: torch.Tensor, eps: float, *scalars: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch an add + norm `kernel` over rows and res_rows [R, H] (one program a row)."""
    if rows.shape[0] > 0:
        hidden = rows.shape[-1]
        kernel[(rows.shape[0],)](
            rows, res_rows, weight, out, new_residual, rows.stride(0), res_rows.stride(0),
            hidden, eps, *scalars, BLOCK_H=triton.next_power_of_2(hidden),
            num_warps=_num_warps(hidden), **pdl.launch_options(rows.device))
    return out, new_residual


@triton.jit
def _normalise_row(h, w_ptr, out_ptr, row, hidden, eps, BLOCK_H: tl.constexpr):
    """Normalise one row h [BLOCK_H] (in the activations' dtype, zero past `hidden`) and
    store it times the weight."""
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    h32 = h.to(tl.float32)
    variance = tl.sum(h32 * h32, axis=0) / hidden
    # Correctly rounded sqrt and division: what torch.rsqrt gives on the CPU reference path.
    normed = (h32 * tl.div_rn(1.0, tl.sqrt_rn(variance + eps))).to(h.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, hidden, eps, BLOCK_H: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < hidden, other=0.0)
    _normalise_row(x, w_ptr, out_ptr, row, hidden, eps, BLOCK_H)


@triton.jit
def _fused_add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, new_r_ptr, stride_x, stride_r,
                               hidden, eps, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    h = _add_row(x_ptr, r_ptr, new_r_ptr, row, stride_x, stride_r, hidden, BLOCK_H)
    _normalise_row(h, w_ptr, out_ptr, row, hidden, eps, BLOCK_H)


@triton.jit
def _add_row(x_ptr, r_ptr, new_r_ptr, row, stride_x, stride_r, hidden, BLOCK_H: tl.constexpr):
    """Row `row` of x + residual, stored as the new residual and returned [BLOCK_H] (zero
    past `hidden`)."""
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
    # The add is rounded to the activations' dtype, as `residual + x` is in PyTorch.
    h = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
    tl.store(new_r_ptr + row * hidden + cols, h, mask=mask)
    return h


@triton.jit
def _normalise_row_f32(h, w_ptr, out_ptr, row, hidden, eps, offset, BLOCK_H: tl.constexpr):
    """Normalise one row h [BLOCK_H] in float32 and store it times `weight + offset`
    (float32 too), rounded once to the output's dtype."""
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    h32 = h.to(tl.float32)
    variance = tl.sum(h32 * h32, axis=0) / hidden
    normed = h32 * tl.div_rn(1.0, tl.sqrt_rn(variance + eps))
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + offset
    tl.store(out_ptr + row * hidden + cols, (w * normed).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _rms_norm_f32_kernel(x_ptr, w_ptr, out_ptr, stride_x, hidden, eps, offset,
                         BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < hidden, other=0.0)
    _normalise_row_f32(x, w_ptr, out_ptr, row, hidden, eps, offset, BLOCK_H)


@triton.jit
def _fused_add_rms_norm_f32_kernel(x_ptr, r_ptr, w_ptr, out_ptr, new_r_ptr, stride_x, stride_r,
                                   hidden, eps, offset, BLOCK_H: tl.constexpr,
                                   PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    h = _add_row(x_ptr, r_ptr, new_r_ptr, row, stride_x, stride_r, hidden, BLOCK_H)
    _normalise_row_f32(h, w_ptr, out_ptr, row, hidden, eps, offset, BLOCK_H)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [R, H] with unit stride along H (a view when possible, else a copy)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _num_warps(hidden: int) -> int:
    return 4 if hidden <= 2048 else 8 if hidden <= 8192 else 16


def _check_add(kernel: object, x: torch.Tensor, residual: torch.Tensor,
               weight: torch.Tensor) -> None:
    _check(kernel, x, weight, residual)
    assert x.shape == residual.shape and x.dtype == residual.dtype, (
        f"x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} {residual.dtype} "
        f"must have the same shape and dtype")


def _check(kernel: object, x: torch.Tensor, weight: torch.Tensor, *more: torch.Tensor) -> None:
    tensors = (x, weight, *more)
    assert all(t.device == x.device for t in tensors), (
        f"x, weight and residual must share one device, got "
        f"{sorted({str(t.device) for t in tensors})}")
    assert x.device.type == "cuda" or isinstance(kernel, InterpretedFunction), (
        f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {x.device}")
    assert x.dtype in SUPPORTED_DTYPES and weight.dtype in SUPPORTED_DTYPES, (
        f"x {x.dtype} and weight {weight.dtype} must be float16, bfloat16 or float32")
    assert weight.dim() == 1 and x.shape[-1] == weight.shape[0], (
        f"norm weight {tuple(weight.shape)} does not match the last dim of x {tuple(x.shape)}")
    assert weight.stride(0) == 1, f"weight must be contiguous, got stride {weight.stride(0)}"
    assert x.shape[-1] <= MAX_HIDDEN, f"hidden size {x.shape[-1]} exceeds {MAX_HIDDEN}"
