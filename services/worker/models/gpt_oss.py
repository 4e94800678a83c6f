"""gpt-oss (gpt-oss-20b, gpt-oss-120b): llama.py's decoder layer with gpt-oss's attention and
experts.

    layer        h += attn(norm(h)); h += moe(norm(h))      (llama.py's DecoderLayer, unchanged)
    RMSNorm      the normalised row times the weight in float32, then cast (transformers keeps
                 gpt-oss's norms in float32)
    attention    q/k/v/o biases, YaRN RoPE, a learned sink logit per head in every softmax's
                 denominator (kernels/attention.py `sinks`); sliding-window layers
                 (`ModelConfig.layer_windows`, 128 in the published models) alternate with
                 full ones
    router       logits [T, E] = x @ W^T + b; the top k logits, a softmax over those k
                 (kernels/moe.py `route_topk_softmax`)
    experts      sum over the k chosen e of w * (down_e(swiglu_oai(gate_up_e(x) + b13_e)) + b2_e),
                 gpt-oss's clamped SwiGLU (kernels/activation.py), stacked as every MoE's:
                 w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], b13 [E, 2I], b2 [E, H]

The layers keep llama.py's protocol (input_norm, the attention's project and attend, finish)
and the model its `embed` and `rotary_for`, so the engine's decode and piecewise CUDA graphs
run them as they run Llama's; attention with sinks and windows is in both the PyTorch
reference and the Triton kernel, the biased clamped SwiGLU experts in both paths of
kernels/moe.py.

Checkpoints hold the experts as transformers does in memory (`mlp.experts.gate_up_proj`
[E, H, 2I] with gate and up interleaved in the last dim, gate = [..., ::2], up = [..., 1::2],
`gate_up_proj_bias` [E, 2I] interleaved alike, `down_proj` [E, I, H], `down_proj_bias` [E, H]),
or, as the published checkpoints do, in MXFP4 (`gate_up_proj_blocks`/`_scales`, rows
[E, 2I] interleaved, and `down_proj_blocks`/`_scales` [E, H]; models/mxfp4.py), dequantized on
load to the model's dtype. `load_weights` takes the interleaving and transposes apart.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from meshserve.kernels.linear import linear
from meshserve.kernels.moe import fused_experts, route_topk_softmax
from meshserve.kernels.norm import fused_add_rms_norm_f32_weight, rms_norm_f32_weight
from meshserve.kernels.rotary import RotaryEmbedding
from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.llama import (
    Attention,
    CausalLM,
    DecoderLayer,
    DecoderModel,
    RMSNorm,
)
from meshserve.services.worker.models.moe import Experts
from meshserve.services.worker.models.mxfp4 import dequantize_mxfp4
from meshserve.shared.errors import ModelLoadError

# A layer's expert tensors in a checkpoint: (layer prefix, which, MXFP4 part or none).
_EXPERT_TENSOR = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\."
                            r"(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)"
                            r"(?:_(blocks|scales))?$")
# Our stacked expert parameters -> the checkpoint's names for them.
_CHECKPOINT_NAMES = {"w13": "gate_up_proj", "b13": "gate_up_proj_bias", "w2": "down_proj",
                     "b2": "down_proj_bias"}


class GptOssRMSNorm(RMSNorm):
    """RMSNorm whose weight multiplies in float32 before the cast back, as transformers'
    `GptOssRMSNorm` with its float32 weight (the same numbers in float32 models)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_f32_weight(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor,
                    residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_add_rms_norm_f32_weight(x, residual, self.weight, self.eps)


class GptOssAttention(Attention):
    """llama.py's attention (q/k/v/o biases from the config) with each head's sink logit and
    the layer's window."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__(config)
        self.window = config.layer_windows[index]
        self.sinks = nn.Parameter(torch.empty(config.num_attention_heads))  # [Hq]


class GptOssRouter(nn.Module):
    """The router's biased projection x [T, H] -> logits [T, E]. Not an nn.Linear, as
    models/moe.py's ExpertRouter: routing stays in the model's dtype."""

    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class GptOssExperts(Experts):
    """models/moe.py's stacked experts with biases, b13 [E, 2I] (gate, then up) and b2 [E, H],
    running gpt-oss's clamped SwiGLU."""

    def __init__(self, config: ModelConfig) -> None:
        experts, hidden, inter = (config.num_experts, config.hidden_size,
                                  config.moe_intermediate_size)
        super().__init__(experts, hidden, inter)
        self.b13 = nn.Parameter(torch.empty(experts, 2 * inter))
        self.b2 = nn.Parameter(torch.empty(experts, hidden))
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor,
                expert_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], routing weights and expert ids [T, k] -> [T, H]."""
        return fused_experts(x, self.w13, self.w2, weights, expert_ids,
                             w13_scale=self.w13_scale, w2_scale=self.w2_scale, b13=self.b13,
                             b2=self.b2, activation="swiglu_oai", alpha=self.alpha,
                             limit=self.limit)


class GptOssMoe(nn.Module):
    """Every layer's MLP: the router, then the experts of the top k logits."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = GptOssRouter(config.num_experts, config.hidden_size)
        self.experts = GptOssExperts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        weights, expert_ids = route_topk_softmax(self.router(x), self.top_k)  # [T, k]
        return self.experts(x, weights, expert_ids)


