"""DeepSeek-V2 against transformers on the same weights, over the compressed latent cache.

Tiny random folders written by transformers itself (tests/tiny_models.py, DEEPSEEK_DIMS): a
dense layer 0, then routed experts beside shared ones, three setups: q through q_lora_rank with
group_limited_greedy routing; a plain q_proj with greedy routing; and YaRN with mscale and
mscale_all_dim apart (both the cos/sin factor and the softmax scale move). transformers' greedy
`generate` and log-softmax are the reference, through the whole engine: batched requests,
prefix-cache hits, preemption; then the cache itself (only the latent rows, exactly
transformers' cached latents), the KV tier moving its blocks, routing against transformers'
routers, config reading and what is refused by name.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

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
from test_kv_tier import MemoryStore, wait_saved
from test_kv_tier import make_engine as tier_engine
from test_kv_tier import run as tier_run
from test_models import PagedRunner, check_stacked_experts_load, hf_logits, load, token_ids
from tiny_models import DEEPSEEK_YARN, build_tiny_model
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.cache_utils import DynamicCache
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from meshserve.services.worker.engine.kv_copy import gather_blocks, scatter_blocks
from meshserve.services.worker.engine.model_runner import kv_cache_bytes_per_block
from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.deepseek_v2 import (
    DeepseekMoe,
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
    grouped_topk,
    softmax_scale,
)
from meshserve.shared.errors import ModelLoadError
from meshserve.shared.sampling_params import SamplingParams

# Setup name -> (tiny_models arch, config overrides).
SETUPS: dict[str, tuple[str, dict[str, Any]]] = {
    "q-lora-grouped": ("deepseek_v2", {}),
    "q-proj-greedy": ("deepseek_v2", {"q_lora_rank": None, "topk_method": "greedy",
                                      "n_group": None, "topk_group": None}),
    "yarn": ("deepseek_v2", {"rope_parameters": DEEPSEEK_YARN}),
    "v3": ("deepseek_v3", {}),
    "v3-neox-rope": ("deepseek_v3", {"rope_interleave": False, "q_lora_rank": None}),
}
LATENT = 24 + 8  # kv_lora_rank + qk_rope_head_dim of DEEPSEEK_DIMS
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=sorted(SETUPS))
def ds_setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    arch, overrides = SETUPS[request.param]
    return (request.param, *hf_setup(arch, tmp_path_factory, **overrides))


def test_model_logits_match_transformers(ds_setup) -> None:
    name, folder, _, _, _ = ds_setup
    model = load(folder)
    assert isinstance(model, DeepseekV3ForCausalLM if name.startswith("v3")
                      else DeepseekV2ForCausalLM)
    sparse = [isinstance(layer.mlp, DeepseekMoe) for layer in model.model.layers]
    assert sparse == [False, True, True]
    assert (model.config.q_lora_rank is None) == (name in ("q-proj-greedy", "v3-neox-rope"))
    assert model.config.rope_interleave == (name != "v3-neox-rope")
    ids = token_ids(40, seed=3)
    want = hf_logits(folder, ids)
    assert want.std() > 0.5, "reference logits too flat to tell implementations apart"
    runner = PagedRunner(model)  # blocks of 4, handed out scrambled
    got = runner.step([(0, ids[:13], 0)]) + runner.step([(0, ids[13:37], 13)])
    got += [runner.step([(0, ids[t : t + 1], t)])[0] for t in range(37, 40)]
    torch.testing.assert_close(torch.cat(got), want, atol=1e-4, rtol=1e-4)


def test_greedy_batched_with_prefix_hits_matches_transformers(ds_setup) -> None:
    _, folder, _, prompts, expected = ds_setup
    check_greedy(make_engine(folder, max_num_batched_tokens=40), prompts, expected)


def test_preemption_keeps_outputs_equal(ds_setup) -> None:
    _, folder, _, prompts, expected = ds_setup
    check_preemption(make_engine(folder, num_kv_blocks=10, max_num_batched_tokens=64),
                     prompts, expected)


def test_logprobs_match_transformers(ds_setup) -> None:
    _, folder, hf, prompts, _ = ds_setup
    check_logprobs(make_engine(folder, max_num_batched_tokens=48), prompts[2:6],
                   hf_reference(hf))


def test_the_cache_holds_only_the_latent_rows(ds_setup) -> None:
    """A block is kv_lora_rank + qk_rope_head_dim values per token and layer, and they are
    what transformers caches: the normalised latent and the rotated k_pe (its complex pairs
    (re, im) stored here as [all re | all im])."""
    name, folder, hf, prompts, _ = ds_setup
    engine = make_engine(folder, block_size=16)
    config = engine.runner.config
    assert (config.cache_kv_heads, config.cache_head_dim) == (1, LATENT // 2)
    layers = config.num_hidden_layers
    assert kv_cache_bytes_per_block(config, 16, torch.float32) == layers * 16 * LATENT * 4
    k_cache, v_cache = engine.runner.kv_caches[0]
    assert tuple(k_cache.shape[1:]) == tuple(v_cache.shape[1:]) == (16, 1, LATENT // 2)
    prompt = prompts[5]  # 64 tokens: 4 full blocks
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=2))
    engine.step()  # the whole prompt in one step; its blocks are the request's until it ends
    table = engine.kv.block_ids("r")[:4]
    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        hf(torch.tensor([prompt]), cache=cache, use_cache=True)
    for layer, (k_cache, v_cache) in enumerate(engine.runner.kv_caches):
        rows = torch.cat((k_cache[table], v_cache[table]), dim=-1).view(-1, LATENT)  # [64, R+P]
        latent, k_pe = cache.layers[layer].keys[0, 0], cache.layers[layer].values[0, 0]
        torch.testing.assert_close(rows[:, :24], latent, atol=1e-5, rtol=1e-5)
        pairs = (torch.cat((k_pe[:, 0::2], k_pe[:, 1::2]), dim=-1)  # [re | im]
                 if "v3" not in name else k_pe)  # (V3's are in that layout already)
        torch.testing.assert_close(rows[:, 24:], pairs, atol=1e-5, rtol=1e-5)
    while engine.has_unfinished_requests():
        engine.step()


def test_the_kv_tier_moves_compressed_blocks(tmp_path: Path) -> None:
    """Blocks one engine saves are the compressed rows, and another engine loads them back to
    the same tokens (gather and scatter keep every byte)."""
    folder = build_tiny_model(tmp_path / "ds", "deepseek_v2", seed=2)
    store = MemoryStore()
    rng = random.Random(3)
    prompt = [rng.randrange(3, 200) for _ in range(5 * 8 + 3)]  # 5 full blocks of 8
    reference, _ = tier_run(tier_engine(folder, None)[0], prompt)
    first, first_transfer = tier_engine(folder, store)
    assert first_transfer is not None and tier_run(first, prompt, "a")[0] == reference
    wait_saved(first_transfer, store, 6)
    block_bytes = kv_cache_bytes_per_block(first.runner.config, 8, torch.float32)
    assert block_bytes == 3 * 8 * LATENT * 4
    assert {len(data) for data in store.blocks.values()} == {block_bytes}
    second, second_transfer = tier_engine(folder, store)
    assert second_transfer is not None
    out, cached = tier_run(second, prompt, "b")
    assert out == reference and cached == 5 * 8
    caches = second.runner.kv_caches
    blocks = [1, 4, 2]
    packed = gather_blocks(caches, blocks)
    assert packed.shape == (3, 3, 2, 8, 1, LATENT // 2) and packed.nbytes == 3 * block_bytes
    scatter_blocks(caches, [5, 6, 7], packed)
    assert torch.equal(gather_blocks(caches, [5, 6, 7]), packed)
    first_transfer.stop()
    second_transfer.stop()


@pytest.mark.parametrize("method, groups, best", [
    ("greedy", None, None), ("group_limited_greedy", 4, 2), ("group_limited_greedy", 8, 3)])
def test_grouped_topk_matches_transformers_router(method: str, groups: int | None,
                                                   best: int | None) -> None:
    config = DeepseekV2Config(hidden_size=32, num_attention_heads=4, n_routed_experts=16,
                              num_experts_per_tok=4, topk_method=method, n_group=groups,
                              topk_group=best, routed_scaling_factor=2.5)
    router = DeepseekV2TopkRouter(config)
    torch.nn.init.normal_(router.weight, std=0.5, generator=torch.Generator().manual_seed(1))
    x = torch.randn(200, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, want_weights, want_ids = router(x)
    weights, ids = grouped_topk(logits, 4, method, groups or 1, best or 1, False, 2.5)
    order, want_order = ids.long().sort(-1), want_ids.sort(-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices),
                               want_weights.gather(1, want_order.indices))


@pytest.mark.parametrize("renormalize", [True, False])
def test_noaux_tc_routing_matches_transformers_v3_router(renormalize: bool) -> None:
    config = DeepseekV3Config(hidden_size=32, num_attention_heads=4, n_routed_experts=16,
                              num_experts_per_tok=4, n_group=4, topk_group=2,
                              norm_topk_prob=renormalize, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(config)
    generator = torch.Generator().manual_seed(1)
    torch.nn.init.normal_(router.weight, std=0.5, generator=generator)
    router.e_score_correction_bias.copy_(0.3 * torch.randn(16, generator=generator))
    x = torch.randn(200, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, want_weights, want_ids = router(x)
    weights, ids = grouped_topk(logits, 4, "noaux_tc", 4, 2, renormalize, 2.5,
                                router.e_score_correction_bias)
    order, want_order = ids.long().sort(-1), want_ids.sort(-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices),
                               want_weights.gather(1, want_order.indices))
    greedy_ids = torch.topk(logits.sigmoid() + router.e_score_correction_bias, 4).indices
    assert not torch.equal(greedy_ids.sort(-1).values, want_order.values), (
        "the groups should change some token's experts")


def test_v3_checkpoint_mtp_layers_are_skipped(tmp_path: Path) -> None:
    """DeepSeek-V3 checkpoints append multi-token prediction layers past num_hidden_layers:
    skipped, as transformers skips them; any other unknown tensor is still named."""
    from safetensors.torch import load_file, save_file

    folder = build_tiny_model(tmp_path / "v3", "deepseek_v3", seed=3)
    ids = token_ids(9, seed=4)
    want = hf_logits(folder, ids)
    tensors = load_file(str(folder / "model.safetensors"))
    extra = {name.replace("model.layers.2.", "model.layers.3."): t.clone()
             for name, t in tensors.items() if name.startswith("model.layers.2.")}
    save_file({**tensors, **extra}, str(folder / "model.safetensors"))
    got = PagedRunner(load(folder)).step([(0, ids, 0)])[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    save_file({**tensors, "model.layers.1.mlp.gate.extra": torch.zeros(2)},
              str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="unexpected tensor.*gate.extra"):
        load(folder)


def _hub_config(**changes: object) -> dict[str, Any]:
    """DeepSeek-V2-Lite's published config.json (no head_dim, YaRN as `rope_scaling`)."""
    return {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
            "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
            "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
            "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
            "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": None,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
            "topk_method": "greedy", "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6,
            "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": False,
            "scoring_func": "softmax", "hidden_act": "silu", "max_position_embeddings": 163840,
            "rms_norm_eps": 1e-06, "rope_theta": 10000, "torch_dtype": "bfloat16",
            "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                             "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                             "type": "yarn"}, **changes}


