"""Paged attention and the KV-cache write, over block tables.

The KV cache of one layer is a pair of tensors `k_cache`, `v_cache`, each
[num_blocks, block_size, num_kv_heads, head_dim]. A token's KV lives at the
flat slot `block_id * block_size + offset`. One step holds a ragged batch of
sequences flattened into T tokens: sequence i owns query rows
`query_start_loc[i]:query_start_loc[i+1]`, which are the last positions of its
`seq_lens[i]` tokens of context. Prefill, chunked prefill over a cached prefix,
and decode are the same operation with different query lengths.

The PyTorch code here is the reference and the CPU path; GPU kernels plug in
behind `write_kv` and `paged_attention` with the same signatures.

An FP8 cache (float8_e4m3fn or float8_e5m2, `--kv-cache-dtype fp8*`) stores K and V cast
to FP8 with a per-tensor scale of 1.0, as vLLM does when a checkpoint brings no KV scales:
writes saturate to the format's range, reads widen to the query's dtype (the Triton kernel
multiplies 16-bit queries with the widened values in float16: see triton_attention.py).

Two per-layer options serve Gemma 2/3 (models/gemma.py): `window` W, sliding-window attention
where the query at position p reads keys p-W+1..p (as transformers' `sliding_window_overlay`),
and `softcap` c, scores s -> tanh(s / c) * c before the mask and softmax. A third serves gpt-oss
(models/gpt_oss.py): `sinks` [Hq], one learned logit per query head that joins the softmax's
denominator and carries no value, so a head can attend to "nothing" (each row's weights then
sum to less than 1). The Triton kernel has all three; the fused fresh-prefill path has none,
so such steps go to the Triton kernel (a window no sequence of the step reaches past is
dropped first: plain causal attention is then the same).

A step may also let query rows read keys after their own position (`meta.lookahead`): Gemma 3's
image rows attend to every row of their image during prefill (transformers' `token_type_ids`
mask), so a row of an image reads the keys up to the image's last. Such steps go to the
reference or the Triton kernel; the window stays measured from the query's own position.

With a window, no path reads a block-table entry of a block wholly before the window of the
first query of its sequence (or of its query block, in the Triton kernel): when every layer
of a model slides, the KV cache manager frees those blocks as the sequence advances and
their entries hold a placeholder (services/worker/engine/kv_cache_manager.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step. Built once per step by the model runner."""

    slot_mapping: torch.Tensor  # [T] int64; -1 marks a token whose KV is not written
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # [T] int32: keys past its own position each query row also reads (the rest of a
    # bidirectional image's rows; capped at its sequence's end); None: none, causal.
    lookahead: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T]
) -> None:
    """Store each token's key and value at its slot (skipping slots < 0)."""
    _check_kv(key, value, k_cache, v_cache, slot_mapping)
    if key.is_cuda:
        from meshserve.kernels import triton_attention  # imported on the GPU path only

        triton_attention.write_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    write_kv_reference(key, value, k_cache, v_cache, slot_mapping)


def write_kv_reference(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    for cache, new in ((k_cache, key), (v_cache, value)):
        rows = to_cache_dtype(new[valid], cache.dtype)  # [T', Hkv, D]
        if cache.dtype in FP8_KV_DTYPES:  # no index_copy_ for FP8 on CPU: copy the bytes
            cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
        cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, rows)


FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache's dtype; into FP8 with saturation (scale 1.0) as the GPU kernels do."""
    if dtype in FP8_KV_DTYPES:
        limit = torch.finfo(dtype).max
        return x.float().clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def _widen(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached K or V read back for attention in the query's dtype (FP8 is widened)."""
    return x.to(dtype) if x.dtype in FP8_KV_DTYPES else x


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    *,
    key: torch.Tensor | None = None,  # [T, Hkv, D], this step's keys (already in the cache)
    value: torch.Tensor | None = None,  # [T, Hkv, D]
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq], one logit per query head
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of each query row over its sequence's cached context.

    `key`/`value` are optional copies of this step's new KV; a backend may use
    them for sequences with no cached prefix instead of reading the cache.
    `window`: each query reads only its last `window` positions (None: all);
    `softcap`: scores soft-capped to (-softcap, softcap) (None: not capped);
    `sinks`: a logit per query head added to each row's softmax denominator (None: none).
    """
    assert query.dim() == 3 and k_cache.dim() == 4, (
        f"query must be [T, Hq, D] and caches [N, bs, Hkv, D], got {tuple(query.shape)} "
        f"and {tuple(k_cache.shape)}")
    assert query.shape[1] % k_cache.shape[2] == 0, (
        f"query heads {query.shape[1]} must be a multiple of KV heads {k_cache.shape[2]}")
    assert sinks is None or tuple(sinks.shape) == (query.shape[1],), (
        f"sinks must be [Hq={query.shape[1]}], got {tuple(sinks.shape)}")
    if window is not None and meta.max_seq_len <= window:
        window = None  # every key is inside every query's window
    if query.is_cuda:
        # PyTorch's fused attention has none of the options, and its FlashAttention and
        # cuDNN kernels take half precision only (float32 with grouped-query attention has
        # no fused kernel at all).
        plain = (window is None and softcap is None and sinks is None
                 and meta.lookahead is None and query.dtype in _FUSED_DTYPES)
        if plain and key is not None and value is not None and _fresh_prefill(meta):
            return fresh_prefill_attention(query, key, value, meta, scale)
        from meshserve.kernels import triton_attention  # imported on the GPU path only

        return triton_attention.paged_attention(query, k_cache, v_cache, meta, scale,
                                                window=window, softcap=softcap, sinks=sinks)
    if meta.decode_only and meta.lookahead is None:
        return decode_attention_reference(query, k_cache, v_cache, meta, scale,
                                          window=window, softcap=softcap, sinks=sinks)
    return paged_attention_reference(query, k_cache, v_cache, meta, scale, key=key, value=value,
                                     window=window, softcap=softcap, sinks=sinks)


# The dtypes of the fresh-prefill path (PyTorch's fused kernels).
_FUSED_DTYPES = (torch.float16, torch.bfloat16)

# At most this many sequences go through the per-sequence fresh-prefill path in one step.
_MAX_FRESH_PREFILL_SEQS = 4


def _fresh_prefill(meta: AttentionMetadata) -> bool:
    """A step of a few whole prompts with nothing cached: the step's own KV is all there is."""
    return (not meta.decode_only and meta.num_seqs <= _MAX_FRESH_PREFILL_SEQS
            and meta.query_lens_cpu == meta.seq_lens_cpu)


