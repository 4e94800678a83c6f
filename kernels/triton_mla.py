"""Triton kernel behind `meshserve.kernels.mla`: latent attention over the paged cache of
compressed rows, in the absorbed form (DeepSeek-V2/V3).

Each token caches one row [c_kv (R) | k_pe (P)], split across its slot: values 0..(R+P)/2 in
k_cache, the rest in v_cache (kernels/mla.py). Every query head reads the same rows, so this is
multi-query attention with one key head of R + P dims whose first R dims are also its value.
A program owns one query block of one sequence and HEADS query heads: its BLOCK_M =
BLOCK_Q * HEADS rows are (token, head) pairs, as the paged attention kernel's rows are the
heads of one KV group (triton_attention.py; query blocks are numbered per sequence the same
way, and query row j of a sequence sits at position seq_len - q_len + j and sees keys 0..that
position). Per tile of TILE_N keys it gathers the rows through the block table once, as
c [TILE_N, R] and pe [TILE_N, P] (each value from whichever half of the slot holds it), and
uses c twice:

    scores = (q_c c^T + q_pe pe^T) * scale      [BLOCK_M, TILE_N]
    acc    = acc * alpha + p c                  [BLOCK_M, R]

with an online softmax in float32 (base 2, the scale folded in). The output is the latent
o_lat [T, H, R]; the model multiplies it by W_UV.

Split-KV (flash decoding): a decode step with too few (sequence, head block) programs to fill
the GPU cuts each sequence's key tiles into num_splits ranges (the paged kernel's
`choose_num_splits`); each program writes its unnormalised partial with its running max and
sum, and `_merge_splits_kernel` combines them, one program per (token, head, chunk of R).

An FP8 cache (scale 1.0) is widened to the queries' dtype in registers. Nothing here reads a
device tensor back to the host: the launch shape comes from tensor shapes and the metadata's
host values (num_seqs, max_query_len, max_seq_len), so decode steps can be captured in CUDA
graphs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from meshserve.kernels import pdl
from meshserve.kernels.attention import FP8_KV_DTYPES, AttentionMetadata
from meshserve.kernels.pdl import pdl_prologue
from meshserve.kernels.triton_attention import (
    MAX_SPLITS,
    AttentionTiles,
    _num_sms,
    _query_tile,
    choose_num_splits,
)
from meshserve.kernels.triton_checks import (
    check_cache_dtypes,
    check_device,
    check_step_tables,
)

# The merge of split-KV partials handles R in chunks of this many values per program.
MERGE_CHUNK = 128

# Launch shapes. A row's accumulator holds all R latent values (512 in DeepSeek-V2/V3), so the
# blocks are smaller than the paged kernel's: at most 32 rows (heads of one token in decode,
# tokens x heads in prefill) with 8 warps, the largest that compile for sm_90 without register
# spills at R = 512, P = 64 (tests/kernel_ops/test_mla_kernels.py checks); an FP8 cache's
# widening takes registers too, so its key tiles are halved. float32 (tests, debugging) the
# smallest.
MLA_DECODE_TILES = AttentionTiles(block_m=32, tile_n=32, num_warps=8, num_stages=2)
MLA_PREFILL_TILES = AttentionTiles(block_m=32, tile_n=64, num_warps=8, num_stages=2)
MLA_FP8_TILES = AttentionTiles(block_m=32, tile_n=16, num_warps=8, num_stages=2)
MLA_FLOAT32_TILES = AttentionTiles(block_m=16, tile_n=16, num_warps=4, num_stages=2)


def default_tiles(dtype: torch.dtype, cache_dtype: torch.dtype,
                  decode_only: bool) -> AttentionTiles:
    """The tile shape for a step: by the queries' and the cache's dtypes, decode or not."""
    if dtype == torch.float32:
        return MLA_FLOAT32_TILES
    if cache_dtype in FP8_KV_DTYPES:
        return MLA_FP8_TILES
    return MLA_DECODE_TILES if decode_only else MLA_PREFILL_TILES


def mla_attention(
    query: torch.Tensor,  # [T, H, R + P]: latent queries [q_nope W_UK, q_pe]
    k_cache: torch.Tensor,  # [N, bs, 1, (R + P) / 2]: each row's first half
    v_cache: torch.Tensor,  # [N, bs, 1, (R + P) / 2]: the second half
    meta: AttentionMetadata,
    scale: float,
    kv_lora_rank: int,
    *,
    num_splits: int | None = None,
    tiles: AttentionTiles | None = None,
) -> torch.Tensor:  # [T, H, R], contiguous, query's dtype
    """Causal latent attention of every query row over its sequence's cached rows (this
    step's rows already written): per head, the probability-weighted sum of the latents c_kv.

    `num_splits` forces the split-KV factor (None: chosen from the step's shape); `tiles`
    overrides `default_tiles`."""
    _check_inputs(query, k_cache, v_cache, meta, kv_lora_rank)
    num_tokens, num_heads, width = query.shape
    rank = kv_lora_rank
    out = torch.empty(num_tokens, num_heads, rank, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    tiles = tiles or default_tiles(query.dtype, k_cache.dtype, meta.decode_only)
    heads = min(triton.next_power_of_2(num_heads), tiles.block_m)  # heads per program
    # A decode program's rows are its heads of the one token (at least 16, tl.dot's least).
    block_m = max(heads, 16) if meta.decode_only else tiles.block_m
    block_q = block_m // heads  # query tokens per program
    head_blocks = triton.cdiv(num_heads, heads)
    num_seqs = meta.num_seqs
    # As the paged kernel: sequence i's query blocks are numbered from
    # query_start_loc[i] // block_q + i, so T // block_q + B bounds them.
    num_q_blocks = num_seqs if meta.decode_only else num_tokens // block_q + num_seqs
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, head_blocks, meta.max_query_len,
                                       meta.max_seq_len, _num_sms(query.device))
    assert 1 <= num_splits <= MAX_SPLITS, (
        f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    part_acc, part_max, part_sum = _split_scratch(out, num_splits)
    _mla_kernel[(num_q_blocks, head_blocks, num_splits)](
        out, query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        part_acc, part_max, part_sum, scale * math.log2(math.e), num_seqs, num_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        meta.block_tables.stride(0),
        NUM_HEADS=num_heads, RANK=rank, ROPE=width - rank, HALF=k_cache.shape[3],
        RANK_PAD=max(triton.next_power_of_2(rank), 16),
        ROPE_PAD=max(triton.next_power_of_2(width - rank), 16),
        HEADS=heads, BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_Q=block_q,
        TILE_N=tiles.tile_n, SPLIT=num_splits > 1, DECODE_ONLY=meta.decode_only,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl.launch_options(query.device))
    if num_splits > 1:
        chunk = min(MERGE_CHUNK, max(triton.next_power_of_2(rank), 16))
        _merge_splits_kernel[(num_tokens, num_heads, triton.cdiv(rank, chunk))](
            out, part_acc, part_max, part_sum, num_splits, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, RANK=rank, CHUNK=chunk,
            SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=4,
            **pdl.launch_options(query.device))
    return out


def compile_every_variant(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                          kv_lora_rank: int, dtype: torch.dtype) -> int:
    """Launch latent attention once per kernel variant a step can need (decode and mixed
    steps, without and with split-KV, every width of the merge), so that no step waits for
    Triton to compile one while serving. Reads block 0 of the caches, writes nothing outside
    its own output and scratch. Returns the launches."""
    device = k_cache.device
    query = torch.zeros(2, num_heads, 2 * k_cache.shape[3], dtype=dtype, device=device)
    launches = 0
    for query_len in (1, 2):  # decode-only, mixed
        meta = AttentionMetadata(
            slot_mapping=torch.full((query_len,), -1, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor([0, query_len], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([query_len], dtype=torch.int32, device=device),
            block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device),
            max_query_len=query_len, max_seq_len=query_len, query_lens_cpu=[query_len],
            seq_lens_cpu=[query_len])
        widths = [1] if query_len > 1 else [2**i for i in range(MAX_SPLITS.bit_length())
                                            if 2**i <= MAX_SPLITS]
        for num_splits in widths:
            mla_attention(query[:query_len], k_cache, v_cache, meta, 1.0, kv_lora_rank,
                          num_splits=num_splits)
            launches += 1
    return launches


def _split_scratch(out: torch.Tensor,
                   num_splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 partials of split-KV: acc [T, H, S, R], running max and sum [T, H, S]. Without
    splits the kernel never touches them, so one element stands in for all three."""
    if num_splits == 1:
        unused = torch.empty(1, dtype=torch.float32, device=out.device)
        return unused, unused, unused
    num_tokens, num_heads, rank = out.shape
    part_acc = torch.empty(num_tokens, num_heads, num_splits, rank, dtype=torch.float32,
                           device=out.device)
    part_max = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32,
                           device=out.device)
    return part_acc, part_max, torch.empty_like(part_max)


