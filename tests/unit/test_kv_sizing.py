"""The KV cache's size on a CPU: --kv-cache-memory bytes over one block's bytes, a draft
model's cache riding along with every block, and a clear error when no block fits."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.kv_sizing import (
    PIECEWISE_MAX_TOKENS,
    gpu_memory_and_name,
    kv_blocks_that_fit,
    piecewise_tokens,
)
from meshserve.shared.errors import ModelLoadError

# 2 layers x (K and V) x 2 KV heads x 8 dims x 4 bytes = 256 bytes per token.
_MODEL: Any = SimpleNamespace(config=SimpleNamespace(cache_kv_heads=2, cache_head_dim=8,
                                                     num_hidden_layers=2))


def _config(memory: int) -> EngineConfig:
    return EngineConfig(model="unused", kv_cache_memory=memory, block_size=16)


def test_blocks_are_the_memory_over_one_blocks_bytes() -> None:
    per_block = 256 * 16
    got = kv_blocks_that_fit(_MODEL, _config(10 * per_block + 5), torch.float32,
                             torch.device("cpu"), max_num_seqs=4, batched_tokens=64)
    assert got == 10
    with_draft = kv_blocks_that_fit(_MODEL, _config(10 * per_block), torch.float32,
                                    torch.device("cpu"), 4, 64, draft_bytes_per_block=per_block)
    assert with_draft == 5
    half = kv_blocks_that_fit(_MODEL, _config(10 * per_block), torch.bfloat16,
                              torch.device("cpu"), 4, 64)
    assert half == 20


def test_no_block_fitting_is_an_error_naming_the_flags() -> None:
    with pytest.raises(ModelLoadError, match="--kv-cache-memory"):
        kv_blocks_that_fit(_MODEL, _config(100), torch.float32, torch.device("cpu"), 4, 64)


def test_piecewise_graph_size_and_cpu_device_facts() -> None:
    assert piecewise_tokens(512) == 512
    assert piecewise_tokens(10 * PIECEWISE_MAX_TOKENS) == PIECEWISE_MAX_TOKENS
    assert gpu_memory_and_name(torch.device("cpu")) == (0, "")
