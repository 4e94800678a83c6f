"""gpt-oss against transformers on the same weights.

A tiny random folder written by transformers itself (tests/tiny_models.py, GPT_OSS_DIMS): 4
layers alternating a 12-token window and full attention, attention sinks, q/k/v/o biases,
YaRN with truncate off, 8 biased experts of the clamped SwiGLU (limit 1.0, so the clamps bite)
behind a biased top-2 router. Most prompts are longer than the window. transformers' greedy
`generate` and log-softmax are the reference, through the whole engine: batched and staggered
requests, chunked prefill, prefix-cache hits, preemption. Then MXFP4 checkpoints (the experts
quantized here, loaded by transformers and by meshserve), published configs, and what is
refused by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine_vs_hf import (
    GREEDY,
    check_greedy,
    check_logprobs,
    check_preemption,
    hf_greedy,
    hf_reference,
    hf_setup,
    make_engine,
    run_all,
    tokens_of,
)
from test_models import PagedRunner, hf_logits, load, token_ids
from transformers import AutoModelForCausalLM, Mxfp4Config

from meshserve.kernels.rotary import compute_inv_freq
from meshserve.services.worker.loader import ModelSource, load_model
from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.gpt_oss import GptOssAttention, GptOssForCausalLM
from meshserve.services.worker.models.mxfp4 import FP4_VALUES, dequantize_mxfp4
from meshserve.shared.errors import ModelLoadError
from meshserve.shared.model_config import max_model_len_of, read_folder
from meshserve.shared.quantization import quantization_of

REPO_ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = REPO_ROOT / "loadtest" / "models" / "gpt-oss-20b" / "config.json"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def gpt_oss_setup(tmp_path_factory: pytest.TempPathFactory):
    return hf_setup("gpt_oss", tmp_path_factory)


def test_config_has_windows_yarn_and_experts_and_context_is_not_capped(gpt_oss_setup) -> None:
    folder, _, _, _ = gpt_oss_setup
    config = load(folder).config
    assert config.layer_windows == (12, None, 12, None)
    assert config.max_model_len == 256 == max_model_len_of(read_folder(folder))
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "yarn"
    assert config.rope_scaling["truncate"] is False
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (
        8, 2, 32)
    assert (config.swiglu_alpha, config.swiglu_limit) == (1.702, 1.0)
    assert config.attention_bias and config.o_proj_bias and not config.qk_norm


def test_model_logits_match_transformers(gpt_oss_setup) -> None:
    folder, _, _, _ = gpt_oss_setup
    model = load(folder)
    assert isinstance(model, GptOssForCausalLM)
    ids = token_ids(40, seed=3)
    want = hf_logits(folder, ids)
    assert want.std() > 0.5, "reference logits too flat to tell implementations apart"
    torch.testing.assert_close(_chunked_logits(model, ids), want, atol=1e-4, rtol=1e-4)


def _chunked_logits(model: GptOssForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a 40-token prompt: two prefill chunks over blocks of 4 (windows span blocks),
    then three decode steps."""
    runner = PagedRunner(model, num_blocks=16)
    got = runner.step([(0, ids[:13], 0)]) + runner.step([(0, ids[13:37], 13)])
    got += [runner.step([(0, ids[t : t + 1], t)])[0] for t in range(37, 40)]
    return torch.cat(got)


def _without(model: GptOssForCausalLM, feature: str) -> None:
    """Switch one gpt-oss feature off in every layer of `model`."""
    for layer in model.model.layers:
        attention, moe = layer.self_attn, layer.mlp
        assert isinstance(attention, GptOssAttention)
        if feature == "sinks":
            attention.sinks.data.fill_(-1e4)
        elif feature == "windows":
            attention.window = None
        elif feature == "clamps":
            moe.experts.limit = 1e4
        elif feature == "expert biases":
            moe.experts.b13.data.zero_()
        else:
            moe.router.bias.data.zero_()


@pytest.mark.parametrize("feature", ["sinks", "windows", "clamps", "expert biases",
                                     "router bias"])
