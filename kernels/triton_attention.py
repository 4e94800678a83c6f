"""Triton kernels behind `meshserve.kernels.attention`: the KV-cache write and paged attention.

Cache layout (both caches): [num_blocks, block_size, num_kv_heads, head_dim]; a token's KV lives
at slot `block_id * block_size + offset`. The PyTorch references in `attention.py` define the
semantics; these kernels reproduce them on the GPU.

Paged attention is one kernel for prefill, chunked prefill over a cached prefix and decode.
The T query tokens of a step are cut, per sequence, into blocks of BLOCK_Q tokens. A program
owns one such query block and one KV head, and processes all GROUP query heads that share that
KV head at once: its BLOCK_M = BLOCK_Q * GROUP rows are (token, head) pairs, so each K/V tile is
read once per group. It walks the sequence's keys in tiles of TILE_N, gathering every key
through the block table (so TILE_N need not equal the cache block size), and keeps an online
softmax in float32 (base 2, with the scale folded in). Query row j of a sequence sits at
position seq_len - q_len + j and sees keys 0..that position; with a sliding `window` W
(Gemma 2/3) only keys p-W+1..p, and a query block's key loop starts at the tile of its first
row's first key, loading nothing before that key (blocks behind every window may be freed).
A `softcap` c caps the scaled scores s to tanh(s / c) * c before the softmax.
Attention `sinks` (gpt-oss: a logit per query head that joins the softmax's denominator and
carries no value) start each row's online softmax as if one key with that score and a zero
value came first: running max = the sink, running sum = 1 (with split-KV, in split 0 only, so
the merge counts it once). With `meta.lookahead` (LOOKAHEAD: Gemma 3's image rows read the rest
of their image) row j also sees that many keys past its position, and the block's key loop
ends past its rows' last such key; the window still counts back from the row's own position.
All four are constexpr switches: without them the kernel compiles as before.

Split-KV (flash decoding): when a decode step has too few (sequence, KV head) programs to fill
the GPU and long contexts, a third grid axis cuts each sequence's key tiles into num_splits
ranges. Each program writes its unnormalised partial output with its running max and sum, and
`_reduce_splits_kernel` merges them.

An FP8 cache (e4m3 or e5m2, scale 1.0) with float16 or bfloat16 queries multiplies in float16
(F16_DOTS): both FP8 formats widen to float16 exactly, where bfloat16 takes further
conversions through float32. bf16 queries are scaled by 2^-8 on the way (folded back into the
softmax scale) so that they stay finite; the probabilities are rounded to float16 instead of
bfloat16 (finer), and every sum is float32. The values are widened in registers before their
transposed product (see the loop). An e4m3 cache widens with Hopper's conversion instruction
(`cvt.rn.f16x2.e4m3x2`, one per two elements) or, with `--fp8-widen bits` (kernels/knobs.py), integer
instructions (`meshserve.kernels.fp8_widen`: the values times 2^-8, the 2^8 folded into the
softmax scale for keys and multiplied back in float16 for values, both exact), the same
results bit for bit; e5m2 is the high byte of a float16 and widens by a byte move. On an H100
the two widenings took the same time within 3% (the conversions are not what bounds it).
On an H200 decode attention over an FP8 cache took 0.75-0.78x the time over bf16: it reads
half the bytes, but at about 2.8 TB/s against the bf16 kernel's 4.3
(loadtest/reports/fp8/README.md).

Nothing here reads a device tensor back to the host: grids and tile choices depend only on
shapes and on `meta.max_query_len` / `meta.max_seq_len`, which are host ints, so a decode step
can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from meshserve.kernels import fp8_widen, knobs, pdl
from meshserve.kernels.attention import FP8_KV_DTYPES, AttentionMetadata
from meshserve.kernels.fp8_widen import e4m3_to_f16_scaled
from meshserve.kernels.pdl import pdl_prologue
from meshserve.kernels.triton_checks import check_attention, check_device, check_kv_write

# Split-KV: at least this many keys per split, and never more splits than this.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64
# Used for the split heuristic when there is no GPU to ask (the interpreter): an H100 SXM.
DEFAULT_NUM_SMS = 132


@dataclass(frozen=True)
class AttentionTiles:
    """Launch shape of the paged attention kernel."""

    block_m: int  # query rows per program: (tokens x query heads of one KV group)
    tile_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name in ("block_m", "tile_n"):
            value = getattr(self, name)
            # tl.dot needs every dimension >= 16; tl.arange needs powers of two.
            assert value >= 16 and value & (value - 1) == 0, (
                f"AttentionTiles.{name} must be a power of two >= 16, got {value}")


# Hopper defaults (no register spills on sm_90 with these). Prefill: big query blocks so each
# K/V tile is reused by many rows. Decode: one token per sequence, so the rows are just the
# heads of a group (padded to 16, the smallest tl.dot shape), and the loop is bound by reading
# K/V: 128 keys per step measured fastest on an H100 (loadtest/gpu_op_probe.py: 2.9 TB/s of KV
# at 1000 sequences, 7-10% ahead of 64 keys at 100 and 8 sequences). head_dim 256 halves the
# tiles; float32 dots run on FMA units, so float32 (tests and debugging) gets the smallest tiles.
PREFILL_TILES = AttentionTiles(block_m=128, tile_n=64, num_warps=8, num_stages=2)
PREFILL_TILES_WIDE = AttentionTiles(block_m=64, tile_n=32, num_warps=8, num_stages=2)
DECODE_TILES = AttentionTiles(block_m=16, tile_n=128, num_warps=4, num_stages=3)
DECODE_TILES_WIDE = AttentionTiles(block_m=16, tile_n=32, num_warps=4, num_stages=2)
FLOAT32_TILES = AttentionTiles(block_m=16, tile_n=16, num_warps=4, num_stages=2)


# bf16 queries over an FP8 cache are multiplied by 2^-F16_Q_SHIFT before becoming float16:
# exact in float32, and finite in float16 for any |q| < 65504 * 2^8.
F16_Q_SHIFT = 8
# How an e4m3 cache widens to float16 (module docstring): "bits" or "cvt".


def default_tiles(head_dim: int, dtype: torch.dtype, decode_only: bool) -> AttentionTiles:
    """The tile shape for a step: by dtype, decode or not, and head size."""
    if dtype == torch.float32:
        return FLOAT32_TILES
    if decode_only:
        return DECODE_TILES_WIDE if head_dim > 128 else DECODE_TILES
    return PREFILL_TILES_WIDE if head_dim > 128 else PREFILL_TILES


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
                      num_sms: int) -> int:
    """How many key ranges each decode sequence is cut into (1 = no split-KV).

    Split only a decode step whose (sequence, KV head) programs would leave SMs idle, and only
    as far as each split keeps at least MIN_KEYS_PER_SPLIT keys; aim for about two programs
    per SM.
    """
    programs = num_seqs * num_kv_heads
    if max_query_len != 1 or programs >= num_sms:
        return 1
    splits = min(triton.cdiv(2 * num_sms, programs), max_seq_len // MIN_KEYS_PER_SPLIT,
                 MAX_SPLITS)
    return max(splits, 1)


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int32/int64, < 0 = skip
) -> None:
    """Store each token's key and value at its slot, cast to the cache dtype."""
    check_kv_write(_write_kv_kernel, key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_PAD=triton.next_power_of_2(head_dim),
        num_warps=4, **pdl.launch_options(key.device))


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    # One program per token: copy its [Hkv, D] key and value into the slot's cache row.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch + d,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + d,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    *,
    num_splits: int | None = None,
    tiles: AttentionTiles | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, Hq, D], contiguous, query's dtype
    """Causal attention of every query row over its sequence's cached context.

    `num_splits` forces the split-KV factor (None: `choose_num_splits`; a fixed value keeps
    the launch shape fixed, e.g. for CUDA graphs); `tiles` overrides `default_tiles`.
    `window`: each query reads its last `window` positions only; `softcap`: scores capped;
    `sinks` [Hq]: each head's logit added to its rows' softmax denominators. Rows read
    `meta.lookahead` keys past their own position where it is given.
    """
    assert window is None or window >= 1, f"window must be >= 1, got {window}"
    assert softcap is None or softcap > 0, f"softcap must be positive, got {softcap}"
    check_attention(_paged_attention_kernel, query, k_cache, v_cache, meta)
    if sinks is not None:
        check_device(_paged_attention_kernel, query, sinks)
        assert tuple(sinks.shape) == (query.shape[1],) and sinks.stride(0) == 1, (
            f"sinks must be a contiguous [Hq={query.shape[1]}], got {tuple(sinks.shape)}")
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads, group = k_cache.shape[2], num_q_heads // k_cache.shape[2]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    tiles = tiles or default_tiles(head_dim, query.dtype, meta.decode_only)
    block_m = max(tiles.block_m, triton.next_power_of_2(group), 16)
    block_q = block_m // group  # query tokens per program
    num_seqs = meta.num_seqs
    # Sequence i's query blocks are numbered from query_start_loc[i] // block_q + i, so
    # T // block_q + B bounds them without reading query lengths back from the device.
    num_q_blocks = num_seqs if meta.decode_only else num_tokens // block_q + num_seqs
    if num_splits is None:
        keys = meta.max_seq_len if window is None else min(meta.max_seq_len, window)
        num_splits = choose_num_splits(num_seqs, num_kv_heads, meta.max_query_len, keys,
                                       _num_sms(query.device))
    assert num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"
    part_acc, part_max, part_sum = _split_scratch(query, num_splits)
    head_pad = max(triton.next_power_of_2(head_dim), 16)
    # An FP8 cache with 16-bit queries: products in float16 (F16_DOTS in the kernel).
    f16_dots = k_cache.dtype in FP8_KV_DTYPES and query.dtype in (torch.float16, torch.bfloat16)
    q_shift = F16_Q_SHIFT if f16_dots and query.dtype == torch.bfloat16 else 0
    # e4m3 widened by bits reads as the value times 2^-8: keys' 2^8 joins the softmax
    # scale, values' is a float16 multiplication (v_scale) in the loop.
    bits = f16_dots and k_cache.dtype == torch.float8_e4m3fn and knobs.current().fp8_widen == "bits"
    k_shift = fp8_widen.SHIFT if bits else 0
    _paged_attention_kernel[(num_q_blocks, num_kv_heads, num_splits)](
        out, query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        query if sinks is None else sinks,  # (a pointer the kernel reads only with SINKS)
        meta.seq_lens if meta.lookahead is None else meta.lookahead,  # (LOOKAHEAD only)
        part_acc, part_max, part_sum, scale * math.log2(math.e) * 2.0**(q_shift + k_shift),
        2.0**-q_shift, 2.0**k_shift, window or 0, (softcap or 1.0) * math.log2(math.e),
        num_seqs, num_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), meta.block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tiles.tile_n, SPLIT=num_splits > 1,
        DECODE_ONLY=meta.decode_only, WINDOW=window is not None, SOFTCAP=softcap is not None,
        SINKS=sinks is not None, LOOKAHEAD=meta.lookahead is not None,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", F16_DOTS=f16_dots,
        BITS=bits, ASM=bits and fp8_widen.use_asm(query.device),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl.launch_options(query.device))
    if num_splits > 1:
        _reduce_splits_kernel[(num_tokens, num_q_heads)](
            out, part_acc, part_max, part_sum, num_splits, out.stride(0), out.stride(1),
            NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, HEAD_PAD=head_pad,
            SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=4,
            **pdl.launch_options(query.device))
    return out


