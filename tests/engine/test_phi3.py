"""Phi-3 (`Phi3ForCausalLM`) against transformers on the same weights, through the engine.

Two tiny folders written by transformers (tests/tiny_models.py): plain RoPE, and LongRoPE with
partial rotary (PHI3_LONGROPE: Phi-4-mini's layout, original_max_position_embeddings 64).

transformers 5.24 picks LongRoPE's short or long factors per forward call by the call's largest
position, and its `generate` re-encodes the whole sequence once it grows past 64 tokens
(Phi3ForCausalLM.prepare_inputs_for_generation drops the cache); meshserve picks per position
(kernels/rotary.py). They agree while prompt + output stay within 64 tokens; past that the
reference is transformers' model called with its cache in pieces split at 64 (`hf_reference`,
`hf_greedy_pieces`), which rotates each position as meshserve does.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_engine_vs_hf import (
    GREEDY,
    MAX_NEW,
    check_greedy,
    check_logprobs,
    check_preemption,
    hf_setup,
    make_engine,
    run_all,
    tokens_of,
)
from tiny_models import PHI3_LONGROPE, build_tiny_model
from transformers import AutoConfig, DynamicCache
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from meshserve.kernels.rotary import RotaryEmbedding
from meshserve.services.worker.models.config import ModelConfig
from meshserve.shared.errors import ModelLoadError

SETUPS = {"phi3": {}, "phi3-longrope": PHI3_LONGROPE}
ORIGINAL_MAX = PHI3_LONGROPE["original_max_position_embeddings"]


@pytest.fixture(scope="module", params=sorted(SETUPS))
def phi3_setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(folder, transformers model, prompts, meshserve's expected greedy tokens)."""
    folder, hf, prompts, expected = hf_setup("phi3", tmp_path_factory, **SETUPS[request.param])
    if request.param == "phi3-longrope":  # sequences past 64 tokens: transformers in pieces
        expected = [hf_greedy_pieces(hf, p, MAX_NEW) if len(p) + MAX_NEW > ORIGINAL_MAX
                    else want for p, want in zip(prompts, expected)]
        assert any(len(p) > ORIGINAL_MAX for p in prompts)
        assert any(len(p) <= ORIGINAL_MAX < len(p) + MAX_NEW for p in prompts)
    return folder, hf, prompts, expected


def hf_reference(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' logits [L, V] of `ids`, read in two calls split at original_max (one call
    when shorter): LongRoPE then rotates each position as meshserve does."""
    tensor = torch.tensor([ids])
    with torch.no_grad():
        if len(ids) <= ORIGINAL_MAX:
            return hf(tensor).logits[0].float()
        cache = DynamicCache(config=hf.config)
        first = hf(tensor[:, :ORIGINAL_MAX], past_key_values=cache, use_cache=True).logits
        rest = hf(tensor[:, ORIGINAL_MAX:], past_key_values=cache, use_cache=True).logits
    return torch.cat([first, rest], dim=1)[0].float()


def hf_greedy_pieces(hf: torch.nn.Module, prompt: list[int], max_new: int) -> list[int]:
    """Greedy tokens of transformers' model with its cache: the prompt in one call, or two
    split at original_max when longer (`hf_reference`), then one token per call."""
    cache = DynamicCache(config=hf.config)
    ids = torch.tensor([prompt])
    out: list[int] = []
    with torch.no_grad():
        if len(prompt) > ORIGINAL_MAX:
            hf(ids[:, :ORIGINAL_MAX], past_key_values=cache, use_cache=True)
        logits = hf(ids[:, ORIGINAL_MAX if len(prompt) > ORIGINAL_MAX else 0:],
                    past_key_values=cache, use_cache=True).logits
        for _ in range(max_new):
            out.append(int(logits[0, -1].argmax()))
            logits = hf(torch.tensor([[out[-1]]]), past_key_values=cache, use_cache=True).logits
    return out


def test_greedy_batched_with_prefix_hits_matches_transformers(phi3_setup) -> None:
    folder, _, prompts, expected = phi3_setup
    check_greedy(make_engine(folder, max_num_batched_tokens=40), prompts, expected)


def test_greedy_unchunked_matches_transformers(phi3_setup) -> None:
    folder, _, prompts, expected = phi3_setup
    engine = make_engine(folder, enable_chunked_prefill=False, max_num_batched_tokens=4096)
    outputs = run_all(engine, prompts, GREEDY)
    assert [tokens_of(outputs[f"r{i}"]) for i in range(len(prompts))] == expected


def test_preemption_keeps_outputs_equal(phi3_setup) -> None:
    folder, _, prompts, expected = phi3_setup
    engine = make_engine(folder, num_kv_blocks=10, max_num_batched_tokens=64)
    check_preemption(engine, prompts, expected)


def test_logprobs_match_transformers(phi3_setup) -> None:
    folder, hf, prompts, _ = phi3_setup
    check_logprobs(make_engine(folder, max_num_batched_tokens=48), prompts[2:7],
                   lambda tokens: hf_reference(hf, tokens))


def test_longrope_table_matches_transformers(tmp_path) -> None:
    """Rows below original_max equal transformers' short-factor cos/sin, the rest its long ones
    (a call whose largest position is past original_max), attention factor included."""
    folder = build_tiny_model(tmp_path / "phi3", "phi3", **PHI3_LONGROPE)
    hf_config = AutoConfig.from_pretrained(folder)
    config = ModelConfig.from_hf(hf_config)
    assert (config.rotary_dim, config.rope_scaling["factor"]) == (12, 4.0)
    ours = RotaryEmbedding(config.head_dim, config.rotary_dim, config.max_position_embeddings,
                           config.rope_theta, config.rope_scaling).cos_sin_cache
    hf_rope = Phi3RotaryEmbedding(hf_config)
    assert hf_rope.attention_scaling == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)))
    x = torch.zeros(1, dtype=torch.float32)
    for first, last in ((0, ORIGINAL_MAX), (ORIGINAL_MAX, 200)):
        positions = torch.arange(first, last)[None]
        cos, sin = hf_rope(x, positions)  # [1, P, 12] each: the 6 frequencies twice
        want = torch.cat([cos[0, :, :6], sin[0, :, :6]], dim=-1)
        torch.testing.assert_close(ours[first:last], want, rtol=0, atol=1e-6)


def test_phi3_config_fields() -> None:
    """The legacy layout (rope_scaling "su", top-level lengths and partial factor) and
    Phi-3-mini-4k's sliding window, applied on every layer (the context is not capped)."""
    base = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 64, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
            "max_position_embeddings": 256}
    config = ModelConfig.from_hf({
        **base, "original_max_position_embeddings": 64, "partial_rotary_factor": 0.75,
        "rope_scaling": {"type": "su", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6}})
    assert config.rotary_dim == 12
    assert config.rope_scaling == {"short_factor": [1.0] * 6, "long_factor": [2.0] * 6,
                                   "rope_type": "longrope", "factor": 4.0,
                                   "original_max_position_embeddings": 64}
    window = ModelConfig.from_hf({**base, "max_position_embeddings": 4096,
                                  "sliding_window": 2047})
    assert (window.max_model_len, window.kv_window, window.rotary_dim) == (4096, 2047, 16)
    with pytest.raises(ModelLoadError, match="short_factor has 8 entries, expected 6"):
        ModelConfig.from_hf({**base, "partial_rotary_factor": 0.75, "rope_scaling": {
            "type": "longrope", "original_max_position_embeddings": 64,
            "short_factor": [1.0] * 8, "long_factor": [2.0] * 6}})
