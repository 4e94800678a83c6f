"""Paged attention and KV write (the CPU reference) against dense causal attention."""

from __future__ import annotations

import math

import pytest
import torch

from meshserve.kernels.attention import (
    AttentionMetadata,
    fresh_prefill_attention,
    paged_attention,
    write_kv,
)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int,
                    scale: float) -> torch.Tensor:
    """Textbook causal attention for one sequence: q [Lq, Hq, D], k/v [L, Hkv, D]."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    q_pos = torch.arange(q_start, q_start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


def build_step(ctx_lens: list[int], q_lens: list[int], hkv: int, hq: int, d: int, bs: int,
               num_blocks: int, seed: int):
    """Random sequences whose first ctx-q tokens are already cached, in scattered blocks."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # gaps and disorder in tables
    tables, full_k, full_v, slots = [], [], [], []
    for ctx in ctx_lens:
        nb = -(-ctx // bs)
        table = [perm.pop() for _ in range(nb)]
        tables.append(table)
        full_k.append(torch.randn(ctx, hkv, d, generator=g))
        full_v.append(torch.randn(ctx, hkv, d, generator=g))
    keys, values, queries = [], [], []
    for table, k, v, ctx, ql in zip(tables, full_k, full_v, ctx_lens, q_lens):
        cached = ctx - ql
        for p in range(cached):  # the prefix is already in the cache
            k_cache[table[p // bs], p % bs] = k[p]
            v_cache[table[p // bs], p % bs] = v[p]
        keys.append(k[cached:])
        values.append(v[cached:])
        queries.append(torch.randn(ql, hq, d, generator=g))
        slots.extend(table[p // bs] * bs + p % bs for p in range(cached, ctx))
    width = max(map(len, tables))
    starts = [0]
    for ql in q_lens:
        starts.append(starts[-1] + ql)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                  dtype=torch.int32),
        max_query_len=max(q_lens), max_seq_len=max(ctx_lens),
        query_lens_cpu=q_lens, seq_lens_cpu=ctx_lens)
    return (torch.cat(queries), torch.cat(keys), torch.cat(values), k_cache, v_cache, meta,
            full_k, full_v)


CASES = {
    "decode-ragged": ([1, 17, 64, 5], [1, 1, 1, 1]),
    "prefill-fresh": ([7, 33, 16], [7, 33, 16]),
    "chunk-over-prefix": ([40, 20], [8, 20]),
    "mixed": ([50, 1, 9, 30], [1, 1, 9, 12]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 4, 64), (8, 2, 128), (6, 1, 64)])
@pytest.mark.parametrize("pass_new_kv", [False, True])
def test_paged_attention_matches_dense(case: str, hq: int, hkv: int, d: int,
                                       pass_new_kv: bool) -> None:
    ctx_lens, q_lens = CASES[case]
    q, k, v, k_cache, v_cache, meta, full_k, full_v = build_step(
        ctx_lens, q_lens, hkv, hq, d, bs=16, num_blocks=64, seed=len(case) + hq)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    scale = d**-0.5
    kwargs = {"key": k, "value": v} if pass_new_kv else {}
    out = paged_attention(q, k_cache, v_cache, meta, scale, **kwargs)
    start = 0
    for ctx, ql, fk, fv in zip(ctx_lens, q_lens, full_k, full_v):
        want = dense_attention(q[start : start + ql], fk, fv, ctx - ql, scale)
        torch.testing.assert_close(out[start : start + ql], want, atol=1e-5, rtol=1e-5)
        start += ql


def test_write_kv_skips_negative_slots_and_writes_the_rest() -> None:
    k_cache = torch.zeros(4, 2, 1, 3)
    v_cache = torch.zeros(4, 2, 1, 3)
    key = torch.arange(9, dtype=torch.float32).view(3, 1, 3) + 1
    write_kv(key, -key, k_cache, v_cache, torch.tensor([5, -1, 0]))
    flat_k = k_cache.view(-1, 1, 3)
    assert torch.equal(flat_k[5], key[0]) and torch.equal(flat_k[0], key[2])
    assert torch.equal(v_cache.view(-1, 1, 3)[5], -key[0])
    assert int((flat_k != 0).any(-1).sum()) == 2


@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 4, 64), (8, 2, 128), (6, 1, 64)])
def test_fresh_prefill_attention_matches_dense(hq: int, hkv: int, d: int) -> None:
    ctx_lens = q_lens = [7, 33, 16]
    q, k, v, _, _, meta, full_k, full_v = build_step(ctx_lens, q_lens, hkv, hq, d, bs=16,
                                                     num_blocks=64, seed=d)
    out = fresh_prefill_attention(q, k, v, meta, d**-0.5)
    start = 0
    for ql, fk, fv in zip(q_lens, full_k, full_v):
        want = dense_attention(q[start : start + ql], fk, fv, 0, d**-0.5)
        torch.testing.assert_close(out[start : start + ql], want, atol=1e-5, rtol=1e-5)
        start += ql


@pytest.mark.parametrize(("hq", "hkv"), [(8, 2), (4, 4)])
def test_fresh_prefill_attention_of_one_prompt(hq: int, hkv: int) -> None:
    q, k, v, _, _, meta, full_k, full_v = build_step([40], [40], hkv, hq, 64, bs=16,
                                                     num_blocks=8, seed=hq)
    out = fresh_prefill_attention(q, k, v, meta, 0.125)
    assert out.shape == q.shape and out.is_contiguous()
    torch.testing.assert_close(out, dense_attention(q, full_k[0], full_v[0], 0, 0.125),
                               atol=1e-5, rtol=1e-5)
