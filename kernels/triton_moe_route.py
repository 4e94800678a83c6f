"""Triton routing and grouping of the mixture-of-experts MLP behind `meshserve.kernels.moe`.

Two one-launch kernels replace what PyTorch runs as some forty small kernels a layer (softmax,
top-k, renormalise, a stable sort, a histogram, cumulative sums, a search over tile ends):

    route   router logits [T, E] -> weights [T, k] float32, expert ids [T, k] int32
    align   expert ids [T, k]    -> the pairs sorted by expert and the tile schedule of
                                    kernels/triton_moe.py's grouped GEMMs

`route` takes the k largest logits (the k largest softmax probabilities are the same experts)
and weighs them either by their softmax over all E (`renormalize` off) or over the k chosen
(`renormalize` on: softmax then renormalisation, as Qwen-MoE and Mixtral do, equals a softmax
over the chosen logits, which is also gpt-oss's top-k-then-softmax). Ties go to the lower
expert id, as torch.topk picks them.

`align` runs as one program: it counts the pairs of each expert, cuts each expert's pairs into
tiles of BLOCK_M rows, and places every pair at its expert's offset plus the number of earlier
pairs of that expert (so the order within an expert is token order, as a stable sort's). That
program's work grows with pairs x experts, so past ALIGN_SORT_MIN_PAIRS pairs PyTorch's stable
sort (a radix sort over all SMs) and a scatter-add count the pairs and place them, and the
program only cuts the tiles (on an H200 the one-program path took 430 us a layer at 981
decode tokens of the Qwen3-30B-A3B shape, a quarter of the step).
A pair whose expert id is negative (another rank's expert under expert parallelism) is
skipped: it goes to a last bucket, the "null expert" E, whose tiles the products skip and
whose output rows they write as zeros.
Nothing is read back to the host, so a decode step stays capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from meshserve.kernels import pdl
from meshserve.kernels.pdl import pdl_prologue

MAX_EXPERTS = 1024  # one program holds a row of router logits
ALIGN_BLOCK_P = 64  # pairs placed per iteration of the align kernel
ALIGN_BLOCK_T = 64  # tiles scheduled per iteration
ALIGN_SORT_MIN_PAIRS = 256  # from this many pairs, PyTorch's sort places them (see above)


def _check_device(t: torch.Tensor, kernel: object) -> None:
    assert t.is_cuda or isinstance(kernel, InterpretedFunction), (
        f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {t.device}")


def route(router_logits: torch.Tensor, top_k: int,
          renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32)."""
    _check_device(router_logits, _route_kernel)
    tokens, num_experts = router_logits.shape
    assert num_experts <= MAX_EXPERTS, f"{num_experts} experts, at most {MAX_EXPERTS}"
    assert 1 <= top_k <= num_experts, f"top_k {top_k} must be in 1..{num_experts}"
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](
            logits, weights, ids, logits.stride(0), num_experts, TOP_K=top_k,
            BLOCK_K=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
            BLOCK_E=triton.next_power_of_2(num_experts),
            num_warps=1 if num_experts <= 256 else 4, **pdl.launch_options(logits.device))
    return weights, ids


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, stride_t, E, TOP_K: tl.constexpr,
                  BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                  PDL: tl.constexpr):
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    es = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + t * stride_t + es, mask=es < E,
                     other=-float("inf")).to(tl.float32)  # [BE]
    top = tl.max(logits, axis=0)
    total = tl.sum(tl.where(es < E, tl.exp(logits - top), 0.0), axis=0)
    ks = tl.arange(0, BLOCK_K)
    chosen_logits = tl.full([BLOCK_K], -float("inf"), dtype=tl.float32)
    chosen_ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    remaining = logits
    for j in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=0)
        # The lowest id among the maxima (torch.topk's choice on ties).
        best_id = tl.min(tl.where(remaining == best, es, BLOCK_E), axis=0)
        chosen_logits = tl.where(ks == j, best, chosen_logits)
        chosen_ids = tl.where(ks == j, best_id, chosen_ids)
        remaining = tl.where(es == best_id, -float("inf"), remaining)
    numer = tl.exp(chosen_logits - top)  # [BK], 0 past the k chosen
    if RENORMALIZE:
        w = numer / tl.sum(numer, axis=0)
    else:
        w = numer / total
    tl.store(weights_ptr + t * TOP_K + ks, w, mask=ks < TOP_K)
    tl.store(ids_ptr + t * TOP_K + ks, chosen_ids, mask=ks < TOP_K)


