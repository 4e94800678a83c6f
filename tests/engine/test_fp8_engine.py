"""FP8 weights (`--quantization fp8`, FP8 checkpoints) and the FP8 KV cache, on CPU, against
Hugging Face transformers running the same weights rounded through FP8 (dequantized to float32).

The honest reference for an FP8 model is the dequantized one: on CPU the engine multiplies
unrounded activations by exactly those weights, so greedy tokens must be equal and logprobs
within float32 noise. The distance to the unquantized model is recorded as a bound.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from engine_features import speculation_of
from safetensors.torch import load_file, save_file
from tiny_models import build_tiny_model
from transformers import AutoModelForCausalLM

from meshserve.kernels.fp8_linear import (
    FP8_DTYPE,
    dequantize,
    quantize_blockwise,
    quantize_per_channel,
    quantize_per_tensor,
)
from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.models.quant_fp8 import Fp8Linear, weight_bytes
from meshserve.shared.errors import ModelLoadError
from meshserve.shared.sampling_params import SamplingParams

MAX_NEW = 8
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Recorded on the tiny random model (unit-scale weights, so FP8 rounding is felt strongly):
# max |logprob(fp8 weights) - logprob(float32 weights)| of the tokens both chose (0.065 seen).
FP8_WEIGHTS_LOGPROB_BOUND = 0.15
# Same for the FP8 KV cache, K and V rounded through e4m3 at scale 1.0 (0.143 seen).
FP8_KV_LOGPROB_BOUND = 0.25


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    folder = build_tiny_model(tmp_path_factory.mktemp("fp8"), "llama", seed=1)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (1, 9, 30, 47)]
    return folder, prompts


def is_projection(name: str) -> bool:
    return any(f".{p}.weight" in name for p in PROJECTIONS)


def hf_reference(folder: Path, rounding: Callable[[torch.Tensor], torch.Tensor]
                 ) -> torch.nn.Module:
    """The tiny model in transformers with each projection weight replaced by rounding(w)."""
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if is_projection(name):
                param.copy_(rounding(param))
    return hf


def hf_run(hf: torch.nn.Module, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs (log-softmax of transformers' logits)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                          min_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    lps = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, lps


def engine_run(folder: Path, prompts: list[list[int]], **overrides: object
               ) -> tuple[LLMEngine, list[tuple[list[int], list[float]]]]:
    cfg: dict[str, object] = {"model": str(folder), "dtype": "float32", "device": "cpu",
                              "num_kv_blocks": 64, **overrides}
    engine = build_engine(EngineConfig(**cfg))  # type: ignore[arg-type]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    lps: dict[str, list[float]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            lps[out.request_id] += [lp.logprob for lp in out.new_logprobs or []]
    return engine, [(tokens[f"r{i}"], lps[f"r{i}"]) for i in range(len(prompts))]


def assert_matches(got: list[tuple[list[int], list[float]]], hf: torch.nn.Module,
                   prompts: list[list[int]]) -> None:
    for (tokens, lps), prompt in zip(got, prompts, strict=True):
        ref_tokens, ref_lps = hf_run(hf, prompt)
        assert tokens == ref_tokens, (prompt, tokens, ref_tokens)
        assert max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)) < 1e-4


def common_prefix_logprob_diff(got: list[tuple[list[int], list[float]]],
                               ref: list[tuple[list[int], list[float]]]) -> float:
    """Max |logprob difference| over the positions where both runs chose the same tokens so
    far (same context, same token): where greedy paths part, logprobs stop being comparable."""
    worst = 0.0
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, ref, strict=True):
        for a, b, lp, ref_lp in zip(tokens, ref_tokens, lps, ref_lps):
            if a != b:
                break
            worst = max(worst, abs(lp - ref_lp))
    return worst


def per_channel(w: torch.Tensor) -> torch.Tensor:
    return dequantize(*quantize_per_channel(w), torch.float32)


def per_tensor(w: torch.Tensor) -> torch.Tensor:
    return dequantize(*quantize_per_tensor(w), torch.float32)


def blockwise(w: torch.Tensor) -> torch.Tensor:
    q, scale = quantize_blockwise(w, (32, 32))
    return dequantize(q, scale, torch.float32, (32, 32))


def test_online_fp8_equals_transformers_on_the_fp8_rounded_weights(tiny) -> None:
    folder, prompts = tiny
    _, got = engine_run(folder, prompts, quantization="fp8")
    assert_matches(got, hf_reference(folder, per_channel), prompts)
    # ... and stays within the recorded bound of the unquantized model's logprobs.
    _, exact = engine_run(folder, prompts)
    diff = common_prefix_logprob_diff(got, exact)
    assert diff < FP8_WEIGHTS_LOGPROB_BOUND, diff


def test_fp8_weights_stay_fp8_in_memory(tiny) -> None:
    folder, prompts = tiny
    plain, _ = engine_run(folder, prompts[:1])
    fp8, _ = engine_run(folder, prompts[:1], quantization="fp8")
    decoder = sum(p.numel() for n, p in plain.runner.model.named_parameters()
                  if n.startswith("model.layers.") and n.endswith("_proj.weight"))
    assert weight_bytes(fp8.runner.model)["float8_e4m3fn"] == decoder  # one byte a weight
    saved = weight_bytes(plain.runner.model)["float32"] - weight_bytes(fp8.runner.model)["float32"]
    scales = sum(m.weight_scale.numel() for m in fp8.runner.model.modules()
                 if isinstance(m, Fp8Linear))
    assert saved == 4 * decoder - 4 * scales
    assert all(isinstance(layer.mlp.down_proj, Fp8Linear) for layer in fp8.runner.model.model.layers)
    assert not isinstance(fp8.runner.model.lm_head, Fp8Linear)


def write_fp8_checkpoint(src: Path, dst: Path, quantize: Callable, scale_name: str,
                         quantization_config: dict, extra: Callable | None = None,
                         keep: tuple[str, ...] = ()) -> Path:
    """A copy of `src` with each projection (but those in `keep`) stored as FP8 and its
    scale, and the config."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if is_projection(name) and name.removesuffix(".weight") not in keep:
            q, scale = quantize(tensor)
            out[name] = q
            out[name.removesuffix(".weight") + scale_name] = scale
            if extra is not None:
                out.update(extra(name.removesuffix(".weight"), tensor))
        else:
            out[name] = tensor
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_fp8_format_checkpoint_per_tensor(tiny, tmp_path: Path) -> None:
    folder, prompts = tiny
    ckpt = write_fp8_checkpoint(
        folder, tmp_path / "fp8", lambda w: (quantize_per_tensor(w)[0], quantize_per_tensor(w)[1][0]),
        ".weight_scale", {"quant_method": "fp8", "activation_scheme": "dynamic"})
    assert load_file(str(ckpt / "model.safetensors"))[
        "model.layers.0.self_attn.q_proj.weight"].dtype == FP8_DTYPE
    engine, got = engine_run(ckpt, prompts)
    assert engine.quant is not None and engine.quant.checkpoint_format == "fp8"
    assert_matches(got, hf_reference(folder, per_tensor), prompts)
    # q, k and v came with three different per-tensor scales: the fused layer keeps each.
    qkv = engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and len(set(qkv.weight_scale.tolist())) == 3


