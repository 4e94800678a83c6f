"""The gpt-oss fields of `ModelConfig`, read from a Hugging Face config.

gpt-oss (gpt-oss-20b, gpt-oss-120b) alternates sliding-window layers (`sliding_window`, 128 in
the published models) with full-attention ones, as `layer_types` names them (transformers'
default without it: even layers slide). Every layer is a mixture of experts: num_local_experts
experts of intermediate_size each, num_experts_per_tok chosen per token by the top logits of a
biased router and weighted by a softmax over those k (`norm_topk_prob`: the renormalised top k),
the experts running gpt-oss's clamped SwiGLU (swiglu_alpha, swiglu_limit). q/k/v/o carry
biases (`attention_bias`, read by config.py) and each attention head a learned sink logit.
RoPE is YaRN from the config's rope fields (config.py's `_rope`); transformers fills in a
default YaRN when a config has none, which is refused here rather than guessed.
"""

from __future__ import annotations

from typing import Any

from meshserve.kernels.activation import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from meshserve.shared.errors import ModelLoadError

GPT_OSS_ARCHITECTURES = ("GptOssForCausalLM",)
_LAYER_TYPES = ("sliding_attention", "full_attention")


def gpt_oss_options(architecture: str, cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """gpt-oss's `ModelConfig` fields (none for another architecture)."""
    if architecture not in GPT_OSS_ARCHITECTURES:
        return {}
    window = cfg.get("sliding_window")
    if not window or int(window) <= 0:
        raise ModelLoadError(f"{source}: {architecture} needs a positive sliding_window",
                             param="sliding_window")
    if not (cfg.get("rope_parameters") or cfg.get("rope_scaling")):
        raise ModelLoadError(f"{source}: {architecture} needs its rope fields (rope_scaling or "
                             "rope_parameters: YaRN in the published models)",
                             param="rope_scaling")
    experts = _positive(cfg, "num_local_experts", source)
    top_k = _positive(cfg, "num_experts_per_tok", source)
    limit = float(cfg.get("swiglu_limit") or SWIGLU_OAI_LIMIT)
    if limit <= 0:
        raise ModelLoadError(f"{source}: swiglu_limit must be positive, got {limit}",
                             param="swiglu_limit")
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": _positive(cfg, "intermediate_size", source),
        "norm_topk_prob": True,  # a softmax over the chosen k
        "layer_windows": tuple(int(window) if s else None for s in _sliding_layers(cfg, source)),
        "swiglu_alpha": float(cfg.get("swiglu_alpha") or SWIGLU_OAI_ALPHA),
        "swiglu_limit": limit,
    }


def _sliding_layers(cfg: dict[str, Any], source: str) -> list[bool]:
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if not types:  # transformers' default: layers 0, 2, 4, ... slide
        return [(i + 1) % 2 == 1 for i in range(layers)]
    if len(types) != layers or set(types) - set(_LAYER_TYPES):
        raise ModelLoadError(f"{source}: layer_types must name 'sliding_attention' or "
                             f"'full_attention' for each of the {layers} layers",
                             param="layer_types")
    return [t == "sliding_attention" for t in types]


def _positive(cfg: dict[str, Any], name: str, source: str) -> int:
    value = cfg.get(name)
    if value is None or int(value) <= 0:
        raise ModelLoadError(f"{source}: gpt-oss's {name} must be a positive integer, got "
                             f"{value!r}", param=name)
    return int(value)
