"""Query rows that read ahead (`AttentionMetadata.lookahead`): Gemma 3's image rows attend to
every row of their image during prefill. The PyTorch reference against attention written out
with transformers' mask (causal OR the same image, AND the window), over fresh prefills,
chunks over a cached prefix and mixed steps; then the Triton kernel, run by Triton's
interpreter, against the reference (query blocks cut through images, windows, half precision).

As in test_triton_kernels.py, the interpreted cases run in a child pytest process started with
TRITON_INTERPRET=1 (Triton picks its interpreter when first imported).
"""

from __future__ import annotations

import math

import pytest
import torch
from test_paged_attention import build_step
from test_triton_kernels import (  # noqa: F401 (an autouse fixture)
    AttentionTiles,
    InterpreterRun,
    _interpreter_with_gpu_bf16_numerics,
    assert_attention_close,
    in_interpreter,
    make_step,
    outside_interpreter,
    run_attention,
)

from meshserve.kernels import triton_attention
from meshserve.kernels.attention import (
    AttentionMetadata,
    paged_attention,
    paged_attention_reference,
    write_kv,
)

# (context lengths, query lengths, each sequence's images as (first position, rows)).
CASES = {
    "prefill-fresh": ([7, 33, 16], [7, 33, 16], [[(2, 4)], [(3, 5), (20, 10)], []]),
    "chunk-over-prefix": ([40, 20], [8, 20], [[(5, 3), (33, 6)], [(4, 12)]]),
    # A chunk that starts inside an image (a prefix-cache hit ending there): its first rows
    # read the image's last ones, which are in this chunk.
    "chunk-inside-image": ([30, 12], [14, 12], [[(10, 12)], [(0, 12)]]),
    "mixed": ([50, 1, 9, 30], [1, 1, 9, 12], [[(10, 8)], [], [(1, 7)], [(18, 4), (25, 5)]]),
}


def lookahead_of(ctx_lens: list[int], q_lens: list[int],
                 images: list[list[tuple[int, int]]]) -> torch.Tensor:
    """[T] int32: for a query row inside an image, the keys after it up to the image's last
    row; 0 elsewhere."""
    ahead: list[int] = []
    for ctx, ql, spans in zip(ctx_lens, q_lens, images, strict=True):
        for p in range(ctx - ql, ctx):
            end = next((o + n - 1 for o, n in spans if o <= p < o + n), p)
            ahead.append(end - p)
    return torch.tensor(ahead, dtype=torch.int32)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int,
                    spans: list[tuple[int, int]], scale: float, window: int | None,
                    softcap: float | None) -> torch.Tensor:
    """q [Lq, Hq, D] at positions q_start.., k/v [L, Hkv, D], as transformers' Gemma 3 masks:
    key j visible to query p when (j <= p or both lie in one image) and (with a window W)
    p - j < W."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    group = torch.full((k.shape[0],), -1)
    for i, (offset, rows) in enumerate(spans):
        group[offset : offset + rows] = i
    q_pos = torch.arange(q_start, q_start + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    q_group, k_group = group[q_pos], group[k_pos]
    visible = (k_pos <= q_pos) | ((q_group == k_group) & (q_group >= 0))
    if window is not None:
        visible &= q_pos - k_pos < window
    scores = scores.masked_fill(~visible, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (3, None), (5, 2.0), (16, None)])
@pytest.mark.parametrize("pass_new_kv", [False, True])
def test_reference_reads_ahead_as_transformers_masks(case: str, window: int | None,
                                                      softcap: float | None,
                                                      pass_new_kv: bool) -> None:
    ctx_lens, q_lens, images = CASES[case]
    q, k, v, k_cache, v_cache, meta, full_k, full_v = build_step(
        ctx_lens, q_lens, 2, 8, 32, bs=16, num_blocks=64, seed=len(case))
    meta.lookahead = lookahead_of(ctx_lens, q_lens, images)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    kwargs = {"key": k, "value": v} if pass_new_kv else {}
    out = paged_attention(q, k_cache, v_cache, meta, 0.5, window=window, softcap=softcap,
                          **kwargs)
    start = 0
    for ctx, ql, spans, fk, fv in zip(ctx_lens, q_lens, images, full_k, full_v):
        want = dense_attention(q[start : start + ql], fk, fv, ctx - ql, spans, 0.5, window,
                               softcap)
        torch.testing.assert_close(out[start : start + ql], want, atol=1e-5, rtol=1e-5)
        start += ql


def test_only_image_rows_change() -> None:
    """Reading ahead changes an image's rows but for its last, and no other row."""
    ctx_lens, q_lens, images = CASES["chunk-over-prefix"]
    q, k, v, k_cache, v_cache, meta, _, _ = build_step(ctx_lens, q_lens, 2, 8, 32, bs=16,
                                                       num_blocks=64, seed=5)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    causal = paged_attention(q, k_cache, v_cache, meta, 0.5)
    meta.lookahead = lookahead_of(ctx_lens, q_lens, images)
    ahead = paged_attention(q, k_cache, v_cache, meta, 0.5)
    changed = (ahead - causal).abs().amax(dim=(1, 2)) > 1e-4
    assert changed.tolist() == (meta.lookahead > 0).tolist()
    assert changed.sum() == 5 + 11  # 33..38 less 38 in the first; 4..15 less 15 in the second