def test_hub_config_is_read_and_its_cache_is_576_values_a_token() -> None:
    config = ModelConfig.from_hf(_hub_config())
    assert (config.head_dim, config.rotary_dim, config.kv_lora_rank) == (64, 64, 512)
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "yarn"
    assert (config.cache_kv_heads, config.cache_head_dim) == (1, 288)
    # 27 layers x 16 tokens x 576 values x 2 bytes (bf16), against 2 x 16 heads x 128 dims
    # x 2 bytes a token and layer for uncompressed K and V (v_head_dim 128; K 192).
    assert kv_cache_bytes_per_block(config, 16, torch.bfloat16) == 27 * 16 * 576 * 2
    assert config.mlp_only_layers == (0,) and config.shared_expert_intermediate_size == 2816
    mscale = 0.1 * 0.707 * torch.log(torch.tensor(40.0)).item() + 1.0
    assert softmax_scale(config) == pytest.approx(192**-0.5 * mscale**2)
    v3 = ModelConfig.from_hf(_hub_config(**_V3, n_group=8, topk_group=3))
    assert (v3.topk_method, v3.n_group, v3.topk_group, v3.norm_topk_prob) == (
        "noaux_tc", 8, 3, True)
    assert v3.rope_interleave and v3.cache_head_dim == 288
    # DeepSeek's rule: sparse from first_k_dense_replace on, where index % moe_layer_freq == 0.
    every_other = ModelConfig.from_hf(_hub_config(num_hidden_layers=6, moe_layer_freq=2))
    assert [every_other.is_sparse_layer(i) for i in range(6)] == [False, False, True, False,
                                                                    True, False]