# The batch's sequence count, split count and block-table width are plain arguments, never
# specialised on, as in the paged kernel (no new compilation for a new batch size).
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "stride_bt"])
def _mla_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    query_start_loc_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, scale_log2, num_seqs,
    num_splits, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_vb,
    stride_vs, stride_bt,
    NUM_HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr,
    RANK_PAD: tl.constexpr, ROPE_PAD: tl.constexpr, HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, SPLIT: tl.constexpr, DECODE_ONLY: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq, q_start, q_len, local_block, context_len = _query_tile(
        query_start_loc_ptr, seq_lens_ptr, num_seqs, BLOCK_Q, DECODE_ONLY)
    if local_block * BLOCK_Q >= q_len:
        return  # past the end of this sequence's queries (the grid is an upper bound)
    seq_len = context_len + q_len

    # Row m is token local_block * BLOCK_Q + m // HEADS of the sequence and query head
    # head_block * HEADS + m % HEADS.
    rows = tl.arange(0, BLOCK_M)
    q_tok = local_block * BLOCK_Q + rows // HEADS  # [BLOCK_M], index within the sequence
    head = head_block * HEADS + rows % HEADS  # [BLOCK_M]
    row_ok = (rows < BLOCK_Q * HEADS) & (q_tok < q_len) & (head < NUM_HEADS)
    q_off = (q_start + q_tok).to(tl.int64) * stride_qt + head * stride_qh  # [BLOCK_M]
    r = tl.arange(0, RANK_PAD)
    p = tl.arange(0, ROPE_PAD)
    q_c = tl.load(q_ptr + q_off[:, None] + r[None, :],
                  mask=row_ok[:, None] & (r < RANK)[None, :], other=0.0)  # [BLOCK_M, RANK_PAD]
    q_pe = tl.load(q_ptr + q_off[:, None] + RANK + p[None, :],
                   mask=row_ok[:, None] & (p < ROPE)[None, :], other=0.0)  # [BLOCK_M, ROPE_PAD]

    # Keys this block can see end at its last row's position (causal) or the sequence.
    kv_end = tl.minimum(seq_len, context_len + (local_block + 1) * BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    tile_lo = 0
    tile_hi = num_tiles
    if SPLIT:  # split 0 starts at key 0, which every row sees: the merged max is finite
        per_split = tl.cdiv(num_tiles, num_splits)
        tile_lo = split * per_split
        tile_hi = tl.minimum(num_tiles, tile_lo + per_split)
    acc, row_max, row_sum = _attend_latent_tiles(
        q_c, q_pe, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt,
        context_len + q_tok, kv_end, tile_lo, tile_hi, scale_log2, stride_kb, stride_ks,
        stride_vb, stride_vs, RANK, ROPE, HALF, RANK_PAD, ROPE_PAD, BLOCK_M, BLOCK_SIZE,
        TILE_N, DOT_PRECISION)

    mask = row_ok[:, None] & (r < RANK)[None, :]
    if SPLIT:
        # Unnormalised partials of [T, H, num_splits, R], merged by _merge_splits_kernel.
        part = ((q_start + q_tok).to(tl.int64) * NUM_HEADS + head) * num_splits + split
        tl.store(part_acc_ptr + part[:, None] * RANK + r[None, :], acc, mask=mask)
        tl.store(part_max_ptr + part, row_max, mask=row_ok)
        tl.store(part_sum_ptr + part, row_sum, mask=row_ok)
    else:
        out = acc / tl.where(row_sum > 0.0, row_sum, 1.0)[:, None]
        o_off = (q_start + q_tok).to(tl.int64) * stride_ot + head * stride_oh
        tl.store(out_ptr + o_off[:, None] + r[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _load_row_part(k_cache_ptr, v_cache_ptr, k_off, v_off, key_ok, FIRST: tl.constexpr,
                   WIDTH: tl.constexpr, PAD: tl.constexpr, HALF: tl.constexpr):
    """Values FIRST..FIRST + WIDTH of each key's cached row, [TILE_N, PAD] (zeros past WIDTH
    and for keys not ok): those before HALF from the slot's k_cache half, the rest from its
    v_cache half, in one load (each value's pointer chosen)."""
    j = FIRST + tl.arange(0, PAD)  # [PAD], positions in the row
    ptrs = tl.where((j < HALF)[None, :], k_cache_ptr + k_off[:, None] + j[None, :],
                    v_cache_ptr + v_off[:, None] + (j - HALF)[None, :])
    return tl.load(ptrs, mask=key_ok[:, None] & (j < FIRST + WIDTH)[None, :], other=0.0)


@triton.jit
def _attend_latent_tiles(
    q_c, q_pe, k_cache_ptr, v_cache_ptr, table_ptr, q_pos, kv_end, tile_lo, tile_hi,
    scale_log2, stride_kb, stride_ks, stride_vb, stride_vs,
    RANK: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr, RANK_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online softmax of the latent queries q_c [BLOCK_M, RANK_PAD] and q_pe
    [BLOCK_M, ROPE_PAD] (rows at positions q_pos) over key tiles [tile_lo, tile_hi) of one
    sequence. Returns the unnormalised output [BLOCK_M, RANK_PAD], the running max (base 2,
    scaled) and the running sum [BLOCK_M], all float32."""
    acc = tl.zeros([BLOCK_M, RANK_PAD], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    for tile in range(tile_lo, tile_hi):
        key_pos = tile * TILE_N + tl.arange(0, TILE_N)  # [TILE_N]
        key_ok = key_pos < kv_end
        # Each key's physical block from the table; int64 because caches can be large.
        block = tl.load(table_ptr + key_pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = key_pos % BLOCK_SIZE
        k_off = block * stride_kb + slot * stride_ks  # [TILE_N]
        v_off = block * stride_vb + slot * stride_vs
        # An FP8 cache is widened to the queries' dtype here, in registers.
        c = _load_row_part(k_cache_ptr, v_cache_ptr, k_off, v_off, key_ok, 0, RANK, RANK_PAD,
                           HALF).to(q_c.dtype)  # [TILE_N, RANK_PAD]
        pe = _load_row_part(k_cache_ptr, v_cache_ptr, k_off, v_off, key_ok, RANK, ROPE,
                            ROPE_PAD, HALF).to(q_c.dtype)  # [TILE_N, ROPE_PAD]
        scores = tl.dot(q_c, tl.trans(c), input_precision=DOT_PRECISION)
        scores = tl.dot(q_pe, tl.trans(pe), scores, input_precision=DOT_PRECISION)
        scores = scores * scale_log2  # [BLOCK_M, TILE_N]
        visible = key_ok[None, :] & (key_pos[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # A row that has seen no key yet keeps max -inf; exponentiate against 0 instead so
        # that -inf - -inf never makes a NaN (its p and alpha are then exactly 0).
        safe_max = tl.where(new_max > float("-inf"), new_max, 0.0)
        prob = tl.exp2(scores - safe_max[:, None])
        alpha = tl.exp2(row_max - safe_max)
        row_sum = row_sum * alpha + tl.sum(prob, axis=1)
        acc = acc * alpha[:, None] + tl.dot(prob.to(c.dtype), c, input_precision=DOT_PRECISION)
        row_max = new_max
    return acc, row_max, row_sum


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, num_splits, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, RANK: tl.constexpr, CHUNK: tl.constexpr,
    SPLITS_PAD: tl.constexpr, PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    # One program per (token, head, chunk of R): rescale each split's partial to the global
    # max and sum them.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    r = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < num_splits
    base = (token * NUM_HEADS + head) * num_splits
    split_max = tl.load(part_max_ptr + base + s, mask=s_ok, other=float("-inf"))  # [S]
    split_sum = tl.load(part_sum_ptr + base + s, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + (base + s)[:, None] * RANK + r[None, :],
                  mask=s_ok[:, None] & (r < RANK)[None, :], other=0.0)  # [S, CHUNK]
    # Split 0 always holds key 0, so the global max is finite; empty splits weigh 0.
    global_max = tl.max(split_max, axis=0)
    weight = tl.exp2(split_max - global_max)  # [S]
    total = tl.sum(split_sum * weight, axis=0)
    out = tl.sum(acc * weight[:, None], axis=0) / total  # [CHUNK]
    tl.store(out_ptr + token * stride_ot + head * stride_oh + r,
             out.to(out_ptr.dtype.element_ty), mask=r < RANK)


def _check_inputs(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, kv_lora_rank: int) -> None:
    check_device(_mla_kernel, query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                 meta.query_start_loc)
    assert query.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (
        f"query must be [T, H, R + P] and caches [N, bs, 1, (R + P) / 2], got "
        f"{tuple(query.shape)}, {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    assert k_cache.shape[2] == 1 and query.shape[2] == 2 * k_cache.shape[3], (
        f"latent queries {tuple(query.shape)} do not fit a cache of {tuple(k_cache.shape)} "
        "(one head of half a row)")
    assert 0 < kv_lora_rank < query.shape[2], (
        f"kv_lora_rank {kv_lora_rank} must leave rotary dims of the {query.shape[2]}")
    check_cache_dtypes(query, k_cache, v_cache)
    check_step_tables(meta, query=query, k_cache=k_cache, v_cache=v_cache)
