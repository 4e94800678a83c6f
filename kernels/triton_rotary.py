"""Triton rotary embedding behind `meshserve.kernels.rotary.apply_rotary`.

The PyTorch path costs about sixteen small kernels per layer (gather, cast, slices, products,
sums and concatenations for q and for k); here one program per token rotates every query and
key head of that token in one pass. The arithmetic follows the reference operation for
operation, rounding to the activations' dtype after each product and each sum as PyTorch does,
and floating-point contraction is disabled so float32 also matches it: the result equals the
reference bit for bit.

`apply_rotary_and_write_kv` is the same pass that also stores each token's rotated key and its
value at the token's KV-cache slot, so a layer's projection ends in one launch instead of two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from meshserve.kernels import pdl
from meshserve.kernels.pdl import pdl_prologue
from meshserve.kernels.triton_checks import check_kv_write

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def apply_rotary(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int32/int64
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]: cos half, then sin half
) -> tuple[torch.Tensor, torch.Tensor]:  # new contiguous tensors, shapes of query and key
    """Rotate the first rotary_dim dims of every head of q and k by each token's position."""
    return _launch(query, key, positions, cos_sin_cache, None)


def apply_rotary_and_write_kv(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int32/int64
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int32/int64, < 0 = not written
) -> tuple[torch.Tensor, torch.Tensor]:  # rotated query and key, as `apply_rotary`
    """`apply_rotary`, and each token's rotated key and its value stored at its cache slot
    (cast to the cache dtype), in one launch."""
    assert value.dtype == key.dtype, f"value {value.dtype} must match key {key.dtype}"
    check_kv_write(_rotary_kernel, key, value, k_cache, v_cache, slot_mapping)
    return _launch(query, key, positions, cos_sin_cache, (value, k_cache, v_cache, slot_mapping))


def _launch(
    query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(query, key, positions, cos_sin_cache)
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads, rotary_dim = key.shape[1], cos_sin_cache.shape[1]
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return q_out, k_out
    half = rotary_dim // 2
    rest = head_dim - rotary_dim  # dims past the rotary part pass through unchanged
    if cache is None:  # the kernel never touches the cache arguments: stand-ins
        value, slots = key, positions
        k_cache = v_cache = k_out[:1].unsqueeze(0)  # [1, 1, Hkv, D]
    else:
        value, k_cache, v_cache, slots = cache
    _rotary_kernel[(num_tokens,)](
        query, key, q_out, k_out, positions, cos_sin_cache,
        value, k_cache, v_cache, slots,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_sin_cache.stride(0),
        value.stride(0), value.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half,
        REST=rest, Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF_PAD=triton.next_power_of_2(half), REST_PAD=triton.next_power_of_2(max(rest, 1)),
        HEAD_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1],
        WRITE_KV=cache is not None,
        num_warps=4 if num_q_heads * head_dim < 4096 else 8, enable_fp_fusion=False,
        **pdl.launch_options(query.device))
    return q_out, k_out


@triton.jit
def _rounded(x, DTYPE: tl.constexpr):
    """x (float32) rounded to DTYPE and back: one PyTorch operation's result in DTYPE."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rotate_heads(x_ptr, out_ptr, token, stride_t, stride_h, cos, sin,
                  cache_ptr, cache_row, stride_ch, cache_ok,
                  NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                  REST: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
                  REST_PAD: tl.constexpr, TO_CACHE: tl.constexpr):
    # x: [NUM_HEADS, HEAD_DIM] of one token; cos/sin: [1, HALF_PAD] float32 in x's dtype.
    # With TO_CACHE (and cache_ok true) the rotated heads are also stored at element offset
    # cache_row of cache_ptr, heads stride_ch apart, in the cache's dtype.
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
    o1 = _rounded(_rounded(x1 * cos, dtype) - _rounded(x2 * sin, dtype), dtype).to(dtype)
    o2 = _rounded(_rounded(x2 * cos, dtype) + _rounded(x1 * sin, dtype), dtype).to(dtype)
    tl.store(dst + j, o1, mask=mask)
    tl.store(dst + HALF + j, o2, mask=mask)
    cache_dst = cache_ptr + cache_row + h * stride_ch
    if TO_CACHE:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if cache_ok:
            cache_dtype = cache_ptr.dtype.element_ty
            tl.store(cache_dst + j, o1.to(cache_dtype), mask=mask)
            tl.store(cache_dst + HALF + j, o2.to(cache_dtype), mask=mask)
    if REST > 0:
        r = tl.arange(0, REST_PAD)[None, :]
        rest_mask = (h < NUM_HEADS) & (r < REST)
        rest = tl.load(src + 2 * HALF + r, mask=rest_mask)
        tl.store(dst + 2 * HALF + r, rest, mask=rest_mask)
        if TO_CACHE:  # noqa: SIM102 (compile time, then run time)
            if cache_ok:
                tl.store(cache_dst + 2 * HALF + r, rest.to(cache_ptr.dtype.element_ty),
                         mask=rest_mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cache_ptr,
    v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    stride_vt, stride_vh, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr, REST: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, WRITE_KV: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    # One program per token: rotate its query and key heads; with WRITE_KV also store the
    # rotated key and the value at the token's cache slot (nothing when the slot is < 0).
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    j = tl.arange(0, HALF_PAD)[None, :]
    row = cache_ptr + pos * stride_cache
    # The table is cast to the activations' dtype first, as the reference does.
    dtype = q_ptr.dtype.element_ty
    cos = tl.load(row + j, mask=j < HALF, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(row + HALF + j, mask=j < HALF, other=0.0).to(dtype).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, token, stride_qt, stride_qh, cos, sin, k_cache_ptr, 0, 0,
                  False, NUM_Q_HEADS, HEAD_DIM, HALF, REST, Q_HEADS_PAD, HALF_PAD, REST_PAD,
                  False)
    k_row = 0
    v_row = 0
    written = False
    if WRITE_KV:
        slot = tl.load(slot_ptr + token).to(tl.int64)
        written = slot >= 0
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        k_row = block * stride_kcb + offset * stride_kcs
        v_row = block * stride_vcb + offset * stride_vcs
    _rotate_heads(k_ptr, k_out_ptr, token, stride_kt, stride_kh, cos, sin, k_cache_ptr, k_row,
                  stride_kch, written, NUM_KV_HEADS, HEAD_DIM, HALF, REST, KV_HEADS_PAD,
                  HALF_PAD, REST_PAD, WRITE_KV)
    if WRITE_KV:  # noqa: SIM102 (compile time, then run time)
        if written:
            h = tl.arange(0, KV_HEADS_PAD)[:, None]
            d = tl.arange(0, HEAD_PAD)[None, :]
            v_mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
            v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=v_mask)
            tl.store(v_cache_ptr + v_row + h * stride_vch + d,
                     v.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


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
