"""The Gemma 2/3 fields of `ModelConfig`, read from a Hugging Face config.

Gemma interleaves sliding-window layers with global ones: Gemma 2 alternates (even layers slide),
Gemma 3 names each layer in `layer_types` (older configs: every `sliding_window_pattern`-th layer
is global). Gemma 3 gives its sliding layers their own RoPE base (`rope_local_base_freq`, in
transformers 5 `rope_parameters["sliding_attention"]`); its global layers take the usual rope
fields (`rope_parameters["full_attention"]`, read by config.py's `_rope`). Attention
soft-capping is Gemma 2's only; the final logit soft-capping both models'.
"""

from __future__ import annotations

from typing import Any

from meshserve.shared.errors import ModelLoadError

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_GELU_TANH = "gelu_pytorch_tanh"
_DEFAULT_QUERY_PRE_ATTN_SCALAR = 256
_DEFAULT_LOCAL_ROPE_THETA = 10000.0
_GEMMA3_DEFAULT_PATTERN = 6


def gemma_options(architecture: str, cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """Gemma's `ModelConfig` fields (none for another architecture)."""
    if architecture not in GEMMA_ARCHITECTURES:
        return {}
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or _GELU_TANH
    if act != _GELU_TANH:
        raise ModelLoadError(f"{source}: hidden_activation {act!r} is not supported (only "
                             f"{_GELU_TANH!r})", param="hidden_activation")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: use_bidirectional_attention is not supported",
                             param="use_bidirectional_attention")
    window = cfg.get("sliding_window")
    if not window or int(window) <= 0:
        raise ModelLoadError(f"{source}: {architecture} needs a positive sliding_window",
                             param="sliding_window")
    sliding = _sliding_layers(architecture, cfg, source)
    gemma3 = architecture == "Gemma3ForCausalLM"
    return {
        "layer_windows": tuple(int(window) if s else None for s in sliding),
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar")
                                       or _DEFAULT_QUERY_PRE_ATTN_SCALAR),
        # Gemma 3's config carries the field, but its attention never applies it (transformers).
        "attn_logit_softcapping": None if gemma3 else _optional_float(
            cfg.get("attn_logit_softcapping")),
        "final_logit_softcapping": _optional_float(cfg.get("final_logit_softcapping")),
        "rope_local_theta": _local_theta(cfg, source) if gemma3 else None,
    }


def _sliding_layers(architecture: str, cfg: dict[str, Any], source: str) -> list[bool]:
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types:
        if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
            raise ModelLoadError(f"{source}: layer_types must name 'sliding_attention' or "
                                 f"'full_attention' for each of the {layers} layers",
                                 param="layer_types")
        return [t == "sliding_attention" for t in types]
    if architecture == "Gemma2ForCausalLM":
        return [(i + 1) % 2 != 0 for i in range(layers)]
    pattern = int(cfg.get("sliding_window_pattern") or _GEMMA3_DEFAULT_PATTERN)
    return [(i + 1) % pattern != 0 for i in range(layers)]


def _local_theta(cfg: dict[str, Any], source: str) -> float:
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ModelLoadError(f"{source}: rope type {local['rope_type']!r} on sliding layers is "
                             "not supported (only 'default')",
                             param="rope_parameters.sliding_attention.rope_type")
    return float(local.get("rope_theta") or cfg.get("rope_local_base_freq")
                 or _DEFAULT_LOCAL_ROPE_THETA)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
