"""The mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral) against transformers.

Tiny random MoE folders are written by transformers itself (tests/tiny_models.py, MOE_DIMS:
a dense layer 0 for Qwen3-MoE, a shared expert for Qwen2-MoE); transformers' greedy
`generate` and log-softmax on the same weights are the reference, through the whole engine:
batched requests, prefix-cache hits and preemption. Then what is refused by name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

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
from test_fp8_engine import assert_matches, engine_run, is_projection, per_channel
from test_models import PagedRunner, check_stacked_experts_load, hf_logits, load, token_ids
from tiny_models import build_tiny_model
from transformers import AutoModelForCausalLM

from meshserve.kernels.fp8_linear import FP8_DTYPE
from meshserve.services.worker.loader import ModelSource, load_model, load_model_config
from meshserve.services.worker.models.moe import SparseMoeBlock
from meshserve.shared.errors import ModelLoadError

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=ARCHS)
def moe_setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    return (request.param, *hf_setup(request.param, tmp_path_factory))


def test_model_logits_match_transformers(moe_setup) -> None:
    arch, folder, _, _, _ = moe_setup
    model = load(folder)
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert sparse == ([False, True, True] if arch == "qwen3_moe" else [True, True])
    ids = token_ids(20, seed=3)
    runner = PagedRunner(model)
    got = torch.cat(runner.step([(0, ids[:13], 0)]) + runner.step([(0, ids[13:], 13)]))
    torch.testing.assert_close(got, hf_logits(folder, ids), atol=1e-4, rtol=1e-4)


def test_greedy_batched_with_prefix_hits_matches_transformers(moe_setup) -> None:
    _, folder, _, prompts, expected = moe_setup
    check_greedy(make_engine(folder, max_num_batched_tokens=40), prompts, expected)


def test_preemption_keeps_outputs_equal(moe_setup) -> None:
    _, folder, _, prompts, expected = moe_setup
    engine = make_engine(folder, num_kv_blocks=10, max_num_batched_tokens=64)
    check_preemption(engine, prompts, expected)


def test_logprobs_match_transformers(moe_setup) -> None:
    _, folder, hf, prompts, _ = moe_setup
    check_logprobs(make_engine(folder, max_num_batched_tokens=48), prompts[2:6],
                   hf_reference(hf))


def test_stacked_expert_tensors_load_like_per_expert_ones(moe_setup, tmp_path: Path) -> None:
    _, folder, hf, _, _ = moe_setup
    check_stacked_experts_load(folder, hf, tmp_path)


def test_missing_and_unexpected_expert_tensors_are_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = build_tiny_model(tmp_path / "mixtral", "mixtral")
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    tensors["model.layers.1.block_sparse_moe.experts.4.w3.weight"] = tensors.pop(name)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"experts\.4\.w3"):
        load(folder)
    del tensors["model.layers.1.block_sparse_moe.experts.4.w3.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing tensors.*experts\.3\.w3"):
        load(folder)


def test_dummy_weights_load_and_run(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path / "qwen2_moe", "qwen2_moe")
    (folder / "model.safetensors").unlink()
    model = load(folder, load_format="dummy")
    logits = PagedRunner(model).step([(0, token_ids(5, seed=1), 0)])[0]
    assert torch.isfinite(logits).all()


def test_lora_on_a_moe_model_is_refused(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path / "qwen3_moe", "qwen3_moe")
    with pytest.raises(ModelLoadError, match="LoRA.*Qwen3MoeForCausalLM"):
        make_engine(folder, enable_lora=True)


def test_fp8_checkpoint_and_gguf_of_a_moe_model_are_refused(tmp_path: Path) -> None:
    from meshserve.shared.quantization import quantization_of

    folder = build_tiny_model(tmp_path / "mixtral", "mixtral")
    source = ModelSource(str(folder), folder, "hf", None)
    config = load_model_config(source)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    quant = quantization_of(cfg, None, "config.json")
    assert quant is not None and quant.from_checkpoint
    with pytest.raises(ModelLoadError, match="FP8 checkpoints of mixture-of-experts.*Mixtral"):
        load_model(source, config, torch.float32, CPU, "auto", quant=quant)
    gguf = ModelSource(str(folder), folder / "x.gguf", "gguf", folder / "x.gguf")
    with pytest.raises(ModelLoadError, match="GGUF files of mixture-of-experts.*Mixtral"):
        load_model(gguf, config, torch.float32, CPU, "auto")


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_online_fp8_experts_equal_transformers_on_the_fp8_rounded_weights(
        arch: str, tmp_path: Path) -> None:
    """--quantization fp8 makes the experts FP8 too (per expert and output row scales), and
    the engine then equals transformers running every projection and expert weight rounded
    through FP8 the same way."""
    folder = build_tiny_model(tmp_path / arch, arch, seed=2)
    prompts = [token_ids(n, seed=n).tolist() for n in (1, 9, 30)]
    engine, got = engine_run(folder, prompts, quantization="fp8")
    block = next(layer.mlp for layer in engine.model.model.layers
                 if isinstance(layer.mlp, SparseMoeBlock))
    assert block.experts.w13.dtype == block.experts.w2.dtype == FP8_DTYPE
    assert block.gate.weight.dtype == torch.float32  # routing stays in the model's dtype
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            stacked = name.endswith(("experts.gate_up_proj", "experts.down_proj"))
            if stacked or is_projection(name) or re.search(r"experts\.\d+\.w[123]\.", name):
                rows = param.flatten(0, 1) if stacked else param  # a scale per expert row
                param.copy_(per_channel(rows).view_as(param))
    assert_matches(got, hf, prompts)

