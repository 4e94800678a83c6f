"""The DeepSeek-V2/V3 fields of `ModelConfig`, read from a Hugging Face config.

Attention is multi-head latent attention (MLA): queries through a rank-q_lora_rank pair of
projections (null: one q_proj), keys and values expanded from one compressed latent of
kv_lora_rank dims plus one rotated key part of qk_rope_head_dim dims shared by all heads
(models/deepseek_v2.py). `head_dim` is qk_rope_head_dim, as transformers sets it: the dims
RoPE rotates (published config.json files carry no head_dim).

Experts: n_routed_experts routed ones, num_experts_per_tok chosen per token, their weights
multiplied by routed_scaling_factor, plus n_shared_experts always-on ones run as one MLP of
n_shared_experts * moe_intermediate_size. The first first_k_dense_replace layers are dense,
and after them every layer whose index is not a multiple of moe_layer_freq, as DeepSeek's own
modeling code and vLLM read it (transformers 5.24 reads no moe_layer_freq; every published
checkpoint has 1).

Routing (`models/deepseek_v2.py: grouped_topk`):
    DeepSeek-V2  softmax scores; topk_method greedy, or group_limited_greedy: the experts fall in
                 n_group groups and only the topk_group groups of highest best score compete.
                 transformers 5.24 never renormalises V2's weights, DeepSeek's code does when
                 norm_topk_prob (and then skips the scaling): no published V2 checkpoint sets
                 it, and it is refused rather than guessed.
    DeepSeek-V3  sigmoid scores plus e_score_correction_bias to choose (noaux_tc: groups ranked
                 by the sum of their two best), the plain scores as weights, renormalised
                 when norm_topk_prob.
"""

from __future__ import annotations

from typing import Any

from meshserve.shared.errors import ModelLoadError

DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_V2_TOPK_METHODS = ("greedy", "group_limited_greedy")
_GROUPED_METHODS = ("group_limited_greedy", "noaux_tc")
_SCORING = {"DeepseekV2ForCausalLM": "softmax", "DeepseekV3ForCausalLM": "sigmoid"}


def rope_head_dim(architecture: str, cfg: dict[str, Any], source: str) -> int | None:
    """The head_dim of a DeepSeek config (its qk_rope_head_dim); None for other models."""
    if architecture not in DEEPSEEK_ARCHITECTURES:
        return None
    return _positive(cfg, "qk_rope_head_dim", source)