# DeepSeek-V3's routing fields on the V2-Lite shape.
_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "scoring_func": "sigmoid",
       "topk_method": "noaux_tc", "norm_topk_prob": True}


@pytest.mark.parametrize("change, named", [
    ({"norm_topk_prob": True}, "norm_topk_prob"),
    ({"scoring_func": "sigmoid"}, "scoring_func"),
    ({"topk_method": "noaux_tc"}, "topk_method"),
    ({"kv_lora_rank": 511}, "kv_lora_rank"),
    ({"topk_method": "group_limited_greedy", "n_group": 5, "topk_group": 2}, "n_group"),
    ({"topk_method": "group_limited_greedy", "n_group": 16, "topk_group": 1},
     "num_experts_per_tok"),
    ({"moe_layer_freq": 0}, "moe_layer_freq"),
    ({"qk_rope_head_dim": None}, "qk_rope_head_dim"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "scoring_func": "softmax"}, "scoring_func"),
    ({**_V3, "topk_method": "greedy"}, "topk_method"),
    ({**_V3, "n_group": 64, "topk_group": 6}, "n_group"),
])
def test_unsupported_deepseek_configs_are_refused_by_name(change: dict[str, object],
                                                          named: str) -> None:
    with pytest.raises(ModelLoadError, match=named) as refused:
        ModelConfig.from_hf(_hub_config(**change))
    assert refused.value.param == named


