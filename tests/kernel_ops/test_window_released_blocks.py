"""Windowed paged attention never reads a block wholly behind the window of its sequence's first
query: the KV cache manager releases such blocks of a model whose every layer slides, and their
block-table entries then hold a placeholder (or, as far as attention knows, any block at all).

Each case points those entries at a block of NaN keys and values (any read would spread NaN
through the softmax or the value product) and checks the output against the same step over the
intact table: the PyTorch reference (prefill over a cached prefix, decode, mixed; with the
placeholder id itself too) and the Triton kernel, run by Triton's interpreter in a child pytest
process as in test_triton_kernels.py, with key tiles wider than a block and split-KV.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from test_triton_kernels import (  # noqa: F401 (an autouse fixture)
    InterpreterRun,
    Step,
    _interpreter_with_gpu_bf16_numerics,
    assert_attention_close,
    in_interpreter,
    make_step,
    outside_interpreter,
)

from meshserve.kernels import triton_attention
from meshserve.kernels.attention import (
    paged_attention,
    paged_attention_reference,
    write_kv_reference,
)
from meshserve.kernels.triton_attention import AttentionTiles
from meshserve.services.worker.engine.kv_cache_manager import PLACEHOLDER_BLOCK_ID

REPO_ROOT = Path(__file__).resolve().parents[2]
CASES = {  # (context lengths, query lengths): every sequence longer than the window
    "decode": ([64, 40, 29], [1, 1, 1]),
    "chunk-over-prefix": ([60, 45], [9, 20]),
    "mixed": ([50, 33, 45, 70], [1, 1, 12, 3]),
}


def behind_window(ctx: int, q_len: int, window: int, bs: int) -> int:
    """Leading blocks wholly before the first query's window (what the manager releases)."""
    return max(ctx - q_len - window + 1, 0) // bs


def poisoned(step: Step, window: int, entry: int | None = None) -> Step:
    """The step (its KV already written) with one more cache block, all NaN, and every table
    entry behind a sequence's window pointing at it (or at `entry`)."""
    bs = step.k_cache.shape[1]
    nan = torch.full_like(step.k_cache[:1], float("nan"))
    k_cache, v_cache = torch.cat([step.k_cache, nan]), torch.cat([step.v_cache, nan])
    tables = step.meta.block_tables.clone()
    released = 0
    for i, (ctx, q_len) in enumerate(zip(step.meta.seq_lens_cpu, step.meta.query_lens_cpu)):
        n = behind_window(ctx, q_len, window, bs)
        tables[i, :n] = step.k_cache.shape[0] if entry is None else entry
        released += n
    assert released >= 3, "the case must have blocks behind the window"
    meta = dataclasses.replace(step.meta, block_tables=tables)
    return Step(step.query, step.key, step.value, k_cache, v_cache, meta)


def written(ctx_lens: list[int], q_lens: list[int], bs: int, seed: int,
            dtype: torch.dtype = torch.float32) -> Step:
    step = make_step(ctx_lens, q_lens, 8, 2, 32, bs=bs, dtype=dtype, seed=seed)
    write_kv_reference(step.key, step.value, step.k_cache, step.v_cache, step.meta.slot_mapping)
    return step


def reference(step: Step, window: int) -> torch.Tensor:
    return paged_attention_reference(step.query.float(), step.k_cache.float(),
                                     step.v_cache.float(), step.meta,
                                     step.query.shape[-1] ** -0.5, window=window)


@outside_interpreter
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("window", [1, 7, 16])
@pytest.mark.parametrize("entry", [None, PLACEHOLDER_BLOCK_ID])
def test_reference_reads_no_block_behind_the_window(case: str, window: int,
                                                    entry: int | None) -> None:
    ctx_lens, q_lens = CASES[case]
    step = written(ctx_lens, q_lens, bs=4, seed=window)
    want = reference(step, window)
    bad = poisoned(step, window, entry)
    scale = step.query.shape[-1] ** -0.5
    # paged_attention takes the batched decode path for the decode case.
    got = paged_attention(bad.query, bad.k_cache, bad.v_cache, bad.meta, scale, window=window,
                          key=bad.key, value=bad.value)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got = paged_attention_reference(bad.query, bad.k_cache, bad.v_cache, bad.meta, scale,
                                    window=window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@outside_interpreter
def test_a_window_no_sequence_reaches_past_is_plain_attention() -> None:
    ctx_lens, q_lens = CASES["mixed"]
    step = written(ctx_lens, q_lens, bs=4, seed=3)
    scale = step.query.shape[-1] ** -0.5
    plain = paged_attention(step.query, step.k_cache, step.v_cache, step.meta, scale)
    wide = paged_attention(step.query, step.k_cache, step.v_cache, step.meta, scale,
                           window=max(ctx_lens))
    assert torch.equal(wide, plain)


@in_interpreter
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("window", "bs", "tile_n", "splits"), [
    (7, 8, 16, None),  # each key tile spans two blocks: the first one's may be released
    (16, 8, 32, None),
    (9, 16, 16, None),
    (7, 8, 16, 3),  # split-KV: split 0 starts at the window's first tile
])
def test_triton_reads_no_block_behind_the_window(case: str, window: int, bs: int, tile_n: int,
                                                 splits: int | None) -> None:
    ctx_lens, q_lens = CASES[case]
    step = written(ctx_lens, q_lens, bs=bs, seed=window + bs)
    want = reference(step, window)
    bad = poisoned(step, window)
    tiles = AttentionTiles(block_m=16, tile_n=tile_n, num_warps=4, num_stages=2)
    got = triton_attention.paged_attention(bad.query, bad.k_cache, bad.v_cache, bad.meta,
                                           step.query.shape[-1] ** -0.5, window=window,
                                           tiles=tiles, num_splits=splits)
    assert_attention_close(got, want)


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_reads_no_block_behind_the_window_in_half_precision(dtype: torch.dtype) -> None:
    ctx_lens, q_lens = CASES["mixed"]
    step = written(ctx_lens, q_lens, bs=8, seed=5, dtype=dtype)
    want = reference(step, 11)
    bad = poisoned(step, 11)
    got = triton_attention.paged_attention(bad.query, bad.k_cache, bad.v_cache, bad.meta,
                                           step.query.shape[-1] ** -0.5, window=11)
    assert_attention_close(got, want)


@outside_interpreter
def test_window_kernels_under_the_interpreter(interpreter: InterpreterRun) -> None:
    assert interpreter.passes(__file__) == 14