def deepseek_options(architecture: str, cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """DeepSeek's `ModelConfig` fields (none for another architecture)."""
    if architecture not in DEEPSEEK_ARCHITECTURES:
        return {}
    options = {**_attention_fields(cfg, source), **_expert_fields(architecture, cfg, source)}
    v3 = architecture == "DeepseekV3ForCausalLM"
    options["rope_interleave"] = bool(cfg.get("rope_interleave", True)) if v3 else True
    return options


def _attention_fields(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    rank, rope = _positive(cfg, "kv_lora_rank", source), _positive(cfg, "qk_rope_head_dim", source)
    if (rank + rope) % 2:
        # The cached row [c_kv, k_pe] is split across a slot's K and V halves.
        raise ModelLoadError(
            f"{source}: kv_lora_rank + qk_rope_head_dim must be even (the cached latent row "
            f"is stored in two halves), got {rank} + {rope}", param="kv_lora_rank")
    q_lora_rank = cfg.get("q_lora_rank")
    return {"kv_lora_rank": rank, "qk_rope_head_dim": rope,
            "q_lora_rank": None if q_lora_rank is None else _positive(cfg, "q_lora_rank", source),
            "qk_nope_head_dim": _positive(cfg, "qk_nope_head_dim", source),
            "v_head_dim": _positive(cfg, "v_head_dim", source)}


def _expert_fields(architecture: str, cfg: dict[str, Any], source: str) -> dict[str, Any]:
    layers = int(cfg["num_hidden_layers"])
    experts = int(cfg.get("n_routed_experts") or 0)
    first_dense = int(_field_or(cfg, "first_k_dense_replace", 0))
    freq = int(_field_or(cfg, "moe_layer_freq", 1))
    if first_dense < 0 or freq < 1:
        raise ModelLoadError(f"{source}: first_k_dense_replace must be >= 0 and moe_layer_freq "
                             f">= 1, got {first_dense} and {freq}", param="moe_layer_freq")
    if experts == 0:  # every layer dense
        return {}
    method = _topk_method(architecture, cfg, source)
    grouped = method in _GROUPED_METHODS
    fields = {
        "num_experts": experts,
        "num_experts_per_tok": int(cfg.get("num_experts_per_tok") or 0),
        "moe_intermediate_size": int(cfg.get("moe_intermediate_size") or 0),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "mlp_only_layers": tuple(i for i in range(layers) if i < first_dense or i % freq),
        "shared_expert_intermediate_size": int(cfg.get("moe_intermediate_size") or 0)
        * int(cfg.get("n_shared_experts") or 0),
        "routed_scaling_factor": float(cfg.get("routed_scaling_factor") or 1.0),
        "topk_method": method,
        "n_group": _positive(cfg, "n_group", source) if grouped else 1,
        "topk_group": _positive(cfg, "topk_group", source) if grouped else 1,
    }
    if architecture == "DeepseekV2ForCausalLM" and fields["norm_topk_prob"]:
        raise ModelLoadError(
            f"{source}: norm_topk_prob=true is not supported for DeepSeek-V2 (transformers "
            "ignores it, DeepSeek's code renormalises without routed_scaling_factor; no "
            "published DeepSeek-V2 checkpoint sets it)", param="norm_topk_prob")
    _check_groups(fields, source)
    return fields


def _topk_method(architecture: str, cfg: dict[str, Any], source: str) -> str:
    scoring = cfg.get("scoring_func") or _SCORING[architecture]
    if scoring != _SCORING[architecture]:
        raise ModelLoadError(f"{source}: scoring_func {scoring!r} is not supported for "
                             f"{architecture} (only {_SCORING[architecture]!r})",
                             param="scoring_func")
    if architecture == "DeepseekV3ForCausalLM":
        method = cfg.get("topk_method") or "noaux_tc"
        allowed: tuple[str, ...] = ("noaux_tc",)
    else:
        method = cfg.get("topk_method") or "greedy"
        allowed = _V2_TOPK_METHODS
    if method not in allowed:
        raise ModelLoadError(f"{source}: topk_method {method!r} is not supported for "
                             f"{architecture} (only {', '.join(allowed)})", param="topk_method")
    return str(method)


def _check_groups(fields: dict[str, Any], source: str) -> None:
    experts, groups, best = fields["num_experts"], fields["n_group"], fields["topk_group"]
    if experts % groups or best > groups:
        raise ModelLoadError(
            f"{source}: n_group {groups} must divide n_routed_experts {experts} and be at "
            f"least topk_group {best}", param="n_group")
    per_group = experts // groups
    top_k = fields["num_experts_per_tok"]
    if top_k > best * per_group:
        raise ModelLoadError(
            f"{source}: num_experts_per_tok {top_k} is more than the {best * per_group} experts "
            f"of topk_group {best} groups", param="num_experts_per_tok")
    if fields["topk_method"] == "noaux_tc" and per_group < 2:
        raise ModelLoadError(f"{source}: noaux_tc routing ranks groups by their two best "
                             f"experts; n_group {groups} leaves {per_group} per group",
                             param="n_group")


def _field_or(cfg: dict[str, Any], name: str, default: int) -> Any:
    """The field's value, or `default` where it is missing or null (not where it is 0)."""
    value = cfg.get(name)
    return default if value is None else value


def _positive(cfg: dict[str, Any], name: str, source: str) -> int:
    value = cfg.get(name)
    if value is None or int(value) <= 0:
        raise ModelLoadError(f"{source}: DeepSeek's {name} must be a positive integer, got "
                             f"{value!r}", param=name)
    return int(value)