def compile_every_variant(k_cache: torch.Tensor, v_cache: torch.Tensor, num_q_heads: int,
                          dtype: torch.dtype) -> int:
    """Launch paged attention once per kernel variant a step can need: decode and mixed
    steps, without and with split-KV, every width of the split reduction. Steps with a
    new batch size or context length then find their kernel compiled instead of stopping
    every sequence of the batch while Triton compiles one. Reads block 0 of the caches
    (whatever it holds) and writes nothing outside its own scratch. Returns the launches."""
    device = k_cache.device
    head_dim = k_cache.shape[3]
    query = torch.zeros(2, num_q_heads, head_dim, dtype=dtype, device=device)
    launches = 0
    for query_len in (1, 2):  # decode-only, mixed
        meta = AttentionMetadata(
            slot_mapping=torch.full((query_len,), -1, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor([0, query_len], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([query_len], dtype=torch.int32, device=device),
            block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device),
            max_query_len=query_len, max_seq_len=query_len, query_lens_cpu=[query_len],
            seq_lens_cpu=[query_len])
        widths = [1] if query_len > 1 else [1] + [2**i for i in range(1, MAX_SPLITS.bit_length())
                                                  if 2**i <= MAX_SPLITS]
        for num_splits in widths:
            paged_attention(query[:query_len], k_cache, v_cache, meta, 1.0,
                            num_splits=num_splits)
            launches += 1
    return launches


def _split_scratch(query: torch.Tensor,
                   num_splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 partial results of split-KV: acc [T, Hq, S, D], running max and sum [T, Hq, S].
    Without splits the kernel never touches them, so one element stands in for all three."""
    if num_splits == 1:
        unused = torch.empty(1, dtype=torch.float32, device=query.device)
        return unused, unused, unused
    num_tokens, num_q_heads, head_dim = query.shape
    part_acc = torch.empty(num_tokens, num_q_heads, num_splits, head_dim, dtype=torch.float32,
                           device=query.device)
    part_max = torch.empty(num_tokens, num_q_heads, num_splits, dtype=torch.float32,
                           device=query.device)
    return part_acc, part_max, torch.empty_like(part_max)


@triton.jit
def _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning global query block `q_block`: the last i whose first block
    (query_start_loc[i] // BLOCK_Q + i) is <= q_block (binary search)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _query_tile(query_start_loc_ptr, seq_lens_ptr, num_seqs, BLOCK_Q: tl.constexpr,
                DECODE_ONLY: tl.constexpr):
    """This program's sequence and query block: (seq, q_start, q_len, local_block,
    context_len). Decode-only grids give program i sequence i; otherwise the last query
    blocks, which see the most keys, start first. local_block * BLOCK_Q >= q_len: past
    the end of the sequence's queries (the grid is an upper bound), nothing to do."""
    if DECODE_ONLY:
        seq = tl.program_id(0)
    else:
        q_block = tl.num_programs(0) - 1 - tl.program_id(0)
        seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if DECODE_ONLY:
        local_block = 0
    else:
        local_block = q_block - (q_start // BLOCK_Q + seq)
    context_len = tl.load(seq_lens_ptr + seq) - q_len  # keys cached before this step's
    return seq, q_start, q_len, local_block, context_len


# The batch's sequence count, split count and block-table width are plain arguments, never
# specialised on (Triton would compile apart values of 1 and multiples of 16), so a new batch
# size or context length does not compile a new kernel while serving.
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "stride_bt"])
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    query_start_loc_ptr, sinks_ptr, lookahead_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    scale_log2, q_scale, v_scale, window, softcap_log2, num_seqs, num_splits, stride_qt,
    stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
    stride_vh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, SPLIT: tl.constexpr, DECODE_ONLY: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, F16_DOTS: tl.constexpr, BITS: tl.constexpr,
    ASM: tl.constexpr, SINKS: tl.constexpr, LOOKAHEAD: tl.constexpr, PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq, q_start, q_len, local_block, context_len = _query_tile(
        query_start_loc_ptr, seq_lens_ptr, num_seqs, BLOCK_Q, DECODE_ONLY)
    if local_block * BLOCK_Q >= q_len:
        return  # past the end of this sequence's queries (the grid is an upper bound)
    seq_len = context_len + q_len

    # Rows are (token, head) pairs: row m is token local_block * BLOCK_Q + m // GROUP of the
    # sequence and query head kv_head * GROUP + m % GROUP.
    rows = tl.arange(0, BLOCK_M)
    q_tok = local_block * BLOCK_Q + rows // GROUP  # [BLOCK_M], index within the sequence
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_M]
    row_ok = (rows < BLOCK_Q * GROUP) & (q_tok < q_len)
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM
    q_off = (q_start + q_tok).to(tl.int64) * stride_qt + head * stride_qh  # [BLOCK_M]
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                other=0.0)  # [BLOCK_M, HEAD_PAD]
    if F16_DOTS:
        # FP8 keys and values then widen to float16, one instruction per two; q_scale (2^-8
        # for bf16 queries, folded back into scale_log2) keeps any bf16 query finite in
        # float16. The products sum in float32.
        q = (q.to(tl.float32) * q_scale).to(tl.float16)

    # Keys this block can see end at its last row's position (causal) or the sequence, and
    # with a window start at its first row's first key (kv_start, read with WINDOW only).
    kv_end = tl.minimum(seq_len, context_len + (local_block + 1) * BLOCK_Q)
    q_pos = context_len + q_tok  # [BLOCK_M]
    q_end = q_pos  # the last key a row sees: its own (causal), or with LOOKAHEAD a later one
    if LOOKAHEAD:
        q_end = q_pos + tl.load(lookahead_ptr + q_start + q_tok, mask=row_ok, other=0)
        kv_end = tl.minimum(seq_len, tl.maximum(kv_end, tl.max(q_end, axis=0) + 1))
    kv_start = tl.maximum(context_len + local_block * BLOCK_Q - window + 1, 0)
    tile_lo, tile_hi = _tile_range(context_len + local_block * BLOCK_Q, kv_end, window, split,
                                   num_splits, TILE_N, SPLIT, WINDOW)
    acc, row_max, row_sum = _attend_tiles(
        q, sinks_ptr + head, row_ok & (split == 0), k_cache_ptr, v_cache_ptr,
        block_tables_ptr + seq.to(tl.int64) * stride_bt,
        q_pos, q_end, kv_start, kv_end, tile_lo, tile_hi, scale_log2, v_scale, window,
        softcap_log2, kv_head, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
        stride_vh, BLOCK_M, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, DOT_PRECISION, F16_DOTS,
        BITS, ASM, WINDOW, SOFTCAP, SINKS)

    mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        # Unnormalised partials of [T, Hq, num_splits, D], merged by _reduce_splits_kernel.
        part = ((q_start + q_tok).to(tl.int64) * (GROUP * tl.num_programs(1)) + head) \
            * num_splits + split  # [BLOCK_M]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=mask)
        tl.store(part_max_ptr + part, row_max, mask=row_ok)
        tl.store(part_sum_ptr + part, row_sum, mask=row_ok)
    else:
        out = acc / tl.where(row_sum > 0.0, row_sum, 1.0)[:, None]
        o_off = (q_start + q_tok).to(tl.int64) * stride_ot + head * stride_oh
        tl.store(out_ptr + o_off[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _tile_range(first_pos, kv_end, window, split, num_splits, TILE_N: tl.constexpr,
                SPLIT: tl.constexpr, WINDOW: tl.constexpr):
    """The key tiles [lo, hi) one program walks: from the tile of the first key the block's
    first query row (at `first_pos`) sees, to kv_end; with split-KV, this split's share."""
    tile_first = 0
    if WINDOW:
        tile_first = tl.maximum(first_pos - window + 1, 0) // TILE_N
    num_tiles = tl.cdiv(kv_end, TILE_N)
    tile_lo = tile_first
    tile_hi = num_tiles
    if SPLIT:
        # Split 0 starts at tile_first, whose first visible key keeps the merged max finite.
        per_split = tl.cdiv(num_tiles - tile_first, num_splits)
        tile_lo = tile_first + split * per_split
        tile_hi = tl.minimum(num_tiles, tile_lo + per_split)
    return tile_lo, tile_hi


@triton.jit
def _attend_tiles(
    q, sink_ptrs, sink_rows, k_cache_ptr, v_cache_ptr, table_ptr, q_pos, q_end, kv_start,
    kv_end, tile_lo, tile_hi, scale_log2, v_scale, window, softcap_log2, kv_head, stride_kb,
    stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    F16_DOTS: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    """Online softmax of q [BLOCK_M, HEAD_PAD] over key tiles [tile_lo, tile_hi) of one
    sequence, row m seeing keys up to q_end[m] (and, with WINDOW, after q_pos[m] - window).
    Returns the unnormalised output [BLOCK_M, HEAD_PAD], the running max (base 2, scaled)
    and the running sum [BLOCK_M], all float32. With SINKS, the `sink_rows` start from
    their head's sink (at `sink_ptrs`) as a first key of zero value."""
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SINKS:  # (every row's head exists: the load needs no mask)
        sink = tl.load(sink_ptrs).to(tl.float32) * 1.4426950408889634  # * log2(e)
        row_max = tl.where(sink_rows, sink, row_max)
        row_sum = tl.where(sink_rows, 1.0, row_sum)
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM
    for tile in range(tile_lo, tile_hi):
        key_pos = tile * TILE_N + tl.arange(0, TILE_N)  # [TILE_N]
        key_ok = key_pos < kv_end
        if WINDOW:  # nothing before kv_start is loaded, block-table entries included
            key_ok = key_ok & (key_pos >= kv_start)
        # Each key's physical block from the table; int64 because caches can be large.
        block = tl.load(table_ptr + key_pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = key_pos % BLOCK_SIZE
        k_off = block * stride_kb + slot * stride_ks + kv_head * stride_kh  # [TILE_N]
        v_off = block * stride_vb + slot * stride_vs + kv_head * stride_vh
        # An FP8 cache (scale 1.0) is widened to q's dtype here, in registers.
        k = tl.load(k_cache_ptr + k_off[None, :] + d[:, None],
                    mask=key_ok[None, :] & d_ok[:, None], other=0.0)  # [HEAD_PAD, TILE_N]
        if BITS:  # e4m3 keys times 2^-8 (the 2^8 is in scale_log2)
            k = e4m3_to_f16_scaled(k, ASM)
        else:
            k = k.to(q.dtype)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE_N]
        if SOFTCAP:  # scores are s * log2(e); softcap_log2 is c * log2(e): tanh(s / c) * c
            scores = _tanh(scores / softcap_log2) * softcap_log2
        visible = key_ok[None, :] & (key_pos[None, :] <= q_end[:, None])
        if WINDOW:
            visible = visible & (key_pos[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # A row that has seen no key yet keeps max -inf; exponentiate against 0 instead so
        # that -inf - -inf never makes a NaN (its p and alpha are then exactly 0).
        safe_max = tl.where(new_max > float("-inf"), new_max, 0.0)
        p = tl.exp2(scores - safe_max[:, None])
        alpha = tl.exp2(row_max - safe_max)
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :],
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0)  # [TILE_N, HEAD_PAD]
        if F16_DOTS:
            # The product of p with v sums over keys, but a cache row holds one key's values:
            # v reaches the tensor cores transposed. Widened in registers first (then stored
            # and read back as 16-bit, transposed by ldmatrix), not read from shared memory
            # as FP8 one byte at a time, which the compiler does when the widening alone
            # stands between the load and the product; the multiplication by v_scale (a
            # runtime 1.0, or 2^8 after widening by bits: exact) is what keeps it there.
            if BITS:
                v = e4m3_to_f16_scaled(v, ASM) * tl.cast(v_scale, tl.float16)
            else:
                v = v.to(tl.float16) * tl.cast(v_scale, tl.float16)
        else:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = new_max
    return acc, row_max, row_sum


@triton.jit
def _tanh(x):
    """tanh(x) = 1 - 2 / (e^2x + 1): saturates to +-1 without NaN (no libdevice needed)."""
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # 2 * log2(e)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, num_splits, stride_ot, stride_oh,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    # One program per (token, query head): rescale each split's partial to the global max.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < num_splits
    d = tl.arange(0, HEAD_PAD)
    base = (token * NUM_Q_HEADS + head) * num_splits
    split_max = tl.load(part_max_ptr + base + s, mask=s_ok, other=float("-inf"))  # [S]
    split_sum = tl.load(part_sum_ptr + base + s, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :],
                  mask=s_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)  # [S, HEAD_PAD]
    # Split 0 always holds key 0, so the global max is finite; empty splits weigh 0.
    global_max = tl.max(split_max, axis=0)
    weight = tl.exp2(split_max - global_max)  # [S]
    total = tl.sum(split_sum * weight, axis=0)
    out = tl.sum(acc * weight[:, None], axis=0) / total  # [HEAD_PAD]
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)
