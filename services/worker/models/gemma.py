"""Gemma 2 and Gemma 3 (text): the Llama-family decoder of llama.py with Gemma's changes.

    embeddings   scaled by sqrt(hidden_size), the factor rounded to the model's dtype
    RMSNorm      x * (1 + weight), in float32 before the cast back (kernels/norm.py)
    layer        h += post_attention_norm(attn(input_norm(h)))
                 h += post_feedforward_norm(mlp(pre_feedforward_norm(h)))
    MLP          GeGLU: down(gelu_tanh(gate(x)) * up(x))
    attention    scale query_pre_attn_scalar ** -0.5; scores soft-capped by
                 attn_logit_softcapping (when set); sliding-window layers read only their last
                 `sliding_window` positions, the others all (`ModelConfig.layer_windows`)
    Gemma 3      q/k RMSNorm (Gemma's) before RoPE; sliding layers rotate with their own base
                 (`rope_local_theta`), global layers with rope_theta and its scaling
    logits       tied to the embeddings, soft-capped by final_logit_softcapping (when set)

Attention reads the paged KV cache as every model does, with the window and soft-capping in
both the PyTorch reference and the Triton kernel (kernels/attention.py, triton_attention.py).
The model still refuses a CUDA device by name: the engine's piecewise CUDA graphs cut a layer
at llama.py's DecoderLayer pieces (input_norm, project, finish) and use one RoPE table, which
Gemma's layers do not fit yet. Blocks that fall out of a sliding layer's window stay allocated
(all layers share one block table, and global layers read them).
"""

from __future__ import annotations

import torch
from torch import nn

from meshserve.kernels.activation import gelu_tanh_and_mul
from meshserve.kernels.attention import AttentionMetadata, paged_attention
from meshserve.kernels.norm import gemma_rms_norm
from meshserve.kernels.rotary import RotaryEmbedding
from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.llama import (
    MLP,
    Attention,
    CausalLM,
    DecoderModel,
    KVCache,
    RMSNorm,
)
from meshserve.shared.errors import ModelLoadError


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaling by (1 + weight), in float32 (`kernels.norm.gemma_rms_norm`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor,
                    residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new_residual = residual + x
        return self(new_residual), new_residual


class GemmaMLP(MLP):
    """llama.py's MLP with a tanh-approximated GELU gate instead of SiLU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))  # [T, H]


class GemmaAttention(Attention):
    """llama.py's attention with Gemma's scale, q/k norms, soft-capping and the layer's window."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__(config)
        self.scale = config.query_pre_attn_scalar**-0.5
        self.window = config.layer_windows[index]
        self.softcap = config.attn_logit_softcapping
        if config.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, rotary: RotaryEmbedding) -> torch.Tensor:
        q, k, v = self.project(positions, hidden, kv_cache, meta.slot_mapping, rotary)
        k_cache, v_cache = kv_cache
        out = paged_attention(q, k_cache, v_cache, meta, self.scale, key=k, value=v,
                              window=self.window, softcap=self.softcap)  # [T, Hq, D]
        return self.o_proj(out.reshape(-1, self.q_size))  # [T, H]


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(config, index)
        self.mlp = GemmaMLP(config)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, rotary: RotaryEmbedding) -> torch.Tensor:
        """hidden [T, H] (the residual stream) -> [T, H]."""
        attn = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta, rotary)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class GemmaModel(DecoderModel):
    """Embeddings, layers and final norm. A DecoderModel for the code that reads its parts
    (embed_tokens, layers, norm, rotary_emb); its own constructor and forward."""

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.head_dim,
                                          config.max_position_embeddings, config.rope_theta,
                                          config.rope_scaling)
        # Gemma 3's sliding layers rotate with their own base; Gemma 2's use the one table.
        self.rotary_local: RotaryEmbedding | None = None
        if config.rope_local_theta is not None:
            self.rotary_local = RotaryEmbedding(config.head_dim, config.head_dim,
                                                config.max_position_embeddings,
                                                config.rope_local_theta)
        self.windows = config.layer_windows

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        assert len(kv_caches) == len(self.layers), (
            f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        hidden = self.embed_tokens(input_ids)  # [T, H]
        # As transformers: the factor is rounded to the model's dtype before the multiply.
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        for layer, kv_cache, window in zip(self.layers, kv_caches, self.windows):
            rotary = (self.rotary_local if window is not None and self.rotary_local is not None
                      else self.rotary_emb)
            hidden = layer(positions, hidden, kv_cache, meta, rotary)
        return self.norm(hidden)


class GemmaCausalLM(CausalLM):
    """Gemma 2/3 over the paged KV cache (see the module docstring)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        assert config.layer_windows, "a Gemma config has per-layer windows (gemma_config.py)"
        self.model = GemmaModel(config)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """CausalLM's [N, V] float32 logits, soft-capped: tanh(l / cap) * cap."""
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

    def reset_buffers(self) -> None:
        """The RoPE tables; refuses a GPU, where the engine's CUDA graphs do not fit Gemma's
        layers yet (module docstring)."""
        if self.model.embed_tokens.weight.is_cuda:
            raise ModelLoadError(
                f"{self.config.architecture} runs on CPU only for now: the GPU path's piecewise "
                "CUDA graphs do not fit Gemma's layers (four norms, per-layer sliding window and "
                "RoPE base) yet", param="device")
        super().reset_buffers()
        if isinstance(self.model, GemmaModel) and self.model.rotary_local is not None:
            self.model.rotary_local.reset_parameters()


class Gemma2ForCausalLM(GemmaCausalLM):
    """Gemma 2: alternating sliding-window / global layers, attention and final soft-capping."""


class Gemma3ForCausalLM(GemmaCausalLM):
    """Gemma 3 text (e.g. gemma-3-1b): qk-norm, `layer_types` (5 sliding : 1 global in the
    published models), a local RoPE base for sliding layers; soft-capping when configured."""
