"""Sliding-window and soft-capped paged attention (the CPU reference, used by Gemma 2/3)
against textbook dense attention, over every step shape: decode, fresh prefill, chunks over a
cached prefix, mixed."""

from __future__ import annotations

import math

import pytest
import torch
from test_paged_attention import CASES, build_step

from meshserve.kernels.attention import paged_attention, write_kv


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int,
                    scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """q [Lq, Hq, D] at positions q_start.., k/v [L, Hkv, D]; key j visible to query p when
    j <= p and (with a window W) p - j < W; scores s -> tanh(s / c) * c (with a cap c)."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(q_start, q_start + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= q_pos - k_pos >= window
    scores = scores.masked_fill(hidden, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("window", "softcap"), [(5, None), (16, None), (None, 2.0), (7, 3.0),
                                                 (1, None), (100, 1.5)])
@pytest.mark.parametrize("pass_new_kv", [False, True])
def test_windowed_softcapped_attention_matches_dense(case: str, window: int | None,
                                                     softcap: float | None,
                                                     pass_new_kv: bool) -> None:
    ctx_lens, q_lens = CASES[case]
    hq, hkv, d = 8, 2, 32
    q, k, v, k_cache, v_cache, meta, full_k, full_v = build_step(
        ctx_lens, q_lens, hkv, hq, d, bs=16, num_blocks=64, seed=len(case))
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    scale = 0.5  # large scores, so that the cap bites
    kwargs = {"key": k, "value": v} if pass_new_kv else {}
    out = paged_attention(q, k_cache, v_cache, meta, scale, window=window, softcap=softcap,
                          **kwargs)
    start = 0
    for ctx, ql, fk, fv in zip(ctx_lens, q_lens, full_k, full_v):
        want = dense_attention(q[start : start + ql], fk, fv, ctx - ql, scale, window, softcap)
        torch.testing.assert_close(out[start : start + ql], want, atol=1e-5, rtol=1e-5)
        start += ql


def test_window_and_softcap_change_the_result() -> None:
    """The options are not silently ignored: a window shorter than the context and a cap below
    the scores each give another output than plain causal attention."""
    ctx_lens, q_lens = CASES["mixed"]
    q, k, v, k_cache, v_cache, meta, _, _ = build_step(ctx_lens, q_lens, 2, 8, 32, bs=16,
                                                       num_blocks=64, seed=3)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    plain = paged_attention(q, k_cache, v_cache, meta, 0.5)
    for options in ({"window": 4}, {"softcap": 1.0}):
        assert not torch.allclose(paged_attention(q, k_cache, v_cache, meta, 0.5, **options),
                                  plain, atol=1e-3)
