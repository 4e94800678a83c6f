"""The PyTorch references of norm, rotary and activation against transformers' own code."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from meshserve.kernels.activation import silu_and_mul
from meshserve.kernels.norm import fused_add_rms_norm, rms_norm
from meshserve.kernels.rotary import (
    MropeRotaryEmbedding,
    RotaryEmbedding,
    apply_rotary,
    compute_inv_freq,
    mrope_cos_sin,
)
from meshserve.shared.errors import ModelLoadError

GEN = torch.Generator().manual_seed(1234)


def _randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN).to(dtype)


def _hf_norm(weight: torch.Tensor, eps: float) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(weight.shape[0], eps=eps).to(weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7, 64), (5, 4, 16), (1, 576)])
def test_rms_norm_equals_llama_rms_norm(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = 3 * _randn(*shape, dtype=dtype)
    weight = (1 + 0.5 * _randn(shape[-1])).to(dtype)
    want = _hf_norm(weight, 1e-5)(x)
    got = rms_norm(x, weight, 1e-5)
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_equals_add_then_norm(dtype: torch.dtype) -> None:
    x, residual = _randn(9, 48, dtype=dtype), _randn(9, 48, dtype=dtype)
    weight = (1 + 0.5 * _randn(48)).to(dtype)
    normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(new_residual, residual + x, rtol=0, atol=0)
    torch.testing.assert_close(normed, _hf_norm(weight, 1e-6)(residual + x), rtol=0, atol=0)
    # The inputs are not modified.
    assert not torch.equal(new_residual, residual)


def test_rms_norm_rejects_mismatched_weight() -> None:
    with pytest.raises(AssertionError, match="norm weight"):
        rms_norm(_randn(3, 8), _randn(7), 1e-6)


ROPE_CASES: dict[str, dict[str, Any] | None] = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "linear-old-key": {"type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    "yarn-betas": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256,
                   "beta_fast": 16, "beta_slow": 2, "truncate": False},
}


def _hf_rotary(head_dim: int, theta: float, scaling: dict[str, Any] | None,
               max_pos: int) -> LlamaRotaryEmbedding:
    params = {"rope_theta": theta, **(scaling or {"rope_type": "default"})}
    if "type" in params:
        params["rope_type"] = params.pop("type")
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=max_pos, rope_parameters=params)
    return LlamaRotaryEmbedding(config)


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rotary_matches_transformers(case: str) -> None:
    head_dim, theta, max_pos = 64, 500000.0, 4096
    scaling = ROPE_CASES[case]
    hf = _hf_rotary(head_dim, theta, scaling, max_pos)
    inv_freq, attention_scaling = compute_inv_freq(head_dim, theta, scaling)
    torch.testing.assert_close(inv_freq, hf.inv_freq, rtol=0, atol=0)
    assert attention_scaling == pytest.approx(hf.attention_scaling)

    rope = RotaryEmbedding(head_dim, head_dim, max_pos, theta, scaling)
    positions = torch.cat([torch.tensor([0, 1, 4095, 3000]),
                           torch.randint(0, max_pos, (12,), generator=GEN)])
    q, k = _randn(16, 8, head_dim), _randn(16, 2, head_dim)
    got_q, got_k = apply_rotary(q, k, positions, rope.cos_sin_cache)
    cos, sin = hf(q, positions[None])  # [1, T, D]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          cos, sin)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


def test_rotary_in_bfloat16_matches_transformers() -> None:
    head_dim, theta = 32, 10000.0
    hf = _hf_rotary(head_dim, theta, None, 512)
    rope = RotaryEmbedding(head_dim, head_dim, 512, theta).to(torch.bfloat16)
    positions = torch.arange(100, 140)
    q, k = _randn(40, 4, head_dim, dtype=torch.bfloat16), _randn(40, 4, head_dim,
                                                                 dtype=torch.bfloat16)
    got_q, got_k = rope(positions, q, k)
    cos, sin = hf(q, positions[None])  # already cast to bfloat16, as in the HF model
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          cos, sin)
    assert got_q.dtype == torch.bfloat16
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=0, atol=0)


def test_mrope_matches_transformers_qwen2_5_vl() -> None:
    """Positions [3, T] rotate each mrope_section run of pairs by its own position, as
    Qwen2.5-VL's text rotary; positions [T] are the three equal; the cache write with it."""
    from transformers import Qwen2_5_VLTextConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

    head_dim, theta, section = 32, 1000000.0, (4, 6, 6)
    config = Qwen2_5_VLTextConfig(hidden_size=head_dim * 4, num_attention_heads=4,
                                  max_position_embeddings=256, rope_parameters={
                                      "rope_type": "default", "rope_theta": theta,
                                      "mrope_section": list(section)})
    hf = Qwen2_5_VLRotaryEmbedding(config)
    rope = MropeRotaryEmbedding(head_dim, head_dim, 256, theta, None, section)
    positions = torch.randint(0, 256, (3, 10), generator=GEN)
    q, k, v = _randn(10, 4, head_dim), _randn(10, 2, head_dim), _randn(10, 2, head_dim)
    k_cache, v_cache = torch.zeros(2, 8, 2, head_dim), torch.zeros(2, 8, 2, head_dim)
    slots = torch.arange(3, 13)
    got_q, got_k = rope.rotate_and_write_kv(positions, q, k, v, k_cache, v_cache, slots)
    cos, sin = hf(q, positions[:, None])  # [1, T, D]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          cos, sin)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    assert torch.equal(k_cache.flatten(0, 1)[3:13], got_k)
    assert torch.equal(v_cache.flatten(0, 1)[3:13], v)
    equal = positions[1]
    plain_q, plain_k = rope(equal, q, k)
    three_q, three_k = rope(equal.expand(3, -1), q, k)
    assert torch.equal(plain_q, three_q) and torch.equal(plain_k, three_k)
    assert torch.equal(mrope_cos_sin(rope.cos_sin_cache, equal.expand(3, -1), section),
                       rope.cos_sin_cache[equal])