def num_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound of the tiles of `num_pairs` pairs over `num_experts` experts and the
    null expert that depends on the sizes only: each bucket with pairs wastes at most one
    partial tile."""
    return triton.cdiv(num_pairs, block_m) + min(num_experts + 1, num_pairs)


def align(expert_ids: torch.Tensor, num_experts: int, block_m: int,
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """expert_ids [T, k] -> (sorted_pairs [P] int32, offsets [E+1] int32, and per tile
    (`num_tiles`): expert, start, end [M] int32; start == end past the last tile).

    `sorted_pairs[p]` is the flat pair index t*k + j of the p-th pair in expert order;
    expert e's pairs are positions offsets[e]:offsets[e+1]; the skipped pairs (ids < 0) are
    positions offsets[E]:P, in tiles of expert E."""
    _check_device(expert_ids, _align_kernel)
    assert num_experts <= MAX_EXPERTS, f"{num_experts} experts, at most {MAX_EXPERTS}"
    ids = expert_ids.reshape(-1)
    if ids.dtype != torch.int32 or not ids.is_contiguous():
        ids = ids.to(torch.int32).contiguous()
    pairs = ids.shape[0]
    tiles = num_tiles(pairs, num_experts, block_m)
    device = ids.device
    sorted_pairs = torch.empty(pairs, dtype=torch.int32, device=device)
    offsets = torch.empty(num_experts + 2, dtype=torch.int32, device=device)
    schedule = torch.empty(3, tiles, dtype=torch.int32, device=device)  # expert, start, end
    counts = offsets  # unread: the kernel counts
    presorted = pairs >= ALIGN_SORT_MIN_PAIRS
    if presorted:
        buckets = torch.where(ids < 0, num_experts, ids)
        sorted_pairs = torch.sort(buckets, stable=True).indices.to(torch.int32)
        counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=device).scatter_add_(
            0, buckets.long(), torch.ones_like(buckets))
    _align_kernel[(1,)](
        ids, sorted_pairs, offsets, schedule, counts, pairs, num_experts, tiles,
        BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts + 2),
        BLOCK_P=ALIGN_BLOCK_P, BLOCK_T=ALIGN_BLOCK_T, PRESORTED=presorted, num_warps=4,
        **pdl.launch_options(device))
    return sorted_pairs, offsets[:num_experts + 1], schedule[0], schedule[1], schedule[2]


@triton.jit
def _bucket(ids, valid, E):
    """Each pair's bucket: its expert, E (the null expert) for a skipped pair (id < 0), -1 (no
    bucket) past the last pair."""
    return tl.where(valid, tl.where(ids < 0, E, ids), -1)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, offsets_ptr, schedule_ptr, counts_ptr, P, E, M,
                  BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
                  BLOCK_T: tl.constexpr, PRESORTED: tl.constexpr, PDL: tl.constexpr):
    """PRESORTED: the pairs are placed already and counts_ptr holds each bucket's count."""
    pdl_prologue(PDL)
    es = tl.arange(0, BLOCK_E)  # buckets: experts 0..E-1, the null expert E
    # Pass 1: pairs per bucket.
    if PRESORTED:
        counts = tl.load(counts_ptr + es, mask=es <= E, other=0)
    else:
        counts = tl.zeros([BLOCK_E], dtype=tl.int32)
        for p0 in range(0, P, BLOCK_P):
            ps = p0 + tl.arange(0, BLOCK_P)
            ids = _bucket(tl.load(ids_ptr + ps, mask=ps < P, other=0), ps < P, E)  # [BP]
            counts += tl.sum((ids[:, None] == es[None, :]).to(tl.int32), axis=0)  # [BE]
    offsets = tl.cumsum(counts, axis=0) - counts  # exclusive: bucket e's first position
    tl.store(offsets_ptr + es, offsets, mask=es <= E + 1)  # offsets[E + 1] == P
    tiles = (counts + BLOCK_M - 1) // BLOCK_M  # [BE]
    first_tile = tl.cumsum(tiles, axis=0) - tiles  # [BE]
    tile_end = first_tile + tiles
    # The tile schedule: tile m belongs to the expert whose tiles span it.
    for m0 in range(0, M, BLOCK_T):
        ms = m0 + tl.arange(0, BLOCK_T)
        owner = (first_tile[None, :] <= ms[:, None]) & (ms[:, None] < tile_end[None, :])
        owner = owner & (es[None, :] <= E)  # [BT, BE], at most one per row
        valid = tl.sum(owner.to(tl.int32), axis=1) > 0  # [BT]
        expert = tl.sum(tl.where(owner, es[None, :], 0), axis=1)
        base = tl.sum(tl.where(owner, offsets[None, :], 0), axis=1)
        first = tl.sum(tl.where(owner, first_tile[None, :], 0), axis=1)
        count = tl.sum(tl.where(owner, counts[None, :], 0), axis=1)
        start = base + (ms - first) * BLOCK_M
        end = tl.minimum(start + BLOCK_M, base + count)
        in_grid = ms < M
        tl.store(schedule_ptr + ms, expert, mask=in_grid)
        tl.store(schedule_ptr + M + ms, tl.where(valid, start, 0), mask=in_grid)
        tl.store(schedule_ptr + 2 * M + ms, tl.where(valid, end, 0), mask=in_grid)
    # Pass 2: each pair at its expert's offset plus its rank among the expert's earlier pairs.
    seen = offsets
    for p0 in range(0, P if not PRESORTED else 0, BLOCK_P):
        ps = p0 + tl.arange(0, BLOCK_P)
        ids = _bucket(tl.load(ids_ptr + ps, mask=ps < P, other=0), ps < P, E)
        onehot = (ids[:, None] == es[None, :]).to(tl.int32)  # [BP, BE]
        before = tl.cumsum(onehot, axis=0) - onehot  # earlier pairs of the same expert
        pos = tl.sum(onehot * (before + seen[None, :]), axis=1)  # [BP]
        tl.store(sorted_ptr + pos, ps.to(tl.int32), mask=ps < P)
        seen += tl.sum(onehot, axis=0)
