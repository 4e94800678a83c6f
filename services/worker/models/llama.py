"""The Llama-family decoder: Llama 2/3/3.1/3.2, Mistral, SmolLM2, Qwen2/2.5 and Qwen3.

They differ only in a few switches read from `ModelConfig`: a bias on q/k/v (Qwen2), a per-head
RMSNorm of q and k before RoPE (Qwen3), and tied input/output embeddings. The forward pass runs
over one flat batch of T new tokens from any number of sequences; attention reads and writes the
paged KV cache the engine owns, so the model itself keeps no per-request state.

Parameters are named as in Hugging Face checkpoints except that q/k/v are fused into `qkv_proj`
and gate/up into `gate_up_proj` (one matmul each); `load_weights` does the fusing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from meshserve.kernels.activation import silu_and_mul
from meshserve.kernels.attention import AttentionMetadata, paged_attention
from meshserve.kernels.linear import SKINNY_MAX_ROWS, linear
from meshserve.kernels.norm import fused_add_rms_norm, rms_norm
from meshserve.kernels.rotary import RotaryEmbedding
from meshserve.services.worker.models.config import ModelConfig
from meshserve.shared.errors import ModelLoadError

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each [N, bs, Hkv, D]
# (config, layer index) -> that layer's MLP; mixtures of experts hand one in (models/moe.py).
MlpFactory = Callable[[ModelConfig, int], nn.Module]

# The LM head's rows (past SKINNY_MAX_ROWS, on a GPU) are padded to a multiple of this
# (`CausalLM.compute_logits`).
LOGITS_ROW_BUCKET = 64


def padded_logit_rows(rows: int) -> int:
    """The row count the LM head runs for `rows` rows when padding (`compute_logits`)."""
    if rows <= SKINNY_MAX_ROWS:
        return rows
    return -(-rows // LOGITS_ROW_BUCKET) * LOGITS_ROW_BUCKET


# Checkpoint entries that hold no weights of ours (old Llama files saved RoPE buffers).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".rotary_emb.cos_cached", ".rotary_emb.sin_cached")


class Linear(nn.Linear):
    """nn.Linear whose product goes through `meshserve.kernels.linear` (a Triton kernel for
    decode-sized inputs on a GPU)."""

    # Multi-LoRA serving hooks a callable here that adds each row's adapter product to y.
    lora: Callable[[torch.Tensor, torch.Tensor], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias)
        if self.lora is not None:
            self.lora(x, y)  # x [T, K], y [T, N] in place
        return y


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor,
                    residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one pass."""
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