def test_partial_rotary_rotates_only_the_leading_dims() -> None:
    head_dim, rotary_dim, theta = 64, 32, 10000.0
    hf = _hf_rotary(rotary_dim, theta, None, 256)
    rope = RotaryEmbedding(head_dim, rotary_dim, 256, theta)
    positions = torch.randint(0, 256, (10,), generator=GEN)
    q, k = _randn(10, 4, head_dim), _randn(10, 2, head_dim)
    got_q, got_k = rope(positions, q, k)
    cos, sin = hf(q, positions[None])
    want_q, want_k = apply_rotary_pos_emb(q[..., :rotary_dim].transpose(0, 1)[None],
                                          k[..., :rotary_dim].transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(got_q[..., :rotary_dim], want_q[0].transpose(0, 1))
    torch.testing.assert_close(got_k[..., :rotary_dim], want_k[0].transpose(0, 1))
    torch.testing.assert_close(got_q[..., rotary_dim:], q[..., rotary_dim:], rtol=0, atol=0)
    torch.testing.assert_close(got_k[..., rotary_dim:], k[..., rotary_dim:], rtol=0, atol=0)


@pytest.mark.parametrize("scaling, field", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_type"),
    ({"rope_type": "longrope", "factor": 2.0}, "original_max_position_embeddings"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
      "original_max_position_embeddings": 8192}, "high_freq_factor"),
    ({"rope_type": "linear"}, "factor"),
])
def test_unsupported_or_incomplete_rope_scaling_is_rejected(scaling: dict[str, Any],
                                                            field: str) -> None:
    with pytest.raises(ModelLoadError, match=f"rope_scaling.{field}"):
        RotaryEmbedding(64, 64, 128, 10000.0, scaling)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_transformers_silu(dtype: torch.dtype) -> None:
    x = 4 * _randn(11, 2 * 96, dtype=dtype)
    gate, up = x[:, :96], x[:, 96:]
    want = ACT2FN["silu"](gate) * up
    got = silu_and_mul(x)
    assert got.shape == (11, 96)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
