"""An FP8 KV cache through the KV tier: blocks move as FP8 bytes (half of bf16's, a quarter
of float32's) between engines of the same KV dtype, and the KV namespace keeps FP8-cache
workers apart from full-precision ones."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_kv_tier import BLOCK, MemoryClient, MemoryStore, make_engine, run, wait_saved
from tiny_models import build_tiny_model

from meshserve.services.worker.__main__ import kv_namespace
from meshserve.services.worker.engine.kv_copy import gather_blocks, scatter_blocks
from meshserve.services.worker.tier.store_client import Reservation


class Fp8Client(MemoryClient):
    """The in-memory store's client, for blocks of one byte an element."""

    def reserve(self, hashes: Sequence[bytes], parents: Sequence[bytes], dtype: str,
                shape: tuple[int, ...]) -> Reservation:
        self._check()
        assert dtype == "float8_e4m3fn", dtype
        nbytes = int(torch.tensor(shape).prod())
        views: list[memoryview | None] = [
            None if h in self.store.blocks else memoryview(bytearray(nbytes)) for h in hashes]
        return Reservation(list(hashes), views)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-fp8-tier"), "llama", seed=5)


def test_fp8_blocks_round_trip_through_gather_and_scatter() -> None:
    g = torch.Generator().manual_seed(0)
    caches = [(torch.randn(6, 4, 2, 8, generator=g).to(torch.float8_e4m3fn),
               torch.randn(6, 4, 2, 8, generator=g).to(torch.float8_e4m3fn)) for _ in range(3)]
    packed = gather_blocks(caches, [4, 1])
    assert packed.dtype == torch.float8_e4m3fn and packed.shape == (2, 3, 2, 4, 2, 8)
    empty = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in caches]
    scatter_blocks(empty, [0, 5], packed)
    for (k, v), (k2, v2) in zip(caches, empty, strict=True):
        assert torch.equal(k2[0].float(), k[4].float()) and torch.equal(v2[5].float(), v[1].float())
        assert k2[1:5].float().abs().sum() == 0


def test_fp8_kv_blocks_saved_by_one_engine_are_loaded_by_another(folder: Path) -> None:
    store = MemoryStore()
    prompt = [random.Random(2).randrange(3, 200) for _ in range(4 * BLOCK + 3)]
    reference, _ = run(make_engine(folder, None, kv_cache_dtype="fp8")[0], prompt)
    engines = []
    for rid in ("a", "b"):
        engine, transfer = make_engine(folder, None, client=lambda: Fp8Client(store),
                                       kv_cache_dtype="fp8")
        assert transfer is not None
        out, cached = run(engine, prompt, rid)
        assert out == reference
        engines.append((engine, transfer, cached))
        if rid == "a":
            wait_saved(transfer, store, 4)
    assert engines[0][2] == 0 and engines[1][2] == 4 * BLOCK  # b loaded the 4 prompt blocks
    assert all(len(data) == 2 * 2 * BLOCK * 2 * 16 for data in store.blocks.values())
    for _, transfer, _ in engines:
        transfer.stop()


def test_the_kv_namespace_keeps_fp8_caches_apart() -> None:
    bf16 = SimpleNamespace(dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    fp8 = SimpleNamespace(dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn)
    e5m2 = SimpleNamespace(dtype=torch.bfloat16, kv_dtype=torch.float8_e5m2)
    assert kv_namespace("m", bf16) == "m@bfloat16"  # type: ignore[arg-type]
    names = {kv_namespace("m", e) for e in (bf16, fp8, e5m2)}  # type: ignore[arg-type]
    assert names == {"m@bfloat16", "m@bfloat16+kv=float8_e4m3fn", "m@bfloat16+kv=float8_e5m2"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_caches_that_share_one_tensor_move_blocks_as_separate_caches_do(
        dtype: torch.dtype) -> None:
    """The model runner's caches are views of one [layers, 2, blocks, ...] tensor, which
    gather and scatter move in one kernel each: the same bytes as the per-layer path."""
    from meshserve.services.worker.engine.kv_copy import shared_storage

    g = torch.Generator().manual_seed(1)
    storage = torch.randn(3, 2, 6, 4, 2, 8, generator=g).to(dtype)
    views = [(storage[layer, 0], storage[layer, 1]) for layer in range(3)]
    separate = [(k.clone(), v.clone()) for k, v in views]
    assert shared_storage(views) is storage and shared_storage(separate) is None
    assert shared_storage([views[0], views[2]]) is None  # not every layer of it
    packed = gather_blocks(views, [4, 1, 5])
    reference = gather_blocks(separate, [4, 1, 5])
    assert packed.dtype == dtype and packed.shape == reference.shape == (3, 3, 2, 4, 2, 8)
    assert torch.equal(packed.view(torch.uint8), reference.view(torch.uint8))
    blank = torch.zeros_like(storage)
    blank_views = [(blank[layer, 0], blank[layer, 1]) for layer in range(3)]
    blank_separate = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in separate]
    scatter_blocks(blank_views, [0, 2, 3], packed)
    scatter_blocks(blank_separate, [0, 2, 3], packed)
    for (k, v), (k2, v2) in zip(blank_views, blank_separate, strict=True):
        assert torch.equal(k.view(torch.uint8), k2.view(torch.uint8))
        assert torch.equal(v.view(torch.uint8), v2.view(torch.uint8))
    assert torch.equal(blank[1, 1, 2].view(torch.uint8), storage[1, 1, 1].view(torch.uint8))
