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
}

# The mixtures of experts among them (services/worker/models/moe.py).
MOE_ARCHITECTURES: tuple[str, ...] = (
    "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")
# Hugging Face model types of those, as a config without `architectures` (a GGUF file's,
# exported by transformers) names them: MoE weights load from safetensors folders only.
_MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral")

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)


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
