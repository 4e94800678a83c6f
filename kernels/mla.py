"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged cache of compressed latents.

Each token caches one row of R + P values: its normalised latent c_kv (R = kv_lora_rank) and
its rotated key part k_pe (P = qk_rope_head_dim) shared by all heads, 576 values in DeepSeek-V2
and V3, instead of per-head keys and values. The cache of a layer is the engine's usual
(k_cache, v_cache) pair, here each [num_blocks, block_size, 1, (R + P) / 2]: a token's row is
split across its slot, the first half in k_cache and the second in v_cache, so a block holds
exactly the compressed row and every block mover (kv_copy.py, the KV tier, the kvstore) moves
it as any other block.

Attention runs in the absorbed form. With W_UK [H, nope, R] and W_UV [H, v, R] the per-head
parts of kv_b_proj, head h's key of token j is [W_UK c_j, k_pe_j] and its value W_UV c_j, so

    score(t, j) = q_nope W_UK c_j + q_pe k_pe_j = [q_nope W_UK, q_pe] . [c_j, k_pe_j]
    out_t       = sum_j p(t, j) W_UV c_j = W_UV (sum_j p(t, j) c_j)

The model turns its queries into latent queries [q_nope W_UK, q_pe] [T, H, R + P] and the
latent outputs [T, H, R] back through W_UV; in between, `mla_attention` is multi-query
attention with one key head (the cached rows) and one value head (their first R values).
Causal masking and the metadata (query_start_loc, seq_lens, block_tables, slot_mapping) are
paged attention's (kernels/attention.py); an FP8 cache is written and widened as there.

DeepSeek's RoPE rotates interleaved pairs (x0, x1), (x2, x3), ... of the P rotary dims
(transformers' complex-number form in DeepSeek-V2, `rope_interleave` in V3); `rotate_pe` takes
the pairs apart and returns the rotated halves [evens | odds], the layout transformers' V3
returns. Queries and keys share it, so their products are V2's too.

The PyTorch code here is the reference and the CPU path; on CUDA tensors `mla_attention` runs
the Triton kernel of triton_mla.py (the same signature), and `write_latents` the paged
kernel's cache write.
"""

from __future__ import annotations

import torch

from meshserve.kernels.attention import AttentionMetadata, write_kv
from meshserve.kernels.rotary import apply_rotary


def write_latents(
    rows: torch.Tensor,  # [T, R + P]: each token's c_kv then k_pe
    k_cache: torch.Tensor,  # [N, bs, 1, (R + P) / 2]
    v_cache: torch.Tensor,  # [N, bs, 1, (R + P) / 2]
    slot_mapping: torch.Tensor,  # [T] int64, -1: not written
) -> None:
    """Store each token's latent row at its slot: the first half in k_cache, the rest in
    v_cache."""
    half = k_cache.shape[-1]
    assert rows.dim() == 2 and rows.shape[1] == 2 * half and k_cache.shape[2] == 1, (
        f"latent rows {tuple(rows.shape)} do not fit a cache of {tuple(k_cache.shape)} "
        "(one head of half a row)")
    write_kv(rows[:, None, :half], rows[:, None, half:], k_cache, v_cache, slot_mapping)


def rotate_pe(
    positions: torch.Tensor,  # [T] int64
    q_pe: torch.Tensor,  # [T, H, P]
    k_pe: torch.Tensor,  # [T, 1, P]
    cos_sin_cache: torch.Tensor,  # [max_position, P]: cos | sin (kernels/rotary.py)
    interleave: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q_pe and k_pe rotated by each token's position. `interleave`: DeepSeek's pairs
    (x0, x1), (x2, x3), ..., returned as [rotated evens | rotated odds]; else NeoX halves."""
    if not interleave:
        return apply_rotary(q_pe, k_pe, positions, cos_sin_cache)
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, P/2] each
    cos, sin = cos[:, None].float(), sin[:, None].float()  # broadcast over heads

    def rotate(x: torch.Tensor) -> torch.Tensor:
        # In float32, as transformers' complex product; the result in x's dtype.
        even, odd = x[..., 0::2].float(), x[..., 1::2].float()
        return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1).to(x.dtype)

    return rotate(q_pe), rotate(k_pe)


def gather_latents(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                   seq_len: int) -> torch.Tensor:
    """The first `seq_len` cached latent rows of one sequence: [seq_len, R + P]."""
    block_size, half = k_cache.shape[1], k_cache.shape[3]
    blocks = block_table[: -(-seq_len // block_size)]
    k = k_cache.index_select(0, blocks).view(-1, half)  # [nb * bs, (R + P) / 2]
    v = v_cache.index_select(0, blocks).view(-1, half)
    return torch.cat((k, v), dim=-1)[:seq_len]


def mla_attention(
    query: torch.Tensor,  # [T, H, R + P]: latent queries [q_nope W_UK, q_pe]
    k_cache: torch.Tensor,  # [N, bs, 1, (R + P) / 2]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:  # [T, H, R]: per head, the probability-weighted sum of the latents c_kv
    """Causal latent attention of each query row over its sequence's cached rows (this step's
    rows already written)."""
    assert query.dim() == 3 and query.shape[2] == 2 * k_cache.shape[3], (
        f"latent queries {tuple(query.shape)} do not fit a cache of {tuple(k_cache.shape)}")
    if query.is_cuda:
        from meshserve.kernels import triton_mla  # imported on the GPU path only

        return triton_mla.mla_attention(query, k_cache, v_cache, meta, scale, kv_lora_rank)
    if meta.decode_only:
        return _decode(query, k_cache, v_cache, meta, scale, kv_lora_rank)
    out = query.new_empty(*query.shape[:2], kv_lora_rank)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        rows = gather_latents(k_cache, v_cache, meta.block_tables[i], seq_len).to(query.dtype)
        q = query[start : start + q_len].transpose(0, 1)  # [H, q_len, R + P]
        # Query row j sits at position seq_len - q_len + j and sees keys 0..that position.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = q_pos[:, None] >= torch.arange(seq_len, device=query.device)[None, :]
        o = _attend(q, rows[None], mask, scale, kv_lora_rank)  # [H, q_len, R]
        out[start : start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


def _decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            meta: AttentionMetadata, scale: float, kv_lora_rank: int) -> torch.Tensor:
    """All sequences at once when each has one query row: gather, pad, mask, one product."""
    num_seqs, max_len = meta.num_seqs, meta.max_seq_len
    block_size, half = k_cache.shape[1], k_cache.shape[3]
    max_blocks = -(-max_len // block_size)
    tables = meta.block_tables[:num_seqs, :max_blocks].reshape(-1)  # [B * nb]
    rows = torch.cat((k_cache.index_select(0, tables), v_cache.index_select(0, tables)), dim=-1)
    rows = rows.view(num_seqs, -1, 2 * half)[:, :max_len].to(query.dtype)  # [B, L, R + P]
    lens = meta.seq_lens[:num_seqs].to(torch.long)
    mask = torch.arange(max_len, device=query.device)[None, :] < lens[:, None]  # [B, L]
    return _attend(query, rows, mask[:, None, :], scale, kv_lora_rank)  # [B, H, R]


def _attend(q: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor, scale: float,
            kv_lora_rank: int) -> torch.Tensor:
    """q [B, Lq, R + P] against rows [B, L, R + P] (mask broadcastable to [B, Lq, L], True:
    visible): scores scaled, masked, a float32 softmax cast back, times the rows' c_kv."""
    scores = torch.matmul(q, rows.transpose(-1, -2)) * scale  # [B, Lq, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, rows[..., :kv_lora_rank])  # [B, Lq, R]
