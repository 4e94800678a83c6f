"""Input checks of the Triton launchers: devices, shapes, dtypes and strides, asserted with a
message before a kernel reads a pointer (triton_attention.py, triton_mla.py, triton_rotary.py).
"""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction

from meshserve.kernels.attention import FP8_KV_DTYPES, AttentionMetadata

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def check_kv_write(kernel: object, key: torch.Tensor, value: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """The inputs of a kernel that stores keys and values [T, Hkv, D] at cache slots."""
    check_device(kernel, key, value, k_cache, v_cache, slot_mapping)
    assert key.dim() == 3 and key.shape == value.shape, (
        f"key and value must both be [T, Hkv, D], got {tuple(key.shape)} and "
        f"{tuple(value.shape)}")
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (
        f"k_cache and v_cache must both be [N, bs, Hkv, D], got {tuple(k_cache.shape)} and "
        f"{tuple(v_cache.shape)}")
    assert key.shape[1:] == k_cache.shape[2:], (
        f"key heads/dim {tuple(key.shape[1:])} do not match the cache's {tuple(k_cache.shape[2:])}")
    assert slot_mapping.dim() == 1 and slot_mapping.shape[0] == key.shape[0], (
        f"slot_mapping must be [T={key.shape[0]}], got {tuple(slot_mapping.shape)}")
    assert slot_mapping.dtype in (torch.int32, torch.int64), (
        f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    check_last_dim_contiguous(key=key, value=value, k_cache=k_cache, v_cache=v_cache,
                              slot_mapping=slot_mapping)


def check_device(kernel: object, *tensors: torch.Tensor) -> None:
    """All tensors on one device, and that device CUDA unless the kernel is interpreted."""
    device = tensors[0].device
    assert all(t.device == device for t in tensors), (
        f"tensors must share one device, got {sorted({str(t.device) for t in tensors})}")
    assert device.type == "cuda" or isinstance(kernel, InterpretedFunction), (
        f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {device}")


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    """Each tensor's last dimension has stride 1."""
    for name, t in tensors.items():
        assert t.stride(-1) == 1, (
            f"{name} must be contiguous in its last dim, got strides {tuple(t.stride())}")


def check_cache_dtypes(query: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor) -> None:
    """A supported query dtype, and caches of the query's dtype or FP8."""
    assert query.dtype in SUPPORTED_DTYPES, f"query dtype {query.dtype} is not supported"
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (query.dtype, *FP8_KV_DTYPES), (
        f"k_cache {k_cache.dtype} and v_cache {v_cache.dtype} must be the query's dtype "
        f"({query.dtype}) or FP8")


def check_step_tables(meta: AttentionMetadata, **tensors: torch.Tensor) -> None:
    """The step's block tables, lengths and query starts: int32, long enough for its
    sequences, rows contiguous (and `tensors` too)."""
    check_last_dim_contiguous(**tensors, block_tables=meta.block_tables,
                              seq_lens=meta.seq_lens, query_start_loc=meta.query_start_loc)
    num_seqs = meta.num_seqs
    assert meta.block_tables.dim() == 2 and meta.block_tables.shape[0] >= num_seqs, (
        f"block_tables must be [B >= {num_seqs}, max_blocks], got "
        f"{tuple(meta.block_tables.shape)}")
    assert meta.seq_lens.shape[0] >= num_seqs and meta.query_start_loc.shape[0] >= num_seqs + 1, (
        f"seq_lens {tuple(meta.seq_lens.shape)} / query_start_loc "
        f"{tuple(meta.query_start_loc.shape)} are too short for {num_seqs} sequences")
    for name in ("block_tables", "seq_lens", "query_start_loc"):
        dtype = getattr(meta, name).dtype
        assert dtype == torch.int32, f"meta.{name} must be int32, got {dtype}"


def check_attention(kernel: object, query: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """The inputs of a paged attention kernel (kernels/attention.py's layouts)."""
    check_device(kernel, query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                 meta.query_start_loc)
    assert query.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (
        f"query must be [T, Hq, D] and caches [N, bs, Hkv, D], got {tuple(query.shape)}, "
        f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    check_cache_dtypes(query, k_cache, v_cache)
    assert query.shape[2] == k_cache.shape[3] <= MAX_HEAD_DIM, (
        f"query head_dim {query.shape[2]} must equal the cache's {k_cache.shape[3]} and be "
        f"at most {MAX_HEAD_DIM}")
    assert query.shape[1] % k_cache.shape[2] == 0, (
        f"query heads {query.shape[1]} must be a multiple of KV heads {k_cache.shape[2]}")
    check_step_tables(meta, query=query, k_cache=k_cache, v_cache=v_cache)
    if meta.lookahead is not None:
        check_device(kernel, query, meta.lookahead)
        assert (meta.lookahead.dtype == torch.int32 and meta.lookahead.is_contiguous()
                and tuple(meta.lookahead.shape) == (query.shape[0],)), (
            f"meta.lookahead must be a contiguous int32 [T={query.shape[0]}], got "
            f"{meta.lookahead.dtype} {tuple(meta.lookahead.shape)}")
    assert meta.max_query_len >= 1 and meta.max_seq_len >= meta.max_query_len, (
        f"meta.max_query_len {meta.max_query_len} / max_seq_len {meta.max_seq_len} are invalid")
