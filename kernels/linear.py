"""Matrix products of the model's projections: y = x @ weight^T (+ bias).

On a GPU, a step of at most SKINNY_MAX_ROWS tokens (decode of a few sequences) in float16 or
bfloat16 goes to the Triton kernel of `meshserve.kernels.triton_linear`: reading the weights
is all such a product does, and that kernel reads them faster than cuBLAS and without cuBLAS's
split-K reduction (loadtest/gpu_op_probe.py, on an H100: 5.08 against 5.73 ms of projections
per token of an 8B model, loadtest/reports/h100-probe/). Everything else is F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SKINNY_MAX_ROWS = 8


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N]."""
    if (x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= SKINNY_MAX_ROWS
            and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype
            and x.stride(1) == 1 and weight.stride(1) == 1):
        from meshserve.kernels import triton_linear  # GPU only

        out = triton_linear.skinny_linear(x, weight, triton_linear.config_for(
            x.shape[0], weight.shape[0], weight.shape[1]))
        return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)
