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


def gather_blocks(kv_caches: KVCaches, block_ids: list[int]) -> torch.Tensor:
    """A new tensor [n, layers, 2, block_size, kv_heads, head_dim] holding the blocks."""
    k0 = kv_caches[0][0]
    out = torch.empty((len(block_ids), *block_shape(kv_caches)), dtype=k0.dtype,
                      device=k0.device)
    index = block_index(block_ids, k0.device)
    for layer, (k_cache, v_cache) in enumerate(kv_caches):
        out[:, layer, 0] = k_cache.index_select(0, index)
        out[:, layer, 1] = v_cache.index_select(0, index)
    return out


def scatter_blocks(kv_caches: KVCaches, block_ids: list[int], packed: torch.Tensor) -> None:
    """Write packed blocks [n, layers, 2, block_size, kv_heads, head_dim] into the cache."""
    expected = (len(block_ids), *block_shape(kv_caches))
    assert tuple(packed.shape) == expected, f"packed blocks {tuple(packed.shape)} != {expected}"
    index = block_index(block_ids, packed.device)
    if packed.element_size() == 1:  # FP8 has no index_copy_: move the same bytes as uint8
        packed = packed.view(torch.uint8)
    for layer, (k_cache, v_cache) in enumerate(kv_caches):
        k_cache.view(packed.dtype).index_copy_(0, index, packed[:, layer, 0])
        v_cache.view(packed.dtype).index_copy_(0, index, packed[:, layer, 1])
