"""Architecture name (the `architectures` entry of a Hugging Face config) -> model class.

Classes are imported on first use, so reading a config never imports model code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from meshserve.shared.errors import ModelLoadError

if TYPE_CHECKING:
    from meshserve.services.worker.models.llama import CausalLM

# architecture -> (module under meshserve.services.worker.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "CausalLM"),
    "MistralForCausalLM": ("llama", "CausalLM"),
    "Qwen2ForCausalLM": ("llama", "CausalLM"),
    "Qwen3ForCausalLM": ("llama", "CausalLM"),
    "Qwen2MoeForCausalLM": ("moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("moe", "MixtralForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV3ForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
    "LlavaNextForConditionalGeneration": ("llava", "LlavaNextForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Gemma3ForConditionalGeneration": ("gemma3_vlm", "Gemma3ForConditionalGeneration"),
}

# The mixtures of experts among them (services/worker/models/moe.py).
MOE_ARCHITECTURES: tuple[str, ...] = (
    "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")
# Hugging Face model types of those, as a config without `architectures` (a GGUF file's,
# exported by transformers) names them: MoE weights load from safetensors folders only.
_MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral")

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)

# What an architecture does not run with yet, refused by name where it is asked for.
# Feature -> (the flag that asks for it, what it is), worded for the error.
_FEATURES = {
    "tensor_parallel": ("--tensor-parallel-size", "tensor parallelism of {family} models"),
    "lora": ("--enable-lora", "LoRA adapters on {family} models"),
    "gguf": ("--model", "GGUF files of {family} models"),
    "fp8_checkpoint": ("--model", "FP8 checkpoints of {family} models"),
    "fp8": ("--quantization", "FP8 weights for {family} models"),
}
# Architecture -> (its family's name, the features it lacks, what to do instead).
_NOT_YET: dict[str, tuple[str, frozenset[str], str]] = {
    # (Tensor parallelism, with or without expert parallelism: parallel/experts.py.)
    **{arch: ("mixture-of-experts", frozenset({"lora", "gguf", "fp8_checkpoint"}),
              "run it from a bf16 Hugging Face safetensors folder")
       for arch in MOE_ARCHITECTURES},
    # Its checkpoints hold q/k/v and gate/up fused: the tensor-parallel slicer and LoRA's
    # adapters name them apart.
    "Phi3ForCausalLM": ("Phi-3", frozenset({"tensor_parallel", "lora"}),
                        "run it on one device without adapters"),
    # Four norms a layer, (1 + weight) norms and per-layer windows: neither the slicer,
    # the adapters, the FP8 layers nor the GGUF reader (which stores norms shifted) know it.
    **{arch: ("Gemma 2/3", frozenset({"tensor_parallel", "lora", "gguf", "fp8",
                                      "fp8_checkpoint"}),
              "run it on one device from a bf16 Hugging Face safetensors folder")
       for arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")},
    # Latent attention and its compressed cache: neither the slicer, the adapters, the FP8
    # layers (nor DeepSeek's block-scaled FP8 checkpoints) nor the GGUF reader know them.
    **{arch: ("DeepSeek", frozenset({"tensor_parallel", "lora", "gguf", "fp8",
                                     "fp8_checkpoint"}),
              "run it on one device from a bf16 Hugging Face safetensors folder")
       for arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")},
    # Sinks, windows and biased clamped-SwiGLU experts: neither the slicer, the adapters, the
    # FP8 layers nor the GGUF reader know them (MXFP4 checkpoints load, dequantized).
    "GptOssForCausalLM": ("gpt-oss", frozenset({"tensor_parallel", "lora", "gguf", "fp8",
                                                "fp8_checkpoint"}),
                          "run it on one device from a safetensors folder, bf16 or MXFP4"),
    # The image rows reach the first layer on one rank only; the vision tower and projector
    # are neither sliced, adapted nor quantized.
    **{arch: ("vision-language", frozenset({"tensor_parallel", "lora", "gguf", "fp8",
                                            "fp8_checkpoint"}),
              "run it on one device from a bf16 Hugging Face safetensors folder")
       for arch in ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                    "Qwen2_5_VLForConditionalGeneration", "Gemma3ForConditionalGeneration")},
}


def refuse_unsupported(architecture: str, feature: str) -> None:
    """Raise ModelLoadError naming the architecture when it does not run with `feature`
    (one of _FEATURES) yet."""
    assert feature in _FEATURES, f"unknown feature {feature!r}"
    family, lacking, instead = _NOT_YET.get(architecture, ("", frozenset(), ""))
    if feature in lacking:
        flag, what = _FEATURES[feature]
        raise ModelLoadError(f"{flag}: {what.format(family=family)} ({architecture}) are not "
                             f"supported yet; {instead}", param=flag.lstrip("-").replace("-", "_"))


def check_supported(architecture: str, source: str) -> None:
    """Raise ModelLoadError unless `architecture` is one meshserve runs."""
    if architecture in _MOE_MODEL_TYPES:
        raise ModelLoadError(
            f"{source}: mixture-of-experts model type {architecture!r} without 'architectures' "
            f"(as a GGUF file's config) is not supported yet; load {', '.join(MOE_ARCHITECTURES)} from a Hugging Face "
            "safetensors folder", param="architectures")
    if architecture not in _MODELS:
        raise ModelLoadError(
            f"{source}: architecture {architecture!r} is not supported; supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}", param="architectures")


def get_model_class(architecture: str) -> type[CausalLM]:
    """The module class that runs `architecture`."""
    check_supported(architecture, "model config")
    module_name, class_name = _MODELS[architecture]
    module = importlib.import_module(f"meshserve.services.worker.models.{module_name}")
    model_class: type[CausalLM] = getattr(module, class_name)
    return model_class
