"""`ModelConfig`: the architecture facts the engine and the model modules need.

Built from a Hugging Face config (a `config.json` dict, a `PretrainedConfig`, or the config dict
that transformers derives from GGUF metadata), plus `generation_config.json` when present.
Both rope layouts are read: transformers 4 (`rope_theta` + `rope_scaling`) and transformers 5
(`rope_parameters`, which holds the theta as well).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from meshserve.kernels.activation import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from meshserve.kernels.rotary import compute_inv_freq, rope_type_of
from meshserve.services.worker.models.deepseek_config import deepseek_options, rope_head_dim
from meshserve.services.worker.models.gemma_config import GEMMA_ARCHITECTURES, gemma_options
from meshserve.services.worker.models.gpt_oss_config import gpt_oss_options
from meshserve.services.worker.models.registry import MOE_ARCHITECTURES, check_supported
from meshserve.shared.errors import ModelLoadError
from meshserve.shared.model_config import (
    SLIDING_EVERY_LAYER_ARCHITECTURES,
    architecture_of,
    bos_token_id,
    context_length,
    eos_token_ids,
    sliding_window_of,
    text_config_of,
)

_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "max_position_embeddings")
_DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of one decoder-only model. Derived values are properties."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None for plain RoPE; else has "rope_type"
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2 always, Llama when configured)
    o_proj_bias: bool  # bias on the output projection (Llama/Qwen3 attention_bias)
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE (Qwen3)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str | None  # the checkpoint's dtype name, e.g. "bfloat16"
    sliding_window: int | None = None
    partial_rotary_factor: float = 1.0  # RoPE rotates the first rotary_dim dims of each head
    # Mixture of experts (Qwen2-MoE, Qwen3-MoE, Mixtral); num_experts 0: a dense model.
    num_experts: int = 0  # routed experts per sparse layer (Mixtral: num_local_experts)
    num_experts_per_tok: int = 0  # top k
    moe_intermediate_size: int = 0  # each expert's intermediate size (Mixtral: intermediate_size)
    norm_topk_prob: bool = False  # renormalise the top-k weights to sum to 1 (Mixtral: always)
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not one of these (dense MLP layers)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on shared expert (0: none)
    # Each layer's attention window (None: global); empty for the models whose attention is
    # always full. Gemma 2/3 and gpt-oss interleave (gemma_config.py, gpt_oss_config.py);
    # Mistral, Mixtral and Phi-3 slide every layer over `sliding_window` (_windows).
    layer_windows: tuple[int | None, ...] = ()
    query_pre_attn_scalar: float = 0.0  # attention scale query_pre_attn_scalar ** -0.5
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_theta: float | None = None  # Gemma 3's RoPE base on sliding layers
    # DeepSeek-V2/V3 (models/deepseek_v2.py, deepseek_config.py): multi-head latent attention
    # when kv_lora_rank > 0. head_dim is then qk_rope_head_dim (the dims RoPE rotates).
    kv_lora_rank: int = 0  # the compressed latent c_kv each token caches
    q_lora_rank: int | None = None  # queries through a low-rank q_a/q_b pair (None: q_proj)
    qk_nope_head_dim: int = 0  # per-head key/query dims without RoPE
    qk_rope_head_dim: int = 0  # the rotated dims, one shared key part k_pe for all heads
    v_head_dim: int = 0
    rope_interleave: bool = False  # RoPE rotates pairs (x0, x1), (x2, x3), ... (DeepSeek)
    routed_scaling_factor: float = 1.0  # routed experts' weights are multiplied by this
    topk_method: str = "greedy"  # greedy | group_limited_greedy | noaux_tc (DeepSeek-V3)
    n_group: int = 1  # experts fall in n_group groups; only the best topk_group are chosen
    topk_group: int = 1
    # gpt-oss (models/gpt_oss.py, gpt_oss_config.py): the experts' clamped SwiGLU.
    swiglu_alpha: float = SWIGLU_OAI_ALPHA
    swiglu_limit: float = SWIGLU_OAI_LIMIT
    # A vision-language model's whole Hugging Face config (its vision tower, projector and
    # image token); the fields above are its language model's. None: a text model.
    vision: dict[str, Any] | None = None
    # Its image processor's settings (transformers' `to_dict()` of the folder's), which its
    # `rows_for` may follow (Qwen2.5-VL's resize bounds); set by the worker's loader.
    image_processor: dict[str, Any] | None = None
    # M-RoPE (Qwen2.5-VL): the rotary pairs rotated by each of a token's (time, height,
    # width) positions, summing to rotary_dim / 2; empty: one position a token.
    mrope_section: tuple[int, ...] = ()

    @property
    def max_model_len(self) -> int:
        """Longest context served (`meshserve.shared.model_config.context_length`). Models
        with per-layer windows apply them in attention and are not capped."""
        return context_length(self.max_position_embeddings,
                              None if self.layer_windows else self.sliding_window)

    @property
    def kv_window(self) -> int | None:
        """How far back any layer's attention reaches when every layer slides: the largest
        window (a query at p reads no key before p - kv_window + 1, so the KV cache manager
        frees the blocks behind it). None when some layer reads the whole context."""
        windows = [w for w in self.layer_windows if w is not None]
        if not windows or len(windows) < len(self.layer_windows):
            return None
        return max(windows)

    @property
    def is_moe(self) -> bool:
        """Whether any layer is a mixture of experts."""
        return any(self.is_sparse_layer(i) for i in range(self.num_hidden_layers))

    def is_sparse_layer(self, index: int) -> bool:
        """Whether decoder layer `index` runs experts (else the dense MLP of
        intermediate_size), as transformers' Qwen2-MoE / Qwen3-MoE decoder layers choose."""
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def cache_kv_heads(self) -> int:
        """KV heads of one cache slot: the model's, or 1 for latent attention, whose slot
        holds one compressed row (`cache_head_dim`)."""
        return 1 if self.kv_lora_rank else self.num_key_value_heads

    @property
    def cache_head_dim(self) -> int:
        """Dims of each of a slot's K and V halves: head_dim, or for latent attention half of
        its cached row [c_kv, k_pe] (kernels/mla.py: the K half holds the first half)."""
        if self.kv_lora_rank:
            return (self.kv_lora_rank + self.qk_rope_head_dim) // 2
        return self.head_dim

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (as transformers: int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)


    @classmethod
    def from_hf(cls, hf_config: Any, *, generation_config: dict[str, Any] | None = None,
                source: str = "config.json") -> ModelConfig:
        """Build from a config dict or PretrainedConfig; `source` names the file in errors."""
        outer: dict[str, Any] = (hf_config if isinstance(hf_config, dict)
                                 else hf_config.to_dict())
        check_supported(architecture_of(outer, source), source)
        cfg = text_config_of(outer, source)  # a vision-language model's language model
        architecture = architecture_of(cfg, source)
        for name in _REQUIRED_FIELDS:
            if cfg.get(name) is None:
                raise ModelLoadError(f"{source}: required field {name!r} is missing", param=name)
        if architecture not in GEMMA_ARCHITECTURES:  # (gemma_options checks Gemma's GeGLU)
            _check_mlp(cfg, source)
        heads = int(cfg["num_attention_heads"])
        head_dim = rope_head_dim(architecture, cfg, source) or int(
            cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        partial_rotary_factor = _partial_rotary_factor(cfg)
        rope_theta, rope_scaling = _rope(cfg, int(head_dim * partial_rotary_factor), source)
        config = cls(
            architecture=architecture,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg["max_position_embeddings"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            **_attention_options(architecture, cfg),
            eos_token_ids=eos_token_ids(cfg, generation_config),
            bos_token_id=bos_token_id(cfg, generation_config),
            torch_dtype=_dtype_name(cfg),
            sliding_window=sliding_window_of(architecture, cfg),
            partial_rotary_factor=partial_rotary_factor,
            **_moe_options(architecture, cfg, source),
            **gemma_options(architecture, cfg, source),
            **deepseek_options(architecture, cfg, source),
            **gpt_oss_options(architecture, cfg, source),
            **_windows(architecture, cfg),
            mrope_section=_mrope_section(cfg),
        )
        if cfg is not outer:
            config = replace(config, architecture=architecture_of(outer, source), vision=outer)
        config.validate(source)
        return config

    def validate(self, source: str = "config") -> None:
        """Check the numbers fit together; raise ModelLoadError naming the field."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"{source}: {name} must be positive, got "
                                     f"{getattr(self, name)}", param=name)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}", param="num_key_value_heads")
        if self.head_dim % 2:
            raise ModelLoadError(f"{source}: head_dim {self.head_dim} must be even for RoPE",
                                 param="head_dim")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ModelLoadError(
                f"{source}: partial_rotary_factor {self.partial_rotary_factor} gives "
                f"{self.rotary_dim} rotary dims of head_dim {self.head_dim}; they must be even "
                "and in 2..head_dim", param="partial_rotary_factor")
        if self.mrope_section and (len(self.mrope_section) != 3
                                   or sum(self.mrope_section) != self.rotary_dim // 2):
            raise ModelLoadError(
                f"{source}: rope_scaling.mrope_section {list(self.mrope_section)} must be 3 "
                f"runs of the {self.rotary_dim // 2} rotary pairs", param="mrope_section")
        if self.num_experts > 0:
            self._validate_moe(source)

    def _validate_moe(self, source: str) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ModelLoadError(
                f"{source}: num_experts_per_tok {self.num_experts_per_tok} must be in "
                f"1..{self.num_experts} (the number of experts)", param="num_experts_per_tok")
        if self.moe_intermediate_size <= 0:
            raise ModelLoadError(f"{source}: moe_intermediate_size must be positive, got "
                                 f"{self.moe_intermediate_size}", param="moe_intermediate_size")
        if self.decoder_sparse_step <= 0:
            raise ModelLoadError(f"{source}: decoder_sparse_step must be positive, got "
                                 f"{self.decoder_sparse_step}", param="decoder_sparse_step")


def _windows(architecture: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """`layer_windows` of the architectures that slide every layer over `sliding_window`, as
    transformers runs them (Mistral, Mixtral, Phi-3): the window applied in attention (llama.py)
    instead of capping the context to it."""
    window = sliding_window_of(architecture, cfg)
    if architecture not in SLIDING_EVERY_LAYER_ARCHITECTURES or window is None:
        return {}
    return {"layer_windows": (window,) * int(cfg["num_hidden_layers"])}


def _check_mlp(cfg: dict[str, Any], source: str) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported (only 'silu')",
                             param="hidden_act")
    if cfg.get("mlp_bias"):
        raise ModelLoadError(f"{source}: mlp_bias=true is not supported", param="mlp_bias")


def _partial_rotary_factor(cfg: dict[str, Any]) -> float:
    """RoPE's share of each head: the rope dict's (transformers 5 keeps it there), else the
    top-level field (Phi-4-mini's config.json), else 1."""
    params: dict[str, Any] = cfg.get("rope_parameters") or {}
    merged = {**params.get("full_attention", params), **(cfg.get("rope_scaling") or {})}
    return float(merged.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)


def _rope(cfg: dict[str, Any], head_dim: int,
          source: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either config layout; `head_dim` is the
    rotary part of a head (ModelConfig.rotary_dim)."""
    params: dict[str, Any] = cfg.get("rope_parameters") or {}
    # Gemma 3 keeps one set per layer type; the global layers' is the model's (gemma_config.py).
    params = params.get("full_attention", params)
    merged: dict[str, Any] = {**params, **(cfg.get("rope_scaling") or {})}
    theta = float(merged.pop("rope_theta", None) or cfg.get("rope_theta") or _DEFAULT_ROPE_THETA)
    merged.pop("partial_rotary_factor", None)  # (_partial_rotary_factor)
    merged.pop("mrope_section", None)  # (_mrope_section)
    rope_type = rope_type_of(merged)
    if rope_type == "mrope":  # Qwen2-VL's configs of transformers 4: default frequencies
        rope_type = "default"
    merged.pop("type", None)
    if rope_type in ("longrope", "su"):  # ("su": LongRoPE's name in early Phi-3 configs)
        rope_type = "longrope"
        _longrope_lengths(cfg, merged)
    scaling = None if rope_type == "default" else {**merged, "rope_type": rope_type}
    try:
        compute_inv_freq(head_dim, theta, scaling)  # rejects unsupported types and missing fields now
    except ModelLoadError as exc:
        raise ModelLoadError(f"{source}: {exc.message}", param=exc.param) from exc
    return theta, scaling


def _mrope_section(cfg: dict[str, Any]) -> tuple[int, ...]:
    """M-RoPE's split of the rotary pairs (rope_parameters or rope_scaling), () without."""
    merged = {**(cfg.get("rope_parameters") or {}), **(cfg.get("rope_scaling") or {})}
    return tuple(int(n) for n in merged.get("mrope_section") or ())


def _longrope_lengths(cfg: dict[str, Any], merged: dict[str, Any]) -> None:
    """Fill LongRoPE's lengths in `merged` as transformers does: the top-level
    original_max_position_embeddings (Phi-3 keeps it there) wins, and `factor` defaults to
    max_position_embeddings / original_max_position_embeddings."""
    original = cfg.get("original_max_position_embeddings") or merged.get(
        "original_max_position_embeddings")
    if original:
        merged["original_max_position_embeddings"] = int(original)
        if merged.get("factor") is None:
            merged["factor"] = int(cfg["max_position_embeddings"]) / int(original)


def _attention_options(architecture: str, cfg: dict[str, Any]) -> dict[str, Any]:
    configured_bias = bool(cfg.get("attention_bias", False))
    if architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
        # q/k/v always carry a bias (Qwen2-MoE: qkv_bias, true by default), o_proj never does
        qkv_bias = architecture == "Qwen2ForCausalLM" or bool(cfg.get("qkv_bias", True))
        return {"attention_bias": qkv_bias, "o_proj_bias": False, "qk_norm": False}
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM"):
        return {"attention_bias": False, "o_proj_bias": False, "qk_norm": False}
    return {"attention_bias": configured_bias, "o_proj_bias": configured_bias,
            "qk_norm": architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                                        "Gemma3ForCausalLM")}


def _moe_options(architecture: str, cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """The mixture-of-experts fields of `ModelConfig` (none for a dense architecture)."""
    if architecture not in MOE_ARCHITECTURES:
        return {}
    mixtral = architecture == "MixtralForCausalLM"
    # Published Qwen configs say num_experts; transformers 5 writes num_local_experts for all.
    experts = next((cfg[f] for f in ("num_local_experts", "num_experts")
                    if cfg.get(f) is not None), None)
    if experts is None:
        raise ModelLoadError(f"{source}: required field 'num_local_experts' (or 'num_experts') "
                             "is missing", param="num_local_experts" if mixtral else "num_experts")
    return {
        "num_experts": int(experts),
        "num_experts_per_tok": int(cfg.get("num_experts_per_tok") or 2),
        "moe_intermediate_size": int(cfg["intermediate_size"] if mixtral
                                     else cfg.get("moe_intermediate_size") or 0),
        "norm_topk_prob": mixtral or bool(cfg.get("norm_topk_prob", False)),
        "decoder_sparse_step": 1 if mixtral else int(cfg.get("decoder_sparse_step") or 1),
        "mlp_only_layers": () if mixtral else tuple(
            int(i) for i in cfg.get("mlp_only_layers") or ()),
        "shared_expert_intermediate_size": int(
            cfg.get("shared_expert_intermediate_size") or 0)
        if architecture == "Qwen2MoeForCausalLM" else 0,
    }


def _dtype_name(cfg: dict[str, Any]) -> str | None:
    value = cfg.get("dtype") or cfg.get("torch_dtype")
    if value is None:
        return None
    return str(value).removeprefix("torch.")