@dataclass(frozen=True)
class PieceShapes:
    """Per-token shapes of what an attention's `project` returns (q, k, v) and what its
    `attend` returns (out): the piecewise CUDA graphs hold them in static buffers."""

    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    out: tuple[int, ...]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        # Mistral-style models slide every layer over one window (None: full attention);
        # models with per-layer windows set their own (gemma.py, gpt_oss.py).
        self.window = config.kv_window
        # Gemma's logit soft-capping and gpt-oss's per-head sink logits [Hq] (None: none).
        self.softcap: float | None = None
        self.sinks: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, rotary: RotaryEmbedding) -> torch.Tensor:
        q, k, v = self.project(positions, hidden, kv_cache, meta.slot_mapping, rotary)
        out = self.attend(q, k, v, kv_cache, meta)  # [T, Hq, D]
        return self.output(out)  # [T, H]

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention's output [T, Hq, D] -> [T, H] through o_proj (in the piecewise CUDA
        graphs, the first step of the next piece)."""
        return self.o_proj(out.reshape(-1, self.q_size))

    def piece_shapes(self) -> PieceShapes:
        """q [Hq, D], k and v [Hkv, D], out [Hq, D] per token."""
        q, kv = (self.num_heads, self.head_dim), (self.num_kv_heads, self.head_dim)
        return PieceShapes(q=q, k=kv, v=kv, out=q)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
               meta: AttentionMetadata) -> torch.Tensor:
        """Attention of q [T, Hq, D] over the cache (k, v: this step's, already written):
        [T, Hq, D]. The one piece of a layer that the piecewise CUDA graphs run eagerly."""
        k_cache, v_cache = kv_cache
        return paged_attention(q, k_cache, v_cache, meta, self.scale, key=k, value=v,
                               window=self.window, softcap=self.softcap, sinks=self.sinks)

    def project(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache,
                slot_mapping: torch.Tensor, rotary: RotaryEmbedding,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [T, H*, D] of the tokens (rotated), with k and v written to the cache.

        Everything before attention reads the cache: one piece of a piecewise CUDA graph."""
        qkv = self.qkv_proj(hidden)  # [T, (Hq + 2 Hkv) D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        k_cache, v_cache = kv_cache
        q, k = rotary.rotate_and_write_kv(positions, q, k, v, k_cache, v_cache, slot_mapping)
        return q, k, v


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size,
                                   bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))  # [T, 2I] -> [T, I] -> [T, H]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config) if mlp is None else mlp  # [T, H] -> [T, H]
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, kv_cache: KVCache, meta: AttentionMetadata,
                rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns this layer's MLP output and the residual stream before it is added:
        the add is fused into the next layer's input norm."""
        hidden, residual = self.input_norm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, rotary)
        return self.finish(hidden, residual)

    def input_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed input, residual stream), adding the previous layer's output if any."""
        if residual is None:
            return self.input_layernorm(hidden), hidden
        return self.input_layernorm.add_forward(hidden, residual)

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rest of the layer after attention's o_proj: residual add, norm and MLP."""
        hidden, residual = self.post_attention_layernorm.add_forward(attn_out, residual)
        return self.mlp(hidden), residual


class TokenEmbedding(Protocol):
    """The model's token embedding: nn.Embedding, or tensor parallelism's slice of it
    (services/worker/parallel/layers.py's VocabParallelEmbedding)."""

    @property
    def weight(self) -> torch.Tensor: ...
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor: ...


# (rows [R] of the step's tokens, their embeddings [R, H]): images' rows.
ImageRows = tuple[torch.Tensor, torch.Tensor]


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, mlp_factory: MlpFactory | None = None) -> None:
        super().__init__()
        self.embed_tokens: TokenEmbedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, None if mlp_factory is None else mlp_factory(config, i))
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rotary_dim,
                                          config.max_position_embeddings, config.rope_theta,
                                          config.rope_scaling)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [T] -> the first layer's input [T, H]."""
        return self.embed_tokens(input_ids)

    def rotary_for(self, index: int) -> RotaryEmbedding:
        """The RoPE table layer `index` rotates with."""
        return self.rotary_emb

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata,
                image_rows: ImageRows | None = None) -> torch.Tensor:
        assert len(kv_caches) == len(self.layers), (
            f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        hidden = self.embed(input_ids)  # [T, H]
        if image_rows is not None:  # images' embeddings replace their placeholder tokens'
            rows, embeds = image_rows  # rows [R], embeds [R, H]
            hidden[rows] = embeds.to(hidden.dtype)
        residual: torch.Tensor | None = None
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta,
                                     self.rotary_for(index))
        if residual is None:  # no layers
            return self.norm(hidden)
        hidden, _ = self.norm.add_forward(hidden, residual)
        return hidden