def fresh_prefill_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    meta: AttentionMetadata, scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of whole prompts over their own KV with PyTorch's fused attention
    (FlashAttention or cuDNN's on CUDA), which beats the paged kernel when no KV comes from
    the cache.

    The [T, H, D] tensors go in as [1, H, L, D] views with grouped-query attention enabled: no
    copies of q, and no KV heads repeated. An output that is not already [T, Hq, D] and
    contiguous is made so by the one concatenation.
    """
    seqs = []
    start = 0
    for q_len in meta.query_lens_cpu:
        rows = slice(start, start + q_len)
        q, k, v = (t[rows].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        with _fused_backends(query.is_cuda):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                               enable_gqa=k.shape[1] != q.shape[1])
        seqs.append(o[0].transpose(0, 1))  # [L, Hq, D]
        start += q_len
    if len(seqs) == 1 and seqs[0].is_contiguous():
        return seqs[0]
    return torch.cat(seqs)


@contextlib.contextmanager
def _fused_backends(on_gpu: bool) -> Iterator[None]:
    """On a GPU, prefer FlashAttention, then cuDNN's, and never fall back to the unfused
    (quadratic memory) kernel.

    cuDNN's is the faster on a shape it has seen (H100, Llama-3.1-8B shape, one prompt per
    step: 204 against 233 ms at 8000 tokens, 48 against 51 ms at 2048), but it builds a plan
    for every new sequence length, which costs about 40 ms a step: a prompt of a length not
    seen before took 262 ms at 8001 tokens, 91 at 2049, 50 at 301 and 46 at 11 (flash: 236,
    52, 11 and 8). Served prompts rarely repeat a length, so flash is the faster in service
    (loadtest/first_prefill_probe.py, loadtest/reports/README.md)."""
    if not on_gpu:
        yield
        return
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                      SDPBackend.EFFICIENT_ATTENTION], set_priority=True):
        yield


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                    start: int = 0) -> torch.Tensor:
    """Cached tokens start..seq_len - 1 of one sequence, `start` a block multiple (the table
    entries before it are not read): [seq_len - start, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[start // block_size:num_blocks])  # [nb, bs, ...]
    return blocks.view(-1, cache.shape[2], cache.shape[3])[:seq_len - start]


def paged_attention_reference(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, *,
    key: torch.Tensor | None = None, value: torch.Tensor | None = None,
    window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence at a time; any mix of prefill, chunked prefill and decode (and query
    rows reading ahead, `meta.lookahead`)."""
    out = torch.empty_like(query)
    num_q_heads = query.shape[1]
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        q = query[start : start + q_len].transpose(0, 1)  # [Hq, q_len, D]
        ahead = None if meta.lookahead is None else meta.lookahead[start : start + q_len]
        k_start = 0  # position of the first key read
        if seq_len == q_len and key is not None and value is not None:
            # No cached prefix: plain causal attention over this step's own KV.
            k = key[start : start + q_len].transpose(0, 1)  # [Hkv, q_len, D]
            v = value[start : start + q_len].transpose(0, 1)
            mask = None
        else:
            if window is not None:  # from the block of the first query's first key
                block_size = k_cache.shape[1]
                k_start = max(seq_len - q_len - window + 1, 0) // block_size * block_size
            k = _widen(_gather_context(k_cache, meta.block_tables[i], seq_len, k_start),
                       query.dtype).transpose(0, 1)
            v = _widen(_gather_context(v_cache, meta.block_tables[i], seq_len, k_start),
                       query.dtype).transpose(0, 1)
            # Query row j sits at position seq_len - q_len + j and sees keys 0..that position.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            mask = q_pos[:, None] >= torch.arange(seq_len, device=query.device)[None, :]
        eager = softcap is not None or sinks is not None  # (beyond PyTorch's fused attention)
        if window is not None or eager or ahead is not None:
            # Explicit mask either way (the fresh branch's keys are positions 0..seq_len too).
            mask = _window_causal_mask(torch.arange(seq_len - q_len, seq_len, device=query.device),
                                       torch.arange(k_start, seq_len, device=query.device), window,
                                       ahead)
        groups = num_q_heads // k.shape[0]
        if groups > 1:  # k, v: [Hkv, L, D] -> [Hq, L, D]
            k = k.repeat_interleave(groups, dim=0)
            v = v.repeat_interleave(groups, dim=0)
        if eager:
            assert mask is not None
            o = eager_attention(q.to(k.dtype), k, v, mask, scale, softcap=softcap,
                                sinks=None if sinks is None else sinks[:, None, None])
        else:
            o = F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=mask,
                                               is_causal=mask is None, scale=scale)
        out[start : start + q_len] = o.transpose(0, 1).to(out.dtype)
        start += q_len
    return out


def decode_attention_reference(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, *,
    window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """All sequences at once when each has one query token: gather, pad, mask, one SDPA.
    With a window, only the blocks holding each query's window are gathered."""
    num_seqs, max_len = meta.num_seqs, meta.max_seq_len
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    lens = meta.seq_lens[:num_seqs].to(torch.long)
    if window is None:
        max_blocks = (max_len + block_size - 1) // block_size
        tables = meta.block_tables[:num_seqs, :max_blocks].reshape(-1)  # [B * nb]
        k_pos = torch.arange(max_len, device=query.device)[None, :]  # [1, L]
    else:
        tables, k_pos = _window_blocks(meta.block_tables[:num_seqs], lens, window, block_size)
        max_len = k_pos.shape[1]
    # index_select + one contiguous copy is far cheaper on CPU than advanced indexing
    # followed by attention over a strided view.
    k = _widen(k_cache.index_select(0, tables),
               query.dtype).view(num_seqs, -1, num_kv_heads, head_dim)[:, :max_len]
    v = _widen(v_cache.index_select(0, tables),
               query.dtype).view(num_seqs, -1, num_kv_heads, head_dim)[:, :max_len]
    k = k.transpose(1, 2).contiguous()  # [B, Hkv, L, D]
    v = v.transpose(1, 2).contiguous()
    groups = query.shape[1] // num_kv_heads
    q = query.view(num_seqs, num_kv_heads, groups, head_dim)  # [B, Hkv, G, D]
    mask = k_pos < lens[:, None]  # [B, L]
    if window is not None:  # the query sits at position len - 1
        mask &= k_pos >= lens[:, None] - window
    if softcap is not None or sinks is not None:
        head_sinks = None if sinks is None else sinks.view(num_kv_heads, groups, 1)  # [Hkv, G, 1]
        o = eager_attention(q.to(k.dtype), k, v, mask[:, None, None, :], scale, softcap=softcap,
                            sinks=head_sinks)
    else:
        o = F.scaled_dot_product_attention(
            q.to(k.dtype), k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return o.reshape(num_seqs, -1, head_dim).to(query.dtype)


def _window_blocks(block_tables: torch.Tensor, lens: torch.Tensor, window: int,
                   block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The table entries of the blocks holding each decode query's window, from the block of
    its first key (len - window), padded with the sequence's last block (masked by position):
    ([B * nb] block ids, [B, nb * block_size] the positions of their keys)."""
    num_blocks = min((window - 1 + block_size - 1) // block_size + 1, block_tables.shape[1])
    first = (lens - window).clamp(min=0) // block_size  # [B]
    index = first[:, None] + torch.arange(num_blocks, device=lens.device)[None, :]  # [B, nb]
    last = (lens[:, None] - 1) // block_size
    tables = block_tables.gather(1, torch.minimum(index, last).to(torch.long)).reshape(-1)
    k_pos = (first[:, None] * block_size
             + torch.arange(num_blocks * block_size, device=lens.device)[None, :])
    return tables, k_pos


def _window_causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None,
                        ahead: torch.Tensor | None = None) -> torch.Tensor:
    """[Lq, Lk] bool: key position j is visible to query position p when j <= p (p + a with
    `ahead` a [Lq] for the row) and, with a window W, j > p - W."""
    ends = q_pos if ahead is None else q_pos + ahead.to(q_pos.device, torch.long)
    mask = ends[:, None] >= k_pos[None, :]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def eager_attention(
    q: torch.Tensor,  # [..., Lq, D]
    k: torch.Tensor,  # [..., Lk, D]
    v: torch.Tensor,  # [..., Lk, D]
    mask: torch.Tensor,  # bool, broadcastable to [..., Lq, Lk]; True: visible
    scale: float, *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # a logit per head, broadcastable to [..., Lq, 1]
) -> torch.Tensor:  # [..., Lq, D]
    """Attention written out, in transformers' order of operations: scale, soft-cap (Gemma 2's
    `eager_attention_forward`), mask, then a float32 softmax (over the scores and, with
    `sinks`, one more column holding the head's sink logit, dropped after the softmax as
    gpt-oss's `eager_attention_forward` drops it), cast, @ v."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [..., Lq, Lk]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)  # [..., Lq, 1]
        probs = torch.softmax(torch.cat((scores, column), dim=-1), dim=-1,
                              dtype=torch.float32)[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)


def _check_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    assert key.shape == value.shape, f"key {tuple(key.shape)} != value {tuple(value.shape)}"
    assert k_cache.shape == v_cache.shape, "k_cache and v_cache shapes differ"
    assert key.shape[1:] == k_cache.shape[2:], (
        f"key heads/dim {tuple(key.shape[1:])} do not match cache {tuple(k_cache.shape[2:])}")
    assert slot_mapping.shape[0] == key.shape[0], (
        f"slot_mapping has {slot_mapping.shape[0]} slots for {key.shape[0]} tokens")
