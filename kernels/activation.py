"""Gated activations of the MLP.

`silu_and_mul` consumes the output of the fused gate/up projection: the first half of the last
dimension is the gate, the second half the up projection, as in vLLM's `SiluAndMul`.
`swiglu_oai_reference` is gpt-oss's clamped SwiGLU over the same layout (its experts run it,
kernels/moe.py; on CUDA it is fused into kernels/triton_moe.py's products).
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


# gpt-oss's defaults (transformers' GptOssConfig: swiglu_alpha, swiglu_limit).
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


def swiglu_oai_reference(x: torch.Tensor, alpha: float = SWIGLU_OAI_ALPHA,
                         limit: float = SWIGLU_OAI_LIMIT) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU: x [..., 2I] (gate, then up) -> [..., I], in transformers'
    order of operations (`GptOssExperts._apply_gate`): the gate clamped to at most `limit`,
    the up projection to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    assert x.shape[-1] % 2 == 0, f"swiglu_oai needs an even last dim, got {tuple(x.shape)}"
    gate, up = x.chunk(2, dim=-1)  # each [..., I]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu
