"""MXFP4 weights (OCP microscaling FP4), as gpt-oss's published checkpoints hold their experts.

A weight W [..., N, K] (K a multiple of 32) is stored as two uint8 tensors:

    blocks [..., N, K/32, 16]  32 FP4 (e2m1) values per block, two a byte, low nibble first
    scales [..., N, K/32]      one E8M0 exponent per block, biased by 127

and W[..., n, 32 b + j] = FP4_VALUES[nibble j of block b] * 2 ** (scales[..., n, b] - 127), the
decoding of transformers' `integrations.mxfp4.convert_moe_packed_tensors` before its final
transpose. `dequantize_mxfp4` decodes on load (every such value is exact in bfloat16 and
float32), one leading slice at a time so that a layer of experts never needs more than one
expert's float32 copy besides the result.
"""

from __future__ import annotations

import torch

# The 16 e2m1 codes: sign bit 3, then exponent and mantissa.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale
_SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., N, G, 16] uint8 and scales [..., N, G] uint8 -> W [..., N, G * 32] in
    `dtype`."""
    assert blocks.dtype == torch.uint8 and scales.dtype == torch.uint8, (
        f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    assert blocks.dim() >= 3 and blocks.shape[-1] == BLOCK // 2 and \
        tuple(blocks.shape[:-1]) == tuple(scales.shape), (
            f"MXFP4 blocks [..., N, G, 16] do not fit scales [..., N, G]: "
            f"{tuple(blocks.shape)} and {tuple(scales.shape)}")
    out = torch.empty(*scales.shape[:-1], scales.shape[-1] * BLOCK, dtype=dtype)
    if blocks.dim() == 3:
        out.copy_(_decode(blocks, scales))
        return out
    for i in range(blocks.shape[0]):  # one expert (leading slice) at a time
        out[i] = dequantize_mxfp4(blocks[i], scales[i], dtype)
    return out


def _decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [N, G, 16], scales [N, G] -> [N, G * 32] float32."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]  # [N, G, 16] each
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [N, G, 32]: low nibble first
    exponents = scales.to(torch.int32)[..., None] - _SCALE_BIAS  # [N, G, 1]
    return torch.ldexp(values, exponents).flatten(-2)