def test_fp8_format_checkpoint_block_wise(tiny, tmp_path: Path) -> None:
    folder, prompts = tiny
    ckpt = write_fp8_checkpoint(
        folder, tmp_path / "block", lambda w: quantize_blockwise(w, (32, 32)), ".weight_scale_inv",
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]})
    engine, got = engine_run(ckpt, prompts[:2])
    assert engine.quant is not None and engine.quant.weight_block == (32, 32)
    assert_matches(got, hf_reference(folder, blockwise), prompts[:2])


def test_fp8_checkpoint_of_a_biased_model_with_an_unquantized_layer(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path / "qwen2", "qwen2", seed=2)  # biases on q, k and v
    kept = "model.layers.1.mlp.down_proj"
    ckpt = write_fp8_checkpoint(
        folder, tmp_path / "qwen2-fp8", quantize_per_channel, ".weight_scale",
        {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": [kept]},
        keep=(kept,))
    prompts = [[5, 17, 230, 41, 99], [7, 8, 9]]
    engine, got = engine_run(ckpt, prompts)
    layers = engine.runner.model.model.layers
    assert isinstance(layers[0].self_attn.qkv_proj, Fp8Linear)
    assert layers[0].self_attn.qkv_proj.bias is not None
    assert not isinstance(layers[1].mlp.down_proj, Fp8Linear)
    hf = hf_reference(folder, per_channel)
    with torch.no_grad():  # the kept layer in its original weights
        original = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        hf.model.layers[1].mlp.down_proj.weight.copy_(original.model.layers[1].mlp.down_proj.weight)
    assert_matches(got, hf, prompts)


def test_compressed_tensors_checkpoint_per_channel_with_static_input_scales(
        tiny, tmp_path: Path) -> None:
    folder, prompts = tiny
    config = {"quant_method": "compressed-tensors", "format": "float-quantized",
              "ignore": ["lm_head"], "config_groups": {"group_0": {
                  "targets": ["Linear"],
                  "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                              "symmetric": True, "dynamic": False},
                  "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                        "dynamic": False}}}}
    ckpt = write_fp8_checkpoint(
        folder, tmp_path / "ct", lambda w: (quantize_per_channel(w)[0],
                                            quantize_per_channel(w)[1][:, None]),
        ".weight_scale", config,
        extra=lambda prefix, w: {prefix + ".input_scale": torch.tensor([0.01])})
    engine, got = engine_run(ckpt, prompts)
    assert engine.quant is not None and engine.quant.static_input_scales
    assert_matches(got, hf_reference(folder, per_channel), prompts)


def test_fp8_checkpoint_without_scales_is_refused_by_name(tiny, tmp_path: Path) -> None:
    folder, _ = tiny
    ckpt = write_fp8_checkpoint(folder, tmp_path / "noscale",
                                lambda w: quantize_per_tensor(w), ".weight_scale",
                                {"quant_method": "fp8"})
    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="down_proj"):
        engine_run(ckpt, [[5]])


def test_an_fp8_checkpoint_at_tensor_parallelism_is_refused_before_any_rank_starts(
        tiny, tmp_path: Path) -> None:
    folder, _ = tiny
    ckpt = write_fp8_checkpoint(folder, tmp_path / "tp", lambda w: quantize_per_tensor(w),
                                ".weight_scale", {"quant_method": "fp8"})
    with pytest.raises(ModelLoadError, match="not split over tensor-parallel ranks") as refused:
        engine_run(ckpt, [[5]], tensor_parallel_size=2)
    assert refused.value.param == "tensor_parallel_size"


def test_lora_adapters_on_fp8_weights_match_peft_on_the_rounded_weights(
        tiny, tmp_path: Path) -> None:
    """--enable-lora with --quantization fp8: the adapters (in the model's dtype) add to
    the FP8 projections' output. Two adapters and the base model share the steps; each row
    gets the greedy tokens of transformers + peft on the FP8-rounded base weights."""
    from lora_adapters import build_adapter
    from peft import PeftModel

    from meshserve.shared.lora_config import lora_id_for

    folder, prompts = tiny
    adapters = [build_adapter(folder, tmp_path / "a0", seed=10, rank=8),
                build_adapter(folder, tmp_path / "a1", seed=11, rank=4,
                              targets=["q_proj", "v_proj", "down_proj"])]
    engine = build_engine(EngineConfig(
        model=str(folder), dtype="float32", device="cpu", num_kv_blocks=64,
        quantization="fp8", enable_lora=True, max_loras=2,
        lora_modules=",".join(f"a{i}={p}" for i, p in enumerate(adapters))))
    model = engine.runner.model
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    assert model.model.layers[0].self_attn.qkv_proj.lora is not None
    ids = [None, lora_id_for("a0"), lora_id_for("a1")]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    requests = [(prompt, ids[i % 3]) for i, prompt in enumerate(prompts[1:] * 2)]
    for i, (prompt, lora_id) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params, lora_id=lora_id)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(requests))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    references = [hf_reference(folder, per_channel)] + [
        PeftModel.from_pretrained(hf_reference(folder, per_channel), p).eval()
        for p in adapters]
    for i, (prompt, _) in enumerate(requests):
        assert tokens[f"r{i}"] == hf_run(references[i % 3], prompt)[0], f"request {i}"
    # The adapters change the tokens: the comparison is not the base model's.
    assert [tokens[f"r{i}"] for i in (1, 2)] != [hf_run(references[0], requests[i][0])[0]
                                                  for i in (1, 2)]


def test_unsupported_quant_methods_are_refused(tiny, tmp_path: Path) -> None:
    folder, _ = tiny
    awq = tmp_path / "awq"
    shutil.copytree(folder, awq)
    config = json.loads((awq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (awq / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="quant_method 'awq' is not supported"):
        engine_run(awq, [[5]])


def test_fp8_kv_cache_keeps_greedy_tokens_within_a_logprob_bound(tiny) -> None:
    folder, prompts = tiny
    engine, got = engine_run(folder, prompts, kv_cache_dtype="fp8")
    assert engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    _, exact = engine_run(folder, prompts)
    assert [t for t, _ in got] == [t for t, _ in exact]
    diff = max(abs(a - b) for (_, lps), (_, ref) in zip(got, exact) for a, b in zip(lps, ref))
    assert 0 < diff < FP8_KV_LOGPROB_BOUND, diff  # rounded (not bit-equal), but close


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_kv_cache_holds_twice_the_tokens_of_bf16(tiny, kv_dtype: str) -> None:
    folder, _ = tiny
    memory = 1 << 20

    def blocks(**kw: object) -> int:
        engine = build_engine(EngineConfig(model=str(folder), dtype="bfloat16", device="cpu",
                                        kv_cache_memory=memory, **kw))  # type: ignore[arg-type]
        return engine.kv.num_blocks

    assert blocks(kv_cache_dtype=kv_dtype) == 2 * blocks()


def test_fp8_weights_and_kv_together(tiny) -> None:
    folder, prompts = tiny
    _, both = engine_run(folder, prompts[:2], quantization="fp8", kv_cache_dtype="fp8")
    hf = hf_reference(folder, per_channel)
    ref = [hf_run(hf, p) for p in prompts[:2]]
    assert [t for t, _ in both] == [t for t, _ in ref]
    diff = max(abs(a - b) for (_, lps), (_, r) in zip(both, ref) for a, b in zip(lps, r))
    assert diff < FP8_KV_LOGPROB_BOUND, diff


def test_a_pooling_worker_embeds_with_fp8_weights(tiny) -> None:
    from meshserve.services.worker.pooling.embedder import Embedder

    folder, prompts = tiny

    def embed(**kw: object) -> tuple[Embedder, torch.Tensor]:
        embedder = Embedder(EngineConfig(model=str(folder), dtype="float32", device="cpu",
                                         **kw))  # type: ignore[arg-type]
        return embedder, embedder.embed(prompts[1:3])

    fp8, fp8_out = embed(quantization="fp8")
    _, exact = embed()
    assert isinstance(fp8.model.model.layers[0].mlp.gate_up_proj, Fp8Linear)
    assert fp8_out.shape == exact.shape and torch.isfinite(fp8_out).all()
    assert not torch.equal(fp8_out, exact)  # FP8-rounded weights, not the original ones
    assert torch.allclose(fp8_out, exact, atol=0.5)


def test_gguf_weights_are_dequantized_with_a_warning_and_fp8_requantizes_them(
        caplog: pytest.LogCaptureFixture) -> None:
    from meshserve.services.worker import loader

    source = loader.resolve_model(None, "auto")  # the default model: SmolLM2-135M, a GGUF file
    assert source.format == "gguf"
    config = loader.load_model_config(source)
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        model = loader.load_model(source, config, torch.float32, torch.device("cpu"), "auto",
                                  quant=loader.load_quant_config(source, "fp8"))
    assert "are dequantized to float32 on load" in caplog.text
    assert "GiB in memory" in caplog.text
    assert all(isinstance(layer.mlp.down_proj, Fp8Linear) for layer in model.model.layers)
    assert weight_bytes(model)["float8_e4m3fn"] > 0


def test_fp8_layers_keep_the_forward_hooks_of_the_layers_they_replace(tiny) -> None:
    """Hooks others put on a projection (tensor parallelism's all-reduce) survive the swap."""
    from meshserve.services.worker import loader
    from meshserve.services.worker.models.quant_fp8 import quantize_online

    folder, _ = tiny
    source = loader.resolve_model(str(folder), "auto")
    model = loader.load_model(source, loader.load_model_config(source), torch.float32,
                              torch.device("cpu"), "auto")
    seen: list[tuple[int, ...]] = []
    model.model.layers[0].self_attn.o_proj.register_forward_hook(
        lambda module, args, out: seen.append(tuple(out.shape)))
    quantize_online(model)
    o_proj = model.model.layers[0].self_attn.o_proj
    assert isinstance(o_proj, Fp8Linear)
    o_proj(torch.randn(3, o_proj.in_features))
    assert seen == [(3, o_proj.out_features)]


# Max |logprob(FP8 weights and LM head) - logprob(float32)| on the tiny model, the test's
# prompts: 0.214 untied, 0.224 tied seen (FP8 weights alone: 0.160, 0.261).
FP8_LM_HEAD_LOGPROB_BOUND = 0.35


@pytest.mark.parametrize("tied", [False, True])
def test_fp8_lm_head_equals_transformers_with_the_head_rounded_too(
        tmp_path: Path, tied: bool) -> None:
    """--quantize-lm-head: the LM head (a tied model's copy of its embeddings) goes FP8
    with per-row scales, the input embeddings stay as they were."""
    folder = build_tiny_model(tmp_path, "llama", seed=1, tie_word_embeddings=tied)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (1, 9, 30)]
    engine, got = engine_run(folder, prompts, quantization="fp8", quantize_lm_head=True)
    model = engine.runner.model
    assert isinstance(model.lm_head, Fp8Linear)
    assert model.lm_head.weight.shape == model.model.embed_tokens.weight.shape
    assert model.model.embed_tokens.weight.dtype == torch.float32
    hf = hf_reference(folder, per_channel)
    with torch.no_grad():  # a new Parameter: a tied model's embeddings keep the exact rows
        hf.lm_head.weight = torch.nn.Parameter(per_channel(hf.lm_head.weight.detach()))
    assert torch.equal(hf.model.embed_tokens.weight,
                       AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
                       .model.embed_tokens.weight)
    assert_matches(got, hf, prompts)
    _, exact = engine_run(folder, prompts)
    diff = common_prefix_logprob_diff(got, exact)
    assert 0 < diff < FP8_LM_HEAD_LOGPROB_BOUND, diff


def test_quantize_lm_head_without_fp8_weights_is_refused(tiny) -> None:
    folder, _ = tiny
    with pytest.raises(ModelLoadError, match="--quantize-lm-head needs FP8 weights") as refused:
        engine_run(folder, [[5]], quantize_lm_head=True)
    assert refused.value.param == "quantize_lm_head"


def test_ngram_speculation_on_fp8_weights_keeps_the_greedy_tokens(tiny) -> None:
    """Drafts verified by the FP8 model: the tokens are those of the FP8 model alone."""
    folder, prompts = tiny
    ngram = json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                        "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    def run(**overrides: object) -> tuple[LLMEngine, list[int]]:
        engine = build_engine(EngineConfig(model=str(folder), dtype="float32", device="cpu",
                                        num_kv_blocks=64, quantization="fp8",
                                        **overrides))  # type: ignore[arg-type]
        engine.add_request("r", prompts[2][:6] * 5, params)
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            tokens += [t for out in engine.step() for t in out.new_token_ids]
        return engine, tokens

    _, plain = run()
    spec_engine, spec = run(speculative_config=ngram)
    assert spec == plain and len(spec) == 40
    assert speculation_of(spec_engine) is not None
    _, drafted, accepted, _ = speculation_of(spec_engine).stats.snapshot()
    assert drafted > 0 and accepted > 0
