"""What an architecture does not run with yet is refused by name where it is asked for
(services/worker/models/registry.py), never loaded half right."""

from __future__ import annotations

import pytest

from meshserve.services.worker.models.registry import (
    SUPPORTED_ARCHITECTURES,
    refuse_unsupported,
)
from meshserve.shared.errors import ModelLoadError

LACKING = {
    # Tensor and expert parallelism of MoE models: tests/engine/test_tensor_parallel_moe.py.
    "Qwen3MoeForCausalLM": {"lora", "gguf", "fp8_checkpoint"},
    "Qwen2MoeForCausalLM": {"lora", "gguf", "fp8_checkpoint"},
    "MixtralForCausalLM": {"lora", "gguf", "fp8_checkpoint"},
    "Phi3ForCausalLM": {"tensor_parallel", "lora"},
    "Gemma2ForCausalLM": {"tensor_parallel", "lora", "gguf", "fp8", "fp8_checkpoint"},
    "Gemma3ForCausalLM": {"tensor_parallel", "lora", "gguf", "fp8", "fp8_checkpoint"},
    "DeepseekV2ForCausalLM": {"tensor_parallel", "lora", "gguf", "fp8", "fp8_checkpoint"},
    "DeepseekV3ForCausalLM": {"tensor_parallel", "lora", "gguf", "fp8", "fp8_checkpoint"},
    "GptOssForCausalLM": {"tensor_parallel", "lora", "gguf", "fp8", "fp8_checkpoint"},
    "LlavaForConditionalGeneration": {"tensor_parallel", "lora", "gguf", "fp8",
                                      "fp8_checkpoint"},
    "LlavaNextForConditionalGeneration": {"tensor_parallel", "lora", "gguf", "fp8",
                                          "fp8_checkpoint"},
    "Qwen2_5_VLForConditionalGeneration": {"tensor_parallel", "lora", "gguf", "fp8",
                                           "fp8_checkpoint"},
    "Gemma3ForConditionalGeneration": {"tensor_parallel", "lora", "gguf", "fp8",
                                       "fp8_checkpoint"},
}
FEATURES = ("tensor_parallel", "lora", "gguf", "fp8", "fp8_checkpoint")
FLAGS = {"tensor_parallel": "tensor_parallel_size", "lora": "enable_lora", "gguf": "model",
         "fp8": "quantization", "fp8_checkpoint": "model"}


@pytest.mark.parametrize("architecture", SUPPORTED_ARCHITECTURES)
@pytest.mark.parametrize("feature", FEATURES)
def test_each_architecture_refuses_exactly_what_it_lacks(architecture: str,
                                                         feature: str) -> None:
    if feature not in LACKING.get(architecture, set()):
        refuse_unsupported(architecture, feature)  # runs with it: nothing raised
        return
    with pytest.raises(ModelLoadError, match=architecture) as refused:
        refuse_unsupported(architecture, feature)
    assert refused.value.param == FLAGS[feature]
    assert "not supported yet" in refused.value.message


def test_tensor_parallelism_of_gemma_is_refused_before_any_rank_starts() -> None:
    from meshserve.services.worker.models.config import ModelConfig
    from meshserve.services.worker.parallel.config import ParallelConfig, ShardPlan

    config = ModelConfig.from_hf({
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 256,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 256, "sliding_window": 8, "query_pre_attn_scalar": 16,
        "hidden_activation": "gelu_pytorch_tanh"})
    with pytest.raises(ModelLoadError, match="tensor parallelism of Gemma 2/3 models"):
        ShardPlan(config, ParallelConfig(world_size=2))