def test_each_feature_moves_the_logits(gpt_oss_setup, feature: str) -> None:
    """Each gpt-oss feature moves the tiny model's logits far past the 1e-4 the comparisons
    allow, so the equality with transformers exercises every one of them."""
    folder, _, _, _ = gpt_oss_setup
    ids = token_ids(40, seed=3)
    base = _chunked_logits(load(folder), ids)
    model = load(folder)
    _without(model, feature)
    moved = (_chunked_logits(model, ids) - base).abs().max().item()
    assert moved > 1e-2, f"{feature}: logits moved by only {moved}"


@pytest.mark.parametrize("setup", ["chunked", "not-chunked", "no-prefix-cache"])
def test_greedy_batched_with_prefix_hits_matches_transformers(gpt_oss_setup, setup: str) -> None:
    folder, _, prompts, expected = gpt_oss_setup
    options: dict[str, object] = {
        "chunked": {"max_num_batched_tokens": 40},
        "not-chunked": {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096},
        "no-prefix-cache": {"enable_prefix_caching": False, "max_num_batched_tokens": 64},
    }[setup]
    check_greedy(make_engine(folder, **options), prompts, expected,
                 stagger=setup == "chunked", prefix_hits=setup == "chunked")


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_preemption_keeps_outputs_equal(gpt_oss_setup, async_scheduling: str) -> None:
    folder, _, prompts, expected = gpt_oss_setup
    engine = make_engine(folder, num_kv_blocks=10, max_num_batched_tokens=64,
                         async_scheduling=async_scheduling)
    check_preemption(engine, prompts, expected)


def test_logprobs_match_transformers(gpt_oss_setup) -> None:
    folder, hf, prompts, _ = gpt_oss_setup
    check_logprobs(make_engine(folder, max_num_batched_tokens=48), prompts[2:7],
                   hf_reference(hf))