# -- the Triton kernel ----------------------------------------------------------------------


def _image_step(case: str, hq: int, hkv: int, d: int, dtype: torch.dtype = torch.float32):
    ctx_lens, q_lens, images = CASES[case]
    step = make_step(ctx_lens, q_lens, hq, hkv, d, bs=16, dtype=dtype, seed=hq + d)
    step.meta.lookahead = lookahead_of(ctx_lens, q_lens, images)
    return step


def _reference(step, window: int | None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The float32 reference of a step whose KV the kernel has written (run_attention)."""
    return paged_attention_reference(step.query.float(), step.k_cache.float(),
                                     step.v_cache.float(), step.meta,
                                     step.query.shape[-1] ** -0.5, window=window)


@in_interpreter
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("hq", "hkv", "tiles"), [
    (8, 2, AttentionTiles(block_m=16, tile_n=16, num_warps=4, num_stages=2)),  # 4-token blocks
    (4, 4, None),  # the default float32 tiles: 16 tokens a block
])
@pytest.mark.parametrize("window", [None, 3, 16])
def test_kernel_reads_ahead_as_the_reference(case: str, hq: int, hkv: int,
                                             tiles: AttentionTiles | None,
                                             window: int | None) -> None:
    step = _image_step(case, hq, hkv, 64)
    out, _ = run_attention(step, tiles=tiles, window=window)
    assert_attention_close(out, _reference(step, window))


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_reads_ahead_in_half_precision(dtype: torch.dtype) -> None:
    step = _image_step("mixed", 8, 2, 64, dtype)
    out, _ = run_attention(step, window=5)
    assert_attention_close(out, _reference(step, 5))


@in_interpreter
def test_kernel_lookahead_is_checked() -> None:
    step = _image_step("prefill-fresh", 4, 2, 64)
    meta: AttentionMetadata = step.meta
    assert meta.lookahead is not None
    meta.lookahead = meta.lookahead.long()
    with pytest.raises(AssertionError, match="lookahead must be"):
        triton_attention.paged_attention(step.query, step.k_cache, step.v_cache, meta, 0.1)


@outside_interpreter
def test_image_attention_kernels_under_the_interpreter(interpreter: InterpreterRun
                                                        ) -> None:
    # The reference's cases run there too: 4 x 2 options a case and one more.
    assert interpreter.passes(__file__) == len(CASES) * (8 + 2 * 3) + 1 + 2 + 1
