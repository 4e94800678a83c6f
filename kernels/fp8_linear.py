"""FP8 (e4m3) weights: quantization, dequantization and the matrix product y = x @ w^T.

A weight [N, K] is held as float8_e4m3fn with float32 scales, w ≈ w_fp8 * scale:
- per-tensor and per-channel (one scale per output row) both live as a [N] scale vector (a
  per-tensor scale repeated), so fused projections whose parts came with different per-tensor
  scales (q, k and v) stay exact;
- block-wise: a [ceil(N / bn), ceil(K / bk)] grid of scales, one per bn x bk tile (DeepSeek's
  128 x 128 checkpoints).

The product, by device:
- CUDA on Hopper or later (compute capability 9.0), bfloat16 activations, per-row
  scales, more than
  `SKINNY_MAX_ROWS` rows: the activations are quantized per token (dynamic scale: the row's
  absolute maximum over 448) and `torch._scaled_mm` multiplies both FP8 operands with
  row-wise scales into the activations' dtype.
- CUDA, per-row scales, a few rows (decode): the Triton kernel of
  `meshserve.kernels.triton_fp8_linear` reads the FP8 weight (half of bf16's bytes) and keeps
  the activations as they are (weight-only FP8: no activation rounding on this path), with
  the launch shape measured per weight shape on first use (`meshserve.kernels.fp8_tuning`).
- Otherwise (CPU, block-wise scales, other dtypes, older GPUs): dequantize to the activations' dtype and
  F.linear. On CPU this is the reference: the same FP8 weights as on the GPU, activations
  unrounded, so the CPU results equal a model running the dequantized weights.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
SKINNY_MAX_ROWS = 16
# The smallest scale used, so an all-zero row or tensor does not divide by zero.
_MIN_SCALE = 1e-12


def quantize_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (float8 [N, K], float32 scale [N] holding one value repeated)."""
    scale = (weight.abs().amax().float() / FP8_MAX).clamp(min=_MIN_SCALE)
    q = _to_fp8(weight.float() / scale)
    return q, scale.expand(weight.shape[0]).contiguous()


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (float8 [N, K], float32 scale [N]): one scale per output row."""
    scale = (weight.abs().amax(dim=1).float() / FP8_MAX).clamp(min=_MIN_SCALE)  # [N]
    return _to_fp8(weight.float() / scale[:, None]), scale


def quantize_blockwise(weight: torch.Tensor,
                       block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (float8 [N, K], float32 scale [ceil(N/bn), ceil(K/bk)])."""
    bn, bk = block
    n, k = weight.shape
    padded = F.pad(weight.float(), (0, -k % bk, 0, -n % bn))  # [N', K'] multiples of the tile
    tiles = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=_MIN_SCALE)  # [N'/bn, K'/bk]
    return _to_fp8(weight.float() / expand_block_scale(scale, block, n, k)), scale


def expand_block_scale(scale: torch.Tensor, block: tuple[int, int], n: int,
                       k: int) -> torch.Tensor:
    """A [ceil(N/bn), ceil(K/bk)] scale grid as one scale per element, [N, K]."""
    bn, bk = block
    return scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
               block: tuple[int, int] | None = None) -> torch.Tensor:
    """float8 [N, K] with scale [N] (or a block grid) -> [N, K] in `dtype` (product in fp32)."""
    n, k = weight.shape
    full = scale[:, None] if block is None else expand_block_scale(scale, block, n, k)
    return (weight.float() * full).to(dtype)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] -> (float8 [M, K], float32 scale [M, 1]), dynamic per row."""
    scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=_MIN_SCALE)
    return _to_fp8(x.float() / scale), scale


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                         bias: torch.Tensor | None = None,
                         block: tuple[int, int] | None = None,
                         quantize_input: bool = False) -> torch.Tensor:
    """x [..., K] @ dequantize(weight [N, K])^T (+ bias) -> [..., N] in x's dtype.

    With `quantize_input`, x is first rounded through FP8 per token as the `_scaled_mm`
    path does, so tests can bound that path's error too."""
    if quantize_input:
        rows = x.reshape(-1, x.shape[-1])
        xq, xs = quantize_per_token(rows)
        x = (xq.float() * xs).to(x.dtype).view(x.shape)
    return F.linear(x, dequantize(weight, scale, x.dtype, block), bias)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None,
               block: tuple[int, int] | None = None) -> torch.Tensor:
    """x [..., K] @ (weight [N, K] float8 * scale)^T (+ bias [N]) -> [..., N] in x's dtype."""
    assert weight.dtype == FP8_DTYPE, f"weight must be {FP8_DTYPE}, got {weight.dtype}"
    assert weight.dim() == 2 and x.shape[-1] == weight.shape[1], (
        f"x [..., {weight.shape[1]}] expected for weight {tuple(weight.shape)}, got "
        f"{tuple(x.shape)}")
    assert scale.dtype == torch.float32, f"scale must be float32, got {scale.dtype}"
    if (not x.is_cuda or block is not None or x.dtype != torch.bfloat16
            or not fp8_supported(x.device)):
        return fp8_linear_reference(x, weight, scale, bias, block)
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    if rows.shape[0] == 0:
        return fp8_linear_reference(x, weight, scale, bias)
    if rows.shape[0] <= SKINNY_MAX_ROWS:
        from meshserve.kernels import fp8_tuning, triton_fp8_linear  # GPU only

        rows = rows.contiguous()
        config = fp8_tuning.config_for(rows, weight, scale)  # measured once per shape
        out = triton_fp8_linear.skinny_fp8_linear(rows, weight, scale, config)
    elif weight.shape[0] % 16 or weight.shape[1] % 16:  # _scaled_mm needs both aligned
        return fp8_linear_reference(x, weight, scale, bias)
    else:
        out = scaled_mm(rows, weight, scale)
    out = out.view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out.add_(bias)


def scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16/fp16) quantized per token @ weight [N, K] float8 with scale [N].

    `_scaled_mm` takes A row-major and B column-major: weight [N, K] row-major transposed is
    exactly B [K, N] column-major, so no copy is made."""
    if x.is_cuda:
        from meshserve.kernels import triton_fp8_linear  # GPU only

        xq, xs = triton_fp8_linear.quantize_per_token(x)  # [M, K] float8, [M, 1] float32
    else:  # recent torch runs _scaled_mm on CPU too: the tests check the operands' layout
        xq, xs = quantize_per_token(x)
    # Fast accumulation: Hopper's FP8 tensor-core sums are kept in the MMA's own accumulator
    # instead of being promoted to float32 every few K steps; the usual choice for FP8
    # inference kernels (the per-token and per-channel rounding dominates the error), and
    # loadtest/fp8_kernels_bench.py times both.
    return torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale.view(1, -1),
                            out_dtype=x.dtype, use_fast_accum=True)


@functools.cache
def fp8_supported(device: torch.device) -> bool:
    """Whether this GPU runs the FP8 paths: Hopper or later (row-wise scaled `_scaled_mm`
    is a Hopper feature in the torch releases this project targets)."""
    return torch.cuda.get_device_capability(device) >= (9, 0)


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    # Saturate instead of relying on the cast (which gives NaN past +-448 on some paths).
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