class GptOssDecoderLayer(DecoderLayer):
    """llama.py's layer (forward, input_norm, finish) over gpt-oss's parts."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        nn.Module.__init__(self)
        self.self_attn = GptOssAttention(config, index)
        self.mlp = GptOssMoe(config)
        self.input_layernorm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)


class GptOssModel(DecoderModel):
    """Embeddings, layers, final norm and the one YaRN table; DecoderModel's forward."""

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GptOssDecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rotary_dim,
                                          config.max_position_embeddings, config.rope_theta,
                                          config.rope_scaling)


class GptOssForCausalLM(CausalLM):
    """gpt-oss over the paged KV cache (see the module docstring)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        assert config.layer_windows and config.num_experts, (
            "a gpt-oss config has per-layer windows and experts (gpt_oss_config.py)")
        self.model = GptOssModel(config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As CausalLM's, the experts' tensors (bf16 or MXFP4) first put in our layout."""
        super().load_weights(self._experts_in_our_layout(weights))

    def checkpoint_layout(self) -> dict[str, tuple[str, int, int]]:
        """CausalLM's layout with each layer's experts under the checkpoint's four names, each
        filling a whole stacked parameter (rows over all experts, as load_weights counts)."""
        shapes = {name: param.shape for name, param in self.named_parameters()}
        layout: dict[str, tuple[str, int, int]] = {}
        for name, target in super().checkpoint_layout().items():
            prefix, _, ours = name.rpartition(".")
            if not prefix.endswith(".mlp.experts"):
                layout[name] = target
                continue
            shape = shapes[name]
            rows = shape[0] * shape[1] if len(shape) == 3 else shape[0]
            layout[f"{prefix}.{_CHECKPOINT_NAMES[ours]}"] = (name, 0, rows)
        return layout

    def _experts_in_our_layout(self, weights: Iterable[tuple[str, torch.Tensor]],
                               ) -> Iterator[tuple[str, torch.Tensor]]:
        """Expert tensors -> ours under the checkpoint's plain names (w13/w2 flattened to
        [E*2I, H] / [E*H, I]); MXFP4 pairs dequantized once both halves have come."""
        pending: dict[str, dict[str, torch.Tensor]] = {}  # name -> its blocks / scales
        for name, tensor in weights:
            match = _EXPERT_TENSOR.match(name)
            if match is None:
                yield name, tensor
                continue
            base, part = f"{match[1]}.{match[2]}", match[3]
            if part is None:
                yield base, _to_ours(match[2], tensor, name, quantized=False)
                continue
            halves = pending.setdefault(base, {})
            halves[part] = tensor
            if len(halves) == 2:
                del pending[base]
                dense = dequantize_mxfp4(halves["blocks"], halves["scales"],
                                         self.model.embed_tokens.weight.dtype)
                yield base, _to_ours(match[2], dense, name, quantized=True)
        for base, halves in pending.items():
            missing = "scales" if "blocks" in halves else "blocks"
            raise ModelLoadError(f"missing tensors in the checkpoint: '{base}_{missing}' "
                                 f"(MXFP4 '{base}_{next(iter(halves))}' has no pair)",
                                 param=f"{base}_{missing}")


def _to_ours(which: str, tensor: torch.Tensor, name: str, quantized: bool) -> torch.Tensor:
    """One layer's expert tensor in our stacked layout.

    transformers' layout: gate_up_proj [E, H, 2I] and its bias [E, 2I] with gate/up
    interleaved (even/odd) in the 2I dim, down_proj [E, I, H]. MXFP4, once dequantized:
    gate_up [E, 2I, H] (rows interleaved) and down [E, H, I], the transposes of those.
    Ours: w13 [E, 2I, H] (gate rows, then up), b13 [E, 2I] alike, w2 [E, H, I], b2 [E, H]."""
    dims = 2 if which.endswith("_bias") else 3
    if tensor.dim() != dims:
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                             f"{dims} dims", param=name)
    if which == "down_proj_bias":
        return tensor
    if not quantized and which in ("gate_up_proj", "down_proj"):
        tensor = tensor.transpose(1, 2)  # [E, 2I, H] / [E, H, I], as MXFP4's
    if which == "down_proj":
        return tensor.flatten(0, 1)  # [E*H, I]
    # Rows (dim 1) interleave gate and up: ours hold the gate rows, then the up rows.
    stacked = torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)
    return stacked if which == "gate_up_proj_bias" else stacked.flatten(0, 1)  # [E*2I, H]