class CausalLM(nn.Module):
    """A decoder-only language model over a paged KV cache."""

    # Tensor parallelism's sums over ranks, set by shard_modules (parallel/layers.py's
    # RankSum; models imports no parallel module). A declaration only: unsharded, none.
    rank_sum: object
    # Whether an image's rows attend to every row of their image during prefill (Gemma 3):
    # the scheduler then computes each image in one step and attention reads ahead.
    bidirectional_images: bool = False

    def __init__(self, config: ModelConfig, mlp_factory: MlpFactory | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, mlp_factory)
        # Tied models read the embedding matrix directly (no shared Parameter, so moving the
        # module between devices can never untie it).
        self.lm_head: nn.Module | None = (
            None if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False))
        # Tensor parallelism puts a gather of the ranks' vocabulary slices here
        # (services/worker/parallel/layers.py).
        self.logits_gather: nn.Module = nn.Identity()
        self.pad_logit_rows = False  # see compute_logits

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, all sequences' new tokens flattened
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[KVCache],  # per layer, each [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        image_rows: ImageRows | None = None,
    ) -> torch.Tensor:  # hidden states [T, H]
        """Run every layer over the step's tokens, writing their KV into the cache.
        `image_rows`: (rows [R], embeddings [R, H]) that replace those rows' token
        embeddings (a vision-language model's images)."""
        return self.model(input_ids, positions, kv_caches, meta, image_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] hidden states of the rows to sample -> [N, V] float32 logits.

        With `pad_logit_rows` (the model runner sets it on GPUs), more than SKINNY_MAX_ROWS
        rows are padded with zero rows to a multiple of LOGITS_ROW_BUCKET, and the extra
        rows' logits dropped. On an H100, cuBLAS's first LM-head product for each row count
        held the host until the device had run out of queued work (75-220 ms in the prefill
        steps of a ShareGPT-like burst); N changes from step to step, so the overlapped loop
        kept stopping. Padded, there are few sizes, and the engine runs each once at start
        (`ModelRunner.warm_logits`; loadtest/reports/fp8/README.md).
        """
        rows = hidden.shape[0]
        padded = padded_logit_rows(rows) if self.pad_logit_rows else rows
        if padded != rows:
            hidden = nn.functional.pad(hidden, (0, 0, 0, padded - rows))  # zero rows
        # The LM head is a module (Linear, or Fp8Linear with --quantize-lm-head) unless the
        # embeddings are tied and it stays in the model's dtype.
        logits = (linear(hidden, self.model.embed_tokens.weight) if self.lm_head is None
                  else self.lm_head(hidden))
        return self.logits_gather(logits[:rows]).float()

    def reset_buffers(self) -> None:
        """Recompute non-weight buffers (the RoPE table) after `to_empty` materialised them."""
        self.model.rotary_emb.reset_parameters()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the parameters, fusing q/k/v and gate/up.

        Raises ModelLoadError naming any unexpected, wrongly shaped or missing tensor.
        """
        params = dict(self.named_parameters())
        targets = self.checkpoint_layout()
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name not in targets:
                    if self._ignorable(name):
                        continue
                    raise ModelLoadError(f"unexpected tensor {name!r} in the checkpoint "
                                         f"(not a parameter of {self.config.architecture})",
                                         param=name)
                param_name, offset, rows = targets[name]
                param = params[param_name].data
                if param.dim() == 3:  # stacked experts [E, R, C]: rows count over all experts
                    param = param.flatten(0, 1)
                dest = param.narrow(0, offset, rows)
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                                         f"expected {tuple(dest.shape)}", param=name)
                dest.copy_(tensor)
                loaded.add(name)
        missing = [name for name in targets if name not in loaded]
        if missing:
            shown = ", ".join(repr(name) for name in missing[:8])
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise ModelLoadError(f"missing tensors in the checkpoint: {shown}{more}",
                                 param=missing[0])

    def checkpoint_layout(self) -> dict[str, tuple[str, int, int]]:
        """Hugging Face tensor name -> (parameter name, first row, number of rows)."""
        shards = {
            "qkv_proj": (("q_proj", self.config.q_size), ("k_proj", self.config.kv_size),
                         ("v_proj", self.config.kv_size)),
            "gate_up_proj": (("gate_proj", self.config.intermediate_size),
                             ("up_proj", self.config.intermediate_size)),
        }
        layout: dict[str, tuple[str, int, int]] = {}
        for param_name, param in self.named_parameters():
            fused = next((f for f in shards if f".{f}." in param_name), None)
            if fused is None:
                layout[param_name] = (param_name, 0, param.shape[0])
                continue
            offset = 0
            for shard, rows in shards[fused]:
                layout[param_name.replace(f".{fused}.", f".{shard}.")] = (param_name, offset, rows)
                offset += rows
        return layout

    def _ignorable(self, name: str) -> bool:
        if name.endswith(_IGNORED_SUFFIXES):
            return True
        # Some tied checkpoints store the (identical) output matrix anyway.
        return self.config.tie_word_embeddings and name == "lm_head.weight"
