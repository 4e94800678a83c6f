"""Rotary position embedding (RoPE) in the NeoX / Hugging Face `rotate_half` layout.

`RotaryEmbedding` holds one table `cos_sin_cache` [max_position, rotary_dim]: for position p the
first rotary_dim/2 columns are cos(p * inv_freq) and the last rotary_dim/2 are sin(p * inv_freq),
already multiplied by the scaling's attention factor. Each step gathers the rows of its positions,
so any mix of prefill, chunked prefill and decode positions is one indexing operation. The rotary
part may be the first rotary_dim < head_dim dims of each head (partial_rotary_factor, Phi-4-mini);
the rest pass through.

The inverse frequencies follow `transformers.modeling_rope_utils` operation for operation, so the
table equals what Hugging Face models compute on the fly to float32 precision. Supported scaling
types: default, linear, llama3, yarn, longrope. Dynamic NTK rescales with the length of the longest
sequence in the batch, which a shared cache of a batching server cannot reproduce; it is rejected.

LongRoPE (Phi-3, Phi-3.5, Phi-4-mini) has two sets of frequencies. transformers 5.24 picks one per
forward call by that call's largest position (`longrope_frequency_update`): the long set when
max(position) + 1 > original_max_position_embeddings, else the short set, for every token of the
call; and its Phi-3 `generate` drops the cache and re-encodes the whole sequence with the long set
once it grows past original_max_position_embeddings. meshserve picks per position instead: rows
below original_max_position_embeddings come from the short set, the rest from the long set
(`rope_table`), so a position's rotation never depends on the batch, the chunking or the prefix
cache. That equals transformers' `generate` while prompt + output stay within
original_max_position_embeddings tokens. Past it, it equals transformers' model run with its cache
in pieces split at original_max_position_embeddings, not `generate`: the positions below it keep
the short set.

M-RoPE (Qwen2-VL, Qwen2.5-VL; `MropeRotaryEmbedding`) gives each token three positions (time,
height, width) and splits the rotary pairs into `mrope_section` runs, each rotated by one of the
three. Where the three are equal (text, decode) that is plain RoPE at that position, so only steps
holding image tokens pass positions [3, T]: their rows of the one table are recombined per step
(`mrope_cos_sin`) and rotated as plain RoPE of positions 0..T-1 over that step table.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from meshserve.kernels.attention import write_kv
from meshserve.shared.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_type_of(rope_scaling: dict[str, Any] | None) -> str:
    """The scaling type named by a rope_scaling dict (`rope_type`, or the older `type`)."""
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))


def compute_inv_freq(
    rotary_dim: int, base: float, rope_scaling: dict[str, Any] | None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim/2] (float32) and the attention factor for cos/sin."""
    rope_type = rope_type_of(rope_scaling)
    # Same expression as transformers: float32 exponents, float32 power of a Python float base.
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base ** exponents)
    scaling = rope_scaling or {}
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(_field(scaling, "factor")), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(rotary_dim, base, scaling)
    if rope_type == "longrope":  # the short set (positions below original_max; see rope_table)
        short, _, attention_factor = longrope_inv_freqs(rotary_dim, base, scaling)
        return short, attention_factor
    raise ModelLoadError(
        f"rope_scaling.rope_type {rope_type!r} is not supported; supported types are "
        f"{', '.join(SUPPORTED_ROPE_TYPES)}", param="rope_scaling.rope_type")


