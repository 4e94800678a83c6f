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
The layers keep llama.py's protocol (input_norm, the attention's project and attend, finish;
each layer returns its MLP output and the residual stream, the add left to the next layer's
input norm), and the model its `embed` and per-layer `rotary_for`, so the engine's decode and
piecewise CUDA graphs run Gemma as they run Llama. Blocks that fall out of a sliding layer's
window stay allocated while a global layer reads them (all layers share one block table); a
config whose every layer slides has them freed (`ModelConfig.kv_window`, kv_cache_manager.py).
"""

from __future__ import annotations

import torch
from torch import nn

from meshserve.kernels.activation import gelu_tanh_and_mul
from meshserve.kernels.attention import AttentionMetadata
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

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, kv_cache: KVCache, meta: AttentionMetadata,
                rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        """As llama.py's DecoderLayer: this layer's MLP output (after its norm) and the
        residual stream before it is added, the add left to the next layer's input norm."""
        normed, residual = self.input_norm(hidden, residual)
        attn = self.self_attn(positions, normed, kv_cache, meta, rotary)
        return self.finish(attn, residual)

    def input_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed input, residual stream), adding the previous layer's output if any."""
        stream = hidden if residual is None else residual + hidden
        return self.input_layernorm(stream), stream

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """After o_proj: h = residual + norm(attn); (norm(mlp(norm(h))), h)."""
        stream = residual + self.post_attention_layernorm(attn_out)
        mlp = self.mlp(self.pre_feedforward_layernorm(stream))
        return self.post_feedforward_layernorm(mlp), stream


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

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings scaled by sqrt(hidden_size), the factor rounded to the model's dtype
        first, as transformers does."""
        hidden = self.embed_tokens(input_ids)  # [T, H]
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)

    def rotary_for(self, index: int) -> RotaryEmbedding:
        """Gemma 3's sliding layers rotate with their own base; Gemma 2's use the one table."""
        if self.windows[index] is not None and self.rotary_local is not None:
            return self.rotary_local
        return self.rotary_emb


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
        """The RoPE tables (Gemma 3 has two)."""
        super().reset_buffers()
        if isinstance(self.model, GemmaModel) and self.model.rotary_local is not None:
            self.model.rotary_local.reset_parameters()


class Gemma2ForCausalLM(GemmaCausalLM):
    """Gemma 2: alternating sliding-window / global layers, attention and final soft-capping."""


class Gemma3ForCausalLM(GemmaCausalLM):
    """Gemma 3 text (e.g. gemma-3-1b): qk-norm, `layer_types` (5 sliding : 1 global in the
    published models), a local RoPE base for sliding layers; soft-capping when configured."""
