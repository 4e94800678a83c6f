"""RMSNorm, alone and fused with the residual add that precedes it in every decoder layer.

The reference matches Hugging Face's `LlamaRMSNorm` bit for bit: the mean of squares is taken in
float32, the normalised row is cast back to the input dtype, and only then multiplied by the
weight. Keeping that order matters in bfloat16, where multiplying before the cast rounds
differently.

CUDA tensors go to the Triton kernels in `meshserve.kernels.triton_norm` (imported only there, so
a CPU install never needs Triton); everything else runs the PyTorch reference.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension. x: [..., H], weight: [H] -> [..., H] in x's dtype."""
    _check(x, weight)
    if x.is_cuda:
        from meshserve.kernels import triton_norm  # imported on the GPU path only

        return triton_norm.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor,  # [..., H]
    residual: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`new_residual = x + residual`, then `(rms_norm(new_residual), new_residual)`.

    The add happens in the activations' dtype, as in the unfused Hugging Face layer.
    """
    _check(x, weight)
    assert x.shape == residual.shape, (
        f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must have the same shape")
    if x.is_cuda:
        from meshserve.kernels import triton_norm  # imported on the GPU path only

        return triton_norm.fused_add_rms_norm(x, residual, weight, eps)
    return fused_add_rms_norm_reference(x, residual, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """PyTorch RMSNorm, computed in float32 and cast back before the weight multiply."""
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)  # [..., 1]
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch residual add followed by RMSNorm."""
    new_residual = residual + x
    return rms_norm_reference(new_residual, weight, eps), new_residual


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    assert weight.dim() == 1 and x.shape[-1] == weight.shape[0], (
        f"norm weight {tuple(weight.shape)} does not match the last dim of x {tuple(x.shape)}")


def rms_norm_f32_weight(x: torch.Tensor, weight: torch.Tensor, eps: float,
                        offset: float = 0.0) -> torch.Tensor:
    """RMSNorm in float32 throughout: the normalised row times `weight + offset` [H] in
    float32, cast back to x's dtype once. transformers' `GptOssRMSNorm` (offset 0) and
    `Gemma2RMSNorm`/`Gemma3RMSNorm` (offset 1) keep this order, unlike Llama's."""
    _check(x, weight)
    if x.is_cuda:
        from meshserve.kernels import triton_norm  # imported on the GPU path only

        return triton_norm.rms_norm_f32_weight(x, weight, eps, offset)
    return rms_norm_f32_weight_reference(x, weight, eps, offset)


def fused_add_rms_norm_f32_weight(x: torch.Tensor, residual: torch.Tensor,
                                  weight: torch.Tensor, eps: float, offset: float = 0.0
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`new_residual = x + residual` (in the activations' dtype), then
    `(rms_norm_f32_weight(new_residual), new_residual)`."""
    _check(x, weight)
    assert x.shape == residual.shape, (
        f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must have the same shape")
    if x.is_cuda:
        from meshserve.kernels import triton_norm  # imported on the GPU path only

        return triton_norm.fused_add_rms_norm_f32_weight(x, residual, weight, eps, offset)
    new_residual = residual + x
    return rms_norm_f32_weight_reference(new_residual, weight, eps, offset), new_residual


def rms_norm_f32_weight_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                                  offset: float = 0.0) -> torch.Tensor:
    """PyTorch `rms_norm_f32_weight`."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return ((weight.float() + offset) * normed).to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: x [..., H] scaled by (1 + weight) [H], all in float32 and only then
    cast back to x's dtype (transformers' `Gemma2RMSNorm`/`Gemma3RMSNorm`, which differ from
    Llama's order on purpose)."""
    return rms_norm_f32_weight(x, weight, eps, offset=1.0)
