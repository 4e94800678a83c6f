"""Gemma 2 and Gemma 3 (text) against transformers on the same weights.

Tiny random folders written by transformers itself (tests/tiny_models.py, GEMMA_DIMS): 4 layers
mixing sliding-window (window 12 / 8 tokens) and global attention, attention and final logit
soft-capping on (Gemma 3: final only), Gemma 3 with qk-norm and its local RoPE base. Most prompts are longer than the
window. transformers' greedy `generate` and log-softmax are the reference, through the whole
engine: batched and staggered requests, chunked prefill, prefix-cache hits, preemption.
"""

from __future__ import annotations

import pytest
import torch
from test_engine_vs_hf import (
    check_greedy,
    check_logprobs,
    check_preemption,
    hf_reference,
    hf_setup,
    make_engine,
)
from test_models import PagedRunner, hf_logits, load, token_ids

from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.gemma import GemmaCausalLM
from meshserve.shared.errors import ModelLoadError
from meshserve.shared.model_config import max_model_len_of, read_folder

ARCHS = ("gemma2", "gemma3")


@pytest.fixture(scope="module", params=ARCHS)
def gemma_setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    return (request.param, *hf_setup(request.param, tmp_path_factory))


def test_layers_mix_windows_and_context_is_not_capped(gemma_setup) -> None:
    arch, folder, _, _, _ = gemma_setup
    config = load(folder).config
    window = 12 if arch == "gemma2" else 8
    assert config.layer_windows == ((window, None, window, None) if arch == "gemma2"
                                    else (window, window, None, window))
    assert config.max_model_len == 256 == max_model_len_of(read_folder(folder))


def test_model_logits_match_transformers(gemma_setup) -> None:
    _, folder, _, _, _ = gemma_setup
    model = load(folder)
    assert isinstance(model, GemmaCausalLM)
    ids = token_ids(40, seed=3)
    want = hf_logits(folder, ids)
    assert want.std() > 0.5, "reference logits too flat to tell implementations apart"
    runner = PagedRunner(model)  # blocks of 4: windows span blocks
    got = runner.step([(0, ids[:13], 0)]) + runner.step([(0, ids[13:37], 13)])
    got += [runner.step([(0, ids[t : t + 1], t)])[0] for t in range(37, 40)]
    torch.testing.assert_close(torch.cat(got), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("setup", ["chunked", "not-chunked", "no-prefix-cache"])
def test_greedy_batched_with_prefix_hits_matches_transformers(gemma_setup, setup: str) -> None:
    _, folder, _, prompts, expected = gemma_setup
    options: dict[str, object] = {
        "chunked": {"max_num_batched_tokens": 40},
        "not-chunked": {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096},
        "no-prefix-cache": {"enable_prefix_caching": False, "max_num_batched_tokens": 64},
    }[setup]
    check_greedy(make_engine(folder, **options), prompts, expected,
                 stagger=setup == "chunked", prefix_hits=setup == "chunked")


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_preemption_keeps_outputs_equal(gemma_setup, async_scheduling: str) -> None:
    _, folder, _, prompts, expected = gemma_setup
    engine = make_engine(folder, num_kv_blocks=10, max_num_batched_tokens=64,
                         async_scheduling=async_scheduling)
    check_preemption(engine, prompts, expected)


def test_logprobs_match_transformers(gemma_setup) -> None:
    _, folder, hf, prompts, _ = gemma_setup
    check_logprobs(make_engine(folder, max_num_batched_tokens=48), prompts[2:7],
                   hf_reference(hf))


def _config(**changes: object) -> dict[str, object]:
    return {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 6, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 32768,
            "sliding_window": 512, **changes}


def test_hub_style_configs_are_read() -> None:
    """Published configs: Gemma 3's sliding_window_pattern + rope_local_base_freq + rope_scaling
    on the global layers; Gemma 2's alternation without layer_types."""
    gemma3 = ModelConfig.from_hf(_config(
        sliding_window_pattern=6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        hidden_activation="gelu_pytorch_tanh"))
    assert gemma3.layer_windows == (512,) * 5 + (None,)
    assert (gemma3.rope_theta, gemma3.rope_local_theta) == (1_000_000.0, 10_000.0)
    assert gemma3.rope_scaling == {"factor": 8.0, "rope_type": "linear"}
    assert gemma3.max_model_len == 32768 and gemma3.qk_norm
    assert gemma3.attn_logit_softcapping is None  # transformers ignores it in Gemma 3
    gemma2 = ModelConfig.from_hf(_config(architectures=["Gemma2ForCausalLM"], num_hidden_layers=4,
                                         hidden_act="gelu_pytorch_tanh",
                                         attn_logit_softcapping=50.0,
                                         final_logit_softcapping=30.0))
    assert gemma2.layer_windows == (512, None, 512, None) and not gemma2.qk_norm
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (50.0, 30.0)
    assert gemma2.query_pre_attn_scalar == 256.0


@pytest.mark.parametrize("change, named", [
    ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"sliding_window": None}, "sliding_window"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
])
def test_unsupported_gemma_configs_are_refused_by_name(change: dict[str, object],
                                                       named: str) -> None:
    with pytest.raises(ModelLoadError, match=named):
        ModelConfig.from_hf(_config(**change))


