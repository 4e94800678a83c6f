"""DeepSeek-V2 (and V2-Lite, V2.5) and V3: multi-head latent attention, DeepSeek's experts.

    attention  q     = q_proj(x), or q_b_proj(norm(q_a_proj(x))) with q_lora_rank   [T, H, nope + P]
               c_kv, k_pe = kv_a_proj_with_mqa(x) split [R | P]; c_kv = kv_a_layernorm(c_kv)
               q_pe, k_pe rotated (DeepSeek's interleaved pairs, kernels/mla.py)
               cache [c_kv, k_pe]: R + P values per token and layer, nothing per head
               kv_b_proj [H * (nope + v), R] = per head W_UK [nope, R] then W_UV [v, R]
               out   = o_proj(W_UV . attention([q_nope W_UK, q_pe] over [c_kv, k_pe]))
               scale (nope + P) ** -0.5, times mscale(factor, mscale_all_dim)^2 under YaRN
    MLP        dense (intermediate_size) in the first first_k_dense_replace layers and off
               the moe_layer_freq beat; elsewhere routed experts (grouped top-k, weights times
               routed_scaling_factor) plus the shared experts, one ungated MLP
               (models/deepseek_config.py; V3 routes by sigmoid scores and a bias)

The residual stream, norms, embeddings and LM head are the Llama-family decoder's (llama.py),
and checkpoints name experts as models/moe.py reads them (per expert, or stacked as transformers
holds them), the shared experts `mlp.shared_experts.{gate,up,down}_proj`. The cache holds only
the compressed rows (`ModelConfig.cache_kv_heads` / `cache_head_dim`, kernels/mla.py).

On a GPU latent attention runs the Triton kernel of kernels/triton_mla.py, and the layers keep
llama.py's protocol (input_norm, the attention's project, attend and output, finish), so the
engine's decode and piecewise CUDA graphs run them: `project` (captured) returns the latent
queries [T, H, R + P] and this step's cached rows, already written; `attend` (eager in the
piecewise graphs) the latent outputs [T, H, R]; `output` (captured) multiplies by W_UV, then
o_proj.
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from meshserve.kernels.attention import AttentionMetadata
from meshserve.kernels.mla import mla_attention, rotate_pe, write_latents
from meshserve.kernels.rotary import RotaryEmbedding
from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.llama import (
    MLP,
    DecoderLayer,
    DecoderModel,
    KVCache,
    Linear,
    PieceShapes,
    RMSNorm,
)
from meshserve.services.worker.models.moe import (
    ExpertRouter,
    Experts,
    MoeCausalLM,
    SparseMoeBlock,
)

# The eps of the q_a and kv_a norms: DeepSeek builds them with RMSNorm's default, whatever
# rms_norm_eps says.
_LATENT_NORM_EPS = 1e-6


def softmax_scale(config: ModelConfig) -> float:
    """(nope + P) ** -0.5, times mscale(factor, mscale_all_dim)^2 when a RoPE scaling sets
    mscale_all_dim (YaRN): transformers' `yarn_apply_mscale`."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    scaling = config.rope_scaling or {}  # (None for plain RoPE)
    mscale_all_dim = float(scaling.get("mscale_all_dim") or 0)
    factor = float(scaling.get("factor") or 1)
    if mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class LatentAttention(nn.Module):
    """Multi-head latent attention over the compressed cache (see the module docstring)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        heads, hidden = config.num_attention_heads, config.hidden_size
        self.num_heads, self.rank = heads, config.kv_lora_rank
        self.nope, self.rope, self.v_dim = (config.qk_nope_head_dim, config.qk_rope_head_dim,
                                            config.v_head_dim)
        q_size = heads * (self.nope + self.rope)
        bias = config.attention_bias
        self.q_proj: Linear | None = None
        self.q_a_proj: Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: Linear | None = None
        if config.q_lora_rank is None:
            self.q_proj = Linear(hidden, q_size, bias=False)
        else:
            self.q_a_proj = Linear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = Linear(config.q_lora_rank, q_size, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, _LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.rank, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(heads * self.v_dim, hidden, bias=bias)
        self.scale = softmax_scale(config)
        self.interleave = config.rope_interleave

    def queries(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, H * (nope + P)]."""
        if self.q_proj is not None:
            return self.q_proj(hidden)
        assert self.q_a_proj is not None and self.q_a_layernorm is not None
        assert self.q_b_proj is not None
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, rotary: RotaryEmbedding) -> torch.Tensor:
        q, k, v = self.project(positions, hidden, kv_cache, meta.slot_mapping, rotary)
        return self.output(self.attend(q, k, v, kv_cache, meta))  # [T, hidden]

    def project(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache,
                slot_mapping: torch.Tensor, rotary: RotaryEmbedding,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The latent queries [T, H, R + P] ([q_nope W_UK, rotated q_pe]) and this step's
        cached rows [c_kv, rotated k_pe], written to the cache and returned as the slot holds
        them: k and v [T, 1, (R + P) / 2], each row's halves.

        Everything before attention reads the cache: one piece of a piecewise CUDA graph."""
        heads = self.num_heads
        q = self.queries(hidden).view(-1, heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)  # [T, H, nope], [T, H, P]
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [T, R]
        q_pe, k_pe = rotate_pe(positions, q_pe, k_pe[:, None], rotary.cos_sin_cache,
                               self.interleave)  # [T, H, P], [T, 1, P]
        k_cache, v_cache = kv_cache
        rows = torch.cat((latent, k_pe[:, 0]), dim=-1)  # [T, R + P]
        write_latents(rows, k_cache, v_cache, slot_mapping)
        w_kv = self.kv_b_proj.weight.view(heads, self.nope + self.v_dim, self.rank)
        w_uk = w_kv[:, : self.nope]  # [H, nope, R]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, R]
        half = k_cache.shape[3]
        return torch.cat((q_latent, q_pe), dim=-1), rows[:, None, :half], rows[:, None, half:]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
               meta: AttentionMetadata) -> torch.Tensor:
        """Latent attention of q [T, H, R + P] over the cache (k, v: this step's rows, already
        written, not read again): the latent outputs [T, H, R]. The one piece of a layer
        that the piecewise CUDA graphs run eagerly."""
        k_cache, v_cache = kv_cache
        return mla_attention(q, k_cache, v_cache, meta, self.scale, self.rank)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """Latent outputs [T, H, R] -> [T, hidden]: per head through W_UV, then o_proj."""
        heads = self.num_heads
        w_kv = self.kv_b_proj.weight.view(heads, self.nope + self.v_dim, self.rank)
        w_uv = w_kv[:, self.nope :]  # [H, v, R]
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2))  # [H, T, v]
        return self.o_proj(out.transpose(0, 1).reshape(-1, heads * self.v_dim))

    def piece_shapes(self) -> PieceShapes:
        """q [H, R + P], k and v [1, (R + P) / 2] (a row's halves), out [H, R] per token."""
        half = (self.rank + self.rope) // 2
        return PieceShapes(q=(self.num_heads, self.rank + self.rope), k=(1, half), v=(1, half),
                           out=(self.num_heads, self.rank))


def grouped_topk(
    router_logits: torch.Tensor,  # [T, E] float32
    top_k: int,
    method: str,  # greedy | group_limited_greedy | noaux_tc
    num_groups: int,
    topk_group: int,
    renormalize: bool,
    scaling_factor: float,
    correction_bias: torch.Tensor | None = None,  # [E], noaux_tc's
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] float32, expert ids [T, k] int32
    """DeepSeek's routing, as transformers' DeepseekV2/V3 routers compute it.

    greedy: the top k softmax scores. group_limited_greedy: only experts of the topk_group
    groups with the highest best score compete. noaux_tc (V3): sigmoid scores plus the
    correction bias choose, groups ranked by the sum of their two best; the weights are the
    plain scores. Then renormalised to sum 1 (with `renormalize`) and scaled."""
    tokens, experts = router_logits.shape
    if method == "noaux_tc":
        assert correction_bias is not None, "noaux_tc routing needs e_score_correction_bias"
        scores = router_logits.sigmoid()
        choice = scores + correction_bias.float()
        group_scores = choice.view(tokens, num_groups, -1).topk(2, dim=-1).values.sum(dim=-1)
        masked = float("-inf")
    else:
        scores = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        choice = scores
        group_scores = choice.view(tokens, num_groups, -1).max(dim=-1).values
        masked = 0.0
    if method != "greedy":
        best = torch.topk(group_scores, topk_group, dim=-1).indices  # [T, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        keep = keep.repeat_interleave(experts // num_groups, dim=1)  # [T, E]
        choice = choice.masked_fill(~keep, masked)
    ids = torch.topk(choice, top_k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, ids.to(torch.int32)


class DeepseekRouter(ExpertRouter):
    """The router's [E, H] weight (in float32 math, as transformers keeps it), with
    DeepSeek-V3's e_score_correction_bias [E] under noaux_tc."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config.num_experts, config.hidden_size)
        self.config = config
        self.e_score_correction_bias: nn.Parameter | None = None
        if config.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.empty(config.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] float32, expert ids [T, k] int32)."""
        c = self.config
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        return grouped_topk(logits, c.num_experts_per_tok, c.topk_method, c.n_group,
                            c.topk_group, c.norm_topk_prob, c.routed_scaling_factor,
                            self.e_score_correction_bias)


class DeepseekMoe(SparseMoeBlock):
    """Routed experts plus DeepSeek's always-on shared experts (one MLP, no gate). A
    SparseMoeBlock for models/moe.py's checkpoint layout (its Qwen2-MoE shared expert unset)."""

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        self.gate: DeepseekRouter = DeepseekRouter(config)
        self.experts = Experts(config.num_experts, config.hidden_size,
                               config.moe_intermediate_size)
        self.shared_expert = None
        self.shared_expert_gate = None
        shared = config.shared_expert_intermediate_size
        self.shared_experts = (MLP(dataclasses.replace(config, intermediate_size=shared))
                               if shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        weights, expert_ids = self.gate.route(x)
        out = self.experts(x, weights, expert_ids)  # [T, H]
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DeepseekDecoderLayer(DecoderLayer):
    """llama.py's layer (fused residual adds, its forward) around latent attention and
    DeepSeek's MLP."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        nn.Module.__init__(self)
        self.self_attn = LatentAttention(config)  # type: ignore[assignment]
        self.mlp = DeepseekMoe(config) if config.is_sparse_layer(index) else MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekModel(DecoderModel):
    """Embeddings, DeepSeek layers and final norm; DecoderModel's forward. The RoPE table
    covers the qk_rope_head_dim rotated dims (`ModelConfig.head_dim` here)."""

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.qk_rope_head_dim, config.qk_rope_head_dim,
                                          config.max_position_embeddings, config.rope_theta,
                                          config.rope_scaling)


class DeepseekV2ForCausalLM(MoeCausalLM):
    """DeepSeek-V2 over the compressed latent cache (see the module docstring)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        assert config.kv_lora_rank > 0, "a DeepSeek config has kv_lora_rank (deepseek_config.py)"
        self.model = DeepseekModel(config)

    def _expert_layout(self, index: int,
                       block: SparseMoeBlock) -> dict[str, tuple[str, int, int]]:
        """models/moe.py's expert rows, and the shared experts' gate/up rows at their own
        size (CausalLM's layout gives them intermediate_size's)."""
        layout = super()._expert_layout(index, block)
        shared = block.shared_experts if isinstance(block, DeepseekMoe) else None
        if shared is not None:
            size = shared.down_proj.in_features
            prefix = f"model.layers.{index}.mlp.shared_experts"
            fused = f"{prefix}.gate_up_proj.weight"
            layout[f"{prefix}.gate_proj.weight"] = (fused, 0, size)
            layout[f"{prefix}.up_proj.weight"] = (fused, size, size)
        return layout


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1 (bf16 checkpoints): V2's layers with noaux_tc routing (sigmoid scores,
    e_score_correction_bias, groups ranked by their two best, renormalised) and RoPE pairs
    interleaved unless rope_interleave is false. Its checkpoints append multi-token
    prediction layers (model.layers.{num_hidden_layers}...), which serving does not run."""

    def _ignorable(self, name: str) -> bool:
        match = re.match(r"model\.layers\.(\d+)\.", name)
        if match is not None and int(match[1]) >= self.config.num_hidden_layers:
            return True
        return super()._ignorable(name)
