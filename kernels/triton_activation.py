"""Triton SiLU-and-multiply behind `meshserve.kernels.activation.silu_and_mul`.

PyTorch runs this as two kernels with an intermediate tensor (silu of the gate, then the
product); this one reads the gate and up halves once and writes the result once. Like PyTorch,
silu is computed in float32 and rounded to the activations' dtype before the product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from meshserve.kernels import pdl
from meshserve.kernels.pdl import pdl_prologue

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_COLS = 1024  # columns of the output per program


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I] -> silu(x[..., :I]) * x[..., I:], [..., I], contiguous."""
    assert x.is_cuda or isinstance(_silu_and_mul_kernel, InterpretedFunction), (
        f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {x.device}")
    assert x.dtype in SUPPORTED_DTYPES, f"silu_and_mul does not support {x.dtype}"
    assert x.dim() >= 1 and x.shape[-1] % 2 == 0, (
        f"silu_and_mul needs an even last dim, got {tuple(x.shape)}")
    inter = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])  # [R, 2I], a view when possible
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0 or inter == 0:
        return out
    block = min(BLOCK_COLS, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
        rows, out, rows.stride(0), inter, BLOCK=block, num_warps=4, **pdl.launch_options(x.device))
    return out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = tl.div_rn(g, 1.0 + tl.exp(-g)).to(gate.dtype)  # rounded as F.silu's output is
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)