# -- MXFP4 ----------------------------------------------------------------------------------


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [E, N, K] -> (blocks [E, N, K/32, 16], scales [E, N, K/32]) uint8: per block of 32,
    the exponent that brings its largest magnitude to at most 6, each value rounded to the
    nearest FP4 code, two codes a byte, the even element in the low nibble."""
    experts, rows, cols = w.shape
    blocks = w.float().reshape(experts, rows, cols // 32, 32)
    amax = blocks.abs().amax(-1).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = blocks / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - torch.tensor(FP4_VALUES)).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


def write_mxfp4_copy(folder: Path, dest: Path) -> Path:
    """A copy of `folder` whose experts are MXFP4 as the published checkpoints hold them:
    gate_up_proj [E, H, 2I] -> blocks of its transpose [E, 2I, H] (rows interleaved),
    down_proj [E, I, H] -> blocks of [E, H, I]; biases and the rest unchanged."""
    copy = Path(shutil.copytree(folder, dest))
    tensors = load_file(str(copy / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2).contiguous())
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, str(copy / "model.safetensors"))
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def test_dequantize_mxfp4_equals_transformers_helper() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (3, 40, 4), dtype=torch.uint8, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        ours = dequantize_mxfp4(blocks, scales, dtype)  # [E, N, K]
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, K, N]
        assert ours.dtype == dtype and torch.equal(ours.transpose(1, 2), theirs)


def test_mxfp4_checkpoint_loads_as_transformers_dequantizes_it(gpt_oss_setup,
                                                               tmp_path: Path) -> None:
    folder, hf, _, _ = gpt_oss_setup
    copy = write_mxfp4_copy(folder, tmp_path / "mxfp4")
    model = load(copy)
    # Our stacked experts hold exactly the dequantized blocks, de-interleaved.
    tensors = load_file(str(copy / "model.safetensors"))
    prefix = "model.layers.1.mlp.experts"
    experts = model.model.layers[1].mlp.experts
    gate_up = dequantize_mxfp4(tensors[f"{prefix}.gate_up_proj_blocks"],
                               tensors[f"{prefix}.gate_up_proj_scales"], torch.float32)
    assert torch.equal(experts.w13, torch.cat((gate_up[:, 0::2], gate_up[:, 1::2]), dim=1))
    assert torch.equal(experts.w2, dequantize_mxfp4(tensors[f"{prefix}.down_proj_blocks"],
                                                    tensors[f"{prefix}.down_proj_scales"],
                                                    torch.float32))
    original = hf.model.layers[1].mlp.experts.gate_up_proj.detach()
    assert (experts.w13 - torch.cat((original[..., 0::2], original[..., 1::2]), dim=-1)
            .transpose(1, 2)).abs().max() < 0.2, "the blocks stand for the original weights"
    # transformers reads the same folder (dequantized on CPU): the same logits.
    reference = AutoModelForCausalLM.from_pretrained(
        copy, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)).eval()
    ids = token_ids(40, seed=3)
    with torch.no_grad():
        want = reference(ids[None]).logits[0]
    torch.testing.assert_close(_chunked_logits(model, ids), want, atol=1e-4, rtol=1e-4)
    # And the engine serves it: greedy tokens equal transformers' on the MXFP4 folder.
    prompts = [token_ids(n, seed=n).tolist() for n in (5, 30)]
    outputs = run_all(make_engine(copy), prompts, GREEDY)
    for i, prompt in enumerate(prompts):
        assert tokens_of(outputs[f"r{i}"]) == hf_greedy(reference, prompt, GREEDY.max_tokens)


def test_mxfp4_blocks_without_their_scales_are_named(gpt_oss_setup, tmp_path: Path) -> None:
    folder, _, _, _ = gpt_oss_setup
    copy = write_mxfp4_copy(folder, tmp_path / "mxfp4")
    tensors = load_file(str(copy / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.down_proj_scales"]
    save_file(tensors, str(copy / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"layers\.2\.mlp\.experts\.down_proj_scales"):
        load(copy)


def test_mxfp4_is_refused_for_other_architectures() -> None:
    config = {"architectures": ["LlamaForCausalLM"], "quantization_config": {
        "quant_method": "mxfp4"}}
    with pytest.raises(ModelLoadError, match="mxfp4.*GptOssForCausalLM"):
        quantization_of(config, None)
    assert quantization_of({**config, "architectures": ["GptOssForCausalLM"]}, None) is None


# -- configs and refusals -------------------------------------------------------------------


def test_published_config_is_read_and_its_yarn_equals_transformers() -> None:
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = json.loads(PUBLISHED.read_text())
    config = ModelConfig.from_hf(cfg)
    assert config.layer_windows == (128, None) * 12
    assert config.max_model_len == 131072 == max_model_len_of(read_folder(PUBLISHED.parent))
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (
        32, 4, 2880)
    assert (config.head_dim, config.rope_theta, config.swiglu_limit) == (64, 150000.0, 7.0)
    assert config.attention_bias and config.o_proj_bias
    theirs, their_factor = ROPE_INIT_FUNCTIONS["yarn"](GptOssConfig(**cfg))
    ours, our_factor = compute_inv_freq(config.rotary_dim, config.rope_theta,
                                        config.rope_scaling)
    assert torch.equal(ours, theirs) and our_factor == their_factor
    assert config.rope_scaling is not None and config.rope_scaling["truncate"] is False
    truncated = {**config.rope_scaling, "truncate": True}  # (the flag matters for this model)
    assert not torch.equal(compute_inv_freq(64, 150000.0, truncated)[0], ours)


@pytest.mark.parametrize("change, named", [
    ({"sliding_window": None}, "sliding_window"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"rope_scaling": None, "rope_theta": None}, "rope_scaling"),
    ({"num_local_experts": 0}, "num_local_experts"),
    ({"swiglu_limit": -1.0}, "swiglu_limit"),
])
def test_unsupported_gpt_oss_configs_are_refused_by_name(change: dict[str, object],
                                                         named: str) -> None:
    cfg = {**json.loads(PUBLISHED.read_text()), **change}
    with pytest.raises(ModelLoadError, match=named):
        ModelConfig.from_hf(cfg)


def test_lora_fp8_and_gguf_are_refused_by_name(gpt_oss_setup) -> None:
    folder, _, _, _ = gpt_oss_setup
    with pytest.raises(ModelLoadError, match="LoRA.*GptOssForCausalLM"):
        make_engine(folder, enable_lora=True)
    with pytest.raises(ModelLoadError, match="FP8 weights for gpt-oss.*GptOssForCausalLM"):
        make_engine(folder, quantization="fp8")
    config = load(folder).config
    gguf = ModelSource(str(folder), folder / "x.gguf", "gguf", folder / "x.gguf")
    with pytest.raises(ModelLoadError, match="GGUF files of gpt-oss.*GptOssForCausalLM"):
        load_model(gguf, config, torch.float32, CPU, "auto")
