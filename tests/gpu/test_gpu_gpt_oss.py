"""gpt-oss on the GPU: the compiled Triton attention with sinks (and windows, split-KV) and
gpt-oss's routing against the PyTorch references, then a tiny gpt-oss model's greedy outputs
on CUDA (eager, and with the decode and piecewise CUDA graphs) against the CPU path. Prompts
run past the tiny model's 12-token window, so sinks, windowed and full layers, the biased
router and the biased clamped-SwiGLU experts (kernels/triton_moe.py) all run on the device.
Figures go to $GPU_TEST_OUT/gpt_oss_*.json.

In float32 the tokens must be the CPU path's exactly. bfloat16 is recorded, not held to a
bound, for the reason test_gpu_moe.py gives (routing is discrete; tiny random experts)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from gpu_record import record
from test_gpu_engine_paths import fp32_failures_against_cpu
from tiny_models import build_tiny_model

from meshserve.kernels.attention import AttentionMetadata, paged_attention, write_kv
from meshserve.kernels.moe import route_topk_softmax


def _step(ctx_lens: list[int], q_lens: list[int], hq: int, hkv: int, d: int,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                       AttentionMetadata]:
    """Query rows over caches holding each sequence's context in scattered blocks of 16."""
    gen = torch.Generator(device="cuda").manual_seed(sum(ctx_lens))
    blocks = sum(-(-c // 16) for c in ctx_lens) + 1
    k_cache = torch.zeros(blocks, 16, hkv, d, device="cuda", dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    order = torch.randperm(blocks, device="cuda", generator=gen).tolist()
    tables = [[order.pop() for _ in range(-(-c // 16))] for c in ctx_lens]
    slots = [t[p // 16] * 16 + p % 16 for t, c in zip(tables, ctx_lens) for p in range(c)]
    keys = torch.randn(len(slots), hkv, d, device="cuda", generator=gen).to(dtype)
    write_kv(keys, torch.randn_like(keys), k_cache, v_cache,
             torch.tensor(slots, device="cuda"))
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.full((sum(q_lens),), -1, device="cuda"),
        query_start_loc=torch.tensor([0, *q_lens], device="cuda").cumsum(0).int(),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32, device="cuda"),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                  dtype=torch.int32, device="cuda"),
        max_query_len=max(q_lens), max_seq_len=max(ctx_lens), query_lens_cpu=q_lens,
        seq_lens_cpu=ctx_lens)
    query = torch.randn(sum(q_lens), hq, d, device="cuda", generator=gen).to(dtype)
    return query, k_cache, v_cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("ctx_lens", "q_lens"), [
    ([3000, 40, 700], [1, 1, 1]),  # decode: long contexts take split-KV
    ([300, 90], [120, 90]),  # a chunk over a prefix and a whole prompt
])
@pytest.mark.parametrize("window", [None, 128])
def test_triton_attention_with_sinks_matches_the_reference(
        dtype: torch.dtype, ctx_lens: list[int], q_lens: list[int], window: int | None) -> None:
    query, k_cache, v_cache, meta = _step(ctx_lens, q_lens, 64, 8, 64, dtype)
    sinks = (2.0 + torch.randn(64, device="cuda")).to(dtype)
    got = paged_attention(query, k_cache, v_cache, meta, 0.125, window=window, sinks=sinks)
    cpu = [t.cpu() for t in (query, k_cache, v_cache)]
    cpu_meta = AttentionMetadata(**{name: (value.cpu() if isinstance(value, torch.Tensor)
                                           else value) for name, value in vars(meta).items()})
    want = paged_attention(cpu[0].float(), cpu[1].float(), cpu[2].float(), cpu_meta, 0.125,
                           window=window, sinks=sinks.cpu().float())
    error = ((got.float().cpu() - want).abs().max() / want.abs().max()).item()
    record(f"gpt_oss_sinks_{str(dtype).removeprefix('torch.')}_{q_lens[0]}_{window}",
           {"gpu": torch.cuda.get_device_name(0), "relative_max_error": error})
    assert error < (1e-4 if dtype == torch.float32 else 2e-2), error


def test_routing_on_cuda_equals_the_cpu_reference() -> None:
    logits = torch.randn(300, 32, generator=torch.Generator().manual_seed(0))
    weights, ids = route_topk_softmax(logits.cuda(), 4)
    want_weights, want_ids = route_topk_softmax(logits, 4)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_weights, atol=1e-6, rtol=1e-5)


def test_gpu_gpt_oss_paths_match_cpu(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path, "gpt_oss", seed=5, max_position_embeddings=1024)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (1, 9, 40, 130, 3, 77)]
    failures = fp32_failures_against_cpu(folder, prompts, 24, "gpt_oss_paths")
    assert not failures, "\n".join(failures[:20])
