"""Triton rotary embedding behind `meshserve.kernels.rotary.apply_rotary`.

The PyTorch path costs about sixteen small kernels per layer (gather, cast, slices, products,
sums and concatenations for q and for k); here one program per token rotates every query and
key head of that token in one pass. The arithmetic follows the reference operation for
operation, rounding to the activations' dtype after each product and each sum as PyTorch does,
and floating-point contraction is disabled so float32 also matches it: the result equals the
reference bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def apply_rotary(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int32/int64
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]: cos half, then sin half
) -> tuple[torch.Tensor, torch.Tensor]:  # new contiguous tensors, shapes of query and key
    """Rotate the first rotary_dim dims of every head of q and k by each token's position."""
    _check(query, key, positions, cos_sin_cache)
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads, rotary_dim = key.shape[1], cos_sin_cache.shape[1]
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return q_out, k_out
    half = rotary_dim // 2
    rest = head_dim - rotary_dim  # dims past the rotary part pass through unchanged
    _rotary_kernel[(num_tokens,)](
        query, key, q_out, k_out, positions, cos_sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half,
        REST=rest, Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF_PAD=triton.next_power_of_2(half), REST_PAD=triton.next_power_of_2(max(rest, 1)),
        num_warps=4 if num_q_heads * head_dim < 4096 else 8, enable_fp_fusion=False)
    return q_out, k_out


@triton.jit
def _rounded(x, DTYPE: tl.constexpr):
    """x (float32) rounded to DTYPE and back: one PyTorch operation's result in DTYPE."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rotate_heads(x_ptr, out_ptr, token, stride_t, stride_h, cos, sin,
                  NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                  REST: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
                  REST_PAD: tl.constexpr):
    # x: [NUM_HEADS, HEAD_DIM] of one token; cos/sin: [1, HALF_PAD] float32 in x's dtype.
    h = tl.arange(0, HEADS_PAD)[:, None]
    j = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < NUM_HEADS) & (j < HALF)
    src = x_ptr + token * stride_t + h * stride_h
    dst = out_ptr + (token * NUM_HEADS + h) * HEAD_DIM
    x1 = tl.load(src + j, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + j, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    # x1 * cos - x2 * sin and x2 * cos + x1 * sin, each step rounded as PyTorch rounds it.
    o1 = _rounded(_rounded(x1 * cos, dtype) - _rounded(x2 * sin, dtype), dtype)
    o2 = _rounded(_rounded(x2 * cos, dtype) + _rounded(x1 * sin, dtype), dtype)
    tl.store(dst + j, o1.to(dtype), mask=mask)
    tl.store(dst + HALF + j, o2.to(dtype), mask=mask)
    if REST > 0:
        r = tl.arange(0, REST_PAD)[None, :]
        rest_mask = (h < NUM_HEADS) & (r < REST)
        tl.store(dst + 2 * HALF + r, tl.load(src + 2 * HALF + r, mask=rest_mask),
                 mask=rest_mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr, REST: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    j = tl.arange(0, HALF_PAD)[None, :]
    row = cache_ptr + pos * stride_cache
    # The table is cast to the activations' dtype first, as the reference does.
    dtype = q_ptr.dtype.element_ty
    cos = tl.load(row + j, mask=j < HALF, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(row + HALF + j, mask=j < HALF, other=0.0).to(dtype).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, token, stride_qt, stride_qh, cos, sin, NUM_Q_HEADS,
                  HEAD_DIM, HALF, REST, Q_HEADS_PAD, HALF_PAD, REST_PAD)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_kt, stride_kh, cos, sin, NUM_KV_HEADS,
                  HEAD_DIM, HALF, REST, KV_HEADS_PAD, HALF_PAD, REST_PAD)


def _check(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
           cos_sin_cache: torch.Tensor) -> None:
    tensors = (query, key, positions, cos_sin_cache)
    assert all(t.device == query.device for t in tensors), (
        f"query, key, positions and cos_sin_cache must share one device, got "
        f"{sorted({str(t.device) for t in tensors})}")
    assert query.is_cuda or isinstance(_rotary_kernel, InterpretedFunction), (
        f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {query.device}")
    assert query.dim() == 3 and key.dim() == 3 and query.shape[2] == key.shape[2], (
        f"query and key must be [T, H, D] with one D, got {tuple(query.shape)} and "
        f"{tuple(key.shape)}")
    assert positions.dim() == 1 and positions.shape[0] == query.shape[0] == key.shape[0], (
        f"positions {tuple(positions.shape)} do not match {query.shape[0]} query tokens")
    assert positions.dtype in (torch.int32, torch.int64), (
        f"positions must be int32 or int64, got {positions.dtype}")
    assert query.dtype == key.dtype and query.dtype in SUPPORTED_DTYPES, (
        f"query {query.dtype} and key {key.dtype} must be one of float16, bfloat16, float32")
    rotary_dim = cos_sin_cache.shape[-1]
    assert cos_sin_cache.dim() == 2 and rotary_dim % 2 == 0 and rotary_dim <= query.shape[2], (
        f"cos_sin_cache must be [max_position, rotary_dim <= head_dim {query.shape[2]}, even], "
        f"got {tuple(cos_sin_cache.shape)}")
    for name, t in (("query", query), ("key", key), ("cos_sin_cache", cos_sin_cache),
                    ("positions", positions)):
        assert t.stride(-1) == 1, f"{name} must be contiguous in its last dim"