def _field(scaling: dict[str, Any], name: str) -> Any:
    if scaling.get(name) is None:
        raise ModelLoadError(
            f"rope_scaling of type {rope_type_of(scaling)!r} needs the field rope_scaling.{name}",
            param=f"rope_scaling.{name}")
    return scaling[name]


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 / 3.2: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor = float(_field(scaling, "factor"))
    low_freq_factor = float(_field(scaling, "low_freq_factor"))
    high_freq_factor = float(_field(scaling, "high_freq_factor"))
    old_context_len = _field(scaling, "original_max_position_embeddings")
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    dim: int, base: float, scaling: dict[str, Any],
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, scale attention by mscale."""
    factor = float(_field(scaling, "factor"))
    original_max = _field(scaling, "original_max_position_embeddings")
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq = (inv_freq_interpolation * (1 - extrapolation_factor)
                + inv_freq_extrapolation * extrapolation_factor)
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def longrope_inv_freqs(
    rotary_dim: int, base: float, scaling: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """LongRoPE: (short, long) inverse frequencies [rotary_dim/2] and the attention factor,
    as transformers' `_compute_longrope_parameters` computes them. `factor` is required here:
    the config reader fills in max_position_embeddings / original_max_position_embeddings."""
    original_max = int(_field(scaling, "original_max_position_embeddings"))
    factor = float(_field(scaling, "factor"))
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0 else
                            math.sqrt(1 + math.log(factor) / math.log(original_max)))
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    sets = []
    for name in ("short_factor", "long_factor"):
        ext_factors = torch.tensor(_field(scaling, name), dtype=torch.float32)
        if tuple(ext_factors.shape) != (rotary_dim // 2,):
            raise ModelLoadError(
                f"rope_scaling.{name} has {ext_factors.numel()} entries, expected "
                f"{rotary_dim // 2} (half the rotary dims)", param=f"rope_scaling.{name}")
        sets.append(1.0 / (ext_factors * base**exponents))
    return sets[0], sets[1], float(attention_factor)


def rope_table(
    rotary_dim: int, base: float, rope_scaling: dict[str, Any] | None, max_position: int,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The [max_position, rotary_dim] float32 cos/sin table of a scaling. LongRoPE: rows below
    original_max_position_embeddings from the short factors, the rest from the long ones."""
    inv_freq, attention_scaling = compute_inv_freq(rotary_dim, base, rope_scaling)
    table = build_cos_sin_cache(inv_freq.to(device), max_position, attention_scaling)
    if rope_scaling is not None and rope_type_of(rope_scaling) == "longrope":
        _, long_inv_freq, _ = longrope_inv_freqs(rotary_dim, base, rope_scaling)
        start = min(int(rope_scaling["original_max_position_embeddings"]), max_position)
        long_table = build_cos_sin_cache(long_inv_freq.to(device), max_position,
                                         attention_scaling)
        table[start:] = long_table[start:]
    return table


def build_cos_sin_cache(
    inv_freq: torch.Tensor, max_position: int, attention_scaling: float = 1.0,
) -> torch.Tensor:
    """[max_position, rotary_dim] float32 table: cos in the first half, sin in the second."""
    positions = torch.arange(max_position, dtype=torch.int64, device=inv_freq.device).float()
    freqs = positions[:, None] * inv_freq[None, :].float()  # [P, rotary_dim/2]
    return torch.cat((freqs.cos() * attention_scaling, freqs.sin() * attention_scaling), dim=-1)


