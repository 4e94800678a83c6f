"""Gated activations of the MLP.

`silu_and_mul` consumes the output of the fused gate/up projection: the first half of the last
dimension is the gate, the second half the up projection, as in vLLM's `SiluAndMul`.
On CUDA tensors a fused Triton kernel (triton_activation) does it in one pass; the PyTorch
code here is the reference and the CPU path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I] -> silu(x[..., :I]) * x[..., I:], [..., I]."""
    assert x.shape[-1] % 2 == 0, f"silu_and_mul needs an even last dim, got {tuple(x.shape)}"
    if x.is_cuda:
        from meshserve.kernels import triton_activation  # GPU only

        return triton_activation.silu_and_mul(x)
    return silu_and_mul_reference(x)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """The same operations as Hugging Face's `act_fn(gate_proj(x)) * up_proj(x)`."""
    gate, up = x.chunk(2, dim=-1)  # each [..., I]
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma's MLP): x [..., 2I] -> gelu_tanh(x[..., :I]) * x[..., I:], [..., I], as
    transformers' `gelu_pytorch_tanh` activation. PyTorch on every device: no Triton kernel yet."""
    assert x.shape[-1] % 2 == 0, f"gelu_tanh_and_mul needs an even last dim, got {tuple(x.shape)}"
    gate, up = x.chunk(2, dim=-1)  # each [..., I]
    return F.gelu(gate, approximate="tanh") * up