def test_stacked_expert_tensors_load_like_per_expert_ones(ds_setup, tmp_path: Path) -> None:
    _, folder, hf, _, _ = ds_setup
    check_stacked_experts_load(folder, hf, tmp_path)


def test_lora_fp8_and_gguf_are_refused_by_name(tmp_path: Path) -> None:
    from meshserve.services.worker.loader import ModelSource, load_model, load_model_config
    from meshserve.shared.quantization import quantization_of

    folder = build_tiny_model(tmp_path / "ds", "deepseek_v2")
    with pytest.raises(ModelLoadError, match="LoRA.*DeepseekV2ForCausalLM"):
        make_engine(folder, enable_lora=True)
    source = ModelSource(str(folder), folder, "hf", None)
    config = load_model_config(source)
    with pytest.raises(ModelLoadError, match="FP8 weights for DeepSeek.*DeepseekV2"):
        load_model(source, config, torch.float32, CPU, "auto",
                   quant=quantization_of({}, "fp8", "flags"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    quant = quantization_of(cfg, None, "config.json")
    assert quant is not None and quant.from_checkpoint
    with pytest.raises(ModelLoadError, match="FP8 checkpoints of DeepSeek.*DeepseekV2"):
        load_model(source, config, torch.float32, CPU, "auto", quant=quant)
    gguf = ModelSource(str(folder), folder / "x.gguf", "gguf", folder / "x.gguf")
    with pytest.raises(ModelLoadError, match="GGUF files of DeepSeek.*DeepseekV2"):
        load_model(gguf, config, torch.float32, CPU, "auto")