class RotaryEmbedding(nn.Module):
    """Owns the cos/sin table as a non-persistent buffer, so `.to(device, dtype)` moves it.

    Like Hugging Face, the table is computed in float32 and then cast to the model dtype.
    """

    cos_sin_cache: torch.Tensor  # [max_position, rotary_dim]

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float,
                 rope_scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        assert rotary_dim <= head_dim and rotary_dim % 2 == 0, (
            f"rotary_dim {rotary_dim} must be even and at most head_dim {head_dim}")
        self.head_dim, self.rotary_dim, self.max_position = head_dim, rotary_dim, max_position
        self.base, self.rope_scaling = base, rope_scaling
        # Validates the scaling now, so an unsupported type fails at construction.
        compute_inv_freq(rotary_dim, base, rope_scaling)
        self.register_buffer(
            "cos_sin_cache", torch.empty(max_position, rotary_dim), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """(Re)compute the table on the buffer's device and in its dtype (after `to_empty`)."""
        if self.cos_sin_cache.is_meta:
            return
        table = rope_table(self.rotary_dim, self.base, self.rope_scaling, self.max_position,
                           self.cos_sin_cache.device)
        with torch.no_grad():
            self.cos_sin_cache.copy_(table)

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(query, key, positions, self.cos_sin_cache)

    def rotate_and_write_kv(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
        value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (query, key), with the rotated key and the value stored at each token's slot
        of the caches (slots < 0 are skipped): one kernel on a GPU."""
        if query.is_cuda:
            from meshserve.kernels import triton_rotary  # GPU only

            return triton_rotary.apply_rotary_and_write_kv(
                query, key, value, positions, self.cos_sin_cache, k_cache, v_cache,
                slot_mapping)
        query, key = apply_rotary(query, key, positions, self.cos_sin_cache)
        write_kv(key, value, k_cache, v_cache, slot_mapping)
        return query, key


def apply_rotary(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first rotary_dim dims of every head of q and k by each token's position."""
    assert query.dim() == 3 and key.dim() == 3, (
        f"query and key must be [T, H, D], got {tuple(query.shape)} and {tuple(key.shape)}")
    assert positions.shape[0] == query.shape[0] == key.shape[0], (
        f"positions {tuple(positions.shape)} do not match {query.shape[0]} query tokens")
    if query.is_cuda:
        from meshserve.kernels import triton_rotary  # GPU only

        return triton_rotary.apply_rotary(query, key, positions, cos_sin_cache)
    cos, sin = cos_sin_cache[positions].to(query.dtype).chunk(2, dim=-1)  # [T, rotary_dim/2]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin on the rotary part; the rest passes through."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    rotated = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    if 2 * half == x.shape[-1]:
        return torch.cat(rotated, dim=-1)
    return torch.cat((*rotated, x[..., 2 * half :]), dim=-1)


class MropeRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE: positions [T] rotate as plain RoPE (the three positions equal, as the
    runner passes them for text and decode rows); positions [3, T] of (time, height, width)
    rotate each `mrope_section` run of pairs by its own position."""

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float,
                 rope_scaling: dict[str, Any] | None, mrope_section: tuple[int, ...]) -> None:
        super().__init__(head_dim, rotary_dim, max_position, base, rope_scaling)
        assert len(mrope_section) == 3 and sum(mrope_section) == rotary_dim // 2, (
            f"mrope_section {mrope_section} must split the {rotary_dim // 2} rotary pairs in 3")
        self.mrope_section = mrope_section

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return apply_rotary(query, key, positions, self.cos_sin_cache)
        table = mrope_cos_sin(self.cos_sin_cache, positions, self.mrope_section)
        return apply_rotary(query, key, _rows(table), table)

    def rotate_and_write_kv(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
        value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().rotate_and_write_kv(positions, query, key, value, k_cache, v_cache,
                                               slot_mapping)
        table = mrope_cos_sin(self.cos_sin_cache, positions, self.mrope_section)  # [T, rd]
        if query.is_cuda:
            from meshserve.kernels import triton_rotary  # GPU only

            return triton_rotary.apply_rotary_and_write_kv(
                query, key, value, _rows(table), table, k_cache, v_cache, slot_mapping)
        query, key = apply_rotary(query, key, _rows(table), table)
        write_kv(key, value, k_cache, v_cache, slot_mapping)
        return query, key


def mrope_cos_sin(
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]
    positions: torch.Tensor,  # [3, T] int64: time, height, width
    mrope_section: tuple[int, ...],  # pairs rotated by each of the three, summing to rotary_dim/2
) -> torch.Tensor:  # [T, rotary_dim]: each token's cos/sin row
    """Each token's cos/sin row under M-RoPE, as transformers' Qwen2.5-VL recombines them:
    the first mrope_section[0] pairs from the time position's row, the next from the
    height's, the last from the width's (the cos half and the sin half alike)."""
    assert positions.dim() == 2 and positions.shape[0] == 3, (
        f"M-RoPE positions must be [3, T], got {tuple(positions.shape)}")
    rows = cos_sin_cache[positions]  # [3, T, rd]
    owner = torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))  # [rd/2]
    owner = torch.cat((owner, owner)).to(positions.device)  # [rd]: 0 time, 1 height, 2 width
    return rows.gather(0, owner.expand(1, rows.shape[1], -1)).squeeze(0)


def _rows(table: torch.Tensor) -> torch.Tensor:
    """Positions 0..T-1: row t of a per-step table is token t's."""
    return torch.arange(table.shape[0], device=table.device)
