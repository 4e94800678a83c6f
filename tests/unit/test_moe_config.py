"""Reading mixture-of-experts configs into ModelConfig, and what MoE models refuse by name."""

from __future__ import annotations

from typing import Any

import pytest

from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.parallel.config import ParallelConfig, ShardPlan
from meshserve.shared.errors import ModelLoadError

BASE: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
}


def config(architecture: str, **fields: Any) -> ModelConfig:
    return ModelConfig.from_hf({**BASE, "architectures": [architecture], **fields})


def test_qwen3_moe_fields_and_dense_layers() -> None:
    cfg = config("Qwen3MoeForCausalLM", num_experts=128, num_experts_per_tok=8,
                 moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0, 2])
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (128, 8, 32)
    assert cfg.norm_topk_prob and cfg.qk_norm and not cfg.attention_bias and cfg.is_moe
    assert cfg.mlp_only_layers == (0, 2)
    assert [cfg.is_sparse_layer(i) for i in range(4)] == [False, True, False, True]


def test_decoder_sparse_step_chooses_every_nth_layer() -> None:
    cfg = config("Qwen2MoeForCausalLM", num_experts=4, moe_intermediate_size=32,
                 decoder_sparse_step=2)
    assert [cfg.is_sparse_layer(i) for i in range(4)] == [False, True, False, True]


def test_qwen2_moe_fields() -> None:
    cfg = config("Qwen2MoeForCausalLM", num_experts=60, num_experts_per_tok=4,
                 moe_intermediate_size=32, shared_expert_intermediate_size=128)
    assert cfg.shared_expert_intermediate_size == 128
    assert not cfg.norm_topk_prob  # Qwen2-MoE's default
    assert cfg.attention_bias and not cfg.o_proj_bias and not cfg.qk_norm


def test_mixtral_fields() -> None:
    cfg = config("MixtralForCausalLM", num_local_experts=8, num_experts_per_tok=2,
                 norm_topk_prob=False, mlp_only_layers=[0])
    # Experts of intermediate_size, always renormalised, every layer sparse, no bias.
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (8, 96, True)
    assert all(cfg.is_sparse_layer(i) for i in range(4))
    assert not cfg.attention_bias and not cfg.qk_norm


def test_transformers_5_expert_count_name_is_read() -> None:
    cfg = config("Qwen3MoeForCausalLM", num_local_experts=8, moe_intermediate_size=32)
    assert cfg.num_experts == 8


def test_dense_configs_have_no_experts() -> None:
    cfg = config("Qwen3ForCausalLM")
    assert cfg.num_experts == 0 and not cfg.is_moe
    assert not any(cfg.is_sparse_layer(i) for i in range(4))


@pytest.mark.parametrize(("fields", "param"), [
    ({"moe_intermediate_size": 32}, "num_experts"),
    ({"num_experts": 4, "num_experts_per_tok": 5, "moe_intermediate_size": 32},
     "num_experts_per_tok"),
    ({"num_experts": 4}, "moe_intermediate_size"),
    ({"num_experts": 4, "moe_intermediate_size": 32, "decoder_sparse_step": -1},
     "decoder_sparse_step"),
])
def test_bad_moe_fields_are_named(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ModelLoadError) as err:
        config("Qwen3MoeForCausalLM", **fields)
    assert err.value.param == param


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_config_without_architectures_is_refused(model_type: str) -> None:
    """A GGUF file's config names only the model type: MoE GGUF files do not load yet."""
    with pytest.raises(ModelLoadError, match=f"mixture-of-experts model type '{model_type}'"):
        ModelConfig.from_hf({**BASE, "model_type": model_type, "num_experts": 4})


def test_tensor_parallelism_of_a_moe_model_splits_its_experts() -> None:
    """Split, not refused (tests/unit/test_expert_parallel.py has the rest)."""
    cfg = config("MixtralForCausalLM", num_local_experts=4)
    local = ShardPlan(cfg, ParallelConfig(world_size=2, rank=0)).local_config()
    assert (local.num_experts, local.moe_intermediate_size) == (4, 48)
    placed = ShardPlan(cfg, ParallelConfig(world_size=2, rank=1, expert_parallel=True))
    assert (placed.local_config().moe_intermediate_size, placed.placement.first) == (96, 2)
