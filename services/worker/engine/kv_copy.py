"""Moving whole KV blocks between the paged cache and one packed tensor per block.

The packed layout of a block is [layers, 2 (K, V), block_size, kv_heads, head_dim] in the
cache dtype, C-contiguous: the layout the kvstore holds and every worker of one model agrees
on. Both directions are queued on the current device stream; nothing here waits for it.
"""

from __future__ import annotations

import torch

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer (k_cache, v_cache), each [num_blocks, block_size, kv_heads, head_dim]."""


def block_shape(kv_caches: KVCaches) -> tuple[int, ...]:
    """The packed shape of one block: [layers, 2, block_size, kv_heads, head_dim]."""
    _, block_size, heads, dim = kv_caches[0][0].shape
    return (len(kv_caches), 2, block_size, heads, dim)


def block_index(block_ids: list[int], device: torch.device) -> torch.Tensor:
    """The block ids as a tensor on `device`, queued without waiting.

    `torch.tensor(ids, device=cuda)` copies from pageable memory and then waits for the
    stream to drain. The engine thread calls `gather_blocks` right after queuing a step, so
    that wait stopped the overlapped loop in every step that completed a block. Through the
    mesh, with the KV tier on, a 1000-request burst took 1.55x the in-process engine's time
    in its steps (loadtest/reports/README.md)."""
    index = torch.tensor(block_ids, dtype=torch.long)
    if device.type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)


def shared_storage(kv_caches: KVCaches) -> torch.Tensor | None:
    """The [layers, 2, num_blocks, block_size, kv_heads, head_dim] tensor whose views the
    caches are (the model runner allocates them so), or None for separate tensors."""
    base = kv_caches[0][0]._base
    if base is None or base.dim() != 6 or tuple(base.shape[:2]) != (len(kv_caches), 2):
        return None
    start, size = base.data_ptr(), base.element_size()
    layer_step, kv_step = base.stride(0) * size, base.stride(1) * size
    # Address arithmetic only: this runs on the engine thread in every step that saves.
    for layer, pair in enumerate(kv_caches):
        for j, cache in enumerate(pair):
            if cache._base is not base or cache.shape != base.shape[2:] or (
                    cache.data_ptr() != start + layer * layer_step + j * kv_step):
                return None
    return base


def _bytes_if_fp8(t: torch.Tensor) -> torch.Tensor:
    # FP8 has no index_select / index_copy_: move the same bytes as uint8.
    return t.view(torch.uint8) if t.element_size() == 1 else t


def gather_blocks(kv_caches: KVCaches, block_ids: list[int]) -> torch.Tensor:
    """A new tensor [n, layers, 2, block_size, kv_heads, head_dim] holding the blocks.

    Caches that are views of one tensor (the model runner's) take one gather, straight into
    the packed layout, instead of four copies per layer. (A gather along the blocks' own
    dimension, then a transposing copy, moved every byte twice: on a CPU, 62 blocks of the
    Llama-3.1-8B shape took 359 ms that way, 42 ms this way.)"""
    k0 = kv_caches[0][0]
    index = block_index(block_ids, k0.device)
    base = shared_storage(kv_caches)
    if base is not None:
        by_block = _bytes_if_fp8(base).permute(2, 0, 1, 3, 4, 5)  # [num_blocks, layers, 2, ...]
        return by_block.index_select(0, index).view(k0.dtype)  # [n, layers, 2, ...], dense
    out = torch.empty((len(block_ids), *block_shape(kv_caches)), dtype=k0.dtype,
                      device=k0.device)
    for layer, (k_cache, v_cache) in enumerate(kv_caches):
        out[:, layer, 0] = k_cache.index_select(0, index)
        out[:, layer, 1] = v_cache.index_select(0, index)
    return out


def scatter_blocks(kv_caches: KVCaches, block_ids: list[int], packed: torch.Tensor) -> None:
    """Write packed blocks [n, layers, 2, block_size, kv_heads, head_dim] into the cache."""
    expected = (len(block_ids), *block_shape(kv_caches))
    assert tuple(packed.shape) == expected, f"packed blocks {tuple(packed.shape)} != {expected}"
    index = block_index(block_ids, packed.device)
    packed = _bytes_if_fp8(packed)
    base = shared_storage(kv_caches)
    if base is not None:
        _bytes_if_fp8(base).index_copy_(2, index, packed.permute(1, 2, 0, 3, 4, 5))
        return
    for layer, (k_cache, v_cache) in enumerate(kv_caches):
        k_cache.view(packed.dtype).index_copy_(0, index, packed[:, layer, 0])
        v_cache.view(packed.dtype).index_copy_(0, index, packed[:, layer, 1])
